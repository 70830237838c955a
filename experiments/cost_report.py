"""Predicted sparse-rollout speedups from two cost models, beside the paper's measurements.

  python experiments/cost_report.py --config=configs/cost_report.py \\
      [--config.batch_per_device=60 --config.mean_len_frac=0.5 --config.measure=False]

The paper's eFLOPs model (`cost_model.rollout_speedup`) prices one prompt's samples all running to
the cutoff, without weight reads or prefill. The roofline model (`cost_model.roofline_speedup`)
prices the wall time of one device's batch: weights read once per decode step, page selection,
rows stopping at different lengths, prefill. Both are printed with their relative error against
the measured speedups (Sparrow, 4x H200, AIME24 x 8 samples, 32K cutoff), then the roofline's
sensitivity to its two stated assumptions, the eFLOPs model per hardware, and page sizes. The
static batch and the engine are priced side by side (`cost_model.roofline_static_rate`,
`roofline_engine_rate`) in one pool of KV memory per device.
"""

import numpy as np
from absl import app, flags
from ml_collections import config_flags

from sparrow_jax.mismatch import cost_model
from sparrow_jax.sparsity.schedule import KVSchedule

# Sparrow, rollout speedup at tau 0.86, 4x H200, AIME24 x 8 samples, 32K cutoff.
PAPER_SPEEDUP = {"qwen3-1.7b": 2.21, "qwen3-4b": 2.41, "qwen3-8b": 2.06, "qwen3-14b": 1.49}
PAPER_CUTOFF = 32768
# The one absolute rate the paper gives: Qwen3-1.7B, dense -> sparse generated tokens/s on 4 GPUs.
PAPER_RATE = ("qwen3-1.7b", 2561, 5662, 4)
PAGE_SIZES = (16, 32, 64, 128)
# Values around the configured ones for the sensitivity table (the configured one is added).
MEAN_LEN_FRACS = (1.0, 0.6, 0.4, 0.3)
BATCHES = (8, 30, 120, 240)
AIM = 0.25  # relative error the issue asks of every model size


def _roofline(config, model, **overrides):
  kw = dict(
    batch_per_device=config.batch_per_device,
    mean_len_frac=config.mean_len_frac,
    n_samples=config.n_samples,
    hardware=config.roofline_hardware,
    page_selection=config.page_selection,
  )
  return cost_model.roofline_speedup(
    model,
    KVSchedule.paper(model, config.tau),
    config.prompt_len,
    config.gen_len,
    **{**kw, **overrides},
  )


def _print_assumptions(config):
  hw = cost_model.get_hardware(config.roofline_hardware)
  alive = cost_model.running_fraction(config.gen_len, config.mean_len_frac)
  print(
    f"Predicted rollout speedup at tau {config.tau:.2f} (published schedules, page size 16, "
    f"first 2 layers dense), prompt {config.prompt_len} tokens, generation {config.gen_len} "
    f"tokens (the cutoff), {config.n_samples} samples per prompt"
  )
  print(
    "  eFLOPs (the paper's model): compute + I x memory of one prompt's samples, every one "
    "reaching the cutoff; no weight reads, no prefill."
  )
  print(
    f"  roofline on {hw.name} ({hw.peak_flops / 1e12:.0f} TFLOP/s, "
    f"{hw.mem_bandwidth / 1e9:.0f} GB/s), one device: each decode step lasts "
    "max(FLOPs / peak, bytes / bandwidth), summed over steps, plus prefill."
  )
  print(
    f"    - {config.batch_per_device:g} rows per device start together (default 60: AIME24's "
    "30 prompts x 8 samples over 4 GPUs, one model copy each); each step reads every weight "
    "once for the running rows, then each row's KV (dense: all of it; sparse: its budget)."
  )
  print(
    f"    - response lengths: a constant chance of stopping per token, mean "
    f"{config.mean_len_frac:.2f} x cutoff = {alive.sum():.0f} tokens, the {alive[-1]:.0%} "
    "still running cut at the cutoff; the batch shrinks as rows finish."
  )
  print(
    f"    - page selection {'on' if config.page_selection else 'OFF'}: per sparse layer and KV "
    "head every complete page's centroid read and scored, fp32 scores written and read by "
    "the top-k."
  )
  print(
    "    - prefill: each prompt once (its samples share its KV), the same for dense and sparse."
  )
  if config.gen_len != PAPER_CUTOFF:
    print(
      f"  The measured speedups are at a {PAPER_CUTOFF}-token cutoff: at {config.gen_len} the "
      "errors compare different settings."
    )


def _print_comparison(config):
  print(
    f"\n{'model':11s} {'params':>7s} {'eFLOPs':>7s} {'error':>6s} {'roofline':>8s} "
    f"{'error':>6s} {'paper (4x H200)':>15s} {'peak GB/device':>15s}"
  )
  within = {"eFLOPs": 0, "roofline": 0}
  for model, measured in PAPER_SPEEDUP.items():
    eflops = cost_model.rollout_speedup(
      model,
      KVSchedule.paper(model, config.tau),
      config.prompt_len,
      config.gen_len,
      config.n_samples,
      config.roofline_hardware,
    )
    roofline = _roofline(config, model)
    errors = {"eFLOPs": eflops / measured - 1, "roofline": roofline / measured - 1}
    for name, error in errors.items():
      within[name] += abs(error) <= AIM
    peak = cost_model.peak_memory_bytes(
      model,
      config.prompt_len,
      config.gen_len,
      batch_per_device=config.batch_per_device,
      mean_len_frac=config.mean_len_frac,
      hardware=config.roofline_hardware,
    )
    print(
      f"{model:11s} {cost_model.param_count(model) / 1e9:6.2f}B {eflops:6.2f}x "
      f"{errors['eFLOPs']:+6.0%} {roofline:7.2f}x {errors['roofline']:+6.0%} "
      f"{measured:14.2f}x {peak / 1e9:15.0f}"
    )
  print(
    f"Within {AIM:.0%} of the measured speedup: "
    + ", ".join(f"{name} {n} of {len(PAPER_SPEEDUP)}" for name, n in within.items())
    + ". Peak GB: weights + the largest KV the running rows hold at once (H200: 141 GB)."
  )


def _print_absolute_rate(config):
  model, dense_rate, sparse_rate, gpus = PAPER_RATE
  tokens = config.batch_per_device * np.sum(
    cost_model.running_fraction(config.gen_len, config.mean_len_frac)
  )
  rates = [
    tokens
    / cost_model.roofline_rollout_time(
      model,
      schedule,
      config.prompt_len,
      config.gen_len,
      batch_per_device=config.batch_per_device,
      mean_len_frac=config.mean_len_frac,
      n_samples=config.n_samples,
      hardware=config.roofline_hardware,
      page_selection=config.page_selection,
    )
    for schedule in (None, KVSchedule.paper(model, config.tau))
  ]
  print(
    f"Absolute rate, {model}, generated tokens/s per GPU: roofline dense {rates[0]:.0f}, "
    f"sparse {rates[1]:.0f}; measured {dense_rate / gpus:.0f}, {sparse_rate / gpus:.0f} "
    f"({dense_rate} and {sparse_rate} on {gpus} GPUs). Under these assumptions the real "
    f"rollouts run at {dense_rate / gpus / rates[0]:.0%} and "
    f"{sparse_rate / gpus / rates[1]:.0%} of the roofline: costs it leaves out are large, and "
    "those that do not scale with the bytes read (per-step launches, sampling, scheduling) "
    "lower the speedup most where steps are shortest."
  )


def _print_engine(config):
  """Static batch vs engine per model, and the paper's absolute rate beside both."""
  kw = dict(
    mean_len_frac=config.mean_len_frac,
    n_samples=config.n_samples,
    hardware=config.roofline_hardware,
    page_selection=config.page_selection,
  )
  print(
    f"\nStatic batch vs engine (rollout/engine.py), roofline on {config.roofline_hardware}, one "
    f"device in steady state, {config.pool_gb:g} GB of KV pool, prompt {config.prompt_len}, "
    f"cutoff {config.gen_len}, mean length {config.mean_len_frac:.2f} x cutoff: the static "
    f"batch allocates every row at the cutoff (finished rows stop costing, the batch waits "
    f"for its longest); the engine ({config.engine_slots} slots) refills slots and takes "
    "pages as rows grow. Generated tokens/s per device (rows in flight)."
  )
  print(
    f"{'model':11s} {'static dense':>16s} {'static sparse':>16s} {'engine dense':>16s} "
    f"{'engine sparse':>16s} {'engine/static':>15s} {'sparse/dense':>15s}"
  )
  rates = {}
  for model in PAPER_SPEEDUP:
    pool = config.pool_gb * 1e9 / cost_model.kv_bytes_per_token(model, config.roofline_hardware)
    for name, schedule in (("dense", None), ("sparse", KVSchedule.paper(model, config.tau))):
      rates[model, "static", name] = cost_model.roofline_static_rate(
        model, schedule, config.prompt_len, config.gen_len, pool_tokens=pool, **kw
      )
      rates[model, "engine", name] = cost_model.roofline_engine_rate(
        model,
        schedule,
        config.prompt_len,
        config.gen_len,
        slots=config.engine_slots,
        pool_tokens=pool,
        **kw,
      )
    cell = lambda s, n: f"{rates[model, s, n][0]:7.0f} ({rates[model, s, n][1]:5.1f})"
    ratio = lambda a, b: rates[model, *a][0] / rates[model, *b][0]
    print(
      f"{model:11s} {cell('static', 'dense'):>16s} {cell('static', 'sparse'):>16s} "
      f"{cell('engine', 'dense'):>16s} {cell('engine', 'sparse'):>16s} "
      f"{ratio(('engine', 'dense'), ('static', 'dense')):6.2f}/"
      f"{ratio(('engine', 'sparse'), ('static', 'sparse')):.2f}x "
      f"{ratio(('static', 'sparse'), ('static', 'dense')):6.2f}/"
      f"{ratio(('engine', 'sparse'), ('engine', 'dense')):.2f}x"
    )
  model, dense_rate, sparse_rate, gpus = PAPER_RATE
  print(
    f"  {model} per GPU, measured by the paper (Table 2, {gpus}x H200, AIME24 x 8, 32K): "
    f"dense {dense_rate / gpus:.0f}, sparse {sparse_rate / gpus:.0f} tok/s; predicted static "
    f"{rates[model, 'static', 'dense'][0]:.0f} / {rates[model, 'static', 'sparse'][0]:.0f}, "
    f"engine {rates[model, 'engine', 'dense'][0]:.0f} / "
    f"{rates[model, 'engine', 'sparse'][0]:.0f} (engine/static ratios read as cells above; "
    "sparse/dense: static / engine)."
  )


def _print_sensitivity(config):
  means = sorted(set(MEAN_LEN_FRACS) | {config.mean_len_frac}, reverse=True)
  batches = sorted(set(BATCHES) | {config.batch_per_device})

  def mark(value, configured):
    return f"{value:g}{'*' if value == configured else ''}"

  print("\nRoofline speedup as its assumptions change (* = the table above)")
  print(
    f"{'model':11s} {'mean length / cutoff':>{7 * len(means) - 1}s} | "
    f"{'rows per device':>{7 * len(batches) - 1}s} | {'no selection':>12s}"
  )
  print(
    f"{'':11s} "
    + " ".join(f"{mark(m, config.mean_len_frac):>6s}" for m in means)
    + " | "
    + " ".join(f"{mark(b, config.batch_per_device):>6s}" for b in batches)
    + " |"
  )
  for model in PAPER_SPEEDUP:
    by_mean = [_roofline(config, model, mean_len_frac=m) for m in means]
    by_batch = [_roofline(config, model, batch_per_device=b) for b in batches]
    no_selection = _roofline(config, model, page_selection=False)
    print(
      f"{model:11s} "
      + " ".join(f"{s:5.2f}x" for s in by_mean)
      + " | "
      + " ".join(f"{s:5.2f}x" for s in by_batch)
      + f" | {no_selection:11.2f}x"
    )


def _print_eflops_by_hardware(config):
  hardware = dict(cost_model.HARDWARE)
  if config.measure:
    hardware[cost_model.THIS_MACHINE] = cost_model.measure_this_machine()
  print("\neFLOPs model per hardware (dense / sparse eFLOPs, every sample to the cutoff)")
  for name, hw in hardware.items():
    print(
      f"  {name:14s} {hw.peak_flops / 1e12:9.3f} TFLOP/s {hw.mem_bandwidth / 1e9:8.1f} GB/s "
      f"I = {hw.intensity:6.1f} FLOP/byte  ({hw.dtype_bytes}-byte KV elements)"
    )
  header = " ".join(f"{h:>9.9s}" for h in hardware)
  print(f"{'model':11s} {'max pages':>9s} {header}")
  for model in PAPER_SPEEDUP:
    schedule = KVSchedule.paper(model, config.tau)
    cells = [
      cost_model.rollout_speedup(
        model, schedule, config.prompt_len, config.gen_len, config.n_samples, hw
      )
      for hw in hardware.values()
    ]
    print(f"{model:11s} {schedule.max_pages:9d} " + " ".join(f"{c:8.2f}x" for c in cells))


def _print_page_sizes(config):
  print("\nPage-size comparison on h200 at the same token budget (eFLOPs speedup)")
  print(f"{'model':11s} " + " ".join(f"{'page ' + str(z):>9s}" for z in PAGE_SIZES))
  for model in PAPER_SPEEDUP:
    by_size = cost_model.page_size_comparison(
      model,
      KVSchedule.paper(model, config.tau),
      config.prompt_len,
      config.gen_len,
      PAGE_SIZES,
      config.n_samples,
      "h200",
    )
    print(f"{model:11s} " + " ".join(f"{by_size[z]:8.2f}x" for z in PAGE_SIZES))
  print(
    "Larger pages only save page scoring (one centroid per page) in this model; the paper "
    "picks 16 because at equal cost it keeps the acceptance tail higher."
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  config = flags.FLAGS.config
  _print_assumptions(config)
  _print_comparison(config)
  _print_absolute_rate(config)
  _print_engine(config)
  _print_sensitivity(config)
  _print_eflops_by_hardware(config)
  _print_page_sizes(config)


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/cost_report.py", "experiment config")
  app.run(main)
