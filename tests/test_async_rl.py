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
  rows = trainer.train(small(tmp_path / "run", total_steps=4, **changes))
  assert rows[0]["rollout/token_lag/max"] == 0 and rows[0]["rollout/rows_carried"] == 0
  assert any(r["rollout/rows_carried"] > 0 for r in rows[1:])
  for r in rows:
    assert (_tis_spread(r) > 1e-2) == (r["rollout/token_lag/max"] > 0), r
    assert np.isfinite(r["loss/policy"])


def test_off_policy_steps_beyond_one_are_refused(tmp_path):
  from sparrow_jax.rl import run_config

  with pytest.raises(ValueError, match=r"^config\.rl\.off_policy_steps = 2 is invalid: must be 0"):
    run_config.validate(small(tmp_path / "run", rl__off_policy_steps=2))


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
  params, lora = run.sampler.sync(run.state)
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


def test_in_flight_rollouts_are_kept_per_step_and_process_until_no_checkpoint_needs_them(tmp_path):
  from sparrow_jax.rl import workdir

  sampled = lambda step: trainer.Sampled(step, step - 1, None, *([None] * 6), 0.0, 0)
  for step in (2, 4, 6):
    workdir.save_in_flight(str(tmp_path), step, sampled(step), kept_steps=[2, 4])
  assert sorted(p.name for p in (tmp_path / "in_flight").iterdir()) == [
    "2.process0.pkl",
    "4.process0.pkl",
    "6.process0.pkl",
  ]
  workdir.save_in_flight(str(tmp_path), 8, sampled(8), kept_steps=[6])
  assert workdir.load_in_flight(str(tmp_path), 6) == sampled(6)
  assert workdir.load_in_flight(str(tmp_path), 4) is None  # no checkpoint of step 4 is kept
  (tmp_path / "in_flight" / ".8.process0.pkl.123.tmp").write_bytes(b"torn")
  workdir.remove_stale_tmp(str(tmp_path))
  assert sorted(p.name for p in (tmp_path / "in_flight").iterdir()) == [
    "6.process0.pkl",
    "8.process0.pkl",
  ]


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
  assert (workdir / "in_flight" / "2.process0.pkl").exists()
  resumed = _run(workdir, 1, *under_way)
  assert sorted(resumed) == [1, 2, 3, 4]
  assert_same_metrics(resumed, whole, (1, 2, 3, 4), atol=0)
  weights_step = [0, 0, 1, 2] if "off_policy" in under_way[0] else [0, 1, 2, 3]
  assert [resumed[s]["rollout/weights_step"] for s in (1, 2, 3, 4)] == weights_step
  if "partial" in under_way[0]:
    assert any(resumed[s]["rollout/rows_carried"] for s in (3, 4))
