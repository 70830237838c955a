"""Rollout benchmark: (b) end-to-end decode tokens/s, dense vs sparse; (c) our dense sampler vs
tunix.

  python experiments/bench_rollout.py --config=configs/bench_rollout.py \\
      [--config.decode.contexts=16384,32768 --config.decode.dense_layers=2,0 --config.batch=4 ...]
  python experiments/bench_rollout.py --config=configs/bench_rollout.py --config.parts=c \\
      --config.tunix.python=VENV/bin/python   # (c): needs google-tunix in VENV
  python experiments/bench_rollout.py --config=configs/bench_rollout.py --config.parts=b,c \\
      --config.tunix.python=VENV/bin/python --config.out=docs/results/decode_rollout.json

(a) attention only (one decode step of Qwen3-1.7B attention shapes, dense vs sparse) is
experiments/bench_attention.py, a script with its own config, run on its own.

(b) A Qwen3-1.7B-shaped model (preset "qwen3-1.7b": 16 query / 8 KV heads, head dim 128, width
2048, FFN 6144) truncated to `decode.layers` layers, random weights, decoding at a fixed context.
Only the decode phase is timed: prefilling 32K tokens would take minutes on a 2-core CPU and says
nothing about decode. The cache is written the way a prefill writes it (paged_cache.write_chunk:
keys, values and page centroids), with random keys and values (unit normal, the scale that
Qwen3's k RMSNorm gives) in place of the model's, and `lengths` = context. One timed call is a
jitted `lax.fori_loop` of `decode.steps` `qwen3.decode_step`s, each step feeding its argmax token to
the next; the cache is donated, and each call first rewinds its lengths to the context so every
call does the same work.
Dense is the sampler's dense decode (policy.dense_decode_attention: each row's cached tokens only,
in the cache dtype, the fair baseline). Dense and sparse calls are interleaved run by run (they
share the machine's load) and a cell is the median over `runs` calls after a warm-up (compile)
call. Sparse = SparseConfig(page_size=16, dense_layers=d) with the paper's tau-0.86 table for
Qwen3-1.7B (BudgetTable and max_selected built exactly as the sampler does), one row per d in
`decode.dense_layers`. Sparrow keeps 2 layers dense; in a 4-layer truncation those are half the
model (2 of 28 in the real one), which caps the speedup far below the full model's, so the default
also measures d = 0 (every layer sparse): that row is the per-layer speedup that carries over to
the 28-layer model.
With `decode.model_dir` (an HF dir, e.g. the real LM experiments/import_gguf.py makes) the model
is that one, its own config and real weights, and `decode.schedule` names the sparse rows' table;
the cache still holds random keys and values (what a step costs does not depend on them).
The vocabulary is shrunk by default (it does not change attention cost): `decode.vocab_size` = 0
scales the 151,936-token vocabulary by layers / 28, which keeps the LM head's share of a step what
it is in the full 28-layer model.
The cost model's prediction (sparrow_jax.mismatch.cost_model, with this machine's measured FLOP/s
and bandwidth, KV bytes per element set to `decode.dtype`'s) for the same setting:
rollout_speedup(cfg of the truncated model, schedule, prompt_len=context, gen_len=steps,
n_samples=1): the decode steps at cached lengths context+1 .. context+steps, one sample per cache
because our rows do not share prompt pages (so the batch scales both costs alike). The cost model
leaves parameter reads out (amortized over a large rollout batch); at batch <= 4 on a CPU they are
not negligible, so a second prediction adds steps * I * params * bytes (one read of the weights per
step for the whole batch) to both costs.
Beside the rows, each context's step is split (`step_split`) with two more calls interleaved with
the others: attention replaced by nothing (the rest of a step: weights, cache appends, sampling)
and by page selection alone. A dense layer is (dense step - rest) / layers, a sparse layer comes
from the row with the fewest dense layers, and each part's GB/s is the bytes it must read over
its time, beside the one bandwidth the cost model prices every byte at.

(c) Dense decode tokens/s of a tiny Qwen3 (TINY below) in our sampler (sj.generate) and in
google-tunix's (tunix.generate.sampler.Sampler over tunix.models.qwen3), our random weights copied
into tunix's model, greedy, side by side in one process; decode tok/s comes from two generation
lengths so that prefill and per-call overheads cancel. Beside them, the roofline: the measured time
to read every weight once (`weight_read_ms`), the floor of a small-batch decode step. The greedy
tokens of both are compared as a check that the two run the same model. tunix is optional: it is
not a project dependency and lives in a separate venv (google-tunix 0.1.7 installs from PyPI with
jax 0.10.2 and runs offline on CPU), named by `tunix.python`; (c) then reruns this script under
that interpreter. Without it (c) prints how to make that venv.

With `out` set, the figures (b) and (c) print, with the config, are written there as one results
record (sparrow_jax/records.py; a part that did not run, or (c) without tunix, is left out), from
which docs/make_results_pages.py makes docs/results/decode_rollout.md. (d) writes its own record,
`engine.record`, one per model shape.
"""

import dataclasses
import functools
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from configs import common
import sparrow_jax as sj
from sparrow_jax import records
from sparrow_jax.attention import paged_cache, reference
from sparrow_jax.mismatch import cost_model
from sparrow_jax.model import hf, qwen3
from sparrow_jax.rollout import engine, programs, sampler
from sparrow_jax.sparsity import policy
from sparrow_jax.sparsity.schedule import BudgetTable, KVSchedule

FULL_LAYERS = 28
ROOT = records.ROOT


def median_seconds(calls, runs):
  """Median seconds per call of each thunk, the calls interleaved so they share the machine's load.
  A thunk runs one call and blocks on its result."""
  for call in calls:
    call()
  times = [[] for _ in calls]
  for _ in range(runs):
    for call, t in zip(calls, times):
      start = time.perf_counter()
      call()
      t.append(time.perf_counter() - start)
  return [statistics.median(t) for t in times]


# ---------------------------------------------------------------------------------- (b) decode only


def model_config(layers: int, vocab_size: int) -> sj.Qwen3Config:
  base = sj.Qwen3Config.preset("qwen3-1.7b")
  vocab = vocab_size or round(base.vocab_size * layers / FULL_LAYERS)
  return dataclasses.replace(base, num_hidden_layers=layers, vocab_size=vocab)


@functools.partial(jax.jit, static_argnames=("context",), donate_argnames=("cache",))
def _fill_layer(cache, key, *, context):
  """Writes random keys/values into slots [0, context) of a one-layer cache as a prefill of that
  length would (one jitted call per layer keeps only one layer's random tokens in memory; one draw
  per tensor: a stacked [2, ...] draw costs XLA a copy of both in temporaries)."""
  _, B, K, _, E = cache.k_stored.shape
  key_k, key_v = jax.random.split(key)
  k_BTKE = jax.random.normal(key_k, (B, context, K, E), jnp.float32)
  v_BTKE = jax.random.normal(key_v, (B, context, K, E), jnp.float32)
  return paged_cache.write_chunk(cache, 0, 0, k_BTKE, v_BTKE, jnp.ones((B, context), bool))


def filled_cache(cfg, batch, context, steps, page_size, dtype, key):
  """Per-layer caches (`paged_cache.split_layers`' form) of context + steps slots holding `context`
  random tokens per row."""
  one_layer = dataclasses.replace(cfg, num_hidden_layers=1)
  caches = []
  for i in range(cfg.num_hidden_layers):
    cache = paged_cache.init_cache(one_layer, batch, context + steps, page_size, dtype)
    cache = _fill_layer(cache, jax.random.fold_in(key, i), context=context)
    caches.append(cache.replace(lengths=jnp.full((batch,), context, jnp.int32)))  # as prefill sets
  return tuple(caches)


PROBES = ("", "none", "select")  # decode_loop's `probe`: the real step, or a stand-in for attention


def _probe_fn(probe, sparse, budget, max_selected):
  """Attention stand-ins that split a step's time: "none" reads no cache (what is left is the
  weights, the cache appends and the sampling), "select" runs every layer's page selection
  (scores and top-k) and reads no page."""
  if probe == "none":
    return lambda layer, q_BKGE, cache, lengths_B: q_BKGE

  def select_only(layer, q_BKGE, cache, lengths_B):
    page_idx_BKN, n_valid_BK = policy.cache_pages(
      q_BKGE, cache, lengths_B, sparse, budget, max_selected
    )
    picked_BK = jnp.sum(page_idx_BKN, axis=-1) + n_valid_BK  # keeps every output of it live
    return q_BKGE + 1e-30 * picked_BK[..., None, None].astype(q_BKGE.dtype)

  return select_only


@functools.partial(
  jax.jit,
  static_argnames=("cfg", "sparse", "max_selected", "steps", "context", "probe"),
  donate_argnames=("caches",),
)
def decode_loop(
  params, token_B, caches, budget, *, cfg, sparse, max_selected, steps, context, probe=""
):
  """`steps` greedy decode steps from caches rewound to `context` tokens, dense (sparse=None) or
  with the sampler's sparse policy, as the engine runs them (params split by layer once, before
  the calls, as engine.run splits them once per rollout), or with `probe`'s stand-in for every
  layer's attention (`_probe_fn`). Returns (token, caches)."""
  if probe not in PROBES:
    raise ValueError(f"probe must be one of {PROBES}, got {probe!r}")
  # The keys a previous call wrote past `context` need no rewinding: each append rewrites its slot
  # and its page's centroid, and a page is scored only once every slot of it is rewritten.
  caches = tuple(c.replace(lengths=jnp.full_like(c.lengths, context)) for c in caches)
  if probe:
    attention_fn = _probe_fn(probe, sparse, budget, max_selected)
  elif sparse is not None:
    attention_fn = policy.decode_attention_fn(sparse, budget, max_selected)
  else:
    attention_fn = policy.dense_decode_fn()

  def body(i, carry):
    token_B, caches = carry
    logits_BV, caches = qwen3.decode_step(params, token_B, cfg, caches, attention_fn=attention_fn)
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), caches

  return jax.lax.fori_loop(0, steps, body, (token_B, caches))


def format_decode_row(row) -> str:
  return (
    f"{row['context']:>8} {row['budget']:>7} {row['dense_layers']:>12} "
    f"{row['dense_tok_s']:>12.2f} {row['sparse_tok_s']:>13.2f} {row['ratio']:>6.2f}x "
    f"{row['cost_model']:>10.2f}x {row['with_weights']:>8.2f}x"
  )


def step_split(cfg, tokens, budget_tokens, rest_s, select_s, sparse_row, hw, config):
  """Where a decode step's time goes at `tokens` cached tokens a row (the timed steps' middle), from
  the calls' medians: the rest of the step (no attention: weights, cache appends, sampling), a
  dense layer, a sparse layer (from the row with the fewest dense layers) and its page selection,
  each with the bytes it must read per second, beside the bandwidth the cost model prices every
  byte at."""
  c = config.decode
  layers, d = cfg.num_hidden_layers, sparse_row["dense_layers"]
  step_s = lambda tok_s: config.batch * c.steps / tok_s
  kv_token = 2 * cfg.num_key_value_heads * cfg.head_dim * hw.dtype_bytes  # K and V, one layer
  summaries = tokens // 16 * cfg.num_key_value_heads * cfg.head_dim * hw.dtype_bytes  # mean keys
  dense_layer_s = (step_s(sparse_row["dense_tok_s"]) - rest_s) / layers
  sparse_layer_s = (step_s(sparse_row["sparse_tok_s"]) - rest_s - d * dense_layer_s) / (layers - d)
  per_step = lambda seconds: seconds / c.steps * 1e3  # ms a step
  gbs = lambda nbytes, seconds: nbytes * c.steps / seconds / 1e9
  return dict(
    context=sparse_row["context"],
    rest_ms=per_step(rest_s),
    weights_gbs=gbs(cost_model.param_count(cfg) * hw.dtype_bytes, rest_s),
    dense_layer_ms=per_step(dense_layer_s),
    dense_gbs=gbs(config.batch * tokens * kv_token, dense_layer_s),
    sparse_layer_ms=per_step(sparse_layer_s),
    sparse_gbs=gbs(config.batch * (budget_tokens * kv_token + summaries), sparse_layer_s),
    select_ms=per_step((select_s - rest_s) / layers),
    model_gbs=hw.mem_bandwidth / 1e9,
  )


def format_split(part) -> str:
  return (
    f"    a step at {part['context']}: rest {part['rest_ms']:.1f} ms (weights at "
    f"{part['weights_gbs']:.1f} GB/s), a dense layer {part['dense_layer_ms']:.1f} ms "
    f"({part['dense_gbs']:.1f} GB/s), a sparse layer {part['sparse_layer_ms']:.1f} ms "
    f"({part['sparse_gbs']:.1f} GB/s) of which selection {part['select_ms']:.1f} ms; the cost "
    f"model prices every byte at {part['model_gbs']:.1f} GB/s"
  )


def bench_decode(config):
  """(b): prints a row per (context, dense layers) and returns the figures (settings, this
  machine's roofline, the rows)."""
  c = config.decode
  if c.dtype not in ("float32", "bfloat16"):
    raise ValueError(f"decode.dtype must be float32 or bfloat16, got {c.dtype!r}")
  bad = [n for n in c.contexts if n <= 0 or n % 16]
  if bad:
    raise ValueError(f"decode.contexts must be positive multiples of the page size 16, got {bad}")
  if not c.model_dir and not all(0 <= d <= c.layers for d in c.dense_layers):
    raise ValueError(
      f"decode.dense_layers must lie in [0, decode.layers={c.layers}], got {c.dense_layers}"
    )
  start = time.perf_counter()
  dtype = jnp.dtype(c.dtype)
  if c.model_dir:  # a real model: its own config and weights
    cfg, params = sj.load_hf(c.model_dir, dtype=dtype)
  else:
    cfg = model_config(c.layers, c.vocab_size)
    params = sj.init_params(cfg, jax.random.PRNGKey(0), dtype=dtype)
  n_params = cost_model.param_count(cfg)
  params, _ = jax.jit(qwen3.unstack_layers)(params)
  schedule = KVSchedule.parse(c.schedule, 16, field="config.decode.schedule")
  sparse_configs = [sj.SparseConfig(page_size=16, dense_layers=d) for d in c.dense_layers]
  hw = cost_model.measure_this_machine()
  hw = dataclasses.replace(hw, dtype_bytes=dtype.itemsize)

  print(
    f"(b) decode only, {jax.default_backend()} x{os.cpu_count()} cores, {c.dtype}: "
    + (
      f"{c.model_dir} ({cfg.num_hidden_layers} layers, vocab {cfg.vocab_size}, real weights)"
      if c.model_dir
      else f"Qwen3-1.7B shapes truncated to {cfg.num_hidden_layers} layers, vocab "
      f"{cfg.vocab_size} (shrunk from 151936; attention cost unchanged), random weights"
    )
    + f", {n_params / 1e6:.0f}M params; batch {config.batch}; sparse = {c.schedule}, page 16, "
    f"the first `dense layers` dense; tok/s = batch x steps / median of {config.runs} calls of "
    f"{c.steps} steps"
  )
  print(
    f"    this machine: {hw.peak_flops / 1e9:.0f} GFLOP/s, {hw.mem_bandwidth / 1e9:.1f} GB/s "
    f"(I = {hw.intensity:.1f} FLOP/byte), KV {hw.dtype_bytes} bytes/element"
  )
  print(
    f"{'context':>8} {'budget':>7} {'dense layers':>12} {'dense tok/s':>12} {'sparse tok/s':>13} "
    f"{'ratio':>7} {'cost model':>11} {'+weights':>9}"
  )
  rows, split = [], []
  for context in c.contexts:
    caches = filled_cache(cfg, config.batch, context, c.steps, 16, dtype, jax.random.PRNGKey(1))
    budget_np = sampler.budget_table(schedule, caches[0].max_len, sparse_configs[0])
    max_selected = sampler.max_selected_pages(budget_np)
    budget = BudgetTable(jnp.asarray(budget_np))
    token_B = jnp.zeros((config.batch,), jnp.int32)
    state = {"caches": caches}
    del caches

    def call(sparse, probe=""):
      def run():
        token, state["caches"] = decode_loop(
          params,
          token_B,
          state["caches"],
          budget,
          cfg=cfg,
          sparse=sparse,
          max_selected=max_selected,
          steps=c.steps,
          context=context,
          probe=probe,
        )
        jax.block_until_ready(token)

      return run

    all_sparse = sj.SparseConfig(page_size=16, dense_layers=0)
    probes = [call(None, "none"), call(all_sparse, "select")]
    rest_s, select_s, dense_s, *sparse_s = median_seconds(
      probes + [call(None)] + [call(sp) for sp in sparse_configs], config.runs
    )
    del state["caches"]
    dense_tps = config.batch * c.steps / dense_s
    dense1 = cost_model.dense_rollout_cost(cfg, context, c.steps, 1, hw)
    weights = c.steps * hw.intensity * n_params * hw.dtype_bytes
    budget_tokens = int(budget_np[context + 1]) * 16
    for sparse, seconds in zip(sparse_configs, sparse_s):
      sparse_tps = config.batch * c.steps / seconds
      predicted = cost_model.rollout_speedup(
        cfg, schedule, context, c.steps, n_samples=1, hardware=hw, sparse=sparse
      )
      sparse1 = dense1 / predicted
      with_weights = (config.batch * dense1 + weights) / (config.batch * sparse1 + weights)
      rows.append(
        dict(
          context=context,
          budget=budget_tokens,
          dense_layers=sparse.dense_layers,
          dense_tok_s=dense_tps,
          sparse_tok_s=sparse_tps,
          ratio=sparse_tps / dense_tps,
          cost_model=predicted,
          with_weights=with_weights,
        )
      )
      print(format_decode_row(rows[-1]), flush=True)
    fewest = min(rows[-len(sparse_configs) :], key=lambda row: row["dense_layers"])
    if fewest["dense_layers"] < cfg.num_hidden_layers:  # a sparse layer was timed
      split.append(
        step_split(cfg, context + c.steps // 2, budget_tokens, rest_s, select_s, fewest, hw, config)
      )
  for part in split:
    print(format_split(part))
  return dict(
    backend=jax.default_backend(),
    cores=os.cpu_count(),
    model_dir=c.model_dir,
    schedule=c.schedule,
    layers=cfg.num_hidden_layers,
    vocab_size=cfg.vocab_size,
    params=n_params,
    hardware=dict(
      peak_flops=hw.peak_flops,
      mem_bandwidth=hw.mem_bandwidth,
      intensity=hw.intensity,
      dtype_bytes=hw.dtype_bytes,
    ),
    rows=rows,
    split=split,
    seconds=time.perf_counter() - start,
  )


# --------------------------------------------------------------- (c) our dense sampler vs tunix's

TINY = dict(
  vocab_size=8192,
  hidden_size=512,
  intermediate_size=1536,
  num_hidden_layers=4,
  num_attention_heads=8,
  num_key_value_heads=4,
  head_dim=64,
  tie_word_embeddings=True,
)


class _IdTokenizer:
  """The interface tunix's sampler takes strings through: here a prompt is its token ids written
  out, so both samplers see the same ids. No BOS; `eos` is outside the vocabulary (never sampled),
  so every row decodes the full length in both."""

  def __init__(self, pad: int, eos: int):
    self.pad, self.eos = pad, eos

  def encode(self, text, **kwargs):
    return [int(t) for t in text.split()]

  def decode(self, ids, **kwargs):
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return None

  def eos_id(self):
    return self.eos

  def pad_id(self):
    return self.pad


def _tunix_model(cfg, params, nnx, tunix_qwen3):
  """tunix's Qwen3 (flax nnx) holding our params: same math, its own [D, N, E] weight layout."""
  D, E = cfg.hidden_size, cfg.head_dim
  H, K = cfg.num_attention_heads, cfg.num_key_value_heads
  config = tunix_qwen3.ModelConfig(
    num_layers=cfg.num_hidden_layers,
    vocab_size=cfg.vocab_size,
    embed_dim=D,
    hidden_dim=cfg.intermediate_size,
    num_heads=H,
    head_dim=E,
    num_kv_heads=K,
    rope_theta=int(cfg.rope_theta),
    norm_eps=cfg.rms_norm_eps,
    use_tied_embedding=True,
  )
  model = tunix_qwen3.Qwen3(config, rngs=nnx.Rngs(0))
  model.embedder.input_embedding.value = params["embed"]
  model.final_norm.w.value = params["final_norm"]
  for i, layer in enumerate(model.layers):
    p = {name: w[i] for name, w in params["layers"].items()}
    layer.input_layernorm.w.value = p["attn_norm"]
    layer.post_attention_layernorm.w.value = p["mlp_norm"]
    layer.attn.q_proj.w.value = p["q"].reshape(D, H, E)
    layer.attn.k_proj.w.value = p["k"].reshape(D, K, E)
    layer.attn.v_proj.w.value = p["v"].reshape(D, K, E)
    layer.attn.o_proj.w.value = p["o"].reshape(H, E, D)
    layer.attn.q_norm.w.value = p["q_norm"]
    layer.attn.k_norm.w.value = p["k_norm"]
    layer.mlp.gate_proj.kernel.value = p["gate"]
    layer.mlp.up_proj.kernel.value = p["up"]
    layer.mlp.down_proj.kernel.value = p["down"]
  return model


def weight_read_ms(params, runs):
  """ms to read every parameter once, measured: a jitted loop of 16 passes that each add the pass
  index to every weight and reduce it (the index keeps XLA from hoisting the read out of the
  loop). The floor of a decode step at small batch, which reads every weight once."""
  leaves = jax.tree_util.tree_leaves(params)

  @jax.jit
  def passes(leaves):
    body = lambda i, acc: acc + sum(jnp.sum(x + i.astype(x.dtype)) for x in leaves)
    return jax.lax.fori_loop(0, 16, body, jnp.float32(0.0))

  return median_seconds([lambda: jax.block_until_ready(passes(leaves))], runs)[0] * 1e3 / 16


SAMPLERS = ("sparrow_jax sj.generate", "tunix generate.Sampler")


def _no_attention(q_BKGE, *_):
  return q_BKGE


def _page_gather_only(q_BKGE, k_pages_XZE, v_pages_XZE, page_idx_BKN, *_):
  """Reads the pages the attention would (the same gather) and nothing more."""
  read = lambda pages: jnp.mean(pages.at[page_idx_BKN].get(mode="clip"), axis=(2, 3))[:, :, None]
  return q_BKGE + read(k_pages_XZE) + read(v_pages_XZE)


# Stand-ins for the paged attention inside our decode step (reference.paged_decode_attention, what
# the engine's decode chunk reads the pool through on CPU), which split the step: with no attention
# at all, the rest (weights, cache appends, sampling); with the page gather alone, what reading the
# pages costs before any arithmetic on them.
STEP_PROBES = {"no attention": _no_attention, "page gather alone": _page_gather_only}


def with_attention(run, attention):
  """run() with the engine's decode chunk compiled around `attention` in place of the paged
  attention: a new jit of the chunk's function, traced on its first call with the stand-in in
  place (jit caches a trace per function, so the engine's own chunk keeps the real attention)."""
  raw = programs.decode_chunk.__wrapped__
  chunk = jax.jit(
    functools.wraps(raw)(lambda *a, **k: raw(*a, **k)),
    static_argnames=("cfg", "steps", "sparse", "sampling"),
    donate_argnames=("pool",),
  )

  def probed():
    real_attention, real_chunk = reference.paged_decode_attention, programs.decode_chunk
    reference.paged_decode_attention, programs.decode_chunk = attention, chunk
    try:
      return run()
    finally:
      reference.paged_decode_attention, programs.decode_chunk = real_attention, real_chunk

  return probed


def sampler_figures(batch, gen, seconds, read_ms) -> dict:
  """Each sampler's decode tok/s and ms per decode step from its median call times at the two
  generation lengths (`seconds`: name -> (short, long)); the difference cancels prefill and
  per-call overheads. `per_read` holds a step against the time to read the weights once."""
  short, long = gen
  figures = {}
  for name, (short_s, long_s) in seconds.items():
    tok_s = batch * (long - short) / (long_s - short_s)
    step_ms = 1e3 * batch / tok_s
    figures[name] = dict(
      short_s=short_s, long_s=long_s, tok_s=tok_s, step_ms=step_ms, per_read=step_ms / read_ms
    )
  return figures


def print_tunix(fig) -> None:
  m, (short, long) = fig["model"], fig["gen"]
  ours, theirs = (fig["samplers"][name] for name in SAMPLERS)
  print(
    f"(c) dense decode, tiny Qwen3 ({m['layers']} layers, width {m['hidden_size']}, "
    f"{m['heads']}/{m['kv_heads']} heads, vocab {m['vocab_size']}, float32, random weights "
    f"shared by both), batch {fig['batch']}, prompt {fig['prompt']}, greedy; decode tok/s = "
    f"batch x ({long} - {short}) / (time({long}) - time({short})), medians of {fig['runs']} "
    "calls (prefill and per-call overheads cancel)"
  )
  print(f"{'sampler':>28} {f'{short} tok s':>9} {f'{long} tok s':>9} {'decode tok/s':>13}")
  for name, s in fig["samplers"].items():
    print(f"{name:>28} {s['short_s']:>9.3f} {s['long_s']:>9.3f} {s['tok_s']:>13.1f}")
  print(
    f"    roofline: reading the {fig['weight_bytes'] / 1e6:.1f} MB of weights once takes "
    f"{fig['weight_read_ms']:.2f} ms (measured); a decode step takes {ours['step_ms']:.2f} ms "
    f"here ({ours['per_read']:.2f}x the read), {theirs['step_ms']:.2f} ms in tunix"
  )
  split = fig["step_split"]
  print(
    f"    our step split: {ours['step_ms']:.2f} ms in all, "
    f"{split['no attention']:.2f} ms with no attention, "
    f"{split['page gather alone']:.2f} ms with the page gather alone in its place"
  )
  print(
    f"    ours / tunix: {fig['ours_over_tunix']:.2f}x; same greedy tokens: "
    f"{fig['same_tokens']}/{fig['tokens']} (tunix returned {fig['tokens_per_row']['tunix']} "
    f"tokens per row, ours {fig['tokens_per_row']['ours']})"
  )


def _tunix_version() -> str:
  try:
    return importlib.metadata.version("google-tunix")
  except importlib.metadata.PackageNotFoundError:
    return "unknown"


def _tunix_elsewhere(python):
  """(c) rerun under `python` (tunix's venv) with the same config; its figures, or None when it
  skipped. They come back through a results record written to a temporary file."""
  sys.stdout.flush()
  with tempfile.TemporaryDirectory() as tmp:
    out = os.path.join(tmp, "tunix.json")
    subprocess.run(
      [
        python,
        os.path.abspath(__file__),
        *sys.argv[1:],
        "--config.parts=c",
        "--config.tunix.python=",
        f"--config.out={out}",
      ],
      check=True,
    )
    if not os.path.exists(out):
      return None
    with open(out) as f:
      return json.load(f)["results"].get("tunix")


def bench_tunix(config):
  """(c): prints our sampler against tunix's and returns the figures, or None when google-tunix is
  not importable (it prints how to make a venv for it)."""
  if config.tunix.python:
    return _tunix_elsewhere(config.tunix.python)
  try:
    from flax import nnx
    from tunix.generate import sampler as tunix_sampler
    from tunix.models.qwen3 import model as tunix_qwen3
  except ImportError as e:
    print(
      f"(c) skipped: google-tunix is not importable in this Python ({sys.executable}): {e}. "
      "It is not a project dependency; make a venv for it (python3 -m venv VENV && "
      "VENV/bin/pip install google-tunix jax==0.10.2 flax safetensors tokenizers "
      "ml_collections && VENV/bin/pip install --no-deps -e .) and set "
      "--config.tunix.python=VENV/bin/python."
    )
    return None
  if len(config.tunix.gen) != 2 or not 0 < config.tunix.gen[0] < config.tunix.gen[1]:
    raise ValueError(f"tunix.gen must be two lengths 0 < short < long, got {config.tunix.gen}")
  B, P = config.batch, config.tunix.prompt
  short, long = config.tunix.gen
  cfg = sj.Qwen3Config(**TINY, max_position_embeddings=P + long)
  params = sj.init_params(cfg, jax.random.PRNGKey(0))
  model = _tunix_model(cfg, params, nnx, tunix_qwen3)
  prompt_BT = np.random.default_rng(0).integers(1, cfg.vocab_size, (B, P)).astype(np.int32)
  prompt_len_B = np.full((B,), P, np.int32)
  texts = [" ".join(map(str, row)) for row in prompt_BT]
  tokenizer = _IdTokenizer(pad=0, eos=cfg.vocab_size)
  # Each sampler's cache holds exactly prompt + generation, as ours does (both read all of it).
  samplers = {
    n: tunix_sampler.Sampler(
      model,
      tokenizer,
      tunix_sampler.CacheConfig(
        cache_size=P + n,
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
      ),
    )
    for n in (short, long)
  }
  outputs = {}

  def ours(n, name="ours"):
    def run():
      outputs[name, n] = np.asarray(
        sj.generate(
          params,
          cfg,
          prompt_BT,
          prompt_len_B,
          jax.random.PRNGKey(0),
          max_new_tokens=n,
          sampling=sj.Sampling(temperature=0.0),
        ).tokens
      )

    return run

  def theirs(n):
    def run():
      out = samplers[n](
        texts,
        max_generation_steps=n,
        max_prompt_length=P,
        temperature=0.0,
        eos_tokens=[tokenizer.eos],
      )
      outputs["tunix", n] = np.stack([np.asarray(t) for t in out.tokens])

    return run

  probes = [
    with_attention(ours(n, name), attention)
    for name, attention in STEP_PROBES.items()
    for n in (short, long)
  ]
  ours_s, ours_l, tunix_s, tunix_l, *probe_s = median_seconds(
    [ours(short), ours(long), theirs(short), theirs(long), *probes], config.runs
  )
  read_ms = weight_read_ms(params, config.runs)
  seconds = dict(zip(SAMPLERS, [(ours_s, ours_l), (tunix_s, tunix_l)]))
  by_sampler = sampler_figures(B, (short, long), seconds, read_ms)
  probe_seconds = {name: tuple(probe_s[2 * i : 2 * i + 2]) for i, name in enumerate(STEP_PROBES)}
  split = sampler_figures(B, (short, long), probe_seconds, read_ms)
  a, b = outputs["ours", long], outputs["tunix", long]
  same = int(np.sum(a[:, : b.shape[1]] == b)) if a.shape[0] == b.shape[0] else 0
  fig = dict(
    model=dict(
      layers=cfg.num_hidden_layers,
      hidden_size=cfg.hidden_size,
      heads=cfg.num_attention_heads,
      kv_heads=cfg.num_key_value_heads,
      vocab_size=cfg.vocab_size,
    ),
    batch=B,
    prompt=P,
    gen=[short, long],
    runs=config.runs,
    samplers=by_sampler,
    step_split={name: f["step_ms"] for name, f in split.items()},
    weight_bytes=sum(x.nbytes for x in jax.tree_util.tree_leaves(params)),
    weight_read_ms=read_ms,
    ours_over_tunix=by_sampler[SAMPLERS[0]]["tok_s"] / by_sampler[SAMPLERS[1]]["tok_s"],
    same_tokens=same,
    tokens=int(b.size),
    tokens_per_row=dict(ours=int(a.shape[1]), tunix=int(b.shape[1])),
    versions=dict(tunix=_tunix_version(), jax=jax.__version__, python=sys.version.split()[0]),
  )
  print_tunix(fig)
  return fig


# ------------------------------------------------- (d) long-tail rollouts: engine vs static batch


def engine_model(c) -> sj.Qwen3Config:
  """The bench's model: "default" is the shipped tiny default's shape (configs/common.py's hf_dir),
  "qwen3-1.7b" the 1.7B shape truncated to `engine.layers` layers (vocab as in (b)); random
  weights, positions enough for the prompt and the cutoff."""
  if c.model == "default":
    cfg = hf.load_config(os.path.join(ROOT, common.model().hf_dir))
  elif c.model == "qwen3-1.7b":
    cfg = model_config(c.layers, 0)
  else:
    raise ValueError(f"engine.model must be 'default' or 'qwen3-1.7b', got {c.model!r}")
  return dataclasses.replace(cfg, max_position_embeddings=c.prompt + c.cutoff)


def long_tail_lengths(rows: int, cutoff: int, seed: int) -> np.ndarray:
  """Per-row completion lengths: geometric with mean cutoff / 2, capped at the cutoff (the
  long-tailed lengths of RL rollouts, which the paper's 37K cutoff truncates)."""
  return np.minimum(np.random.default_rng(seed).geometric(2.0 / cutoff, rows), cutoff)


def bench_engine(config):
  """The engine's settings (static batch, continuous) on the same rows and the same pool memory,
  dense and sparse: useful tokens/s, rows in flight, occupancy. Returns the results dict."""
  c = config.engine
  cfg = engine_model(c)
  dtype = jnp.dtype(c.dtype)
  rows = c.prompts * c.group_size
  lengths = long_tail_lengths(rows, c.cutoff, c.seed)
  rng = np.random.default_rng(c.seed)
  prompt_BT = np.repeat(rng.integers(1, cfg.vocab_size, (c.prompts, c.prompt)), c.group_size, 0)
  prompt_len_B = np.full((rows,), c.prompt, np.int32)
  params = sj.init_params(cfg, jax.random.PRNGKey(0), dtype=dtype, std=0.02)
  sparse = sj.SparseConfig(page_size=16, dense_layers=c.dense_layers)
  row_pages = -(-(c.prompt + c.cutoff) // 16)
  # the pool: pool_gb of pages, or (0) the static batch's memory, static_slots rows at full length
  pool = (
    engine.pages_for_bytes(cfg, c.pool_gb * 1e9, 16, dtype, sparse.page_score)
    if c.pool_gb
    else c.static_slots * row_pages + 1
  )
  drain = lambda slots: int(slots * c.drain_share)
  settings = {
    "static": engine.EngineConfig(
      num_slots=c.static_slots,
      num_pages=pool,
      chunk_steps=c.chunk_steps,
      static=True,
      drain_slots=drain(c.static_slots),
    ),
    "engine": engine.EngineConfig(
      num_slots=c.slots, num_pages=pool, chunk_steps=c.chunk_steps, drain_slots=drain(c.slots)
    ),
  }
  if set(c.settings) - set(settings):
    raise ValueError(f"engine.settings takes {tuple(settings)}, got {c.settings}")
  schedule = KVSchedule.paper("qwen3-1.7b", c.tau)
  print(
    f"(d) long-tail rollouts, {jax.default_backend()} ({jax.devices()[0].device_kind}): "
    f"{c.model} shape ({cfg.num_hidden_layers} layers, width {cfg.hidden_size}, vocab "
    f"{cfg.vocab_size}, {c.dtype}, random weights), {c.prompts} prompts x {c.group_size} rows, "
    f"prompt {c.prompt}, lengths geometric mean {c.cutoff // 2} capped at {c.cutoff} (total "
    f"{lengths.sum()}, longest {lengths.max()}); pool {pool} pages of 16 = {pool * 16} tokens "
    f"for every setting; sparse: paper tau-{c.tau} Qwen3-1.7B table, {c.dense_layers} dense "
    f"layers",
    flush=True,
  )
  print(
    f"{'attention':>9} {'setting':>8} {'slots':>5} {'tok/s':>9} {'rows in flight':>14} "
    f"{'occupancy':>9} {'preempted':>9} {'peak pages':>10} {'seconds':>8}"
  )
  results = dict(
    model=c.model, config=c.to_dict(), pool_pages=pool, total_tokens=int(lengths.sum()), runs={}
  )
  for attention in ("dense", "sparse"):
    kw = dict(sparse=sparse, schedule=schedule) if attention == "sparse" else {}
    for name in c.settings:
      setting = settings[name]
      run = lambda max_new: engine.run(
        params,
        cfg,
        engine.Requests(prompt_BT, prompt_len_B, max_new, c.group_size),
        jax.random.PRNGKey(1),
        engine=setting,
        **kw,
      )
      # warm-up: the same compiled shapes (the cutoff sets the page tables' width), little decoding
      run(np.where(np.arange(rows) == 0, c.cutoff, 1))
      start = time.perf_counter()
      out, stats = run(lengths)
      seconds = time.perf_counter() - start
      if not np.array_equal(np.asarray(out.lengths), lengths):
        raise RuntimeError(f"{attention} {name}: rows did not run to their forced lengths")
      tok_s = int(lengths.sum()) / seconds
      results["runs"][f"{attention}/{name}"] = dict(
        tokens_per_s=tok_s,
        rows_in_flight=stats.rows_in_flight,
        occupancy=stats.occupancy,
        preemptions=stats.preemptions,
        peak_pages=stats.peak_pages,
        seconds=seconds,
        slots=setting.num_slots,
        decode_steps=stats.decode_steps,
      )
      print(
        f"{attention:>9} {name:>8} {setting.num_slots:>5} {tok_s:>9.1f} "
        f"{stats.rows_in_flight:>14.2f} {stats.occupancy:>9.2f} {stats.preemptions:>9} "
        f"{stats.peak_pages:>10} {seconds:>8.1f}",
        flush=True,
      )
  r, results["ratios"] = results["runs"], {}
  pairs = [
    ("engine/static dense", "dense/engine", "dense/static", "tokens_per_s"),
    ("engine/static sparse", "sparse/engine", "sparse/static", "tokens_per_s"),
    ("rows in flight engine/static", "dense/engine", "dense/static", "rows_in_flight"),
    ("sparse/dense static", "sparse/static", "dense/static", "tokens_per_s"),
    ("sparse/dense engine", "sparse/engine", "dense/engine", "tokens_per_s"),
  ]
  for name, a, b, key in pairs:
    if a in r and b in r:
      results["ratios"][name] = r[a][key] / r[b][key]
      print(f"    {name}: {results['ratios'][name]:.2f}x")
  if c.record:
    records.write_record(os.path.join(ROOT, c.record), results)
    print(f"    record: {c.record}")
  return results


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  config = flags.FLAGS.config
  parts = config.parts.split(",")
  if set(parts) - {"b", "c", "d"}:
    raise ValueError(
      f"parts takes b, c and/or d, got {config.parts!r} (exact mode: experiments/bench_exact.py)"
    )
  results = {}
  if "b" in parts:
    results["decode"] = bench_decode(config)
  if "c" in parts:
    results["tunix"] = bench_tunix(config)
  if "d" in parts:
    bench_engine(config)
  results = {part: fig for part, fig in results.items() if fig is not None}
  if config.out and results:
    records.write_record(os.path.join(ROOT, config.out), dict(config=config.to_dict(), **results))
    print(f"    record: {config.out}")


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/bench_rollout.py", "experiment config")
  app.run(main)
