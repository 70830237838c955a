"""Rollouts that overlap training (docs/async_rl.md): one-step-off rollouts (rl.off_policy_steps)
and rollout devices of their own (mesh.rollout_devices), against the on-policy colocated loop."""

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from sparrow_jax.rl import trainer
from tests.helpers import (
  ROOT,
  assert_dashboard_has_data,
  assert_same_metrics,
  launch_small,
  rows_by_step,
  subprocess_env,
)
from tests.test_trainer import small

# Dense rollouts and no warmup: an on-policy step's TIS weights are 1 up to float32 rounding, and
# the first update moves the weights (the tiny model earns no reward on this task: the entropy
# bonus moves them), so a rollout one step behind has TIS weights that are not.
DENSE = dict(
  rollout__sparse=False,
  distill__enabled=False,
  rl__warmup_steps=0,
  rl__learning_rate=1e-3,
  rl__entropy_coef=0.01,
)


def _tis_spread(row) -> float:
  return max(abs(row["tis/weight_mean"] - 1), 1 - row["tis/weight_min"])


@pytest.mark.slow
def test_one_step_off_trains_on_the_previous_steps_weights(tmp_path):
  """Step t's rollouts were sampled with step t - 1's weights (the version tag), so its TIS
  weights move off 1 once an update has happened, and its staleness alpha says by how much; step
  0, which has no previous step, samples its own, and equals the on-policy run's step 0."""
  on_config = small(tmp_path / "on", total_steps=3, **DENSE)
  off_config = small(tmp_path / "off", total_steps=3, rl__off_policy_steps=1, **DENSE)
  on, off = trainer.train(on_config), trainer.train(off_config)
  assert_dashboard_has_data(on_config, on)
  assert_dashboard_has_data(off_config, off)  # its staleness chart too
  assert [r["rollout/weights_step"] for r in on] == [0, 1, 2]
  assert [r["rollout/weights_step"] for r in off] == [0, 0, 1]
  assert all(_tis_spread(r) < 1e-3 for r in on)
  assert all(_tis_spread(r) > 1e-2 for r in off[1:])
  # Staleness apart: exact alpha of the weights that sampled against the current ones, 1 where
  # they are the same (step 0), under 1 once the rows are a step old; the on-policy run has none.
  assert not any(k.startswith("acceptance_stale/") for k in on[0])
  assert off[0]["acceptance_stale/mean"] == pytest.approx(1.0, abs=1e-5)
  assert all(0.5 < r["acceptance_stale/mean"] < 1 - 1e-4 for r in off[1:])
  # With dense rollouts the stale dense policy is the sampler itself, so the sampled estimator of
  # the same mean agrees: the staleness alpha compares the weights that really sampled the rows.
  for r in off:
    assert abs(r["acceptance_stale/mean"] - r["acceptance_sampled/mean"]) < 0.01
  same = lambda row: {
    k: v for k, v in row.items() if not k.startswith(("perf/", "acceptance_stale/"))
  }
  assert_same_metrics({0: same(off[0])}, {0: same(on[0])}, (0,), atol=0)


@pytest.mark.slow
def test_partial_rollouts_train_whole_groups_and_carry_the_rest_over(tmp_path):
  """rollout.partial_groups = 2 with 8 slots for 24 rows under way: each step trains on the first
  4 groups to end; rows cut at a step's end go on in the next step's rollout under the new weights
  (rows_carried, tokens a step old: token_lag), and TIS divides by the log-probs of the weights
  that sampled each token, so with dense rollouts a step's TIS weights move off 1 exactly when it
  trains on tokens of earlier weights."""
  changes = dict(rollout__partial_groups=2, rollout__engine_slots=8, **DENSE)
  c = small(tmp_path / "run", total_steps=4, **changes)
  rows = trainer.train(c)
  assert_dashboard_has_data(c, rows)  # the carried rows' charts too
  assert rows[0]["rollout/token_lag/max"] == 0 and rows[0]["rollout/rows_carried"] == 0
  assert any(r["rollout/rows_carried"] > 0 for r in rows[1:])
  for r in rows:
    assert (_tis_spread(r) > 1e-2) == (r["rollout/token_lag/max"] > 0), r
    assert np.isfinite(r["loss/policy"])


def test_off_policy_steps_beyond_one_are_refused(tmp_path):
  from sparrow_jax.rl import run_config

  with pytest.raises(ValueError, match=r"^config\.rl\.off_policy_steps = 2 is invalid: must be 0"):
    run_config.validate(small(tmp_path / "run", rl__off_policy_steps=2))


SPLIT = """
from sparrow_jax.rl import build
from tests.test_trainer import small
c = small("{workdir}", mesh__rollout_devices=3)
try:
  build.rollout_mesh(c, build.make_mesh(c))
except ValueError as e:
  print("ERROR", e)
"""


@pytest.mark.slow
def test_rollout_devices_that_do_not_split_the_rows_name_the_field(tmp_path):
  """3 rollout devices of 4 cannot hold the step's 16 rows as whole groups: the error names
  mesh.rollout_devices before the rows are split over them (where a sharding error would say
  nothing of the config)."""
  code = SPLIT.format(workdir=tmp_path / "run")
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(4), cwd=ROOT
  )
  assert "ERROR config.mesh.rollout_devices = 3 is invalid: the 16 rows" in out.stdout, out


# In a subprocess with 8 fake CPU devices: a run whose rollouts have 4 devices of their own, its
# weights synced there device to device and equal to the trainer's bit for bit.
SYNC = """
import jax, numpy as np
from sparrow_jax.rl import build
from tests.test_trainer import small
c = small("{workdir}", mesh__rollout_devices=4)
mesh = build.make_mesh(c)
with jax.set_mesh(mesh):
  run = build.build(c, mesh)
  params, lora = run.source.sampler.sync(run.state)
train = set(jax.tree.leaves(run.state.params)[0].sharding.device_set)
rollout = set(jax.tree.leaves(params)[0].sharding.device_set)
equal = lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b)))
same = all(jax.tree.leaves(jax.tree.map(equal, (run.state.params, run.state.lora), (params, lora))))
print("RESULT", len(train), len(rollout), len(train & rollout), same, run.engine_cfg.num_slots)
"""


@pytest.mark.nightly
def test_rollout_devices_get_the_trainers_weights_bit_for_bit(tmp_path):
  proc = subprocess.run(
    [sys.executable, "-c", SYNC.format(workdir=tmp_path / "run")],
    cwd=ROOT,
    env=subprocess_env(8),
    capture_output=True,
    text=True,
    timeout=600,
  )
  result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT")]
  assert proc.returncode == 0 and result, proc.stderr[-3000:]
  train, rollout, shared, equal, slots = result[0].split()[1:]
  # 16 rows over 4 rollout devices: a group of 4 each
  assert (train, rollout, shared, equal, slots) == ("4", "4", "0", "True", "4")


def _run(workdir, devices, *overrides):
  proc = launch_small(workdir, *overrides, devices=devices)
  out = proc.communicate(timeout=900)[0]
  assert proc.returncode == 0, out[-3000:]
  return rows_by_step(workdir)


@pytest.mark.nightly
def test_split_meshes_equal_the_colocated_run_and_train_one_step_off(tmp_path):
  """8 fake devices, 4 rolling out and 4 training, give the metrics of the same run on 4
  devices that do both (on-policy: the same rows on the same kind of mesh), and the same split
  trains one step off."""
  colocated = _run(tmp_path / "colocated", 4)
  split = _run(tmp_path / "split", 8, "--config.mesh.rollout_devices=4")
  assert split == colocated
  off = _run(
    tmp_path / "off", 8, "--config.mesh.rollout_devices=4", "--config.rl.off_policy_steps=1"
  )
  assert [off[s]["rollout/weights_step"] for s in sorted(off)] == [0, 0, 1, 2]
  assert all(np.isfinite(off[s]["loss/policy"]) for s in off)


CARRIED = dict(rollout__partial_groups=2, rollout__engine_slots=8, **DENSE)


@pytest.mark.nightly
def test_split_meshes_extend_a_run_with_carried_rows_as_if_never_stopped(tmp_path):
  """Rollout devices of their own keep the carried rows' pool on their mesh: a checkpoint
  written and read there (its checksums summed on each array's own mesh, not the trainer's)
  extends a finished 2-step run to the 4-step run's steps 3 and 4."""
  flags = [
    "--config.mesh.rollout_devices=4",
    "--config.rollout.partial_groups=4",  # a group more a rollout device
    *(f"--config.{k.replace('__', '.')}={v}" for k, v in DENSE.items()),
  ]
  whole = _run(tmp_path / "whole", 8, *flags)
  _run(tmp_path / "cut", 8, *flags, "--config.total_steps=2")
  assert (tmp_path / "cut" / "checkpoints" / "2" / "rollouts").is_dir()
  extended = _run(tmp_path / "cut", 8, *flags)
  assert_same_metrics(extended, whole, (3, 4), atol=0)
  assert any(whole[s]["rollout/rows_carried"] for s in (3, 4))


@pytest.mark.slow
def test_a_finished_run_with_carried_rows_is_extended_as_if_never_stopped(tmp_path):
  """A run of 2 steps, then the same workdir with total_steps 4: its last checkpoint keeps the
  carried rows and their pool (inside the checkpoint, as arrays and JSON), so steps 3 and 4 are
  the 4-step run's, token lags and carried rows included."""
  whole = trainer.train(small(tmp_path / "whole", total_steps=4, ckpt_every=2, **CARRIED))
  trainer.train(small(tmp_path / "cut", total_steps=2, ckpt_every=2, **CARRIED))
  assert (tmp_path / "cut" / "checkpoints" / "2" / "rollouts").is_dir()
  assert not (tmp_path / "cut" / "in_flight").exists()  # nothing beside the checkpoint
  extended = trainer.train(small(tmp_path / "cut", total_steps=4, ckpt_every=2, **CARRIED))
  same = lambda rows: {
    i: {k: v for k, v in r.items() if not k.startswith("perf/")} for i, r in enumerate(rows)
  }
  assert_same_metrics(same(extended), same(whole[2:]), (0, 1), atol=0)
  assert any(r["rollout/rows_carried"] for r in extended)


@pytest.mark.slow
def test_a_finished_one_step_off_run_is_extended_and_says_its_next_step_samples_afresh(
  tmp_path, capsys
):
  """The last checkpoint of a one-step-off run keeps no rows sampled ahead (no later step was to
  run): raising total_steps goes on, the first new step samples its own rows and says so, and the
  steps after it are one step off again."""
  trainer.train(small(tmp_path / "run", total_steps=2, **DENSE, rl__off_policy_steps=1))
  capsys.readouterr()
  rows = trainer.train(small(tmp_path / "run", total_steps=4, **DENSE, rl__off_policy_steps=1))
  assert "checkpoint 2 holds no rows sampled ahead" in capsys.readouterr().out
  assert [r["rollout/weights_step"] for r in rows] == [2, 2]


@pytest.mark.slow
def test_a_damaged_or_edited_saved_rollout_is_refused(tmp_path, capsys):
  """The rows a checkpoint keeps under way are checked like its train state: an edited JSON part
  (a grade, a queued group) fails the meta's checksum and stops the resume in one line; a token
  changed in the saved arrays (written back as well-formed orbax data) fails their checksums, and
  damaged bytes fail to read: either moves the checkpoint aside, and the run resumes from the one
  before."""
  import json
  import shutil

  import jax
  import orbax.checkpoint as ocp

  from sparrow_jax import checkpoint

  run = lambda: trainer.train(small(tmp_path / "run", total_steps=3, ckpt_every=1, **CARRIED))
  trainer.train(small(tmp_path / "run", total_steps=2, ckpt_every=1, **CARRIED))
  ckpt = tmp_path / "run" / "checkpoints"
  backup = tmp_path / "backup"
  shutil.copytree(ckpt, backup)

  def put_back():  # checkpoints 1 and 2 as the run left them
    shutil.rmtree(ckpt)
    shutil.copytree(backup, ckpt)

  def resumes_from_checkpoint_1(why):
    capsys.readouterr()
    rows = run()
    out = capsys.readouterr().out
    assert f"checkpoint {ckpt}/2 is unreadable ({why}" in out and "resumed from" in out, out
    assert (ckpt / "2.corrupt").exists() and len(rows) == 2  # steps 2 and 3
    put_back()

  meta = ckpt / "2" / "meta" / "metadata"
  saved = json.loads(meta.read_text())
  saved["rollouts"]["processes"][0]["carried"]["queued"][0][1] += 1  # a prompt length
  meta.write_text(json.dumps(saved))
  with pytest.raises(ValueError, match="its meta fails its checksum") as e:
    run()
  assert "\n" not in str(e.value)
  put_back()

  mgr = checkpoint.manager(str(tmp_path / "run"), 2)
  tree = mgr.item_metadata(2)["rollouts"].tree
  like = ocp.args.StandardRestore(jax.tree.map(ocp.utils.to_shape_dtype_struct, tree))
  arrays = mgr.restore(2, args=ocp.args.Composite(rollouts=like))["rollouts"]
  tokens = arrays["host"]["carried"]["tokens"]
  arrays["host"]["carried"]["tokens"] = tokens.at[0, 0].add(1)  # a token never sampled
  edit = checkpoint.manager(str(tmp_path / "edit"), 1)
  edit.save(2, args=ocp.args.Composite(rollouts=ocp.args.StandardSave(arrays)))
  edit.wait_until_finished()
  shutil.rmtree(ckpt / "2" / "rollouts")
  shutil.copytree(tmp_path / "edit" / "checkpoints" / "2" / "rollouts", ckpt / "2" / "rollouts")
  resumes_from_checkpoint_1("checksum mismatch in 1 array(s), first ['host']['carried']['tokens']")

  for path in [p for p in (ckpt / "2" / "rollouts").rglob("*") if p.parent.name == "d"]:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # array data cut to half
  resumes_from_checkpoint_1("")


def _wait_for_logged_step(proc, workdir, step):
  metrics, deadline = workdir / "metrics.jsonl", time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    if metrics.exists() and f'"step": {step}' in metrics.read_text():
      return
    time.sleep(0.2)


@pytest.mark.nightly
@pytest.mark.parametrize(
  "under_way",
  [
    ("--config.rl.off_policy_steps=1",),
    ("--config.rollout.partial_groups=2", "--config.rollout.engine_slots=8"),
  ],
  ids=["one_step_off", "partial"],
)
def test_a_run_killed_mid_run_resumes_on_the_rollouts_it_had_under_way(tmp_path, under_way):
  """SIGKILL after step 3 is logged (the step-2 checkpoint exists, with what was under way: one
  step off, the rollouts of step 3 sampled with step 2's weights; partial rollouts, the rows cut
  at step 2's end, in the engine's pool): the resumed run logs the uninterrupted run's metrics at
  every step, version tags and token lags included: nothing lost, nothing trained twice."""
  whole = _run(tmp_path / "whole", 1, *under_way)
  workdir = tmp_path / "killed"
  proc = launch_small(workdir, *under_way)
  _wait_for_logged_step(proc, workdir, 3)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert (workdir / "checkpoints" / "2" / "rollouts").is_dir()
  resumed = _run(workdir, 1, *under_way)
  assert sorted(resumed) == [1, 2, 3, 4]
  assert_same_metrics(resumed, whole, (1, 2, 3, 4), atol=0)
  weights_step = [0, 0, 1, 2] if "off_policy" in under_way[0] else [0, 1, 2, 3]
  assert [resumed[s]["rollout/weights_step"] for s in (1, 2, 3, 4)] == weights_step
  if "partial" in under_way[0]:
    assert any(resumed[s]["rollout/rows_carried"] for s in (3, 4))


def _source(partial_groups=2, off_policy_steps=0, pool_shape=(1, 2, 64, 8, 16)):
  """A rollout source whose sampler carries rows in a pool of `pool_shape` (no engine: what the
  resume checks read)."""
  import jax

  from sparrow_jax.rl import rollouts

  class Carried:
    def abstract_pool(self, params):
      return [jax.ShapeDtypeStruct(pool_shape, np.float32)]

  class Sampler:
    carried = Carried() if partial_groups else None

  overlap = rollouts.AsyncConfig(off_policy_steps, partial_groups)
  settings = rollouts.Settings(4, 4, 64, 40, overlap, 8, 0, 16, 20)
  return rollouts.Source(settings, None, None, Sampler(), None, None)


def test_resuming_carried_rows_elsewhere_is_refused_naming_the_checkpoint():
  """Carried rows saved in a pool this run's devices cannot hold (another device count), saved by
  another process count, saved where this config carries none, or missing from a checkpoint of a
  run that carries rows (written before rows were saved inside checkpoints): one line each,
  naming the checkpoint, before anything is restored."""
  saved = {"host/carried/tokens": ((1, 10), "int32"), "pool/0": ((2, 2, 64, 8, 16), "float32")}
  with pytest.raises(ValueError, match=r"^checkpoint 4 holds carried rows in a KV pool of shape"):
    _source().abstract_saved(None, saved, 4)
  with pytest.raises(ValueError, match=r"^checkpoint 4 holds carried rows, but this config has"):
    _source(partial_groups=0, off_policy_steps=1).abstract_saved(None, saved, 4)
  mine = {"host/carried/tokens": ((1, 10), "int32"), "pool/0": ((1, 2, 64, 8, 16), "float32")}
  assert set(_source().abstract_saved(None, mine, 4)) == {"host", "pool"}
  with pytest.raises(ValueError, match=r"^checkpoint 4 holds rows under way of 2 processes"):
    _source().restore(({"processes": [{}, {}]}, {}), 4, None)
  with pytest.raises(ValueError, match=r"^checkpoint 4 keeps no carried rows"):
    _source().restore(None, 4, None)


# The SMALL run with carried rows in a subprocess that SIGKILLs itself as orbax starts writing the
# second item of checkpoint 4: one item of it is on disk (in orbax's temporary directory), the
# train state or the rows under way, the other not.
KILL_BETWEEN_ITEMS = """
import os, signal, sys
from absl import app
import orbax.checkpoint as ocp
from sparrow_jax import train

save, started = ocp.StandardCheckpointHandler.async_save, []

async def save_or_die(self, directory, *args, **kwargs):
  if "/4.orbax-checkpoint-tmp" in str(directory):
    started.append(str(directory))
    if len(started) == 2:
      os.kill(os.getpid(), signal.SIGKILL)
  return await save(self, directory, *args, **kwargs)

ocp.StandardCheckpointHandler.async_save = save_or_die
sys.argv = ["train", *{argv!r}]
app.run(train.main, flags_parser=train._parse_flags)
"""


@pytest.mark.nightly
def test_a_kill_between_a_checkpoints_items_resumes_as_the_uninterrupted_run(tmp_path):
  """Killed between writing checkpoint 4's train state and its rows under way (either order),
  the checkpoint is not committed: the resume takes checkpoint 2, its state and its carried rows
  together, and logs the uninterrupted run's metrics at every step."""
  from tests.helpers import SMALL

  under_way = ("--config.rollout.partial_groups=2", "--config.rollout.engine_slots=8")
  changes = ("--config.total_steps=6", *under_way)
  whole = _run(tmp_path / "whole", 1, *changes)
  workdir = tmp_path / "killed"
  argv = ["--config=configs/default.py", f"--config.workdir={workdir}", *SMALL, *changes]
  code = KILL_BETWEEN_ITEMS.format(argv=argv)
  killed = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), cwd=ROOT
  )
  assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-2000:]
  steps = sorted(p.name for p in (workdir / "checkpoints").iterdir())
  assert "2" in steps and "4" not in steps, steps  # 4 was never committed
  resumed = _run(workdir, 1, *changes)
  assert_same_metrics(resumed, whole, range(1, 7), atol=0)
