"""Benchmark (a): one decode step of attention only, dense vs block-sparse.

  python experiments/bench_attention.py --config=configs/bench_attention.py \\
      [--config.contexts=4096,16384,32768 --config.budget=2048 --config.batch=4 --config.steps=8
       --config.runs=7 --config.dtype=float32 --config.impl=auto --config.select=False
       --config.out=docs/results/decode_attention.json]

Qwen3-1.7B attention shapes (16 query heads, 8 KV heads, head dim 128), `batch` rows holding
`context` tokens each in a cache preallocated for `cache_tokens` (default the largest context), as
the sampler preallocates prompt + max_new_tokens; page size 16, a 2048-token budget (128 pages, all
valid). Dense and sparse go through the dispatch the sampler uses (sparsity/policy.py, `impl`:
auto = the Triton kernel on a GPU, the Mosaic kernel on a TPU, XLA elsewhere). Timed, per context,
side by side:
  dense          policy.dense_decode_attention: the fair baseline, reading each row's cached
                 tokens only, in the cache dtype (a length-aware dense kernel, as the paper's
                 FlashInfer baseline);
  whole cache    reference.dense_decode_attention over the whole preallocated cache (masked by
                 length): a baseline that reads more than a good dense kernel does;
  sparse         policy.decode_attention over 128 given pages (random distinct pages including the
                 first and the last two); page selection not timed;
  sparse+select  select.decode_pages (centroid scores, block top-k) + sparse attention.
GB/s = bytes each step must read (K and V of the tokens read, plus the page centroids, in the cache
dtype, for select) / time: the achieved bandwidth, to hold against the chip's peak
(experiments/device_check.py).
Each timed call is one jitted `lax.fori_loop` of `steps` decode steps, each step's output being the
next step's query (and the page list shifting by one page per step, so XLA cannot hoist the gather
out of the loop); a cell is the median over `runs` calls (after a warm-up call) divided by `steps`,
the columns' calls interleaved run by run so that they share whatever else loads the machine;
"min ratio" divides the fastest dense call by the fastest sparse one (less sensitive to that load);
"old ratio" is whole cache / sparse, the inflated ratio a baseline reading the whole cache gives.
Why a loop: a decode loop reuses its buffers, while a lone jitted call allocates its outputs and
temporaries afresh, and on a CPU first-touching fresh memory costs enough per 4 KiB page to
dominate the sparse step (--config.steps=1 shows that single-call regime).
With `out` set, the table and its settings are also written there as a results record
(sparrow_jax/records.py), from which docs/make_results_pages.py makes
docs/results/decode_attention.md.
"""

import os
import statistics

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from experiments import timing
from sparrow_jax import records
from sparrow_jax.attention import paged_cache, reference, select
from sparrow_jax.sparsity import policy

KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE = 8, 2, 128, 16


def _times_ms(calls, runs):
  """(median, min) ms per call of each (fn, args), timed by `timing.interleaved_seconds`."""
  thunks = [lambda fn=fn, args=args: jax.block_until_ready(fn(*args)) for fn, args in calls]
  times = timing.interleaved_seconds(thunks, runs)
  return [(statistics.median(t) * 1e3, min(t) * 1e3) for t in times]


def _loops(steps, n_selected, impl):
  def dense(q, k, v, lengths):
    body = lambda i, q: policy.dense_decode_attention(
      q, k, v, lengths, page_size=PAGE_SIZE, impl=impl
    )
    return jax.lax.fori_loop(0, steps, body, q)

  def whole_cache(q, k, v, lengths):
    body = lambda i, q: reference.dense_decode_attention(q, k, v, lengths)
    return jax.lax.fori_loop(0, steps, body, q)

  def sparse(q, k, v, page_idx, n_valid, lengths):
    P = k.shape[2] // PAGE_SIZE
    body = lambda i, q: policy.decode_attention(
      q, k, v, (page_idx + i) % P, n_valid, lengths, page_size=PAGE_SIZE, impl=impl
    )
    return jax.lax.fori_loop(0, steps, body, q)

  def sparse_select(q, k, v, summaries, lengths):
    config = select.SparseConfig(page_size=PAGE_SIZE, attention_impl=impl)
    budget = jnp.full(lengths.shape, n_selected, jnp.int32)

    def body(i, q):
      page_idx, n_valid = select.decode_pages(q, summaries, lengths, budget, config, n_selected)
      return policy.decode_attention(
        q, k, v, page_idx, n_valid, lengths, page_size=PAGE_SIZE, impl=impl
      )

    return jax.lax.fori_loop(0, steps, body, q)

  return jax.jit(dense), jax.jit(whole_cache), jax.jit(sparse), jax.jit(sparse_select)


def _inputs(batch, context, n_selected, dtype, cache_tokens=None, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  shape = (batch, KV_HEADS, cache_tokens or context, HEAD_DIM)
  q = jax.random.normal(kq, (batch, KV_HEADS, GROUP, HEAD_DIM), dtype)
  k = jax.random.normal(kk, shape, dtype)
  v = jax.random.normal(kv, shape, dtype)
  P = context // PAGE_SIZE
  rng = np.random.default_rng(seed)
  rows = [
    np.concatenate([[0, P - 2, P - 1], 1 + rng.permutation(P - 3)[: n_selected - 3]])
    for _ in range(batch * KV_HEADS)
  ]
  page_idx = jnp.asarray(np.stack(rows).reshape(batch, KV_HEADS, n_selected), jnp.int32)
  n_valid = jnp.full((batch, KV_HEADS), n_selected, jnp.int32)
  lengths = jnp.full((batch,), context, jnp.int32)
  return q, k, v, page_idx, n_valid, lengths


def measure(config, context):
  """{column: (median ms, min ms, bytes read per step)} for one context, columns dense, whole
  cache, sparse and (with config.select) sparse+select."""
  n_selected = config.budget // PAGE_SIZE
  dense, whole_cache, sparse, sparse_select = _loops(config.steps, n_selected, config.impl)
  dtype = jnp.dtype(config.dtype)
  cache_tokens = config.cache_tokens or max(config.contexts)
  q, k, v, page_idx, n_valid, lengths = _inputs(
    config.batch, context, n_selected, dtype, cache_tokens
  )
  kv_bytes = 2 * config.batch * KV_HEADS * HEAD_DIM * dtype.itemsize  # K + V of one token
  calls = {
    "dense": ((dense, (q, k, v, lengths)), context * kv_bytes),
    "whole cache": ((whole_cache, (q, k, v, lengths)), cache_tokens * kv_bytes),
    "sparse": ((sparse, (q, k, v, page_idx, n_valid, lengths)), config.budget * kv_bytes),
  }
  if config.select:
    summaries = paged_cache.page_summaries(k[:, :, :context], PAGE_SIZE, "mean")
    calls["sparse+select"] = (
      (sparse_select, (q, k, v, summaries, lengths)),
      config.budget * kv_bytes + summaries.nbytes,
    )
  times = _times_ms([call for call, _ in calls.values()], config.runs)
  return {
    name: (med / config.steps, low / config.steps, nbytes)
    for (name, (_, nbytes)), (med, low) in zip(calls.items(), times)
  }


def check_config(config) -> None:
  """Rejects settings the page layout cannot hold: whole pages, 3 fixed pages, budget <= context."""
  if config.impl not in reference.IMPLS:
    raise ValueError(f"impl must be one of {reference.IMPLS}, got {config.impl!r}")
  if config.batch < 1:
    raise ValueError(f"batch must be >= 1, got {config.batch}")
  if config.dtype not in ("float32", "bfloat16"):
    raise ValueError(f"dtype must be float32 or bfloat16, got {config.dtype!r}")
  if config.budget % PAGE_SIZE or config.budget < 3 * PAGE_SIZE:
    raise ValueError(
      f"budget must be a multiple of {PAGE_SIZE} of at least 3 pages (the first "
      f"and last two are always selected), got {config.budget}"
    )
  bad = [c for c in config.contexts if c % PAGE_SIZE or c < config.budget]
  if bad:
    raise ValueError(
      f"contexts must be multiples of {PAGE_SIZE} of at least budget="
      f"{config.budget} tokens, got {bad}"
    )
  if config.cache_tokens and (
    config.cache_tokens % PAGE_SIZE or config.cache_tokens < max(config.contexts)
  ):
    raise ValueError(
      f"cache_tokens must be 0 or a multiple of {PAGE_SIZE} holding every context "
      f"(>= {max(config.contexts)}), got {config.cache_tokens}"
    )


def row_figures(context, cells) -> dict:
  """The figures of one table row from `measure`'s cells: ms per step, GB/s read, and the ratios
  (dense / sparse is the speedup over the fair baseline; whole cache / sparse the one a baseline
  reading the whole preallocated cache gives)."""
  (dense_ms, dense_min, dense_b), (sparse_ms, sparse_min, sparse_b) = (
    cells["dense"],
    cells["sparse"],
  )
  whole_ms = cells["whole cache"][0]
  row = dict(
    context=context,
    dense_ms=dense_ms,
    dense_gbs=dense_b / dense_ms / 1e6,
    whole_cache_ms=whole_ms,
    sparse_ms=sparse_ms,
    sparse_gbs=sparse_b / sparse_ms / 1e6,
    ratio=dense_ms / sparse_ms,
    min_ratio=dense_min / sparse_min,
    whole_cache_ratio=whole_ms / sparse_ms,
  )
  if "sparse+select" in cells:
    row["select_ms"] = cells["sparse+select"][0]
    row["select_ratio"] = dense_ms / row["select_ms"]
  return row


def format_row(row) -> str:
  text = (
    f"{row['context']:>8} {row['dense_ms']:>9.3f} {row['dense_gbs']:>7.1f} "
    f"{row['whole_cache_ms']:>12.3f} {row['sparse_ms']:>9.3f} {row['sparse_gbs']:>7.1f} "
    f"{row['ratio']:>6.1f}x {row['min_ratio']:>9.1f}x {row['whole_cache_ratio']:>9.1f}x"
  )
  if "select_ms" in row:
    text += f" {row['select_ms']:>14.3f} {row['select_ratio']:>6.1f}x"
  return text


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  config = flags.FLAGS.config
  check_config(config)
  load = os.getloadavg()[0]
  print(
    f"{jax.default_backend()} x{os.cpu_count()} cores, impl {config.impl}, {config.dtype}, "
    f"batch {config.batch}, cache {config.cache_tokens or max(config.contexts)} tokens, "
    f"{KV_HEADS * GROUP} query / {KV_HEADS} KV heads, head dim "
    f"{HEAD_DIM}, budget {config.budget} tokens ({config.budget // PAGE_SIZE} pages of "
    f"{PAGE_SIZE}); ms per decode step (median of {config.runs} calls of {config.steps} "
    f"steps), GB/s read; 1-min load average at start {load:.1f}"
  )
  print(
    f"{'context':>8} {'dense':>9} {'GB/s':>7} {'whole cache':>12} {'sparse':>9} {'GB/s':>7} "
    f"{'ratio':>7} {'min ratio':>10} {'old ratio':>10} {'sparse+select':>14} {'ratio':>7}"
  )
  rows = []
  for context in config.contexts:
    rows.append(row_figures(context, measure(config, context)))
    print(format_row(rows[-1]), flush=True)
  if config.out:
    results = dict(
      config=config.to_dict(),
      backend=jax.default_backend(),
      cores=os.cpu_count(),
      load_average=load,
      cache_tokens=config.cache_tokens or max(config.contexts),
      shape=dict(query_heads=KV_HEADS * GROUP, kv_heads=KV_HEADS, head_dim=HEAD_DIM),
      page_size=PAGE_SIZE,
      rows=rows,
    )
    records.write_record(os.path.join(records.ROOT, config.out), results)


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/bench_attention.py", "experiment config")
  app.run(main)
