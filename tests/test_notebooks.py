"""The notebooks run headless: every code cell executes on a small run and calibration surface."""
import json
import os

import numpy as np

from sparrow_jax.logging import MetricsLogger

NOTEBOOK = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks",
                        "sparrow_tail_stats.ipynb")


def test_tail_stats_notebook_runs_headless(tmp_path, monkeypatch, capsys):
  logger = MetricsLogger(str(tmp_path / "run"), resume_step=0)
  for step in range(1, 4):
    logger.write(step, {"reward/mean": 0.1 * step, "acceptance/mean": 0.97, "acceptance/p5": 0.8,
                        "acceptance/p5_bin": np.array([np.nan, 0.9, 0.8 - 0.01 * step])})
  logger.close()
  candidates = [1, 2, 4, 8]
  surface = {"tau": 0.86, "bin_size": 2048, "page_size": 16, "always_kept": 3,
             "candidates": candidates, "count_bin": [10, 10, 10],
             "p5": {str(c): [0.7 + 0.05 * i, 0.6 + 0.05 * i, None] for i, c in enumerate(candidates)},
             "chosen_topk": [4, 8, 8]}
  (tmp_path / "surface.json").write_text(json.dumps(surface))
  monkeypatch.setenv("SPARROW_WORKDIR", str(tmp_path / "run"))
  monkeypatch.setenv("SPARROW_SURFACE", str(tmp_path / "surface.json"))
  monkeypatch.setenv("SPARROW_OUT", str(tmp_path / "out"))

  cells = json.load(open(NOTEBOOK))["cells"]
  namespace = {}
  for cell in cells:
    if cell["cell_type"] == "code":
      exec("".join(cell["source"]), namespace)  # noqa: S102 (our own notebook)
  out = capsys.readouterr().out
  assert "3 steps; last reward 0.300" in out
  assert (tmp_path / "out" / "training_curves.png").stat().st_size > 1000
  assert (tmp_path / "out" / "tau_sweep.png").stat().st_size > 1000
  # higher tau never picks a cheaper schedule, hence never a larger predicted speedup
  speedups = [s for _, _, s in namespace["sweep"]]
  assert all(a >= b - 1e-9 for a, b in zip(speedups, speedups[1:]))
  assert speedups[0] > speedups[-1]


def test_tail_stats_notebook_defaults_work_from_the_notebooks_dir(tmp_path, monkeypatch, capsys):
  """As `jupyter nbconvert --execute` runs it (cwd notebooks/), with no paths set: the shipped
  default run and calibration surface."""
  for name in ("SPARROW_WORKDIR", "SPARROW_SURFACE"):
    monkeypatch.delenv(name, raising=False)
  monkeypatch.setenv("SPARROW_OUT", str(tmp_path / "out"))
  monkeypatch.chdir(os.path.dirname(NOTEBOOK))
  namespace = {}
  for cell in json.load(open(NOTEBOOK))["cells"]:
    if cell["cell_type"] == "code":
      exec("".join(cell["source"]), namespace)  # noqa: S102 (our own notebook)
  out = capsys.readouterr().out
  assert "40 steps; last reward" in out or "workdir/default" in out
  assert (tmp_path / "out" / "training_curves.png").stat().st_size > 1000
