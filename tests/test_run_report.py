"""experiments/run_report.py: a finished run's figures as a record, and the page that shows them."""

import json

import numpy as np
import pytest

from experiments import run_report
from sparrow_jax.logging import MetricsLogger
from tests.helpers import load_file


def _finished_run(workdir, steps=6):
  """A trainer workdir: a metrics row a step (p5 rising 0.5 -> 1.0) and summary.json."""
  logger = MetricsLogger(str(workdir), resume_step=0)
  for step in range(1, steps + 1):
    p5 = 0.4 + 0.1 * step
    logger.write(
      step,
      {
        "reward/mean": 0.1 * step,
        "response_length/mean": 100.0,
        "acceptance/p5": p5,
        "acceptance/p1": p5 / 2,
        "acceptance/p5_bin": np.array([np.nan, p5, p5 - 0.2]),
        "acceptance/count_bin": np.array([0, 10, 10]),
        "acceptance/frac_below_tau_bin": np.array([np.nan, 0.0, 0.1]),
        "kv/read_fraction": 0.75,
        "kv/predicted_speedup": 0.6,
        "perf/rollout_tokens_per_s": 100.0,
        "perf/engine_occupancy": 0.5,
        "perf/engine_rows_in_flight": 4.0 * step,
        "perf/train_step_s": 100.0 if step == 1 else float(step),  # the first compiles
      },
    )
  logger.close()
  summary = {
    "steps": steps,
    "time_s": {"first_step": 9.0, "rollout": 20.0, "train_step": 30.0, "total": 120.0},
    "peak_rss_gib": 1.5,
    "command": "python -m sparrow_jax.train --config=configs/default.py",
    "commit": "0" * 40,
    "machine": "a test machine",
  }
  (workdir / "summary.json").write_text(json.dumps(summary))


def test_run_figures_windows_medians_and_the_runs_own_summary(tmp_path):
  _finished_run(tmp_path)
  run = run_report.run_figures(str(tmp_path), window=2, tau=0.86)
  assert run["p5_first"] == pytest.approx(0.55) and run["p5"] == pytest.approx(0.95)
  assert run["p5_bin_first"] == [None, pytest.approx(0.55), pytest.approx(0.35)]
  assert run["reward_first"] == pytest.approx(0.15) and run["reward_last"] == pytest.approx(0.55)
  assert run["p5_median"] == pytest.approx(0.75) and run["p1"] == pytest.approx(0.375)
  assert run["train_step_median_s"] == 4.0  # steps 2-6: the compiling first step left out
  assert run["rows_in_flight"] == pytest.approx(14.0) and run["heldout_score"] is None
  assert run["summary"]["peak_rss_gib"] == 1.5 and run["summary"]["machine"] == "a test machine"


def test_unfinished_runs_and_bad_names_are_refused(tmp_path):
  (tmp_path / "metrics.jsonl").write_text("")
  with pytest.raises(FileNotFoundError, match="no summary.json"):
    run_report.run_figures(str(tmp_path), window=2, tau=0.86)
  with pytest.raises(ValueError, match="name=path"):
    run_report.parse_named("a=x,a=y", "runs")
  with pytest.raises(ValueError, match="name=path"):
    run_report.parse_named("x", "runs")


def test_record_renders_a_column_per_run(tmp_path):
  for name in ("on", "off"):
    _finished_run(tmp_path / name)
  c = load_file("configs/run_report.py").get_config()
  c.runs = f"on={tmp_path / 'on'},off={tmp_path / 'off'}"
  c.window = 2
  c.out = str(tmp_path / "record.json")
  run_report.report(c)
  record = json.loads((tmp_path / "record.json").read_text())
  assert set(record) == {"command", "commit", "machine", "date", "results"}
  page = load_file("docs/make_results_pages.py").distill_sparse_page([record])
  assert "| | on | off |" in page and "| exact p5, first / last window | 0.550 / 0.950 |" in page
  assert "| peak RSS (GiB) | 1.50 | 1.50 |" in page
