"""Long-tail rollouts through the rollout engine and through its static-batch setting, dense and
sparse, on the same rows and the same pool memory.

  python experiments/bench_engine.py --config=configs/bench_engine.py \\
      [--config.engine.model=qwen3-1.7b --config.engine.layers=2 ...] \\
      [--config.engine.record=docs/results/engine_long_tail_default.json]

`engine.prompts` x `engine.group_size` rows of random prompts (a group shares its prompt) on a
model of random weights: the shipped tiny default's shape, or Qwen3-1.7B's cut to `engine.layers`
layers. Per-row completion lengths are long-tailed as RL rollouts are (geometric with mean cutoff /
2, capped at the cutoff), forced with per-row `max_new_tokens`. The static batch
(`EngineConfig(static=True)`) allocates every row's pages at full length and admits rows only into
an empty batch; the engine refills slots between chunks and hands out pages as rows grow. Both get
the same pool (`engine.pool_gb`, or the static batch's `static_slots` rows at full length) and
decode only their first `drain_share` x slots once few rows are left. Sparse runs take the paper's
Qwen3-1.7B table at `engine.tau`. Each (attention, setting) runs once after a warm-up call of the
same compiled shapes; tok/s counts the tokens the rollout keeps over wall time, beside rows in
flight, occupancy, preemptions and the peak of pages in use.

With `engine.record` set, the figures and the settings are written there as a results record
(sparrow_jax/records.py), one per model shape, from which docs/make_results_pages.py makes
docs/results/rollout_engine.md.
"""

import dataclasses
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from configs import common
from experiments.bench_decode import model_config
import sparrow_jax as sj
from sparrow_jax import records
from sparrow_jax.model import hf
from sparrow_jax.rollout import engine
from sparrow_jax.sparsity.schedule import KVSchedule


def engine_model(c) -> sj.Qwen3Config:
  """The bench's model: "default" is the shipped tiny default's shape (configs/common.py's hf_dir),
  "qwen3-1.7b" the 1.7B shape truncated to `engine.layers` layers (bench_decode.model_config: its
  vocabulary scaled by layers / 28); random weights, positions enough for the prompt and the
  cutoff."""
  if c.model == "default":
    cfg = hf.load_config(os.path.join(records.ROOT, common.model().hf_dir))
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
    f"long-tail rollouts, {jax.default_backend()} ({jax.devices()[0].device_kind}): "
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
    records.write_record(os.path.join(records.ROOT, c.record), results)
    print(f"    record: {c.record}")
  return results


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  bench_engine(flags.FLAGS.config)


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/bench_engine.py", "experiment config")
  app.run(main)
