"""experiments/tau_sweep.py: the settings it derives from a calibration surface, its per-seed
statistics, and a tiny sweep end to end that a re-run skips (or resumes) instead of retraining."""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from configs import tau_sweep as sweep_config
from experiments import tau_sweep
from sparrow_jax.rl import run_config
from sparrow_jax.sparsity.schedule import KVSchedule
from tests.helpers import ROOT, SMALL, load_file, subprocess_env

SHIPPED_SCHEDULE = os.path.join(ROOT, "assets/pointer_chase_tiny/calibration/schedule.json")
QUEST_SCHEDULE = os.path.join(ROOT, "assets/pointer_chase_tiny/calibration_quest/schedule.json")


@pytest.mark.nightly
def test_settings_from_the_shipped_surface_share_runs_and_pass_the_trainers_checks(tmp_path):
  c = sweep_config.get_config()
  c.sweep_dir = str(tmp_path)
  settings = {s["name"]: s for s in tau_sweep.settings(c)}
  assert list(settings) == [
    "dense",
    "tau0.3",
    "tau0.5",
    "tau0.7",
    "tau0.86",
    "tau0.94",
    "tau0.99",
    "fixed8",
    "fixed64",
    "adaptive0.86",
    "quest0.86",
    "quest_adaptive0.86",
  ]
  table = lambda name: KVSchedule.parse(settings[name]["schedule"], 16).values
  shipped = lambda path: KVSchedule.from_json(open(path).read()).values
  assert table("tau0.86") == shipped(SHIPPED_SCHEDULE)  # no re-calibration
  assert table("quest0.86") == shipped(QUEST_SCHEDULE)  # quest's own surface
  # The shipped surface is a cliff: 0.5 ... 0.94 pick one table and share its run.
  assert {settings[n]["run"] for n in ("tau0.5", "tau0.7", "tau0.86", "tau0.94")} == {"tau0.5"}
  assert all(a <= b <= d for a, b, d in zip(table("tau0.3"), table("tau0.86"), table("tau0.99")))
  assert table("tau0.3") != table("tau0.86") != table("tau0.99")
  assert settings["adaptive0.86"]["schedule"] == f"adaptive:0.86:{tmp_path}/schedules/tau0.86.json"
  assert settings["fixed8"]["schedule"] == "fixed:8" and settings["fixed64"]["run"] == "fixed64"

  dense = tau_sweep.run_config(c, settings["dense"], 1)
  assert (dense.workdir, dense.seed) == (f"{tmp_path}/dense_seed1", 1)
  assert not dense.rollout.sparse and not dense.distill.enabled  # distill needs sparse rollouts
  shared = tau_sweep.run_config(c, settings["tau0.7"], 0)
  assert shared.workdir == f"{tmp_path}/tau0.5_seed0" and shared.distill.enabled
  assert shared.rollout.page_score == "mean"
  assert tau_sweep.run_config(c, settings["quest0.86"], 0).rollout.page_score == "quest"
  assert settings["quest_adaptive0.86"]["schedule"] == (
    f"adaptive:0.86:{tmp_path}/schedules/quest0.86.json"
  )
  for setting in settings.values():
    run_config.validate(tau_sweep.run_config(c, setting, 0))  # adaptive: bins match, exact alpha on

  c.runs = "dense,tua"
  with pytest.raises(ValueError, match=r"config.runs = 'dense,tua': unknown \['tua'\]"):
    tau_sweep.settings(c)
  c.runs, c.quest_tables = "quest", "5:0.86,1:0.94"  # the shipped surface holds p5 only
  with pytest.raises(
    ValueError,
    match=r"surface.json holds the percentiles \['5'\] of alpha, "
    r"not 1: calibrate again",
  ):
    tau_sweep.settings(c)


@pytest.mark.nightly
def test_summary_is_mean_and_std_over_seeds_with_speedup_against_the_same_seeds_dense_run():
  run = lambda tok_s, p5_bin: {
    **{f: 0.5 for f in tau_sweep.FIELDS},
    "p5_bin": p5_bin,
    "rollout_tokens_per_s": tok_s,
  }
  runs = {
    "dense_seed0": run(100.0, [None, 1.0]),
    "dense_seed1": run(200.0, [None, 1.0]),
    "fixed8_seed0": run(150.0, [None, 0.2]),
    "fixed8_seed1": run(100.0, [None, 0.4]),
  }
  settings = [dict(name="dense", run="dense"), dict(name="fixed8", run="fixed8")]
  summary = tau_sweep.summarize(settings, runs, [0, 1])
  assert runs["fixed8_seed0"]["measured_speedup"] == 1.5
  assert summary["fixed8"]["measured_speedup"] == pytest.approx(
    {"mean": 1.0, "std": np.std([1.5, 0.5], ddof=1)}
  )
  assert summary["fixed8"]["p5_bin"]["mean"] == [None, pytest.approx(0.3)]
  assert summary["dense"]["rollout_tokens_per_s"]["mean"] == 150.0
  assert tau_sweep.summarize(settings[1:], {k: runs[k] for k in ("fixed8_seed0",)}, [0])["fixed8"][
    "measured_speedup"
  ] == {"mean": None, "std": None}  # no dense run to compare


@pytest.mark.nightly
def test_run_record_counts_the_steps_under_tau_per_bin(tmp_path):
  """A bin's under-tau share is over the steps with tokens in it (NaN: none), at the given tau;
  its tokens under tau are pooled over all steps; p5 per bin is over the last `window` steps; a
  closed loop's start-table read over all steps."""
  from sparrow_jax.logging import MetricsLogger

  logger = MetricsLogger(str(tmp_path), resume_step=0)
  for step, p5_bin in enumerate(
    [[np.nan, 0.9, 0.5], [np.nan, 0.8, np.nan], [np.nan, 0.95, 0.7], [np.nan, 0.99, 0.9]], 1
  ):
    logger.write(
      step,
      {
        "reward/mean": 0.1,
        "response_length/mean": 10.0,
        "acceptance/p5": 0.5,
        "acceptance/p5_bin": np.array(p5_bin),
        "kv/read_fraction": 0.5,
        "kv/read_fraction_start": 0.4 + 0.1 * step,
        "acceptance/count_bin": np.array([0, 100 * step, 10]),
        "acceptance/frac_below_tau_bin": np.array([np.nan, 0.01 * step, 0.5]),
        "perf/rollout_tokens_per_s": 1.0,
      },
    )
  logger.close()
  (tmp_path / "eval.json").write_text(json.dumps({"metrics": {"mean@1": 0.4, "pass@1": 0.3}}))
  run = tau_sweep.run_record(str(tmp_path), window=2, tau=0.86)
  assert run["under_tau_bin"] == [None, 0.25, pytest.approx(2 / 3)]
  assert run["p5_bin"] == [None, pytest.approx(0.97), pytest.approx(0.8)]
  assert run["kv_read_start"] == pytest.approx(0.65) and run["kv_read"] == 0.5
  # pooled over the steps, token-weighted: bin 1 (1 + 4 + 9 + 16) / 1000 under tau
  assert run["below_tau_bin"] == [None, pytest.approx(0.03), pytest.approx(0.5)]
  assert tau_sweep.run_record(str(tmp_path), window=2, tau=0.5)["under_tau_bin"] == [None, 0, 0]


def _value(text):
  for kind in (int, float):
    try:
      return kind(text)
    except ValueError:
      pass
  return text


@pytest.mark.nightly
def test_tiny_sweep_end_to_end_then_skips_finished_runs_and_resumes_partial_ones(
  small_run, tmp_path, monkeypatch
):
  """2 settings x 1 seed x 2 steps of the SMALL run (the `small_run` fixture has already compiled
  its train step and sampler into the session's compilation cache: fixed:4, and a tau table whose
  largest budget is also 4 pages)."""
  surface = {
    "tau": 0.86,
    "bin_size": 16,
    "page_size": 8,
    "always_kept": 3,
    "candidates": [0, 1],
    "count_bin": [0, 10, 10, 10, 10, 10],
    "quantile": 5,
    "tail": {"5": {"0": [None, 0.9, 0.8, 0.5, 0.3, 0.2], "1": [None, 1.0, 0.99, 0.95, 0.9, 0.9]}},
  }
  (tmp_path / "surface.json").write_text(json.dumps(surface))
  overrides = {
    f"train.{arg[len('--config.') :].split('=')[0]}": _value(arg.split("=", 1)[1])
    for arg in SMALL
    if "rollout.schedule" not in arg
  }  # a per-run field
  overrides.update(
    {
      "sweep_dir": str(tmp_path / "sweep"),
      "surface": str(tmp_path / "surface.json"),
      "runs": "tau,fixed",
      "taus": "0.86",
      "fixed_pages": "4",
      "seeds": "0",
      "window": 1,
      "train.total_steps": 2,
      "eval.num_problems": 2,
      "eval.samples": 1,
      "eval.batch_size": 2,
    }
  )
  env = subprocess_env(1)  # launch_small's: the same cache keys
  cmd = [
    sys.executable,
    "experiments/tau_sweep.py",
    "--config=configs/tau_sweep.py",
    *[f"--config.{k}={v}" for k, v in overrides.items()],
  ]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  assert re.search(r"run 1/2 tau0.86_seed0 .* ETA -- \(2 runs left\)", proc.stdout)
  assert re.search(r"run 2/2 fixed4_seed0 .* ETA \d+s \(1 runs left\)", proc.stdout)
  sweep_dir = tmp_path / "sweep"
  sweep = json.loads((sweep_dir / "sweep.json").read_text())
  assert list(sweep["settings"]) == ["tau0.86", "fixed4"] and sweep["config"]["window"] == 1
  for name, setting in sweep["settings"].items():
    assert setting["seeds"] == [0] and f"{name} " in proc.stdout  # a table row
    for field in tau_sweep.FIELDS:
      assert set(setting[field]) == {"mean", "std"}, field
  for run in sweep["runs"].values():
    assert run["steps"] == 2 and len(run["reward_curve"]) == 2
    assert set(run) >= set(tau_sweep.FIELDS) | {"reward_curve", "workdir"}
    assert len(run["p5_bin"]) == 7 and 0 <= run["p5"] <= 1  # stats.num_bins
    assert 0 < run["kv_read"] < 1 and run["predicted_speedup"] > 0
    assert run["kv_read_start"] is None  # no closed loop, no start table
    assert run["mask_token_frac"] is None  # no mismatch masking
    assert run["rollout_tokens_per_s"] > 0 and run["measured_speedup"] is None  # no dense run
    assert 0 <= run["heldout_score"] <= 1 and 0 <= run["heldout_accuracy"] <= 1
  table = KVSchedule.from_json((sweep_dir / "schedules" / "tau0.86.json").read_text())
  assert table.values == (0, 0, 1, 1, 1, 1) and table.max_pages == 4
  assert (sweep_dir / "tau_sweep.png").read_bytes()[:4] == b"\x89PNG"

  # Again: nothing trains or evaluates, the logs stay as they were, the summary comes out the same.
  metrics = {run: (sweep_dir / run / "metrics.jsonl").read_bytes() for run in sweep["runs"]}
  calls = []
  monkeypatch.setattr(tau_sweep.trainer, "train", lambda rc: calls.append(("train", rc.workdir)))
  monkeypatch.setattr(tau_sweep.evaluate, "evaluate", lambda ec: calls.append(("eval", ec.out)))
  c = sweep_config.get_config()
  c.lock()
  c.update_from_flattened_dict(overrides)
  assert tau_sweep.sweep(c) == sweep and calls == []
  assert metrics == {run: (sweep_dir / run / "metrics.jsonl").read_bytes() for run in sweep["runs"]}
  # On a base sweep: its other settings kept (in plot order), its namesake replaced, and the
  # speedup measured against its dense run.
  fixed4 = sweep["settings"]["fixed4"]
  base = {
    "settings": {
      "dense": {**fixed4, "name": "dense", "kind": "dense", "note": "base"},
      "fixed4": {**fixed4, "note": "base"},
    },
    "runs": {"dense_seed0": {**sweep["runs"]["fixed4_seed0"], "rollout_tokens_per_s": 1.0}},
  }
  (tmp_path / "base.json").write_text(json.dumps(base))
  c.base = str(tmp_path / "base.json")
  merged = tau_sweep.sweep(c)
  assert list(merged["settings"]) == ["dense", "tau0.86", "fixed4"] and calls == []
  assert merged["settings"]["dense"]["note"] == "base"
  assert "note" not in merged["settings"]["fixed4"]
  assert set(merged["runs"]) == {"dense_seed0", "tau0.86_seed0", "fixed4_seed0"}
  assert merged["runs"]["fixed4_seed0"]["measured_speedup"] == pytest.approx(
    sweep["runs"]["fixed4_seed0"]["rollout_tokens_per_s"]
  )
  c.base = str(tmp_path / "missing.json")
  with pytest.raises(FileNotFoundError, match="config.base"):
    tau_sweep.sweep(c)
  c.base = ""
  # A run that did not finish (no summary.json) goes back to the trainer, which resumes it.
  (sweep_dir / "fixed4_seed0" / "summary.json").unlink()
  tau_sweep.sweep(c)
  assert calls == [("train", str(sweep_dir / "fixed4_seed0"))]


@pytest.mark.nightly
def test_a_finished_sweep_is_reported_without_running(tmp_path):
  """runs="" with a base: nothing runs; the record holds the base's config and settings, and its
  page has a row per run (taus that share one table in one row)."""
  base_path = os.path.join(ROOT, "assets/pointer_chase_tiny/tau_sweep/sweep.json")
  base = json.load(open(base_path))
  c = sweep_config.get_config()
  c.runs, c.base, c.sweep_dir = "", base_path, str(tmp_path / "sweep")
  c.record = str(tmp_path / "threshold_sweep.json")
  out = tau_sweep.sweep(c)
  assert out["config"] == base["config"] and out["settings"] == base["settings"]
  assert not [p for p in os.listdir(c.sweep_dir) if p.endswith("_seed0")]  # nothing trained
  page = load_file("docs/make_results_pages.py").threshold_sweep_page([json.load(open(c.record))])
  rows = [line for line in page.splitlines() if line.startswith("| ") and "---" not in line][1:]
  assert len(rows) == len({v["run"] for v in base["settings"].values()})
  assert any(row.startswith("| tau 0.5 / 0.7 / 0.86 / 0.94 (one run) |") for row in rows)
  with pytest.raises(ValueError, match="config.runs is empty"):
    c.base = ""
    tau_sweep.settings(c)
