"""The paper's workload priced on the roofline: an on-policy step on all devices against one step
off with rollout devices of their own (docs/async_rl.md), dense and sparse rollouts.

  python experiments/price_async.py --config=configs/price_async.py \\
      [--config.out=docs/results/async_pricing.json]

A step of `prompts_per_step` x `group_size` rows on `devices` GPUs, each part priced as
cost_model prices a rollout (`roofline_rollout_time`: the busiest device's rows start together,
each decode step max(FLOPs / peak, bytes / bandwidth), the batch shrinking as rows end, prefill):
  rollout  on R devices: the busiest holds ceil(groups / R) whole groups; dense, or sparse under
           the published tau table (page selection counted).
  update   on T devices: the busiest holds ceil(rows / T) rows, each priced at the expected row
           of the length distribution (prompt + response), compute-bound at peak x MFU: a no-grad
           dense pass when there are several minibatches, a no-grad sparse pass for exact
           acceptance (sparse rollouts), the gradient pass (forward, its full-remat recompute and
           the backward: 8P FLOPs a token, 4.5 x the forward's attention with a flash backward),
           and one step off one more no-grad dense pass with the behaviour params (staleness).
  weights  to the rollout: colocated, the all-gather over the N devices (each receives (N - 1) /
           N of the bf16 weights) and one step off also the sampler's copy in HBM; on rollout
           devices of their own the device-to-device put (each rollout device receives all of
           them, each trainer sends its shard to every rollout device) over `link_gbs`.
Layouts: on-policy colocated (the baseline) = rollout(N) + weights + update(N); one step off
colocated = the same plus the staleness pass: one device runs one program at a time, so nothing
overlaps; on-policy split = rollout(R) + weights + update(N - R); one step off split =
max(rollout(R), update(N - R)) + weights. Each split's R is swept; the best is the fastest, and the
best that runs as configured (whole groups on every rollout device, a minibatch's rows split evenly
over the trainers). Left out: length-bucket padding, FSDP collectives in the update, per-step host
work, grading. Two scenarios: everything at its roofline, and derated (the rollout at the share of
its roofline the paper's one absolute rate reaches, the update at `train_mfu`).
"""

import math

from absl import app, flags
from ml_collections import config_flags
import numpy as np

from sparrow_jax import records
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.mismatch import cost_model
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.sparsity.schedule import KVSchedule

# Sparrow, Qwen3-1.7B at tau 0.86: rollout and whole RL step speedups of sparse over dense.
PAPER_SPEEDUPS = {"qwen3-1.7b": (2.21, 1.97)}
GRAD_LINEAR = 8  # FLOPs / (P x token) of a gradient pass: forward, full-remat recompute, backward
GRAD_ATTENTION = 4.5  # its attention / a forward's: forward, recompute, flash backward (2.5)
SCENARIOS = ("roofline", "derated")
LAYOUTS = (
  "on-policy, colocated",
  "one step off, colocated",
  "on-policy, split",
  "one step off, split",
)


def length_probs(gen_len: int, mean_len_frac: float):
  """P(a response has t tokens), t = 1..gen_len: `running_fraction`'s geometric lengths cut at the
  cutoff (the rows still running there end at it)."""
  alive_t = cost_model.running_fraction(gen_len, mean_len_frac)
  return alive_t - np.append(alive_t[1:], 0.0)


def attended_keys(cfg: Qwen3Config, schedule, length: int):
  """Keys each query position s = 1..length attends to, summed over layers: every cached token in
  a dense layer, the schedule's budget in a sparse one (schedule None: all layers dense)."""
  s = np.arange(1, length + 1, dtype=np.float64)
  if schedule is None:
    return cfg.num_hidden_layers * s
  dense = SparseConfig(page_size=schedule.page_size).dense_layers  # the paper's layout
  sparse_layers = cfg.num_hidden_layers - dense
  return dense * s + sparse_layers * cost_model.attended_tokens(schedule, s, schedule.page_size)


def pass_flops(c, schedule=None):
  """(linear, attention) FLOPs of one no-grad forward over the expected row (prompt + a response
  of the length distribution): 2P a token and 4 x q_width a query per attended key."""
  cfg = Qwen3Config.preset(c.model)
  p_t = length_probs(c.gen_len, c.mean_len_frac)
  rows_t = c.prompt_len + np.arange(1, c.gen_len + 1)
  keys_cum = np.cumsum(attended_keys(cfg, schedule, c.prompt_len + c.gen_len))
  q_width = cfg.num_attention_heads * cfg.head_dim
  linear = 2 * cost_model.param_count(cfg) * float(np.sum(p_t * rows_t))
  return linear, 4 * q_width * float(np.sum(p_t * keys_cum[rows_t - 1]))


def row_update_flops(c, sparse: bool, off_policy: bool) -> float:
  """FLOPs the update spends on the expected row (the passes of the module docstring)."""
  linear, attention = pass_flops(c)
  flops = GRAD_LINEAR / 2 * linear + GRAD_ATTENTION * attention
  extra = (c.num_minibatches > 1) + off_policy  # no-grad dense passes
  flops += extra * (linear + attention)
  if sparse and c.exact_acceptance:
    flops += sum(pass_flops(c, KVSchedule.paper(c.model, c.tau)))
  return flops


def update_seconds(c, devices: int, row_flops: float, mfu: float) -> float:
  """The busiest trainer's rows at `row_flops` each (`row_update_flops`)."""
  hw = cost_model.get_hardware(c.hardware)
  rows = math.ceil(c.prompts_per_step * c.group_size / devices)
  return rows * row_flops / (hw.peak_flops * mfu)


def rollout_rows(c, devices: int) -> int:
  """Rows of the busiest rollout device: whole groups."""
  return math.ceil(c.prompts_per_step / devices) * c.group_size


def rollout_seconds(c, devices: int, sparse: bool, share: float) -> float:
  schedule = KVSchedule.paper(c.model, c.tau) if sparse else None
  seconds = cost_model.roofline_rollout_time(
    c.model,
    schedule,
    c.prompt_len,
    c.gen_len,
    batch_per_device=rollout_rows(c, devices),
    mean_len_frac=c.mean_len_frac,
    n_samples=c.group_size,
    hardware=c.hardware,
  )
  return seconds / share


def weights_seconds(c, rollout_devices: int, off_policy: bool) -> float:
  """The bf16 weights to the rollout: rollout_devices 0 is colocated (module docstring)."""
  hw = cost_model.get_hardware(c.hardware)
  nbytes, link = hw.dtype_bytes * cost_model.param_count(c.model), c.link_gbs * 1e9
  n = c.devices
  if not rollout_devices:
    copy = 2 * nbytes / hw.mem_bandwidth if off_policy else 0.0  # read + write in HBM
    return (n - 1) / n * nbytes / link + copy
  return max(nbytes, rollout_devices * nbytes / (n - rollout_devices)) / link


def step_seconds(rollout_s: float, update_s: float, weights_s: float, overlap: bool) -> float:
  """One step: the rollout and the update one after the other, or side by side (one step off on
  devices of their own), the weights' transfer between them either way."""
  if overlap:
    return max(rollout_s, update_s) + weights_s
  return rollout_s + update_s + weights_s


def runs_as_configured(c, rollout_devices: int) -> bool:
  """Whole groups on every rollout device (run_config.check_rollout_mesh) and each backward's
  rows split evenly over the trainers (the rows per backward pass of the config)."""
  trainers = c.devices - rollout_devices
  rows_per_backward = c.prompts_per_step * c.group_size // (c.num_minibatches * c.micro_batches)
  return c.prompts_per_step % rollout_devices == 0 and rows_per_backward % trainers == 0


def _parts(c, layout: str, r: int, sparse: bool, shares, row_flops) -> dict:
  """One layout's step at R = r (row_flops: the update's per row, by off_policy)."""
  decode_share, mfu = shares
  off_policy, split = layout.startswith("one step off"), layout.endswith("split")
  rollout_on, train_on = (r, c.devices - r) if split else (c.devices, c.devices)
  rollout_s = rollout_seconds(c, rollout_on, sparse, decode_share)
  update_s = update_seconds(c, train_on, row_flops[off_policy], mfu)
  weights_s = weights_seconds(c, r if split else 0, off_policy)
  step_s = step_seconds(rollout_s, update_s, weights_s, overlap=off_policy and split)
  return dict(
    rollout_devices=r if split else 0,
    rollout_s=rollout_s,
    update_s=update_s,
    weights_s=weights_s,
    step_s=step_s,
    trainer_idle=1 - update_s / step_s,
    rollout_idle=1 - rollout_s / step_s,
  )


def price(c, sparse: bool, scenario: str) -> dict:
  """Each layout's step (each split per R swept, its best overall and as configured) and its
  speedup against the on-policy colocated step."""
  shares = (1.0, 1.0)
  if scenario == "derated":
    shares = (c.decode_share_sparse if sparse else c.decode_share_dense, c.train_mfu)
  row_flops = {off: row_update_flops(c, sparse, off) for off in (False, True)}
  out = {}
  for layout in LAYOUTS:
    if not layout.endswith("split"):
      out[layout] = _parts(c, layout, c.devices, sparse, shares, row_flops)
      continue
    sweep = []
    for r in c.rollout_devices:
      fig = _parts(c, layout, r, sparse, shares, row_flops)
      fig["runs_as_configured"] = runs_as_configured(c, r)
      fig["rollout_peak_gb"] = rollout_peak_gb(c, r)
      sweep.append(fig)
    configured = [f for f in sweep if f["runs_as_configured"]]
    out[layout] = dict(
      sweep=sweep,
      best=min(sweep, key=lambda f: f["step_s"]),
      best_configured=min(configured, key=lambda f: f["step_s"]) if configured else None,
    )
  base = out[LAYOUTS[0]]["step_s"]
  for fig in out.values():
    for f in [fig] if "step_s" in fig else [*fig["sweep"], fig["best"], fig["best_configured"]]:
      if f is not None:
        f["speedup"] = base / f["step_s"]
  return out


def rollout_peak_gb(c, rollout_devices: int) -> float:
  """Weights + the largest KV the busiest rollout device's rows hold at once (dense and sparse
  alike: sparse reads fewer pages, stores all)."""
  return (
    cost_model.peak_memory_bytes(
      c.model,
      c.prompt_len,
      c.gen_len,
      batch_per_device=rollout_rows(c, rollout_devices),
      mean_len_frac=c.mean_len_frac,
      hardware=c.hardware,
    )
    / 1e9
  )


def balance(c, sparse: bool) -> dict:
  """The split where rollout(R) = update(N - R) if both scaled linearly with devices, R* = N x
  rollout / (rollout + update) of the on-policy colocated step, at the roofline: a whole R near it
  can only gain what the rollout's sublinear scaling (the weights read every decode step, the
  long tail's few rows) saves."""
  rollout_s = rollout_seconds(c, c.devices, sparse, 1.0)
  update_s = update_seconds(c, c.devices, row_update_flops(c, sparse, False), 1.0)
  return dict(
    rollout_share=rollout_s / (rollout_s + update_s),
    r_star=c.devices * rollout_s / (rollout_s + update_s),
  )


def paper_rollout_share(model: str):
  """The rollout's share of the dense step implied by the paper's rollout and step speedups
  (Amdahl: step = 1 / (share / rollout + 1 - share)); None for a model it gives none for."""
  if model not in PAPER_SPEEDUPS:
    return None
  rollout, step = PAPER_SPEEDUPS[model]
  return (1 - 1 / step) / (1 - 1 / rollout)


def report(c) -> dict:
  hw = cost_model.get_hardware(c.hardware)
  return dict(
    config=c.to_dict(),
    params_b=cost_model.param_count(c.model) / 1e9,
    peak_tflops=hw.peak_flops / 1e12,
    bandwidth_gbs=hw.mem_bandwidth / 1e9,
    mean_response=float(
      np.sum(length_probs(c.gen_len, c.mean_len_frac) * np.arange(1, c.gen_len + 1))
    ),
    paper_rollout_share=paper_rollout_share(c.model),
    balance={kind: balance(c, kind == "sparse") for kind in ("dense", "sparse")},
    scenarios={
      scenario: {kind: price(c, kind == "sparse", scenario) for kind in ("dense", "sparse")}
      for scenario in SCENARIOS
    },
  )


def _print(c, fig):
  print(
    f"{c.model} ({fig['params_b']:.2f}B) on {c.devices} x {c.hardware} ({fig['peak_tflops']:.0f} "
    f"TFLOP/s, {fig['bandwidth_gbs']:.0f} GB/s, link {c.link_gbs:g} GB/s), "
    f"{c.prompts_per_step} x {c.group_size} rows a step, prompt {c.prompt_len}, cutoff "
    f"{c.gen_len}, mean response {fig['mean_response']:.0f} tokens"
  )
  for kind, b in fig["balance"].items():
    print(
      f"  {kind}: rollout {b['rollout_share']:.0%} of the on-policy step at the roofline, "
      f"balance R* = {b['r_star']:.2f} of {c.devices}"
    )
  if fig["paper_rollout_share"] is not None:
    print(f"  the paper's speedups imply a rollout share of {fig['paper_rollout_share']:.0%}")
  for scenario, by_kind in fig["scenarios"].items():
    for kind, layouts in by_kind.items():
      print(f"\n{scenario}, {kind} rollouts: step s (rollout / update / weights), speedup")
      for layout, f in layouts.items():
        rows = [f] if "step_s" in f else f["sweep"]
        for g in rows:
          tag = f"R = {g['rollout_devices']}" if "sweep" in f else ""
          mark = "" if g.get("runs_as_configured", True) else " (not as configured)"
          print(
            f"  {layout:24s} {tag:6s} {g['step_s']:8.1f} ({g['rollout_s']:.1f} / "
            f"{g['update_s']:.1f} / {g['weights_s']:.2f}) {g['speedup']:.3f}x{mark}"
          )
        if "sweep" in f:
          best, conf = f["best"], f["best_configured"]
          print(
            f"    best R = {best['rollout_devices']} ({best['speedup']:.3f}x)"
            + (
              f", as configured R = {conf['rollout_devices']} ({conf['speedup']:.3f}x)"
              if conf
              else ""
            )
          )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  c = flags.FLAGS.config
  fig = report(c)
  _print(c, fig)
  if c.out:
    records.write_record(c.out, fig)


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/price_async.py", "experiment config")
  app.run(main)
