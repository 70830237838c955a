"""Benchmark (a): one decode step of attention only, dense vs block-sparse (XLA jnp references).

  python experiments/bench_attention.py --config=configs/bench_attention.py \\
      [--config.contexts=4096,16384,32768 --config.budget=2048 --config.steps=8 --config.runs=7
       --config.dtype=float32 --config.select=False]

Qwen3-1.7B attention shapes (16 query heads, 8 KV heads, head dim 128), batch 4, every cached token
valid, page size 16, a 2048-token budget (128 pages, all valid). Timed, per context, side by side:
  dense          reference.dense_decode_attention over the whole cache;
  sparse         reference.sparse_decode_attention over 128 given pages (random distinct pages
                 including the first and the last two); page selection not timed;
  sparse+select  select.decode_pages (centroid scores, block top-k) + sparse attention.
Each timed call is one jitted `lax.fori_loop` of `steps` decode steps, each step's output being the
next step's query (and the page list shifting by one page per step, so XLA cannot hoist the gather
out of the loop); a cell is the median over `runs` calls (after a warm-up call) divided by `steps`,
the columns' calls interleaved run by run so that they share whatever else loads the machine;
"min ratio" divides the fastest dense call by the fastest sparse one (less sensitive to that load).
Why a loop: a decode loop reuses its buffers, while a lone jitted call allocates its outputs and
temporaries afresh, and on this VM first-touching fresh memory costs ~1.5 us per 4 KiB page, which
would dominate the sparse step (--config.steps=1 shows that single-call regime).
"""
import os
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from sparrow_jax.attention import reference, select

BATCH, KV_HEADS, GROUP, HEAD_DIM, PAGE_SIZE = 4, 8, 2, 128, 16


def _times_ms(calls, runs):
  """(median, min) ms per call of each (fn, args), the calls interleaved run by run so that they
  share whatever else loads the machine."""
  for fn, args in calls:
    jax.block_until_ready(fn(*args))
  times = [[] for _ in calls]
  for _ in range(runs):
    for (fn, args), t in zip(calls, times):
      start = time.perf_counter()
      jax.block_until_ready(fn(*args))
      t.append(time.perf_counter() - start)
  return [(statistics.median(t) * 1e3, min(t) * 1e3) for t in times]


def _loops(steps, n_selected):
  def dense(q, k, v, lengths):
    body = lambda i, q: reference.dense_decode_attention(q, k, v, lengths)
    return jax.lax.fori_loop(0, steps, body, q)

  def sparse(q, k, v, page_idx, n_valid, lengths):
    P = k.shape[2] // PAGE_SIZE
    body = lambda i, q: reference.sparse_decode_attention(
        q, k, v, (page_idx + i) % P, n_valid, lengths, page_size=PAGE_SIZE)
    return jax.lax.fori_loop(0, steps, body, q)

  def sparse_select(q, k, v, centroid_sum, lengths):
    config = select.SparseConfig(page_size=PAGE_SIZE)
    budget = jnp.full(lengths.shape, n_selected, jnp.int32)

    def body(i, q):
      page_idx, n_valid = select.decode_pages(q, centroid_sum, lengths, budget, config, n_selected)
      return reference.sparse_decode_attention(q, k, v, page_idx, n_valid, lengths,
                                               page_size=PAGE_SIZE)
    return jax.lax.fori_loop(0, steps, body, q)

  return jax.jit(dense), jax.jit(sparse), jax.jit(sparse_select)


def _inputs(context, n_selected, dtype, seed=0):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  shape = (BATCH, KV_HEADS, context, HEAD_DIM)
  q = jax.random.normal(kq, (BATCH, KV_HEADS, GROUP, HEAD_DIM), dtype)
  k = jax.random.normal(kk, shape, dtype)
  v = jax.random.normal(kv, shape, dtype)
  P = context // PAGE_SIZE
  rng = np.random.default_rng(seed)
  rows = [np.concatenate([[0, P - 2, P - 1], 1 + rng.permutation(P - 3)[:n_selected - 3]])
          for _ in range(BATCH * KV_HEADS)]
  page_idx = jnp.asarray(np.stack(rows).reshape(BATCH, KV_HEADS, n_selected), jnp.int32)
  n_valid = jnp.full((BATCH, KV_HEADS), n_selected, jnp.int32)
  lengths = jnp.full((BATCH,), context, jnp.int32)
  return q, k, v, page_idx, n_valid, lengths


def check_config(config) -> None:
  """Rejects settings the page layout cannot hold: whole pages, 3 fixed pages, budget <= context."""
  if config.dtype not in ("float32", "bfloat16"):
    raise ValueError(f"dtype must be float32 or bfloat16, got {config.dtype!r}")
  if config.budget % PAGE_SIZE or config.budget < 3 * PAGE_SIZE:
    raise ValueError(f"budget must be a multiple of {PAGE_SIZE} of at least 3 pages (the first "
                     f"and last two are always selected), got {config.budget}")
  bad = [c for c in config.contexts if c % PAGE_SIZE or c < config.budget]
  if bad:
    raise ValueError(f"contexts must be multiples of {PAGE_SIZE} of at least budget="
                     f"{config.budget} tokens, got {bad}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  config = flags.FLAGS.config
  check_config(config)
  n_selected = config.budget // PAGE_SIZE
  dense, sparse, sparse_select = _loops(config.steps, n_selected)

  print(f"{jax.default_backend()} x{os.cpu_count()} cores, {config.dtype}, batch {BATCH}, "
        f"{KV_HEADS * GROUP} query / {KV_HEADS} KV heads, head dim {HEAD_DIM}, budget "
        f"{config.budget} tokens ({n_selected} pages of {PAGE_SIZE}); ms per decode step "
        f"(median of {config.runs} calls of {config.steps} steps); 1-min load average at start "
        f"{os.getloadavg()[0]:.1f}")
  print(f"{'context':>8} {'dense':>9} {'sparse':>9} {'ratio':>7} {'min ratio':>10} "
        f"{'sparse+select':>14} {'ratio':>7}")
  for context in config.contexts:
    q, k, v, page_idx, n_valid, lengths = _inputs(context, n_selected, jnp.dtype(config.dtype))
    calls = [(dense, (q, k, v, lengths)), (sparse, (q, k, v, page_idx, n_valid, lengths))]
    if config.select:
      centroid_sum = k.astype(jnp.float32).reshape(
          BATCH, KV_HEADS, context // PAGE_SIZE, PAGE_SIZE, HEAD_DIM).sum(axis=3)
      calls.append((sparse_select, (q, k, v, centroid_sum, lengths)))
    (dense_ms, dense_min), (sparse_ms, sparse_min), *select_ms = [
        (med / config.steps, low / config.steps) for med, low in _times_ms(calls, config.runs)]
    row = (f"{context:>8} {dense_ms:>9.2f} {sparse_ms:>9.2f} {dense_ms / sparse_ms:>6.1f}x "
           f"{dense_min / sparse_min:>9.1f}x")
    if select_ms:
      row += f" {select_ms[0][0]:>14.2f} {dense_ms / select_ms[0][0]:>6.1f}x"
    print(row, flush=True)


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/bench_attention.py", "experiment config")
  app.run(main)
