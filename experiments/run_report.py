"""The figures of finished trainer runs as a results record, so a docs page can show them without
copying them by hand.

  python experiments/run_report.py --config=configs/run_report.py \\
      --config.runs=default=/tmp/runs/default \\
      --config.out=docs/results/embedded_default_run.json

Per run: what the threshold sweep keeps of a run (`tau_sweep.run_record`: reward and length over
the first and last `window` steps, exact-alpha p5 overall and per bin over the last `window`,
steps and tokens under tau per bin, p1, KV read, rollout tokens/s; the held-out score when the
workdir has an eval.json), the same p5 figures over the first `window` steps, the median p5 of a
step, the engine's occupancy and rows in flight, the median train step (the steps after the first,
which compiles), a multi-turn run's env/* tags step by step, and the run's own summary.json: its
wall time by part, peak RSS, command, commit and machine. Per evaluation (`evals`,
experiments/evaluate.py outputs): its model, settings and metrics.
"""

import json
import os
import warnings

from absl import app, flags
from ml_collections import config_flags
import numpy as np

from experiments import tau_sweep
from sparrow_jax import records


def parse_named(text: str, field: str) -> dict:
  """'a=x,b=y' -> {'a': 'x', 'b': 'y'}, in order."""
  named = {}
  for item in filter(None, text.split(",")):
    name, sep, value = item.partition("=")
    if not (sep and name and value) or name in named:
      raise ValueError(f"config.{field}: expected unique name=path items, got {item!r}")
    named[name] = value
  return named


def _read_summary(workdir: str) -> dict:
  path = os.path.join(workdir, "summary.json")
  if not os.path.exists(path):
    raise FileNotFoundError(f"{workdir} has no summary.json: the run has not finished")
  with open(path) as f:
    return json.load(f)


def run_figures(workdir: str, window: int, tau: float) -> dict:
  """One finished run's figures (module docstring)."""
  summary = _read_summary(workdir)
  rows = tau_sweep.read_metrics(workdir)
  first = rows[:window]
  with warnings.catch_warnings():  # a bin empty in every step stays NaN (null)
    warnings.simplefilter("ignore", RuntimeWarning)
    p5_bin_first = np.nanmean(tau_sweep.series(first, "acceptance/p5_bin"), 0)
  timed = rows[1:] or rows  # the first step compiles
  figures = tau_sweep.run_record(workdir, window, tau)
  figures.update(
    p5_first=float(np.mean(tau_sweep.series(first, "acceptance/p5"))),
    p5_bin_first=[None if np.isnan(v) else float(v) for v in p5_bin_first],
    p5_median=float(np.median(tau_sweep.series(rows, "acceptance/p5"))),
    occupancy=float(np.mean(tau_sweep.series(rows, "perf/engine_occupancy"))),
    rows_in_flight=float(np.mean(tau_sweep.series(rows, "perf/engine_rows_in_flight"))),
    train_step_median_s=float(np.median(tau_sweep.series(timed, "perf/train_step_s"))),
    summary={k: summary.get(k) for k in ("time_s", "peak_rss_gib", "command", "commit", "machine")},
  )
  # a multi-turn run's tool use, step by step (docs/metrics.md#multi-turn-runs)
  tags = sorted({k for row in rows for k in row if k.startswith("env/")})
  if tags:
    figures["env"] = {tag: [row.get(tag) for row in rows] for tag in tags}
  return figures


def eval_figures(path: str) -> dict:
  """An experiments/evaluate.py output without its per-problem rows."""
  with open(path) as f:
    result = json.load(f)
  keep = ("model_dir", "num_problems", "samples", "max_new_tokens", "temperature", "seed")
  return {**{k: result[k] for k in keep}, "metrics": result["metrics"]}


def report(c) -> dict:
  runs = parse_named(c.runs, "runs")
  evals = parse_named(c.evals, "evals")
  if not (runs or evals):
    raise ValueError("config.runs and config.evals are both empty: nothing to report")
  results = {
    "config": {"window": c.window, "tau": c.tau},
    "runs": {name: run_figures(workdir, c.window, c.tau) for name, workdir in runs.items()},
    "evals": {name: eval_figures(path) for name, path in evals.items()},
  }
  for name, run in results["runs"].items():
    print(
      f"{name}: {run['steps']} steps, reward {run['reward_first']:.3f} -> "
      f"{run['reward_last']:.3f}, p5 {run['p5_first']:.3f} -> {run['p5']:.3f}, "
      f"kv read {run['kv_read']:.3f}"
    )
  for name, ev in results["evals"].items():
    print(
      f"{name}: {ev['model_dir']}: " + ", ".join(f"{k} {v:.3f}" for k, v in ev["metrics"].items())
    )
  if c.out:
    records.write_record(c.out, results)
    print(f"wrote {c.out}")
  return results


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  report(flags.FLAGS.config)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "configs/run_report.py", "experiment config")
  app.run(main)
