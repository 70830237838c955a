"""The trainer CLI on many processes gives the single-device run's metrics: 2 processes x 2 devices
(CPU collectives, a local coordinator), killed with SIGKILL mid-run, that resume from their sharded
checkpoint and replay exactly the steps an uninterrupted run takes. (The sampler and train step on
a 2 x 2 x 2 mesh against one device: tests/test_sharding.py.)"""

import signal
import time

import pytest

from tests.helpers import (
  PER_DEVICE_METRICS,
  assert_same_metrics,
  free_port,
  launch_small,
  rows_by_step,
)

# Summation order differs across shards: float32 rounding, nothing more (no sampled token changes).
ATOL = 1e-5


def _two_processes(workdir, *overrides):
  port = free_port()
  return [
    launch_small(
      workdir,
      *overrides,
      "--config.distributed.enabled=True",
      f"--config.distributed.coordinator=localhost:{port}",
      "--config.distributed.num_processes=2",
      f"--config.distributed.process_id={i}",
      "--config.mesh.data=2",
      "--config.mesh.tensor=2",
      devices=2,
    )
    for i in range(2)
  ]


@pytest.mark.nightly
def test_two_processes_match_one_device_and_resume_after_sigkill(small_run, tmp_path):
  workdir = tmp_path / "two"
  procs = _two_processes(workdir)
  metrics = workdir / "metrics.jsonl"
  deadline = time.time() + 600
  while time.time() < deadline:  # step 3 logged: the step-2 checkpoint exists (ckpt_every=2)
    if metrics.exists() and '"step": 3' in metrics.read_text():
      break
    if any(p.poll() is not None for p in procs):  # one died early: fail now, not at the deadline
      break
    time.sleep(0.2)
  for p in procs:
    p.send_signal(signal.SIGKILL)
    p.wait()
  procs = _two_processes(workdir)
  lead, other = [p.communicate(timeout=600)[0] for p in procs]
  for p, out in zip(procs, (lead, other)):
    assert p.returncode == 0, out[-3000:]
  assert "resumed from" in lead and "at step 2" in lead and "step 4/4" in lead
  assert "step 4/4" not in other  # process 0 logs; the others stay quiet
  got = rows_by_step(workdir)
  assert sorted(got) == [1, 2, 3, 4]  # step 3, logged before the kill, replaced by its replay
  assert_same_metrics(got, rows_by_step(small_run), (1, 2, 3, 4), ATOL, skip=PER_DEVICE_METRICS)


@pytest.mark.nightly
def test_two_processes_one_step_off_match_one_device_and_partial_rollouts_run(tmp_path):
  """One step off on 2 processes x 2 devices (each process's next rollouts in order, before the
  update) gives the single-device one-step-off run's metrics; partial rollouts on 2 processes
  (each takes its share of a step's groups, agreeing when to stop) train every step and carry rows
  over."""
  off = "--config.rl.off_policy_steps=1"
  single = launch_small(tmp_path / "single", off)
  out = single.communicate(timeout=900)[0]
  assert single.returncode == 0, out[-3000:]
  runs = {}
  for name, overrides in (
    ("off", (off,)),
    ("partial", ("--config.rollout.partial_groups=2", "--config.rollout.engine_slots=4")),
  ):
    procs = _two_processes(tmp_path / name, *overrides)
    for p in procs:
      out = p.communicate(timeout=900)[0]
      assert p.returncode == 0, out[-3000:]
    runs[name] = rows_by_step(tmp_path / name)
  want = rows_by_step(tmp_path / "single")
  assert_same_metrics(runs["off"], want, (1, 2, 3, 4), ATOL, skip=PER_DEVICE_METRICS)
  partial = runs["partial"]
  assert sorted(partial) == [1, 2, 3, 4]
  assert any(partial[s]["rollout/rows_carried"] for s in (2, 3, 4))
