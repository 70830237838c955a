"""Rollout benchmark: (b) end-to-end decode tokens/s, dense vs sparse; (c) our dense sampler vs tunix.

  python experiments/bench_rollout.py [--parts b] [--layers 4] [--dense_layers 2,0] [--batch 4]
      [--contexts 16384,32768] [--steps 8] [--runs 5] [--dtype float32] [--vocab_size 0]
  /work/venv-tunix/bin/python experiments/bench_rollout.py --parts c   # (c): needs google-tunix

(a) attention only (one decode step of Qwen3-1.7B attention shapes, dense vs sparse) is
experiments/bench_attention.py; it exposes only a command line (`main()` parses sys.argv), so it is
run on its own rather than from here.

(b) A Qwen3-1.7B-shaped model (preset "qwen3-1.7b": 16 query / 8 KV heads, head dim 128, width
2048, FFN 6144) truncated to --layers layers, random weights, decoding at a fixed context. Only the
decode phase is timed: prefilling 32K tokens would take minutes on a 2-core CPU and says nothing
about decode. The cache is filled directly with random keys and values (unit normal, the scale that
Qwen3's k RMSNorm gives) and page centroid sums computed from those keys, `lengths` = context. One
timed call is a jitted `lax.fori_loop` of --steps `qwen3.decode_step`s, each step feeding its argmax
token to the next; the cache is donated, and each call first rewinds it to the context (lengths, and
the centroid sums of the pages written by the previous call) so every call does the same work.
Dense and sparse calls are interleaved run by run (they share the machine's load) and a cell is the
median over --runs calls after a warm-up (compile) call. Sparse = SparseConfig(page_size=16,
dense_layers=d) with the paper's tau-0.86 table for Qwen3-1.7B (budget_by_len and max_selected built
exactly as the sampler does), one row per d in --dense_layers. Sparrow keeps 2 layers dense; in a
4-layer truncation those are half the model (2 of 28 in the real one), which caps the speedup far
below the full model's, so the default also measures d = 0 (every layer sparse): that row is the
per-layer speedup that carries over to the 28-layer model.
The vocabulary is shrunk by default (it does not change attention cost): --vocab_size 0 scales the
151,936-token vocabulary by layers / 28, which keeps the LM head's share of a step what it is in the
full 28-layer model.
The cost model's prediction (sparrow_jax.mismatch.cost_model, with this machine's measured FLOP/s
and bandwidth, KV bytes per element set to --dtype's) for the same setting: rollout_speedup(cfg of
the truncated model, schedule, prompt_len=context, gen_len=steps, n_samples=1): the decode steps at
cached lengths context+1 .. context+steps, one sample per cache because our rows do not share
prompt pages (so the batch scales both costs alike). The cost model leaves parameter reads out
(amortized over a large rollout batch); at batch <= 4 on a CPU they are not negligible, so a second
prediction adds steps * I * params * bytes (one read of the weights per step for the whole batch)
to both costs.

(c) Dense decode tokens/s of a tiny Qwen3 (TINY below) in our sampler (sj.generate) and in
google-tunix's (tunix.generate.sampler.Sampler over tunix.models.qwen3), our random weights copied
into tunix's model, greedy, side by side in one process; decode tok/s comes from two generation
lengths so that prefill and per-call overheads cancel. The greedy tokens of both are compared as a
check that the two run the same model. tunix is optional: it is not a project dependency and lives
in a separate venv (google-tunix 0.1.7 installs from PyPI with jax 0.10.2 and runs offline on CPU);
without it (c) prints why.
"""
import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import sparrow_jax as sj  # noqa: E402
from sparrow_jax.attention import paged_cache  # noqa: E402
from sparrow_jax.mismatch import cost_model  # noqa: E402
from sparrow_jax.mismatch.schedule import KVSchedule  # noqa: E402
from sparrow_jax.model import qwen3  # noqa: E402
from sparrow_jax.rollout import sampler  # noqa: E402

FULL_LAYERS = 28


def _median_s(calls, runs):
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


# ----------------------------------------------------------------------------------- (b) decode only

def model_config(layers: int, vocab_size: int) -> sj.Qwen3Config:
  base = sj.Qwen3Config.preset("qwen3-1.7b")
  vocab = vocab_size or round(base.vocab_size * layers / FULL_LAYERS)
  return dataclasses.replace(base, num_hidden_layers=layers, vocab_size=vocab)


@functools.partial(jax.jit, static_argnames=("context", "page_size"), donate_argnames=("k", "v"))
def _fill_layer(k, v, key, context, page_size):
  """Random keys/values in slots [0, context) of one layer and the page sums of those keys."""
  B, K, _, E = k.shape
  kk, kv = jax.random.split(key)
  new_k = jax.random.normal(kk, (B, K, context, E), jnp.float32)
  new_v = jax.random.normal(kv, (B, K, context, E), jnp.float32)
  sums_BKPE = new_k.reshape(B, K, context // page_size, page_size, E).sum(axis=3)
  return (k.at[:, :, :context].set(new_k.astype(k.dtype)),
          v.at[:, :, :context].set(new_v.astype(v.dtype)), sums_BKPE)


def filled_cache(cfg, batch, context, steps, page_size, dtype, key):
  """A cache of context + steps slots holding `context` random tokens per row."""
  cache = paged_cache.init_cache(cfg, batch, context + steps, page_size, dtype)
  k, v, sums = list(cache.k), list(cache.v), list(cache.centroid_sum)
  for i in range(cfg.num_hidden_layers):
    k[i], v[i], layer_sums = _fill_layer(k[i], v[i], jax.random.fold_in(key, i), context, page_size)
    sums[i] = sums[i].at[:, :, :layer_sums.shape[2]].set(layer_sums)
  return cache.replace(k=k, v=v, centroid_sum=sums,
                       lengths=jnp.full((batch,), context, jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "sparse", "max_selected", "steps", "context"),
                   donate_argnames=("cache",))
def decode_loop(params, token_B, cache, budget_by_len, *, cfg, sparse, max_selected, steps, context):
  """`steps` greedy decode steps from a cache rewound to `context` tokens. Returns (token, cache)."""
  first_new_page = context // cache.page_size
  cache = cache.replace(
      lengths=jnp.full_like(cache.lengths, context),
      centroid_sum=[c.at[:, :, first_new_page:].set(0.0) for c in cache.centroid_sum])

  def body(i, carry):
    token_B, cache = carry
    logits_BV, cache = qwen3.decode_step(params, token_B, cfg, cache, sparse=sparse,
                                         budget_by_len=budget_by_len, max_selected=max_selected)
    return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32), cache

  return jax.lax.fori_loop(0, steps, body, (token_B, cache))


def bench_decode(args):
  dtype = jnp.dtype(args.dtype)
  cfg = model_config(args.layers, args.vocab_size)
  schedule = KVSchedule.paper("qwen3-1.7b", 0.86)
  contexts = [int(c) for c in args.contexts.split(",")]
  dense_layers = [int(d) for d in args.dense_layers.split(",")]
  bad = [c for c in contexts if c <= 0 or c % 16]
  if bad:
    raise ValueError(f"--contexts must be positive multiples of the page size 16, got {bad}")
  if not all(0 <= d <= args.layers for d in dense_layers):
    raise ValueError(f"--dense_layers must lie in [0, --layers={args.layers}], got {dense_layers}")
  sparse_configs = [sj.SparseConfig(page_size=16, dense_layers=d) for d in dense_layers]
  params = sj.init_params(cfg, jax.random.PRNGKey(0), dtype=dtype)
  n_params = qwen3.param_count(params)
  hw = cost_model.measure_this_machine()
  hw = dataclasses.replace(hw, dtype_bytes=dtype.itemsize)

  print(f"(b) decode only, {jax.default_backend()} x{os.cpu_count()} cores, {args.dtype}: Qwen3-1.7B "
        f"shapes truncated to {cfg.num_hidden_layers} layers, vocab {cfg.vocab_size} (shrunk from "
        f"151936; attention cost unchanged), {n_params / 1e6:.0f}M params, random weights; batch "
        f"{args.batch}; sparse = paper tau-0.86 Qwen3-1.7B table, page 16, the first `dense "
        f"layers` dense; tok/s = batch x steps / median of {args.runs} calls of {args.steps} steps")
  print(f"    this machine: {hw.peak_flops / 1e9:.0f} GFLOP/s, {hw.mem_bandwidth / 1e9:.1f} GB/s "
        f"(I = {hw.intensity:.1f} FLOP/byte), KV {hw.dtype_bytes} bytes/element")
  print(f"{'context':>8} {'budget':>7} {'dense layers':>12} {'dense tok/s':>12} {'sparse tok/s':>13} "
        f"{'ratio':>7} {'cost model':>11} {'+weights':>9}")
  for context in contexts:
    cache = filled_cache(cfg, args.batch, context, args.steps, 16, dtype, jax.random.PRNGKey(1))
    budget_np = sampler.budget_table(schedule, cache.max_len, sparse_configs[0])
    max_selected = 1 << max(int(budget_np.max()) - 1, 1).bit_length()
    budget_by_len = jnp.asarray(budget_np)
    token_B = jnp.zeros((args.batch,), jnp.int32)
    state = {"cache": cache}
    del cache

    def call(sparse):
      def run():
        token, state["cache"] = decode_loop(
            params, token_B, state["cache"], budget_by_len, cfg=cfg, sparse=sparse,
            max_selected=max_selected, steps=args.steps, context=context)
        jax.block_until_ready(token)
      return run

    dense_s, *sparse_s = _median_s([call(None)] + [call(sp) for sp in sparse_configs], args.runs)
    del state["cache"]
    dense_tps = args.batch * args.steps / dense_s
    dense1 = cost_model.dense_rollout_cost(cfg, context, args.steps, 1, hw)
    weights = args.steps * hw.intensity * n_params * hw.dtype_bytes
    budget_tokens = int(budget_np[context + 1]) * 16
    for d, seconds in zip(dense_layers, sparse_s):
      sparse_tps = args.batch * args.steps / seconds
      predicted = cost_model.rollout_speedup(cfg, schedule, context, args.steps, n_samples=1,
                                             hardware=hw, dense_layers=d)
      sparse1 = dense1 / predicted
      with_weights = (args.batch * dense1 + weights) / (args.batch * sparse1 + weights)
      print(f"{context:>8} {budget_tokens:>7} {d:>12} {dense_tps:>12.2f} {sparse_tps:>13.2f} "
            f"{sparse_tps / dense_tps:>6.2f}x {predicted:>10.2f}x {with_weights:>8.2f}x", flush=True)


# --------------------------------------------------------------- (c) our dense sampler vs tunix's

TINY = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)


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
      num_layers=cfg.num_hidden_layers, vocab_size=cfg.vocab_size, embed_dim=D,
      hidden_dim=cfg.intermediate_size, num_heads=H, head_dim=E, num_kv_heads=K,
      rope_theta=int(cfg.rope_theta), norm_eps=cfg.rms_norm_eps, use_tied_embedding=True)
  model = tunix_qwen3.Qwen3(config, rngs=nnx.Rngs(0))
  model.embedder.input_embedding.value = params["embed"]
  model.final_norm.w.value = params["final_norm"]
  for layer, p in zip(model.layers, params["layers"]):
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


def bench_tunix(args):
  try:
    from flax import nnx
    from tunix.generate import sampler as tunix_sampler
    from tunix.models.qwen3 import model as tunix_qwen3
  except ImportError as e:
    print(f"(c) skipped: google-tunix is not importable in this Python ({sys.executable}): {e}. "
          "It is not a project dependency; install it in a separate venv "
          "(python3 -m venv /work/venv-tunix && /work/venv-tunix/bin/pip install google-tunix "
          "jax==0.10.2 flax safetensors tokenizers) and run this script with that venv's python.")
    return
  B, P = args.batch, args.tunix_prompt
  short, long = (int(n) for n in args.tunix_gen.split(","))
  cfg = sj.Qwen3Config(**TINY, max_position_embeddings=P + long)
  params = sj.init_params(cfg, jax.random.PRNGKey(0))
  model = _tunix_model(cfg, params, nnx, tunix_qwen3)
  prompt_BT = np.random.default_rng(0).integers(1, cfg.vocab_size, (B, P)).astype(np.int32)
  prompt_len_B = np.full((B,), P, np.int32)
  texts = [" ".join(map(str, row)) for row in prompt_BT]
  tokenizer = _IdTokenizer(pad=0, eos=cfg.vocab_size)
  # Each sampler's cache holds exactly prompt + generation, as ours does (both read all of it).
  samplers = {n: tunix_sampler.Sampler(model, tokenizer, tunix_sampler.CacheConfig(
      cache_size=P + n, num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
      head_dim=cfg.head_dim)) for n in (short, long)}
  outputs = {}

  def ours(n):
    def run():
      outputs["ours", n] = np.asarray(sj.generate(
          params, cfg, prompt_BT, prompt_len_B, jax.random.PRNGKey(0), max_new_tokens=n,
          temperature=0.0).tokens)
    return run

  def theirs(n):
    def run():
      out = samplers[n](texts, max_generation_steps=n, max_prompt_length=P, temperature=0.0,
                        eos_tokens=[tokenizer.eos])
      outputs["tunix", n] = np.stack([np.asarray(t) for t in out.tokens])
    return run

  ours_s, ours_l, tunix_s, tunix_l = _median_s(
      [ours(short), ours(long), theirs(short), theirs(long)], args.runs)
  ours_tps = B * (long - short) / (ours_l - ours_s)
  tunix_tps = B * (long - short) / (tunix_l - tunix_s)
  a, b = outputs["ours", long], outputs["tunix", long]
  same = int(np.sum(a[:, :b.shape[1]] == b)) if a.shape[0] == b.shape[0] else 0
  print(f"(c) dense decode, tiny Qwen3 ({cfg.num_hidden_layers} layers, width "
        f"{cfg.hidden_size}, {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads, vocab "
        f"{cfg.vocab_size}, float32, random weights shared by both), batch {B}, prompt {P}, greedy; "
        f"decode tok/s = batch x ({long} - {short}) / (time({long}) - time({short})), medians of "
        f"{args.runs} calls (prefill and per-call overheads cancel)")
  print(f"{'sampler':>28} {f'{short} tok s':>9} {f'{long} tok s':>9} {'decode tok/s':>13}")
  print(f"{'sparrow_jax sj.generate':>28} {ours_s:>9.3f} {ours_l:>9.3f} {ours_tps:>13.1f}")
  print(f"{'tunix generate.Sampler':>28} {tunix_s:>9.3f} {tunix_l:>9.3f} {tunix_tps:>13.1f}")
  print(f"    ours / tunix: {ours_tps / tunix_tps:.2f}x; same greedy tokens: {same}/{b.size} "
        f"(tunix returned {b.shape[1]} tokens per row, ours {a.shape[1]})")


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=4, help="decoder layers of the 1.7B shape")
  parser.add_argument("--parts", default="b", help="comma-separated: b (decode, dense vs sparse), "
                      "c (ours vs tunix)")
  parser.add_argument("--dense_layers", default="2,0",
                      help="comma-separated: sparse runs with these first layers kept dense")
  parser.add_argument("--vocab_size", type=int, default=0,
                      help="0 = 151936 * layers / 28 (the full model's LM-head share)")
  parser.add_argument("--contexts", default="16384,32768")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--steps", type=int, default=8, help="decode steps per timed call")
  parser.add_argument("--runs", type=int, default=5)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--tunix_prompt", type=int, default=64, help="(c) prompt tokens")
  parser.add_argument("--tunix_gen", default="32,160", help="(c) the two generation lengths")
  args = parser.parse_args()
  parts = args.parts.split(",")
  if set(parts) - {"b", "c"}:
    raise ValueError(f"--parts takes b and/or c, got {args.parts!r}")
  if "b" in parts:
    bench_decode(args)
  if "c" in parts:
    bench_tunix(args)


if __name__ == "__main__":
  main()
