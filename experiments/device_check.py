"""The one-shot accelerator check: what a GPU or TPU machine runs, in under 11 minutes, to prove
the kernels and measure them. Prints markdown tables (for docs/kernels.md) and, with --out,
writes them as JSON.

  python experiments/device_check.py [--out=device_check.json]
  python experiments/device_check.py --smoke      # tiny sizes on any backend (CI runs it on CPU)
  python experiments/device_check.py --config.parts=exact    # some parts only (config.parts)

(1) kernels == their jnp twin, on the device: the platform's kernel (Triton on a GPU, Mosaic on a
    TPU; both in interpret mode on a CPU) against reference.sparse_decode_attention, float32 and
    bfloat16, several splits / pages per block, rows with empty selections; max |diff| and pass.
(2) attention only, dense vs sparse (experiments/bench_attention.py's `measure`): batch 64, 8 KV
    heads, G 2, head dim 128, a 2K-token budget at 4K / 16K / 32K, bfloat16; ms per step, achieved
    GB/s and its share of the chip's peak (PEAK_GBS; blank for an unknown chip). On a GPU the
    Triton tuning alternatives (block tokens x dot / CUDA-core reduce) are timed at 32K, so
    kernels/sparse_decode.TUNING can be set from the measurement.
(3) end-to-end decode of a random Qwen3-1.7B (28 layers, bfloat16, batch 16, cache filled directly
    with 32K - 64 tokens, no prefill: experiments/bench_decode.py's filled_cache and decode_loop),
    64 greedy steps dense vs sparse (the paper's tau-0.86 table, 2 dense layers): tok/s, compile
    seconds and the compiled temp size of each.
(4) the rollout engine (experiments/bench_engine.py) on long-tailed rows up to 32K: dense vs
    sparse useful tokens/s on this one device, rows in flight, occupancy.
(5) dense training attention (attention/flash.py): the gradient of the model's attention ("auto":
    cuDNN on a GPU, splash on a TPU) against the blockwise jnp path, Qwen3-1.7B heads, bfloat16:
    max |diff| of output and gradients at a short row, and ms of each at the train step's length.
(6) exact mode at 32K (experiments/bench_exact.py's part (1), `bench_shapes`): a random
    Qwen3-1.7B (28 layers, full vocabulary, bfloat16), batch 4, a page pool filled with 32K random
    cached tokens per row; chunks of 16 tokens of dense decoding, lossy sparse, speculate 2 and 4
    (sparse drafts under the paper's tau-0.86 table with 2 dense layers, one dense verification
    pass a round) and auto (the regime switch's plan, priced on this run's measured rounds),
    interleaved, median of 3: tok/s, x dense, accepted tokens per round, draft acceptance and a
    round's cost in dense decode steps. The weights are random, so the drafts' acceptance is low
    (about 0.6, below a trained model's): exact mode's ratios here understate a trained model's.
    Cost on an H100 (estimated from bytes; not yet run): the pool is 4 rows x 2,050 pages x 28
    layers x 66 KiB (keys, values and summary of 8 KV heads) = 15.5 GB and the weights 3.4 GB, so
    a dense step reads 19 GB (under 6 ms at 3.35 TB/s); its 30 chunks (warm-ups included) read
    about 6 TB (2-4 s); compiling its five 28-layer programs (dense, sparse, speculate 2 and 4,
    auto: its budget carries the plan) takes the rest: about 3 minutes in all.

(1)-(5) are sized for under 8 minutes, (6) for about 3 more; `--config.parts` runs some of them.
Each part runs on its own: a part that raises prints its traceback and the next part runs; the
JSON (--out) is rewritten after every part; the summary is printed last. The exit status is
non-zero only when a kernel differs from its twin (table (1)).
"""

import json
import time
import traceback

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

from configs import device_check as device_check_config
from experiments import bench_attention, bench_decode, bench_engine, bench_exact, timing
from kernels import sparse_decode, sparse_decode_tpu
import sparrow_jax as sj
from sparrow_jax.attention import flash, reference
from sparrow_jax.mismatch import cost_model
from sparrow_jax.rollout import sampler
from sparrow_jax.sparsity.schedule import BudgetTable, KVSchedule

# HBM bandwidth, GB/s, by jax's device_kind (vendor figures).
PEAK_GBS = {
  "NVIDIA H200": 4800,
  "NVIDIA H100 80GB HBM3": 3350,
  "NVIDIA H100": 3350,
  "NVIDIA A100-SXM4-80GB": 2039,
  "TPU v4": 1228,
  "TPU v5 lite": 819,
  "TPU v5": 2765,
  "TPU v6 lite": 1640,
}
BF16_RTOL, BF16_ATOL = 2.0**-7, 2.0**-9  # one bfloat16 ulp of the output (as in the tests)
_FLAGS = flags.FLAGS


def _kernel_variants():
  """(name, kernel fn with its knob bound) for this backend's kernel(s)."""
  backend = jax.default_backend()
  triton = [
    (f"triton splits={s}", dict(fn=sparse_decode.sparse_decode_attention, num_splits=s))
    for s in (None, 1, 7)
  ]
  mosaic = [
    (
      f"mosaic pages/block={p}",
      dict(fn=sparse_decode_tpu.sparse_decode_attention, pages_per_block=p),
    )
    for p in (None, 1, 4)
  ]
  return {"gpu": triton, "tpu": mosaic}.get(backend, triton[:2] + mosaic[:2])


def _kernel_inputs(context, dtype, seed):
  """Qwen3-1.7B heads, 4 rows, ragged lengths, 128 distinct pages per (row, head) of which a random
  number are real (row 0 / head 0 selects nothing; the last row all)."""
  B, K, G, E, Z = 4, 8, 2, 128, 16
  P, N = context // Z, min(128, context // Z)
  rng = np.random.default_rng(seed)
  lengths = rng.integers(context // 2, context + 1, size=B)
  n_valid = rng.integers(0, N + 1, size=(B, K))
  n_valid[0, 0], n_valid[-1] = 0, N
  page_idx = np.stack([[rng.permutation(P)[:N] for _ in range(K)] for _ in range(B)])
  q = rng.standard_normal((B, K, G, E))
  kc, vc = rng.standard_normal((2, B, K, P * Z, E))
  return (
    jnp.asarray(q, dtype),
    jnp.asarray(kc, dtype),
    jnp.asarray(vc, dtype),
    jnp.asarray(page_idx, jnp.int32),
    jnp.asarray(n_valid, jnp.int32),
    jnp.asarray(lengths, jnp.int32),
  )


def check_kernels(config):
  rows = []
  for dtype in ("float32", "bfloat16"):
    args = _kernel_inputs(config.kernel_context, dtype, seed=len(rows))
    # the twin at full float32 precision: at default precision a GPU runs its einsums in TF32
    with jax.default_matmul_precision("highest"):
      want = np.asarray(
        jax.jit(reference.sparse_decode_attention, static_argnames="page_size")(
          *args, page_size=16
        ),
        np.float32,
      )
    for name, variant in _kernel_variants():
      knobs = {k: v for k, v in variant.items() if k != "fn"}
      got = np.asarray(
        jax.jit(lambda *a: variant["fn"](*a, page_size=16, **knobs))(*args), np.float32
      )
      diff = np.abs(got - want)
      ok = (
        np.all(diff <= 1e-4)
        if dtype == "float32"
        else np.all(diff <= BF16_ATOL + BF16_RTOL * np.abs(want))
      )
      empty_zero, finite = bool(np.all(got[0, 0] == 0.0)), bool(np.all(np.isfinite(got)))
      rows.append(
        dict(
          kernel=name,
          dtype=dtype,
          max_abs_diff=float(diff.max()),
          finite=finite,
          empty_rows_zero=empty_zero,
          ok=bool(ok and empty_zero and finite),
        )
      )
  print(f"\n(1) kernel == jnp twin ({jax.default_backend()}, context {config.kernel_context})\n")
  print("| kernel | dtype | max abs diff | empty rows 0 | ok |\n|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['kernel']} | {r['dtype']} | {r['max_abs_diff']:.2e} | {r['empty_rows_zero']} | "
      f"{r['ok']} |"
    )
  return rows


def time_attention(config):
  peak = PEAK_GBS.get(jax.devices()[0].device_kind)
  rows = []
  for context in config.attention.contexts:
    cells = bench_attention.measure(config.attention, context)
    row = {"context": context}
    for name, (ms, _, nbytes) in cells.items():
      row[name] = dict(ms=ms, gbs=nbytes / ms / 1e6)
    rows.append(row)
  a = config.attention
  print(
    f"\n(2) attention only ({jax.devices()[0].device_kind}, impl {a.impl}, {a.dtype}, batch "
    f"{a.batch}, 8 KV heads, G 2, head dim 128, budget {a.budget} tokens; ms per step, "
    f"achieved GB/s, % of a {peak or '?'} GB/s peak)\n"
  )
  names = [n for n in ("dense", "whole cache", "sparse", "sparse+select") if n in rows[0]]
  print(
    "| context | "
    + " | ".join(f"{n} ms | GB/s | % peak" for n in names)
    + " | dense / sparse | dense / sparse+select |"
  )
  print("|---" * (1 + 3 * len(names) + 2) + "|")
  for r in rows:
    cells = " | ".join(
      f"{r[n]['ms']:.3f} | {r[n]['gbs']:.0f} | {100 * r[n]['gbs'] / peak:.0f}"
      if peak
      else f"{r[n]['ms']:.3f} | {r[n]['gbs']:.0f} | "
      for n in names
    )
    ratios = " | ".join(f"{r['dense']['ms'] / r[n]['ms']:.2f}x" for n in names[2:])
    print(f"| {r['context']} | {cells} | {ratios} |")
  return dict(peak_gbs=peak, rows=rows)


def time_tuning(config):
  """The Triton kernel at tuning_context under each table alternative (GPU only)."""
  a = config.attention
  context = config.tuning_context
  B, n = a.batch, a.budget // 16
  q, k, v, page_idx, n_valid, lengths = bench_attention._inputs(B, context, n, jnp.bfloat16)
  base = sparse_decode.TUNING["bfloat16"]
  variants = [base] + sparse_decode.tuning_alternatives()

  def loop(tuning):
    step = lambda i, q: sparse_decode.sparse_decode_attention(
      q, k, v, (page_idx + i) % (context // 16), n_valid, lengths, page_size=16, config=tuning
    )
    return jax.jit(lambda q: jax.lax.fori_loop(0, a.steps, step, q))

  times = bench_attention._times_ms([(loop(t), (q,)) for t in variants], a.runs)
  rows = [
    dict(
      block_tokens=t.block_tokens,
      use_dot=t.use_dot,
      num_warps=t.num_warps,
      num_stages=t.num_stages,
      ms=med / a.steps,
    )
    for t, (med, _) in zip(variants, times)
  ]
  print(
    f"\n(2b) Triton tuning alternatives, sparse at {context}, batch {B}, bf16 "
    f"(table now: block {base.block_tokens}, dot {base.use_dot}, {base.num_warps} warps, "
    f"{base.num_stages} stages; the first row)\n"
  )
  print("| block tokens | dot | warps | stages | ms |\n|---|---|---|---|---|")
  for r in rows:
    print(
      f"| {r['block_tokens']} | {r['use_dot']} | {r['num_warps']} | {r['num_stages']} | "
      f"{r['ms']:.3f} |"
    )
  return rows


def time_decode(config):
  c = config.decode
  cfg = bench_decode.model_config(c.layers, c.vocab_size)
  params = sj.init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16)
  caches = bench_decode.filled_cache(
    cfg, c.batch, c.context, c.steps, 16, jnp.bfloat16, jax.random.PRNGKey(1)
  )
  sparse = sj.SparseConfig(page_size=16, dense_layers=c.dense_layers)
  budget_np = sampler.budget_table(KVSchedule.paper("qwen3-1.7b", c.tau), caches[0].max_len, sparse)
  max_selected = sampler.max_selected_pages(budget_np)
  budget = BudgetTable(jnp.asarray(budget_np))
  token_B = jnp.zeros((c.batch,), jnp.int32)
  state, rows = {"caches": caches}, {}
  del caches
  for name, sp in (("dense", None), ("sparse", sparse)):
    start = time.perf_counter()
    lowered = bench_decode.decode_loop.lower(
      params,
      token_B,
      state["caches"],
      budget,
      cfg=cfg,
      sparse=sp,
      max_selected=max_selected,
      steps=c.steps,
      context=c.context,
    )
    compiled = lowered.compile()
    rows[name] = dict(
      compile_s=time.perf_counter() - start,
      compiled=compiled,
      temp_gb=compiled.memory_analysis().temp_size_in_bytes / 1e9,
    )

  def run(name):
    def call():
      token, state["caches"] = rows[name]["compiled"](params, token_B, state["caches"], budget)
      jax.block_until_ready(token)

    return call

  seconds = timing.median_seconds([run("dense"), run("sparse")], c.runs)
  for name, s in zip(("dense", "sparse"), seconds):
    del rows[name]["compiled"]
    rows[name]["tok_s"] = c.batch * c.steps / s
  print(
    f"\n(3) end-to-end decode: random Qwen3-1.7B ({c.layers} layers, vocab {cfg.vocab_size}, "
    f"bf16), batch {c.batch}, {c.context} cached tokens, {c.steps} steps; sparse = paper "
    f"tau-{c.tau} table, {c.dense_layers} dense layers, budget {int(budget_np[c.context + 1])} "
    f"pages at the start\n"
  )
  print("| decode | tok/s | compile s | compiled temp GB |\n|---|---|---|---|")
  for name, r in rows.items():
    print(f"| {name} | {r['tok_s']:.1f} | {r['compile_s']:.1f} | {r['temp_gb']:.2f} |")
  print(f"\nsparse / dense: {rows['sparse']['tok_s'] / rows['dense']['tok_s']:.2f}x")
  return rows


def time_train_attention(config):
  """(5): the fused path against blockwise, equal (bf16 tolerance) and timed, forward + backward."""
  c = config.train_attention
  K, G, E = 8, 2, 128

  def grad_fn(impl):
    attention = lambda q, k, v, m: flash.causal_attention(q, k, v, m, impl=impl)
    loss = lambda q, k, v, m: jnp.sum(attention(q, k, v, m).astype(jnp.float32))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))

  def inputs(T):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    shapes = ((c.rows, T, K, G, E), (c.rows, T, K, E), (c.rows, T, K, E))
    q, k, v = (jax.random.normal(key, s, jnp.bfloat16) for key, s in zip(keys, shapes))
    return q, k, v, jnp.arange(T)[None] < jnp.array([[T - T // 8]] * c.rows)

  args = inputs(c.check_tokens)
  (_, fused), (_, plain) = grad_fn("auto")(*args), grad_fn("blockwise")(*args)
  diff = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b))) for a, b in zip(fused, plain))
  args = inputs(c.tokens)
  fns = [(grad_fn(impl), args) for impl in ("auto", "blockwise")]
  (auto_ms, _), (blockwise_ms, _) = bench_attention._times_ms(fns, c.runs)
  print(
    f"\n(5) dense training attention, grad, {c.rows} x {c.tokens} tokens, bf16: auto "
    f"{auto_ms:.1f} ms, blockwise {blockwise_ms:.1f} ms ({blockwise_ms / auto_ms:.2f}x); "
    f"max |grad diff| at {c.check_tokens} tokens {diff:.2e}"
  )
  return dict(auto_ms=auto_ms, blockwise_ms=blockwise_ms, max_abs_diff=diff)


def time_exact(config):
  """(6): bench_exact's settings at long context on the random Qwen3-1.7B, a table row each."""
  c = config.exact
  hardware = cost_model.get_hardware(c.hardware)
  rows = bench_exact.bench_shapes(c, hardware, jnp.dtype(c.dtype))
  rows = [r | dict(round_dense_steps=bench_exact.round_dense_steps(r)) for r in rows]
  e = c.shapes
  print(
    f"\n(6) exact mode: random Qwen3-1.7B ({e.layers} layers, {c.dtype}), batch {c.batch}, "
    f"{e.steps} tokens a chunk; drafts under the paper's tau-{e.tau} table, {e.dense_layers} "
    f"dense layers; auto priced on {hardware.name}. Random weights: low acceptance (~0.6)\n"
  )
  print(
    "| context | setting | tok/s | x dense | accepted / round | draft acceptance | "
    "round (dense steps) |\n|---|---|---|---|---|---|---|"
  )
  for r in rows:
    accepted = r.get("accepted_per_round")
    alpha = r.get("draft_acceptance")
    print(
      f"| {r['context']} | {r['setting']} | {r['tokens_per_s']:.1f} | {r['vs_dense']:.2f} | "
      f"{'' if accepted is None else f'{accepted:.2f}'} | "
      f"{'' if alpha is None else f'{alpha:.2f}'} | {r['round_dense_steps']:.2f} |"
    )
  return dict(rows=rows)


def _run_part(name, fn, report, out):
  """report[name] = fn(), or the traceback if it raises; the JSON is rewritten either way."""
  start = time.perf_counter()
  try:
    report[name] = fn()
  except Exception:  # a part's failure must not cost the other parts' results
    report[name] = {"error": traceback.format_exc()}
    print(f"\n({name}) failed:\n{report[name]['error']}", flush=True)
  report.setdefault("part_seconds", {})[name] = time.perf_counter() - start
  _write(report, out)


def _write(report, out):
  if out:
    with open(out, "w") as f:
      json.dump(report, f, indent=1, default=str)


def run_parts(parts, config, report, out):
  """Each (name, fn) of `parts` as fn(config), isolated by `_run_part`."""
  for name, fn in parts:
    _run_part(name, lambda: fn(config), report, out)


def _summary(report) -> str:
  lines = ["| part | result |", "|---|---|"]
  for name, value in report.items():
    if name == "part_seconds":
      lines.append("| seconds | " + ", ".join(f"{k} {v:.0f}" for k, v in value.items()) + " |")
    elif isinstance(value, dict) and "error" in value:
      lines.append(f"| {name} | failed: {value['error'].strip().splitlines()[-1]} |")
    elif name == "kernels":
      lines.append(f"| kernels | {sum(r['ok'] for r in value)}/{len(value)} equal their twin |")
    elif name == "engine":
      ratios = ", ".join(f"{k} {v:.2f}x" for k, v in value["ratios"].items())
      rates = ", ".join(f"{k} {v['tokens_per_s']:.0f} tok/s" for k, v in value["runs"].items())
      lines.append(f"| engine | {rates}{'; ' + ratios if ratios else ''} |")
    elif name == "train_attention":
      lines.append(
        f"| train attention | blockwise / auto {value['blockwise_ms'] / value['auto_ms']:.2f}x, "
        f"max grad diff {value['max_abs_diff']:.1e} |"
      )
    elif name == "decode":
      lines.append(
        f"| decode | sparse / dense {value['sparse']['tok_s'] / value['dense']['tok_s']:.2f}x |"
      )
    elif name == "exact":
      lines.append(f"| exact | {_exact_line(value['rows'])} |")
  return "\n".join(lines)


def _exact_line(rows) -> str:
  """Each exact-mode setting's ratio to dense, with its drafts' acceptance, per context."""
  cells = []
  for r in rows:
    if r["setting"].startswith("speculate") or r["setting"] == "auto":
      alpha = r.get("draft_acceptance")
      cells.append(
        f"{r['context']} {r['setting']} {r['vs_dense']:.2f}x"
        + ("" if alpha is None else f" (acceptance {alpha:.2f})")
      )
  return ", ".join(cells)


PARTS = {
  "kernels": check_kernels,
  "attention": time_attention,
  "tuning": time_tuning,
  "decode": time_decode,
  "engine": bench_engine.bench_engine,
  "train_attention": time_train_attention,
  "exact": time_exact,
}


def chosen_parts(spec: str, backend: str) -> list:
  """(name, fn) of each part config.parts (comma-separated) names, in PARTS' order; tuning times
  Triton alternatives, so it runs on a GPU only."""
  names = spec.split(",")
  unknown = sorted(set(names) - set(PARTS))
  if unknown:
    raise ValueError(f"config.parts: unknown part(s) {unknown}; the parts: {','.join(PARTS)}")
  return [(n, PARTS[n]) for n in PARTS if n in names and (n != "tuning" or backend == "gpu")]


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  config = device_check_config.get_config("smoke") if _FLAGS.smoke else _FLAGS.config
  start = time.perf_counter()
  device = jax.devices()[0]
  print(
    f"device_check: {device.platform} / {device.device_kind} x{jax.device_count()}, jax "
    f"{jax.__version__}{' (smoke sizes)' if config.smoke else ''}"
  )
  report = dict(
    device=device.device_kind,
    backend=jax.default_backend(),
    jax=jax.__version__,
    smoke=config.smoke,
  )
  run_parts(chosen_parts(config.parts, jax.default_backend()), config, report, _FLAGS.out)
  report["seconds"] = time.perf_counter() - start
  _write(report, _FLAGS.out)
  print(f"\ndevice_check done in {report['seconds']:.0f} s\n\n{_summary(report)}")
  kernels = report.get("kernels", [])
  if isinstance(kernels, list) and not all(r["ok"] for r in kernels):
    raise SystemExit("a kernel differs from its jnp twin (table (1))")


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/device_check.py", "experiment config")
  flags.DEFINE_bool("smoke", False, "tiny sizes on any backend: configs/device_check.py:smoke")
  flags.DEFINE_string("out", "", "also write the tables as JSON to this path")
  app.run(main)
