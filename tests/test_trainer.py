"""The training loop end to end: runs, logs TensorBoard tags, resumes safely, and rejects bad
configs naming the field."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import default
import sparrow_jax as sj
from sparrow_jax.data.tokenizer import load_tokenizer
from sparrow_jax.rl import build, hooks, run_config, trainer, workdir
from sparrow_jax.rl import train_step as ts
from sparrow_jax.rollout import programs
from sparrow_jax.sparsity.schedule import KVSchedule
from tests import test_dashboard
from tests.helpers import ROOT, assert_same_metrics, rows_by_step


@pytest.mark.nightly
def test_run_logs_tensorboard_curves(small_run):
  """(Resume after SIGKILL, replaying the same steps: tests/test_mesh_runs.py, on 2 processes.)"""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  events = EventAccumulator(str(small_run / "tensorboard"))
  events.Reload()
  tags = events.Tags()["scalars"]
  assert "reward/mean" in tags and "kv/read_fraction" in tags and "acceptance/p5" in tags
  assert any(t.startswith("acceptance/p5_bin/") for t in tags)  # bins holding generated tokens
  assert len(events.Scalars("reward/mean")) == 4
  assert sorted(rows_by_step(small_run)) == [1, 2, 3, 4]
  # bins without tokens in any step (the prompt's) get no point, though metrics.jsonl lists them
  counts = np.sum([row["acceptance/count_bin"] for row in rows_by_step(small_run).values()], 0)
  written = [f"acceptance/count_bin/{b:02d}" in tags for b in range(len(counts))]
  assert counts[0] == 0 and written == [n > 0 for n in counts]
  # the dashboard as TensorBoard serves it names only tags the run wrote
  custom, _, ctx = test_dashboard.tensorboard_over(small_run)
  for regex in test_dashboard.served_regexes(custom, ctx):
    assert custom.scalars_impl(ctx, "tensorboard", regex, "")["tag_to_events"], regex


def config(**changes):
  """The default config with changes given as group__field=value, its rollouts lossy sparse (the
  path most tests here check; exact mode's own tests set rollout__speculate)."""
  changes = {"rollout__speculate": 0, **changes}
  c = default.get_config()
  for dotted, value in changes.items():
    node = c
    *path, last = dotted.split("__")
    for part in path:
      node = node[part]
    node[last] = value
  return c


TINY_SCHEDULE = "assets/pointer_chase_tiny/calibration/schedule.json"  # mean's tau-0.86 table


@pytest.mark.parametrize(
  "changes, field",
  [
    ({"stats__tau": 1.5}, "stats.tau"),
    ({"rollout__page_size": 12}, "rollout.page_size"),
    ({"rollout__group_size": 1}, "rollout.group_size"),
    ({"rl__num_minibatches": 3}, "rl.num_minibatches"),
    ({"rollout__schedule": "fixed:2"}, "always_kept"),
    ({"rollout__schedule": "nonsense"}, "rollout.schedule"),
    ({"rl__estimator": "ppo"}, "rl.estimator"),
    ({"distill__targets": "q,lm_head"}, "distill.targets"),
    ({"rollout__sparse": False}, "distill.enabled"),
    ({"model__preset": "tiny"}, "model.hf_dir / model.preset"),
    ({"rollout__top_p": 0.9}, "rollout.top_p"),
    ({"stats__bin_size": 100}, "stats.bin_size"),
    ({"rollout__schedule": "0:fixed:8,0:fixed:9"}, "rollout.schedule"),
    ({"rollout__schedule": "paper:qwen3-1.7b"}, "rollout.schedule"),
    ({"rl__learning_rate": -1e-4}, "rl.learning_rate"),
    ({"rl__warmup_steps": -1}, "rl.warmup_steps"),
    ({"rl__eps_low": -0.1}, "rl.eps_low"),
    ({"rl__max_grad_norm": -1.0}, "rl.max_grad_norm"),
    ({"rl__ppo_epochs": 0}, "rl.ppo_epochs"),
    ({"profile_steps": (3, 3)}, r"profile_steps = \(3, 3\)"),
    ({"profile_steps": (-1, 2)}, r"profile_steps = \(-1, 2\)"),
    ({"profile_steps": (1,)}, r"profile_steps = \(1,\)"),
    ({"profile_steps": (1.0, 2)}, r"profile_steps = \(1.0, 2\)"),
    ({"profile_steps": (0, 41)}, r"profile_steps = \(0, 41\)"),
    ({"eval__every": -1}, "eval.every = -1 is invalid: must be an int >= 0"),
    ({"eval__problems": -2}, "eval.problems = -2"),
    ({"eval__samples": 0}, "eval.samples = 0 is invalid: must be an int >= 1"),
    ({"eval__completions": -1}, "eval.completions = -1"),
    ({"rl__mask_alpha_below": 1.5}, "rl.mask_alpha_below = 1.5"),
    ({"rl__mask_row_alpha_below": -0.1}, "rl.mask_row_alpha_below = -0.1"),
    ({"stats__bin_size": 0}, "stats.bin_size"),
    ({"stats__num_bins": 0}, "stats.num_bins"),
    ({"keep_checkpoints": 0}, "keep_checkpoints"),
    ({"distill__rank": 0}, "distill.rank"),
    ({"hardware": "tpu9"}, "hardware"),
    ({"rollout__dense_layers": 99}, "rollout.dense_layers"),
    ({"rollout__page_score": "max"}, "rollout.page_score"),
    ({"rollout__max_new_tokens": 100000}, "max_new_tokens = 100512"),
    ({"rollout__schedule": "fixed:abc"}, "rollout.schedule"),
    ({"mesh__fsdp": 0}, "mesh.fsdp"),
    ({"mesh__data": -2}, "mesh.data"),
    ({"rollout__schedule": "adaptive:1.2:" + TINY_SCHEDULE}, "rollout.schedule"),
    ({"rollout__schedule": "adaptive:0.86:fixed:8"}, "rollout.schedule"),
    ({"rollout__schedule": "0:adaptive:0.86:fixed:8,5:fixed:4"}, "rollout.schedule"),
    ({"rollout__schedule": "adaptive:0.86:paper:qwen3-1.7b:0.86"}, "stats.bin_size"),
    (
      {"rollout__schedule": "adaptive:0.86:" + TINY_SCHEDULE, "stats__exact_acceptance": False},
      "stats.exact_acceptance",
    ),
    (
      {"rollout__schedule": "adaptive:0.86:" + TINY_SCHEDULE, "rollout__adaptive_raise": 1.0},
      "rollout.adaptive_raise",
    ),
    (
      {"rollout__schedule": "adaptive:0.86:" + TINY_SCHEDULE, "rollout__adaptive_lower": 1.0},
      "rollout.adaptive_lower",
    ),
    (
      {"rollout__schedule": "adaptive:0.86:" + TINY_SCHEDULE, "rollout__adaptive_headroom": 0.5},
      "rollout.adaptive_headroom",
    ),
    (
      {"rollout__schedule": "adaptive:0.86:" + TINY_SCHEDULE, "rollout__adaptive_window": 0},
      "rollout.adaptive_window",
    ),
    (
      {
        "rollout__schedule": "adaptive:0.86:" + TINY_SCHEDULE,
        "rollout__adaptive_lower_share": 0.05,
      },
      "rollout.adaptive_lower_share",
    ),
    ({"rollout__schedule": "adaptive:0.9:" + TINY_SCHEDULE}, "stats.tau"),
  ],
)
def test_bad_config_names_field(changes, field):
  with pytest.raises(ValueError, match=field.replace(".", r"\.")):
    run_config.validate(config(**changes))


def test_schedule_geometry_other_than_the_sparse_configs_is_refused_up_front(tmp_path):
  """A table made for other always-kept pages (or page size) fails validate, naming the field,
  not after the model has loaded; for an adaptive BASE too."""
  table = tmp_path / "two_kept.json"
  table.write_text(KVSchedule.table((4, 4), page_size=16, always_kept=2).to_json())
  for spec in (str(table), f"adaptive:0.86:{table}"):
    with pytest.raises(ValueError, match=r"rollout\.schedule.*always_kept = 2 differs"):
      run_config.validate(config(rollout__schedule=spec))


@pytest.mark.nightly
def test_trainer_smoke_on_reasoning_gym_math(tmp_path):
  """End to end on an offline math task (reasoning-gym) with a tiny random model and a real
  tokenizer + chat template: prompts, sparse rollouts, math-verify rewards, train steps."""
  from tests.helpers import write_tiny_hf_dir

  write_tiny_hf_dir(tmp_path / "model")
  c = config(
    workdir=str(tmp_path / "run"),
    total_steps=2,
    model__hf_dir=str(tmp_path / "model"),
    task__name="math:reasoning_gym:basic_arithmetic",
    rollout__schedule="fixed:4",
    rollout__page_size=8,
    rollout__dense_layers=1,
    rollout__max_prompt_len=384,
    rollout__max_new_tokens=24,
    rollout__group_size=2,
    stats__bin_size=64,
    rl__num_minibatches=1,
  )
  rows = trainer.train(c)
  assert len(rows) == 2
  assert all(0.0 <= r["reward/mean"] <= 1.0 and r["kv/read_fraction"] < 1.0 for r in rows)
  assert os.path.exists(tmp_path / "run" / "summary.json")
  # The final policy is exported as an HF dir with the source model's tokenizer.
  hf_dir, model_dir = str(tmp_path / "run" / "hf"), str(tmp_path / "model")
  assert sj.load_hf(hf_dir)[0] == sj.load_hf(model_dir)[0]
  assert load_tokenizer(hf_dir).eos_ids == load_tokenizer(model_dir).eos_ids


def test_export_policy_round_trips(tmp_path):
  """A random-preset policy exports with the synthetic task's tokenizer and loads back bit-exact."""
  c = config(model__hf_dir="", model__preset="tiny")
  task = build.make_task(c)
  cfg, params, _ = build.load_model(c, task)
  workdir.export_policy(c, cfg, params, str(tmp_path / "hf"), task)
  cfg2, params2 = sj.load_hf(str(tmp_path / "hf"))
  assert cfg2 == cfg
  for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  tok = load_tokenizer(str(tmp_path / "hf"))
  assert tok.eos_ids == (task.eos_id,) and tok.pad_id == task.pad_id


def engine_programs():
  """Compiled programs of the engine's jitted parts (insert, decode chunk, page copy)."""
  return tuple(
    f._cache_size() for f in (programs.prefill, programs.decode_chunk, programs.copy_pages)
  )


@pytest.mark.nightly
def test_schedule_stages_switch_without_recompiling(tmp_path):
  c = config(
    workdir=str(tmp_path / "run"),
    total_steps=3,
    model__hf_dir="",
    model__preset="tiny",
    rollout__schedule="0:fixed:4,2:fixed:6",
    rollout__page_size=8,
    rollout__dense_layers=1,
    task__min_hops=4,
    task__max_hops=8,
    rollout__max_prompt_len=64,
    rollout__max_new_tokens=40,
    stats__bin_size=16,
    rollout__group_size=4,
    rl__num_minibatches=1,
    export_hf=False,
  )
  compiled = engine_programs()
  rows = trainer.train(c)
  assert [r["kv/schedule_stage"] for r in rows] == [0, 0, 1]
  assert len({r["response_length/mean"] for r in rows}) > 1  # the steps' lengths differ
  # 3 steps of both stages: at most one program of each part (none when this shape ran before)
  assert all(after - before <= 1 for before, after in zip(compiled, engine_programs()))


def test_mesh_that_does_not_fit_the_devices_or_the_batch_names_the_field():
  with pytest.raises(ValueError, match=r"config\.mesh .*does not match the 1 devices"):
    build.make_mesh(config(mesh__data=2))
  with pytest.raises(ValueError, match=r"config\.rl\.micro_batches .*multiple of mesh data x fsdp"):
    build.make_mesh(config(rl__micro_batches=16))  # 32 rows / 4 minibatches / 16 = 0.5


def test_random_preset_needs_a_task_with_its_own_vocabulary():
  from sparrow_jax.data import tasks

  c = config(model__hf_dir="", model__preset="tiny")
  with pytest.raises(ValueError, match="config.model.preset .* own vocabulary"):
    build.load_model(c, tasks.make_task("math:reasoning_gym:basic_arithmetic", limit=2))


@pytest.mark.slow
def test_cli_bad_value_is_one_line_and_creates_nothing(tmp_path):
  out = subprocess.run(
    [
      sys.executable,
      "-m",
      "sparrow_jax.train",
      "--config=configs/default.py",
      f"--config.workdir={tmp_path / 'run'}",
      "--config.rl.learning_rate=-1",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )
  assert out.returncode == 2
  assert out.stderr.strip().splitlines() == [
    "error: config.rl.learning_rate = -1.0 is invalid: must be > 0 (--verbose for the traceback)"
  ]
  assert not (tmp_path / "run").exists()


def small(workdir, **changes):
  return config(
    **{
      **dict(
        workdir=str(workdir),
        model__hf_dir="",
        model__preset="tiny",
        rollout__schedule="fixed:4",
        rollout__page_size=8,
        rollout__dense_layers=1,
        task__min_hops=4,
        task__max_hops=8,
        rollout__max_prompt_len=64,
        rollout__max_new_tokens=40,
        stats__bin_size=16,
        rollout__group_size=4,
        rl__num_minibatches=1,
        export_hf=False,
      ),
      **changes,
    }
  )


@pytest.mark.nightly
def test_profile_steps_write_a_trace_of_the_rollout_and_the_update(tmp_path):
  """profile_steps = (1, 3): one trace, of steps 1 and 2, in workdir/profile where TensorBoard's
  profile plugin finds it (plugins/profile/<run>/<host>.xplane.pb), the engine's decode chunks and
  the train step in it."""
  work = tmp_path / "run"
  rows = trainer.train(small(work, total_steps=3, profile_steps=(1, 3)))
  traces = list((work / "profile" / "plugins" / "profile").glob("*/*.xplane.pb"))
  assert len(rows) == 3 and len(traces) == 1, traces
  trace = traces[0].read_bytes()
  assert b"train_step" in trace and b"decode_chunk" in trace


@pytest.mark.slow
def test_resume_is_safe(tmp_path, capsys):
  """A changed config is refused naming the fields; a finished run rewrites nothing; a corrupt
  newest checkpoint falls back to the previous one, and the replayed step is logged once."""
  work = tmp_path / "run"
  first = trainer.train(small(work, total_steps=3, ckpt_every=2))
  with pytest.raises(ValueError, match=r"rl\.learning_rate: 0\.0002 -> 0\.001"):
    trainer.train(small(work, total_steps=3, ckpt_every=2, rl__learning_rate=1e-3))
  summary = (work / "summary.json").stat().st_mtime_ns
  assert trainer.train(small(work, total_steps=3, ckpt_every=2)) == []
  assert (work / "summary.json").stat().st_mtime_ns == summary
  json.loads((work / "summary.json").read_text())  # strict JSON (NaN bins are null)
  # Cut after the last checkpoint, before the export and summary: a re-run writes only those.
  (work / "summary.json").unlink()
  metrics = (work / "metrics.jsonl").read_text()
  assert trainer.train(small(work, total_steps=3, ckpt_every=2, export_hf=True)) == []
  finished = json.loads((work / "summary.json").read_text())
  assert finished["steps"] == 3 and finished["time_s"] is None
  assert finished["last"]["step"] == 3 and "reward/mean" in finished["last"]
  assert (work / "hf" / "model.safetensors").exists()
  assert (work / "metrics.jsonl").read_text() == metrics

  newest = work / "checkpoints" / "3"
  for f in newest.rglob("*"):
    if f.is_file():
      f.write_bytes(b"")  # a write cut short
  capsys.readouterr()
  again = trainer.train(small(work, total_steps=3, ckpt_every=2))
  out = capsys.readouterr().out
  assert f"checkpoint {newest} is unreadable" in out and "at step 2" in out
  assert (work / "checkpoints" / "3.corrupt").exists()
  steps = [json.loads(line)["step"] for line in (work / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3]
  for name, value in first[2].items():
    if not name.startswith("perf/"):
      np.testing.assert_allclose(
        np.asarray(again[0][name], float), np.asarray(value, float), rtol=1e-5, err_msg=name
      )


def evaluated(workdir, **changes):
  """`small` evaluating 2 held-out problems x 2 samples, one completion shown per mode."""
  return small(
    workdir, eval__problems=2, eval__samples=2, eval__completions=1, **{"eval__every": 1, **changes}
  )


def sample_rows(workdir):
  return [json.loads(line) for line in (workdir / "eval_samples.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_evaluation_runs_every_n_steps_dense_and_sparse(tmp_path):
  """eval.every = 2 over 4 steps: steps 1 and 3 (0-based) are evaluated, dense and under the
  sparse budget, logged as eval/* (completions as TensorBoard text, not in the rows), shown in
  eval_samples.jsonl and listed in summary.json. Prompt + completion (64 + 36) is not a whole
  number of pages: the budget tables cover the cache up to the end of its last page."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  work = tmp_path / "run"
  rows = trainer.train(evaluated(work, total_steps=4, eval__every=2, rollout__max_new_tokens=36))
  assert [i for i, r in enumerate(rows) if "eval/dense/pass@2" in r] == [1, 3]
  assert all(0 <= rows[i]["eval/sparse/mean@2"] <= 1 for i in (1, 3))
  assert not any(name.endswith("/samples") for r in rows for name in r)
  lines = sample_rows(work)
  assert [(r["step"], r["mode"], r["problem"]) for r in lines] == [
    (step, mode, "1234:0") for step in (2, 4) for mode in ("dense", "sparse")
  ]
  summary = json.loads((work / "summary.json").read_text())
  assert [e["step"] for e in summary["eval"]] == [2, 4]
  assert summary["eval"][1]["eval/sparse/pass@1"] == rows[3]["eval/sparse/pass@1"]
  events = EventAccumulator(str(work / "tensorboard"))
  events.Reload()
  assert any(t.startswith("eval/sparse/samples") for t in events.Tags()["tensors"])
  assert len(events.Scalars("eval/dense/mean_2")) == 2  # TensorBoard's tags have no "@"


@pytest.mark.slow
def test_evaluation_history_and_samples_survive_a_resume(tmp_path):
  """A run stopped after step 2 (its step 3 logged, not checkpointed) resumes with the history
  of steps 1 and 2, replays step 3's evaluation once and goes on: each step's completions once."""
  work = tmp_path / "run"
  trainer.train(evaluated(work, total_steps=3, ckpt_every=2))
  shutil.rmtree(work / "checkpoints" / "3")
  (work / "summary.json").unlink()
  assert [r["step"] for r in sample_rows(work)] == [1, 1, 2, 2, 3, 3]
  trainer.train(evaluated(work, total_steps=4, ckpt_every=2))
  assert [(r["step"], r["mode"]) for r in sample_rows(work)] == [
    (step, mode) for step in (1, 2, 3, 4) for mode in ("dense", "sparse")
  ]
  summary = json.loads((work / "summary.json").read_text())
  assert [e["step"] for e in summary["eval"]] == [1, 2, 3, 4]
  logged = rows_by_step(work)
  for e in summary["eval"]:
    assert e["eval/sparse/mean@2"] == logged[e["step"]]["eval/sparse/mean@2"], e["step"]


def adaptive_small(workdir, base, **changes):
  """`small` under 'adaptive:0.9999:BASE', bins moving on 16 tokens, ceiling 4 x BASE's largest:
  the tiny random model's sparse p10 (~0.99) is under tau in every measured bin (a cliff), so each
  step raises them at once, and the largest budget with them."""
  return small(
    workdir,
    rollout__schedule=f"adaptive:0.9999:{base}",
    stats__tau=0.9999,
    rollout__adaptive_min_tokens=16,
    rollout__adaptive_headroom=4.0,
    **changes,
  )


@pytest.fixture(scope="module")
def adaptive_run(tmp_path_factory):
  """A straight 3-step adaptive run -> (root dir, BASE path, rows, (train step, engine) compiled
  programs after each step)."""
  root = tmp_path_factory.mktemp("adaptive")
  base = root / "base.json"
  base.write_text(KVSchedule.table((0, 0, 0, 1), page_size=8, bin_size=16).to_json())
  make_step, compiled = ts.make_train_step, []

  def counting(*args, **kwargs):
    step = make_step(*args, **kwargs)

    def run(*step_args):
      out = step(*step_args)
      compiled.append((step._cache_size(), engine_programs()))
      return out

    run.lower = step.lower  # the trainer compiles the step before the run (its memory check)
    return run

  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(ts, "make_train_step", counting)
    rows = trainer.train(adaptive_small(root / "straight", base, total_steps=3))
  return root, base, rows, compiled


@pytest.mark.slow
def test_adaptive_budgets_move_without_recompiling(adaptive_run):
  root, _, rows, compiled = adaptive_run
  tables = [r["kv/topk_bin"] for r in rows]
  assert tables[0] == [0, 0, 0, 1, 1, 1, 1]  # BASE, its last bin repeated to stats.num_bins = 7
  assert len({max(t) for t in tables}) == 3, tables  # a larger budget each step (1 + 3 pages ..)
  assert all(t == sorted(t) and max(t) <= 4 for t in tables)  # ceiling 4 x 1
  assert rows[-1]["kv/read_fraction"] > rows[0]["kv/read_fraction"]  # the rollouts read more
  # BASE's read of the same rollouts: equal under BASE (step 1), below the raised tables after
  assert rows[0]["kv/read_fraction_start"] == rows[0]["kv/read_fraction"]
  assert all(r["kv/read_fraction_start"] < r["kv/read_fraction"] for r in rows[1:])
  assert compiled[0] == compiled[-1], compiled  # neither the train step nor the engine again
  assert [rows_by_step(root / "straight")[s]["kv/topk_bin"] for s in (1, 2, 3)] == tables


@pytest.mark.slow
def test_adaptive_resume_replays_the_budgets(adaptive_run):
  root, base, _, _ = adaptive_run
  trainer.train(adaptive_small(root / "resumed", base, total_steps=2, ckpt_every=2))
  trainer.train(adaptive_small(root / "resumed", base, total_steps=3, ckpt_every=2))
  got, want = rows_by_step(root / "resumed"), rows_by_step(root / "straight")
  assert got[3]["kv/topk_bin"] == want[3]["kv/topk_bin"] != want[2]["kv/topk_bin"]
  assert got[3]["kv/floor_bin"] == want[3]["kv/floor_bin"] != [0] * 7  # the floors too
  assert_same_metrics(got, want, (1, 2, 3), atol=1e-6)


def test_predicted_speedup_prices_the_runs_own_engine():
  """kv/predicted_speedup is the roofline's sparse / dense tokens/s for one device running this
  run's slots and pool: the 1.7B paper config's 32 slots at the paper's long tail read far more KV
  than weights (~3x), while 2 slots are bound by reading the weights (little to gain)."""
  from configs import qwen3_1p7b_polaris
  from sparrow_jax.mismatch import cost_model

  c = qwen3_1p7b_polaris.get_config()
  cfg = sj.Qwen3Config.preset("qwen3-1.7b")
  schedule = KVSchedule.paper("qwen3-1.7b", 0.86)
  prompt_lens, lengths = [1024] * 32, [37 * 1024 // 2] * 32
  speedup = lambda config: hooks.predicted_speedup(
    cfg,
    build.sparse_config(c),
    schedule,
    config,
    "h200",
    prompt_lens,
    lengths,
    c.rollout.max_new_tokens,
    c.rollout.group_size,
  )
  ours = build.engine_config(c, cfg, rows_per_device=32)
  assert (ours.num_slots, ours.num_pages) == (32, 31706)  # 60 GB of bf16 pages
  rate = lambda s: cost_model.roofline_engine_rate(
    cfg,
    s,
    1024,
    37 * 1024,
    slots=32,
    pool_tokens=31706 * 16,
    mean_len_frac=0.5,
    hardware="h200",
    sparse=sj.SparseConfig(dense_layers=2),
  )[0]
  np.testing.assert_allclose(speedup(ours), rate(schedule) / rate(None), rtol=1e-6)
  assert speedup(ours) > 2.5
  import dataclasses

  assert speedup(dataclasses.replace(ours, num_slots=2)) < 0.6 * speedup(ours)
