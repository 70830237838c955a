"""Decode tokens/s end to end, dense vs sparse, beside the cost model's prediction.

  python experiments/bench_decode.py --config=configs/bench_decode.py \\
      [--config.decode.contexts=16384,32768 --config.decode.dense_layers=2,0 --config.batch=4 ...]
  python experiments/bench_decode.py --config=configs/bench_decode.py \\
      --config.out=docs/results/decode_rollout.json

Attention alone (one decode step of Qwen3-1.7B attention shapes, dense vs sparse) is
experiments/bench_attention.py; our dense sampler against tunix's is experiments/bench_tunix.py.

A Qwen3-1.7B-shaped model (preset "qwen3-1.7b": 16 query / 8 KV heads, head dim 128, width
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

With `out` set, the printed figures and the config are written there as one results record
(sparrow_jax/records.py), from which docs/make_results_pages.py makes docs/results/decode_rollout.md
(docs/results/real_lm_decode.md for a `decode.model_dir` run).
"""

import dataclasses
import functools
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags

from experiments.timing import median_seconds
import sparrow_jax as sj
from sparrow_jax import records
from sparrow_jax.attention import paged_cache
from sparrow_jax.mismatch import cost_model
from sparrow_jax.model import qwen3
from sparrow_jax.rollout import sampler
from sparrow_jax.sparsity import policy
from sparrow_jax.sparsity.schedule import BudgetTable, KVSchedule

FULL_LAYERS = 28


def model_config(layers: int, vocab_size: int) -> sj.Qwen3Config:
  """Qwen3-1.7B's shape cut to `layers` layers; vocab_size 0 scales its vocabulary by layers / 28
  (the LM head's share of a step stays the full model's)."""
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
  """Prints a row per (context, dense layers) and returns the figures (settings, this machine's
  roofline, the rows)."""
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
    f"decode only, {jax.default_backend()} x{os.cpu_count()} cores, {c.dtype}: "
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


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  config = flags.FLAGS.config
  decode = bench_decode(config)
  if config.out:
    records.write_record(
      os.path.join(records.ROOT, config.out), dict(config=config.to_dict(), decode=decode)
    )
    print(f"    record: {config.out}")


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/bench_decode.py", "experiment config")
  app.run(main)
