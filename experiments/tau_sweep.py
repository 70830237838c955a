"""Threshold sweep: the same RL job under dense rollouts, calibrated schedules at several tau, a
fixed aggressive budget, closed-loop budgets and quest page scores; stability against cost per
setting.

  python experiments/tau_sweep.py --config=configs/tau_sweep.py [--config.seeds=0 ...]

configs/tau_sweep.py documents every field and a smoke run. Each tau's table is chosen from a
shipped calibration surface at its tail percentile (`calibrate.choose_schedule`: p5 unless a quest
table names another) and written as a KVSchedule JSON to
<sweep_dir>/schedules/, so nothing re-calibrates and every run's config.json names its table. Each
(setting, seed) is a trainer workdir <sweep_dir>/<run>_seed<k>: a finished one (summary.json at
total_steps, eval.json current) is skipped, a partial one resumes through the trainer's own resume.
Taus that pick the same table share one run (same job, same seeds: the same result).

Per run (sweep.json "runs"): the reward curve, reward and mean response length over the first and
last `window` steps, the held-out dense per-step score and exact-answer accuracy of the exported
policy (sparrow_jax.rl.evaluate), exact-alpha p5 overall and per position bin (mean over the last
`window` steps), per bin the share of steps whose p5 fell under tau (all steps with tokens in the
bin) and the share of the run's tokens under tau (`below_tau_bin`, pooled over all steps: at most 5%
is the run's p5 >= tau, the closed loop's target), KV pages read relative to dense (a closed loop's
also as its start table would have read the same rollouts, `kv_read_start`: the loop's saving,
paired token for token), the share of completion tokens mismatch masking took out of the loss
(`mask_token_frac`, mean over steps; runs with `rl.mask_alpha_below` only), the cost model's
predicted rollout speedup (dense: 1) and the measured rollout tokens/s (median over the steps after
the first, which compiles) with its ratio to the same seed's dense run. Per setting ("settings"):
mean and std (ddof 1; 0 for one seed) of each over seeds. Then tau_sweep.png and a printed table.
With `base`, a finished sweep's other settings and runs are kept beside the ones run here
(re-running a few settings only); with `base` and no `runs`, nothing runs: the finished sweep is
reported (its table, plot and record).
"""

import json
import os
import time
import warnings

from absl import app, flags, logging
import ml_collections
from ml_collections import config_flags
import numpy as np

from configs import evaluate as evaluate_config
from experiments import evaluate
from sparrow_jax import records as results_records
from sparrow_jax.mismatch import calibrate
from sparrow_jax.rl import trainer

KINDS = ("dense", "tau", "fixed", "adaptive", "quest", "quest_adaptive")
# Per-run figures averaged over seeds per setting (p5_bin too, bin by bin).
FIELDS = (
  "reward_first",
  "reward_last",
  "heldout_score",
  "heldout_accuracy",
  "length_first",
  "length_last",
  "p5",
  "p5_bin",
  "under_tau_bin",
  "below_tau_bin",
  "p1",
  "kv_read",
  "kv_read_start",
  "mask_token_frac",
  "predicted_speedup",
  "rollout_tokens_per_s",
  "measured_speedup",
)


def parse_list(text: str, field: str, kind=float) -> list:
  try:
    values = [kind(x) for x in str(text).split(",") if x.strip()]
  except ValueError:
    raise ValueError(
      f"config.{field} = {text!r}: expected comma-separated {kind.__name__}s"
    ) from None
  if not values:
    raise ValueError(f"config.{field} is empty")
  return values


def tau_schedules(surface_path: str, taus, quantile: float) -> dict:
  """{tau: KVSchedule} chosen from a calibration surface (surface.json) at each tau, holding the
  `quantile`-th percentile."""
  with open(surface_path) as f:
    s = json.load(f)
  cands, tail_CB = calibrate.surface_tail(s, quantile, surface_path)
  return {
    tau: calibrate.choose_schedule(
      tail_CB,
      cands,
      tau,
      page_size=s["page_size"],
      always_kept=s["always_kept"],
      bin_size=s["bin_size"],
      quantile=quantile,
    )
    for tau in taus
  }


def quest_tables(text: str) -> list:
  """config.quest_tables 'Q:TAU,...' -> [(quantile, tau), ...]."""
  try:
    pairs = [tuple(float(x) for x in item.split(":")) for item in text.split(",") if item.strip()]
  except ValueError:
    pairs = None
  if not pairs or any(len(p) != 2 for p in pairs):
    raise ValueError(
      f"config.quest_tables = {text!r}: expected comma-separated QUANTILE:TAU "
      "pairs, e.g. '5:0.86,1:0.86'"
    )
  return pairs


def settings(c) -> list:
  """The sweep's settings, in config.runs order: dicts of name, kind, tau, schedule (a trainer
  rollout.schedule spec; None: dense) and run (the workdir prefix; taus with the same table share
  the first one's run). Writes each tau's table to <sweep_dir>/schedules/tau<T>.json."""
  kinds = parse_list(c.runs, "runs", str) if c.runs or not c.base else []
  bad = sorted(set(kinds) - set(KINDS))
  if bad:
    raise ValueError(f"config.runs = {c.runs!r}: unknown {bad}; allowed: {list(KINDS)}")
  taus = parse_list(c.taus, "taus") if "tau" in kinds else []
  needed = taus + ([c.adaptive_tau] if "adaptive" in kinds else [])
  tables = tau_schedules(c.surface, needed, c.train.stats.quantile) if needed else {}
  os.makedirs(os.path.join(c.sweep_dir, "schedules"), exist_ok=True)

  def write(schedule, name):
    path = os.path.join(c.sweep_dir, "schedules", f"{name}.json")
    with open(path, "w") as f:
      f.write(schedule.to_json() + "\n")
    return path

  paths = {tau: write(schedule, f"tau{tau:g}") for tau, schedule in tables.items()}
  out = []
  for kind in kinds:
    if kind == "dense":
      out.append(dict(name="dense", kind=kind, tau=None, schedule=None, run="dense"))
    elif kind == "fixed":
      for pages in parse_list(c.fixed_pages, "fixed_pages", int):
        out.append(
          dict(
            name=f"fixed{pages}",
            kind=kind,
            tau=None,
            schedule=f"fixed:{pages}",
            run=f"fixed{pages}",
          )
        )
    elif kind == "adaptive":
      name = f"adaptive{c.adaptive_tau:g}"
      out.append(
        dict(
          name=name,
          kind=kind,
          tau=c.adaptive_tau,
          run=name,
          schedule=f"adaptive:{c.adaptive_tau:g}:{paths[c.adaptive_tau]}",
        )
      )
    elif kind in ("quest", "quest_adaptive"):  # quest page scores, on quest's own surface
      for q, tau in quest_tables(c.quest_tables):
        suffix = f"{tau:g}" + ("" if q == 5 else f"_p{q:g}")  # p5, the paper's, unmarked
        table = write(tau_schedules(c.quest_surface, [tau], q)[tau], f"quest{suffix}")
        name = f"{kind}{suffix}"
        out.append(
          dict(
            name=name,
            kind=kind,
            tau=tau,
            quantile=q,
            run=name,
            page_score="quest",
            schedule=f"adaptive:{tau:g}:{table}" if kind == "quest_adaptive" else table,
          )
        )
    else:
      first = {}  # table -> the first tau that picked it
      for tau in taus:
        twin = first.setdefault(tables[tau].values, tau)
        out.append(
          dict(name=f"tau{tau:g}", kind=kind, tau=tau, schedule=paths[twin], run=f"tau{twin:g}")
        )
  return out


def run_config(c, setting: dict, seed: int) -> ml_collections.ConfigDict:
  """The trainer config of one run: config.train plus the run's workdir, seed and schedule."""
  rc = ml_collections.ConfigDict(c.train.to_dict())
  rc.workdir = os.path.join(c.sweep_dir, f"{setting['run']}_seed{seed}")
  rc.seed = seed
  rc.rollout.sparse = setting["schedule"] is not None
  rc.rollout.schedule = setting["schedule"] or ""
  rc.rollout.page_score = setting.get("page_score", rc.rollout.page_score)
  rc.stats.quantile = setting.get("quantile", rc.stats.quantile)
  if not rc.rollout.sparse:
    rc.distill.enabled = False  # DistillSparse adapts the sparse actor; dense has none
  return rc


def eval_config(c, rc) -> ml_collections.ConfigDict:
  """The evaluation config (configs/evaluate.py) for run `rc`'s exported policy: dense, on the run's
  task and lengths, held-out seed; results to <workdir>/eval.json, and TensorBoard's to
  <workdir>/tensorboard/eval, where the HParams tab reads the run's held-out score."""
  ec = evaluate_config.get_config()
  ec.update(c.eval.to_dict())
  ec.out = os.path.join(rc.workdir, "eval.json")
  ec.logdir = os.path.join(rc.workdir, "tensorboard", "eval")
  ec.step = rc.total_steps
  ec.model.update(rc.model.to_dict(), hf_dir=os.path.join(rc.workdir, "hf"), preset="")
  ec.task.update(rc.task.to_dict())
  for name in ("max_new_tokens", "temperature", "top_p"):
    ec.rollout[name] = rc.rollout[name]
  ec.rollout.sparse = False
  return ec


def _read_json(path):
  if not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def trained(rc) -> bool:
  """The run reached total_steps (the trainer writes summary.json last)."""
  summary = _read_json(os.path.join(rc.workdir, "summary.json"))
  return summary is not None and summary["steps"] >= rc.total_steps


def evaluated(ec) -> bool:
  """eval.json exists and was made with these settings, at this step."""
  done = _read_json(ec.out)
  want = {
    "step": ec.step,
    "num_problems": ec.num_problems,
    "samples": ec.samples,
    "seed": ec.seed,
    "max_new_tokens": ec.rollout.max_new_tokens,
  }
  return done is not None and all(done[k] == v for k, v in want.items())


def train_and_evaluate(c, rc) -> None:
  """Trains (or resumes) run `rc` to total_steps, then evaluates it; each part only when not
  done already."""
  if not trained(rc):
    trainer.train(rc)
  ec = eval_config(c, rc)
  if not evaluated(ec):
    if not os.path.isdir(ec.model.hf_dir):
      raise FileNotFoundError(
        f"{rc.workdir} has no hf/ export to evaluate: config.train.export_hf must be True"
      )
    evaluate.evaluate(ec)


def read_metrics(workdir: str) -> list:
  """The metrics.jsonl rows of a run, one a step, in step order."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f if line.strip()]


def series(rows, name, default=None):
  """Metric `name` per row as floats (None, an empty bin's value, and absent: NaN)."""
  return np.array([r.get(name, default) for r in rows], np.float64)


def run_record(workdir: str, window: int, tau: float) -> dict:
  """The figures of one finished, evaluated run (see the module docstring)."""
  rows = read_metrics(workdir)
  first, last = rows[:window], rows[-window:]
  p5_step_bin = series(rows, "acceptance/p5_bin")
  with warnings.catch_warnings():  # a bin empty in every step stays NaN (null)
    warnings.simplefilter("ignore", RuntimeWarning)
    p5_bin = np.nanmean(p5_step_bin[-window:], 0)
    under_tau_bin = np.nanmean(np.where(np.isnan(p5_step_bin), np.nan, p5_step_bin < tau), 0)
  # the share of the run's tokens under tau per bin, pooled over all steps: at most 5% is the
  # run's p5 >= tau
  count_step_bin = series(rows, "acceptance/count_bin")
  below_step_bin = np.nan_to_num(series(rows, "acceptance/frac_below_tau_bin")) * count_step_bin
  with np.errstate(invalid="ignore"):
    below_tau_bin = [
      None if np.isnan(v) else float(v) for v in below_step_bin.sum(0) / count_step_bin.sum(0)
    ]
  p1 = series(
    rows, "acceptance/p1"
  )  # deeper than p5: what decides a lookup task (docs/threshold_sweep.md)
  kv_start = series(rows, "kv/read_fraction_start")  # closed loops only
  masked = series(rows, "mask/token_frac")  # runs with rl.mask_alpha_below only
  timed = rows[1:] or rows  # the first step compiles
  # a run evaluated on held-out problems (every sweep run is) has eval.json beside its metrics
  heldout = (_read_json(os.path.join(workdir, "eval.json")) or {}).get("metrics", {})
  return {
    "workdir": workdir,
    "steps": len(rows),
    "reward_curve": series(rows, "reward/mean").tolist(),
    "reward_first": float(np.mean(series(first, "reward/mean"))),
    "reward_last": float(np.mean(series(last, "reward/mean"))),
    "heldout_score": heldout.get("mean@1"),
    "heldout_accuracy": heldout.get("pass@1"),
    "length_first": float(np.mean(series(first, "response_length/mean"))),
    "length_last": float(np.mean(series(last, "response_length/mean"))),
    "p5": float(np.mean(series(last, "acceptance/p5"))),
    "p1": float(np.nanmean(p1)) if np.isfinite(p1).any() else None,  # mean over all steps
    "p5_bin": [None if np.isnan(v) else float(v) for v in p5_bin],
    "under_tau_bin": [None if np.isnan(v) else float(v) for v in under_tau_bin],
    "below_tau_bin": below_tau_bin,
    "kv_read": float(np.mean(series(rows, "kv/read_fraction"))),
    "kv_read_start": float(np.mean(kv_start)) if np.isfinite(kv_start).all() else None,
    "mask_token_frac": float(np.mean(masked)) if np.isfinite(masked).all() else None,
    "predicted_speedup": float(np.mean(series(rows, "kv/predicted_speedup", 1.0))),  # dense: 1
    "rollout_tokens_per_s": float(np.median(series(timed, "perf/rollout_tokens_per_s"))),
  }


def _mean_std(values):
  """Mean and std (ddof 1; 0 for one value) over seeds, elementwise for per-bin lists; None for
  NaN (a bin with no tokens)."""
  if all(v is None for v in values):  # a figure these runs did not record
    return {"mean": None, "std": None}
  x = np.array(values, np.float64)  # None -> NaN
  with warnings.catch_warnings():  # a bin empty in every run stays NaN (null)
    warnings.simplefilter("ignore", RuntimeWarning)
    mean = np.nanmean(x, 0)
    std = np.nanstd(x, 0, ddof=1) if len(x) > 1 else np.where(np.isnan(mean), np.nan, 0.0)
  to_json = lambda a: None if np.isnan(a) else float(a)
  if np.ndim(mean) == 0:
    return {"mean": to_json(mean), "std": to_json(std)}
  return {"mean": [to_json(v) for v in mean], "std": [to_json(v) for v in std]}


def summarize(sweep_settings, runs, seeds) -> dict:
  """Per setting: its runs and the mean / std over seeds of every FIELDS figure. Also fills each
  run's measured_speedup (tokens/s over the same seed's dense run; None without one)."""
  for setting in sweep_settings:
    for seed in seeds:
      run = runs[f"{setting['run']}_seed{seed}"]
      dense = runs.get(f"dense_seed{seed}")
      run["measured_speedup"] = (
        run["rollout_tokens_per_s"] / dense["rollout_tokens_per_s"] if dense else None
      )
  out = {}
  for setting in sweep_settings:
    rows = [runs[f"{setting['run']}_seed{seed}"] for seed in seeds]
    out[setting["name"]] = {
      **setting,
      "seeds": list(seeds),
      **{f: _mean_std([r.get(f) for r in rows]) for f in FIELDS},
    }
  return out


def print_table(summary) -> None:
  fmt = lambda d, p=3: "-" if d["mean"] is None else f"{d['mean']:.{p}f}+-{d['std']:.{p}f}"
  w = max(map(len, summary), default=0) + 2  # the setting column
  head = (
    f"{'setting':<{w}}{'reward first->last':>26}{'held-out':>14}{'accuracy':>14}"
    f"{'length first->last':>20}{'p5':>14}{'min p5 bin':>11}{'under tau':>10}"
    f"{'max below':>10}{'p1':>7}"
    f"{'KV read':>9}{'start':>7}{'pred x':>8}{'tok/s':>8}{'meas x':>8}"
  )
  print(head)
  for name, s in summary.items():
    bins = [v for v in s["p5_bin"]["mean"] if v is not None]
    under = [v for v in s["under_tau_bin"]["mean"] if v is not None]
    # figures the shipped sweep's earlier settings did not record (assets/.../tau_sweep): "-"
    meas, p1, start, below = (
      (s.get(f) or {}).get("mean")
      for f in ("measured_speedup", "p1", "kv_read_start", "below_tau_bin")
    )
    below = [v for v in below or [] if v is not None]  # pooled: at most 5% is p5 >= tau
    print(
      f"{name:<{w}}{fmt(s['reward_first']) + ' -> ' + fmt(s['reward_last']):>26}"
      f"{fmt(s['heldout_score']):>14}{fmt(s['heldout_accuracy']):>14}"
      f"{s['length_first']['mean']:>11.0f} -> {s['length_last']['mean']:<5.0f}"
      f"{fmt(s['p5']):>14}{min(bins) if bins else float('nan'):>11.3f}"
      f"{f'{min(under):.0%}-{max(under):.0%}' if under else '-':>10}"
      f"{f'{max(below):.1%}' if below else '-':>10}"
      f"{'-' if p1 is None else f'{p1:.3f}':>7}"
      f"{s['kv_read']['mean']:>9.3f}{'-' if start is None else f'{start:.3f}':>7}"
      f"{s['predicted_speedup']['mean']:>8.2f}"
      f"{s['rollout_tokens_per_s']['mean']:>8.0f}"
      f"{'-' if meas is None else f'{meas:.2f}':>8}"
    )


def plot(sweep: dict, path: str) -> None:
  """PNG: reward and held-out score per setting, exact p5 per bin per setting, KV read and
  speedups per setting, and held-out score against KV read (the Pareto front); error bars are the
  std over seeds."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  s = sweep["settings"]
  names = list(s)
  x = np.arange(len(names))
  mean = lambda f: np.array([s[n][f]["mean"] for n in names], np.float64)  # None -> NaN
  std = lambda f: np.nan_to_num(np.array([s[n][f]["std"] for n in names], np.float64))
  bars = lambda ax, dx, f, fmt, label: ax.errorbar(
    x + dx, mean(f), std(f), fmt=fmt, capsize=3, label=label
  )
  fig, axes = plt.subplots(1, 4, figsize=(22, 4.5))
  bars(
    axes[0], -0.1, "reward_last", "o", f"training reward (last {sweep['config']['window']} steps)"
  )
  bars(axes[0], 0.0, "heldout_score", "s", "held-out score (dense)")
  bars(axes[0], 0.1, "heldout_accuracy", "^", "held-out exact accuracy")
  axes[0].set(title="stability: reward and held-out score", ylabel="score")
  p5_SB = np.array([s[n]["p5_bin"]["mean"] for n in names], np.float64)
  for b in range(p5_SB.shape[1]):
    if np.isfinite(p5_SB[:, b]).any():
      axes[1].plot(x, p5_SB[:, b], marker="o", label=f"bin {b}")
  tau = sweep["config"]["train"]["stats"]["tau"]
  axes[1].axhline(tau, color="k", ls="--", lw=0.8, label=f"stats.tau {tau}")
  axes[1].set(title="exact-alpha p5 per position bin (last steps)", ylabel="p5")
  bars(axes[2], -0.1, "kv_read", "o", "KV pages read / dense")
  bars(axes[2], 0.0, "predicted_speedup", "s", "predicted rollout speedup (cost model)")
  if np.isfinite(mean("measured_speedup")).any():
    bars(axes[2], 0.1, "measured_speedup", "^", "measured rollout tokens/s / dense")
  axes[2].set(title="cost")
  for ax in axes[:3]:
    ax.set_xticks(x, names, rotation=30, ha="right")
    ax.legend(fontsize=7)
  axes[3].errorbar(
    mean("kv_read"), mean("heldout_score"), std("heldout_score"), std("kv_read"), fmt="o", capsize=3
  )
  for n, kv, score in zip(names, mean("kv_read"), mean("heldout_score")):
    axes[3].annotate(n, (kv, score), fontsize=7, xytext=(3, 3), textcoords="offset points")
  axes[3].set(
    title="held-out score vs KV read (Pareto front)",
    xlabel="KV pages read / dense",
    ylabel="held-out score",
  )
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


KV_SAVING = 0.95  # a table "saves" when it reads at most this share of the dense KV


def quantile_verdict(sweep: dict) -> dict:
  """The pre-registered test of docs/threshold_sweep.md ("Which tail predicts training"): the line
  is dense's mean held-out score less its std over seeds (ddof 1); confirmed if a p1 table reading
  at most KV_SAVING of the dense KV scores at least the line while the p5 table is below it;
  refuted if every such p1 table is below the line, or the p5 table is above it too; else
  inconclusive. Tables are the quest settings, by the percentile they hold."""
  s = sweep["settings"]
  dense = s["dense"]["heldout_score"]
  line = dense["mean"] - dense["std"]
  tables = [
    dict(
      name=n,
      quantile=v["quantile"],
      tau=v["tau"],
      kv_read=v["kv_read"]["mean"],
      heldout=v["heldout_score"]["mean"],
      above=v["heldout_score"]["mean"] >= line,
    )
    for n, v in s.items()
    if v["kind"] == "quest"
  ]
  p1_saving = [t for t in tables if t["quantile"] == 1 and t["kv_read"] <= KV_SAVING]
  p5 = [t for t in tables if t["quantile"] == 5]
  if not p1_saving or not p5:
    verdict = "inconclusive"
  elif any(t["above"] for t in p5) or not any(t["above"] for t in p1_saving):
    verdict = "refuted"
  else:
    verdict = "confirmed"
  return dict(
    line=line, dense_mean=dense["mean"], dense_std=dense["std"], tables=tables, verdict=verdict
  )


def plot_quantiles(sweep: dict, path: str) -> None:
  """PNG: held-out score against KV read, one curve per percentile held at tau (the quest tables,
  by KV read), dense at 1.0 and the test's line (dense mean - std); error bars: std over seeds."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  s, v = sweep["settings"], quantile_verdict(sweep)
  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for i, q in enumerate(sorted({t["quantile"] for t in v["tables"]})):
    names = sorted(
      (t["name"] for t in v["tables"] if t["quantile"] == q), key=lambda n: s[n]["tau"]
    )
    kv = [s[n]["kv_read"]["mean"] for n in names]
    score = [s[n]["heldout_score"]["mean"] for n in names]
    err = [s[n]["heldout_score"]["std"] or 0.0 for n in names]
    ax.errorbar(kv, score, err, marker="o", capsize=3, color=f"C{i}", label=f"p{q:g} >= tau")
    for n, x, y in zip(names, kv, score):
      ax.annotate(
        f"tau {s[n]['tau']:g}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points"
      )
  ax.errorbar(1.0, v["dense_mean"], v["dense_std"], marker="s", color="k", capsize=3, label="dense")
  ax.axhline(v["line"], color="k", ls="--", lw=0.8, label="dense mean - std (the test's line)")
  ax.axvline(KV_SAVING, color="gray", ls=":", lw=0.8, label=f"KV read {KV_SAVING}")
  ax.set(
    title=f"which tail predicts training: {v['verdict']}",
    xlabel="KV pages read / dense",
    ylabel="held-out score (mean over seeds)",
  )
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)


def sweep(c) -> dict:
  """Runs what is not done yet, then writes sweep.json and tau_sweep.png and prints the table;
  returns the sweep dict."""
  seeds = parse_list(c.seeds, "seeds", int)
  if c.window < 1:
    raise ValueError(f"config.window = {c.window}: must be >= 1 (steps averaged)")
  base = _read_json(c.base) if c.base else {"settings": {}, "runs": {}}  # read before hours of runs
  if base is None:
    raise FileNotFoundError(f"config.base = {c.base!r}: no such sweep.json")
  sweep_settings = settings(c)
  runs = {}  # run name -> trainer config, in order, each shared run once
  for setting in sweep_settings:
    for seed in seeds:
      runs.setdefault(f"{setting['run']}_seed{seed}", run_config(c, setting, seed))
  todo = [name for name, rc in runs.items() if not (trained(rc) and evaluated(eval_config(c, rc)))]
  print(
    f"[tau_sweep] {len(sweep_settings)} settings x {len(seeds)} seeds = {len(runs)} runs "
    f"(shared tables run once), {len(runs) - len(todo)} done already, in {c.sweep_dir}",
    flush=True,
  )
  t_start, times = time.time(), []
  for i, (name, rc) in enumerate(runs.items()):
    if name not in todo:
      print(f"[tau_sweep] run {i + 1}/{len(runs)} {name}: done, skipped", flush=True)
      continue
    left = len(todo) - len(times)
    eta = f"{np.mean(times) * left:.0f}s" if times else "--"
    print(
      f"[tau_sweep] run {i + 1}/{len(runs)} {name} ({rc.rollout.schedule or 'dense'}): "
      f"{time.time() - t_start:.0f}s elapsed, ETA {eta} ({left} runs left)",
      flush=True,
    )
    t0 = time.time()
    train_and_evaluate(c, rc)
    times.append(time.time() - t0)

  records = {name: run_record(rc.workdir, c.window, rc.stats.tau) for name, rc in runs.items()}
  records = {**base["runs"], **records}  # a run made here replaces the base's of the same name
  merged = {**base["settings"], **summarize(sweep_settings, records, seeds)}
  order = lambda n: (KINDS.index(merged[n]["kind"]), merged[n]["tau"] or 0, len(n), n)  # plot order
  out = {
    # a report of the base alone describes the base's runs: its config
    "config": json.loads(c.to_json_best_effort()) if sweep_settings else base["config"],
    "settings": {name: merged[name] for name in sorted(merged, key=order)},
    "runs": records,
  }
  with open(os.path.join(c.sweep_dir, "sweep.json"), "w") as f:
    json.dump(out, f, indent=1, allow_nan=False)
  plot(out, os.path.join(c.sweep_dir, "tau_sweep.png"))
  print_table(out["settings"])
  quantiles = {v.get("quantile") for v in out["settings"].values() if v["kind"] == "quest"}
  verdict = None
  if "dense" in out["settings"] and len(seeds) > 1 and len(quantiles) > 1:
    v = verdict = quantile_verdict(out)
    plot_quantiles(out, os.path.join(c.sweep_dir, "quantiles.png"))
    print(
      f"[tau_sweep] which tail predicts training: {v['verdict']} (line {v['line']:.3f}: "
      + ", ".join(
        f"{t['name']} kv {t['kv_read']:.3f} held-out {t['heldout']:.3f}" for t in v["tables"]
      )
      + "); quantiles.png",
      flush=True,
    )
  if c.record:
    results_records.write_record(
      c.record, {"config": out["config"], "settings": out["settings"], "verdict": verdict}
    )
  print(
    f"[tau_sweep] wrote {c.sweep_dir}/sweep.json and tau_sweep.png ({time.time() - t_start:.0f}s)",
    flush=True,
  )
  return out


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  sweep(flags.FLAGS.config)


if __name__ == "__main__":
  # Defined here, not at import: tests import this module beside other scripts defining --config.
  config_flags.DEFINE_config_file("config", "configs/tau_sweep.py", "experiment config")
  app.run(main)
