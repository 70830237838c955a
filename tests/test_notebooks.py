"""The notebooks are valid in the current nbformat and run headless: every code cell executes on a
small run and calibration surface."""

import glob
import json
import os
import warnings

import nbformat
import numpy as np
import pytest

from sparrow_jax.logging import MetricsLogger

NOTEBOOK = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  "notebooks",
  "sparrow_tail_stats.ipynb",
)


@pytest.mark.nightly
@pytest.mark.parametrize(
  "path",
  sorted(glob.glob(os.path.join(os.path.dirname(NOTEBOOK), "*.ipynb"))),
  ids=os.path.basename,
)
def test_notebook_is_valid_in_the_current_format(path):
  """What nbformat only warns about today (a cell without an id) is an error in its later
  versions, so a warning fails here too."""
  with open(path, encoding="utf-8") as f, warnings.catch_warnings():
    warnings.simplefilter("error")
    nbformat.validate(nbformat.read(f, as_version=nbformat.NO_CONVERT))


@pytest.mark.nightly
def test_tail_stats_notebook_runs_headless(tmp_path, monkeypatch, capsys):
  logger = MetricsLogger(str(tmp_path / "run"), resume_step=0)
  for step in range(1, 4):
    logger.write(
      step,
      {
        "reward/mean": 0.1 * step,
        "acceptance/mean": 0.97,
        "acceptance/p5": 0.8,
        "acceptance/p5_bin": np.array([np.nan, 0.9, 0.8 - 0.01 * step]),
      },
    )
  logger.close()
  candidates = [1, 2, 4, 8]
  surface = {
    "tau": 0.86,
    "bin_size": 2048,
    "page_size": 16,
    "always_kept": 3,
    "candidates": candidates,
    "count_bin": [10, 10, 10],
    "quantile": 5,
    "tail": {
      "5": {str(c): [0.7 + 0.05 * i, 0.6 + 0.05 * i, None] for i, c in enumerate(candidates)}
    },
    "chosen_topk": [4, 8, 8],
  }
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


@pytest.mark.nightly
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


def _run_notebook(name):
  """Executes every code cell of notebooks/<name> (the first, Colab's install, does nothing here);
  returns the namespace."""
  namespace = {}
  for cell in json.load(open(os.path.join(os.path.dirname(NOTEBOOK), name)))["cells"]:
    if cell["cell_type"] == "code":
      exec("".join(cell["source"]), namespace)  # noqa: S102 (our own notebook)
  return namespace


def _fake_run(workdir, p5_by_step):
  """A finished trainer workdir: metrics.jsonl rows with what the notebooks read, summary.json."""
  logger = MetricsLogger(str(workdir), resume_step=0)
  for step, p5 in enumerate(p5_by_step, 1):
    logger.write(
      step,
      {
        "reward/mean": 0.1 * step,
        "response_length/mean": 300.0 + step,
        "acceptance/p5": p5,
        "acceptance/p5_bin": np.array([np.nan, p5, p5 - 0.1]),
        "acceptance/count_bin": np.array([0, 100, 50]),
        "acceptance/frac_below_tau_bin": np.array([np.nan, 0.01, 0.2]),
        "kv/read_fraction": 0.8,
        "kv/predicted_speedup": 0.7,
        "perf/rollout_tokens_per_s": 1000.0 + step,
      },
    )
  logger.close()
  (workdir / "summary.json").write_text(json.dumps({"steps": len(p5_by_step)}))


@pytest.mark.nightly
def test_tau_sweep_notebook_loads_a_finished_sweep(tmp_path, monkeypatch, capsys):
  from configs import tau_sweep as sweep_config
  from experiments import tau_sweep

  c = sweep_config.get_config()
  c.sweep_dir = str(tmp_path / "sweep")
  c.quest_tables = "5:0.86,1:0.86,1:0.94"  # two percentiles: the notebook's quantile axis
  c.quest_surface = "assets/pointer_chase_tiny/quantile_sweep/calibration/surface.json"
  settings = tau_sweep.settings(c)  # every kind, from the shipped surfaces
  runs = {}
  for i, setting in enumerate(settings):
    for seed in (0, 1):
      workdir = tmp_path / "sweep" / f"{setting['run']}_seed{seed}"
      if not workdir.exists():
        _fake_run(workdir, [0.9 - 0.01 * i, 0.95, 0.9 + 0.01 * seed])
        (workdir / "eval.json").write_text(json.dumps({"metrics": {"mean@1": 0.4, "pass@1": 0.3}}))
      runs[workdir.name] = tau_sweep.run_record(str(workdir), c.window, 0.86)
  sweep = {
    "config": json.loads(c.to_json_best_effort()),
    "settings": tau_sweep.summarize(settings, runs, [0, 1]),
    "runs": runs,
  }
  (tmp_path / "sweep" / "sweep.json").write_text(json.dumps(sweep))
  monkeypatch.setenv("SPARROW_SWEEP_DIR", str(tmp_path / "sweep"))
  monkeypatch.setenv("SPARROW_OUT", str(tmp_path / "out"))
  monkeypatch.chdir(os.path.dirname(NOTEBOOK))  # as nbconvert runs it; the notebook moves to ROOT
  namespace = _run_notebook("tau_sweep.ipynb")
  out = capsys.readouterr().out
  assert "16 settings, 26 runs" in out and "quest0.86" in out  # 0.5 ... 0.94 share a run
  assert [s["tau"] for s in namespace["taus"]] == [0.3, 0.5, 0.7, 0.86, 0.94, 0.99]
  assert "quest0.94_p1  p1 >= 0.94" in out and namespace["verdict"]["verdict"] in out
  for name in ("tau_sweep_notebook.png", "tau_sweep_rewards.png", "quantiles.png"):
    assert (tmp_path / "out" / name).stat().st_size > 1000


@pytest.mark.nightly
def test_distill_sparse_notebook_reads_finished_runs_without_training(
  tmp_path, monkeypatch, capsys
):
  from sparrow_jax.rl import trainer

  _fake_run(tmp_path / "on", [0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85])
  _fake_run(tmp_path / "off", [0.5, 0.5, 0.4, 0.5, 0.5, 0.5, 0.6, 0.5])
  monkeypatch.setattr(trainer, "train", lambda c: pytest.fail(f"trained {c.workdir}"))
  for name, value in (("ON", tmp_path / "on"), ("OFF", tmp_path / "off"), ("STEPS", 8)):
    monkeypatch.setenv(f"SPARROW_DISTILL_{name}", str(value))
  monkeypatch.setenv("SPARROW_OUT", str(tmp_path / "out"))
  monkeypatch.chdir(os.path.dirname(NOTEBOOK))  # as nbconvert runs it; the notebook moves to ROOT
  namespace = _run_notebook("distill_sparse.ipynb")
  out = capsys.readouterr().out
  assert "with DistillSparse: 8 steps, p5 first 5 steps 0.600, last 5 0.750" in out
  assert "without: 8 steps, p5 first 5 steps 0.480, last 5 0.520" in out
  assert namespace["bins"] == [1, 2]  # bin 0 never has a token
  assert (tmp_path / "out" / "distill_sparse.png").stat().st_size > 1000


@pytest.mark.nightly
def test_distill_sparse_notebook_defaults_to_the_shipped_runs(tmp_path, monkeypatch, capsys):
  """With no run named, the notebook reads the two runs shipped in assets/ (docs/distill_sparse.md
  "DistillSparse") and trains nothing, whatever SPARROW_DISTILL_STEPS says."""
  from sparrow_jax.rl import trainer

  monkeypatch.setattr(trainer, "train", lambda c: pytest.fail(f"trained {c.workdir}"))
  for name in ("ON", "OFF"):
    monkeypatch.delenv(f"SPARROW_DISTILL_{name}", raising=False)
  monkeypatch.setenv("SPARROW_DISTILL_STEPS", "7")
  monkeypatch.setenv("SPARROW_OUT", str(tmp_path / "out"))
  monkeypatch.chdir(os.path.dirname(NOTEBOOK))
  namespace = _run_notebook("distill_sparse.ipynb")
  out = capsys.readouterr().out
  assert "with DistillSparse: 20 steps" in out and "without: 20 steps" in out, out
  assert [len(rows) for rows in namespace["rows"].values()] == [20, 20]
  assert (tmp_path / "out" / "distill_sparse.png").stat().st_size > 1000
