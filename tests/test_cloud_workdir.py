"""A workdir on an object store (any etils.epath URL): a run writes everything there and resumes
from it, and the run lock there (a lease, sparrow_jax/rl/lease.py) holds across processes. The
store is tests/fake_bucket.py: object-store semantics over a local folder, no network."""

import json
import subprocess
import sys
import threading
import time

from etils import epath
import pytest

from sparrow_jax.model.hf import load_hf
from sparrow_jax.rl import lease, trainer, workdir
from tests import fake_bucket
from tests.helpers import subprocess_env
from tests.test_trainer import small

LEASE = dict(lease_s=2.0, settle_s=0.2)


@pytest.mark.nightly
def test_run_on_an_object_store_writes_there_and_resumes(tmp_path, monkeypatch):
  """Checkpoints, metrics.jsonl, TensorBoard events, config and summary, the HF export: all in
  the bucket, the lock released; a longer run resumes from the bucket's step-2 checkpoint."""
  from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

  work = fake_bucket.bucket(tmp_path, monkeypatch) + "/run"
  trainer.train(small(work, total_steps=2, ckpt_every=1, export_hf=True))
  names = {p.name for p in epath.Path(work).iterdir()}
  assert names == {
    "checkpoints",
    "config.json",
    "hf",
    "metrics.jsonl",
    "summary.json",
    "tensorboard",
  }
  assert sorted(p.name for p in epath.Path(work, "checkpoints").iterdir()) == ["1", "2"]
  assert json.loads(epath.Path(work, "summary.json").read_text())["steps"] == 2
  load_hf(fake_bucket.local(f"{work}/hf"))
  events = EventAccumulator(fake_bucket.local(f"{work}/tensorboard"))
  events.Reload()
  assert [e.step for e in events.Scalars("reward/mean")] == [1, 2]
  assert not list(tmp_path.glob("fake*")) and not epath.Path("fake:").exists()  # nothing local

  rows = trainer.train(small(work, total_steps=3, ckpt_every=1))
  assert len(rows) == 1  # resumed at step 2
  steps = [
    json.loads(line)["step"] for line in epath.Path(work, "metrics.jsonl").read_text().splitlines()
  ]
  assert steps == [1, 2, 3]
  events = EventAccumulator(fake_bucket.local(f"{work}/tensorboard"))
  events.Reload()
  assert [e.step for e in events.Scalars("reward/mean")] == [1, 2, 3]


HOLD = (
  "import sys, time\n"
  "from tests import fake_bucket\n"
  "fake_bucket.install()\n"
  "from sparrow_jax.rl import workdir\n"
  "with workdir.workdir_lock(sys.argv[1], lease_s=2.0, settle_s=0.2):\n"
  "  print('held', flush=True)\n"
  "  time.sleep(600)\n"
)


@pytest.mark.slow
def test_lease_refuses_another_process_and_is_taken_over_once_stale(tmp_path, monkeypatch):
  """Another process's lease is refused, for longer than the lease (its heartbeat keeps it
  fresh); once that process is killed (SIGKILL: nothing released), it is taken over as stale
  after the lease, and released at the end."""
  work = fake_bucket.bucket(tmp_path, monkeypatch) + "/run"
  epath.Path(work).mkdir(parents=True)
  holder = subprocess.Popen(
    [sys.executable, "-c", HOLD, work], env=subprocess_env(), stdout=subprocess.PIPE, text=True
  )
  try:
    assert holder.stdout.readline().strip() == "held"
    time.sleep(3.0)  # past one lease: only the heartbeat keeps it
    with pytest.raises(ValueError, match=r"is in use by another run \(pid \d+ on .*heartbeat"):
      with workdir.workdir_lock(work, **LEASE):
        pass
  finally:
    holder.kill()
    holder.wait()
  time.sleep(2.5)
  lock = epath.Path(work, workdir.LOCK_FILE)
  with workdir.workdir_lock(work, **LEASE) as held:
    assert json.loads(lock.read_text())["owner"] == held.owner
  assert not lock.exists()


def test_of_two_runs_starting_together_one_holds_the_lease(tmp_path, monkeypatch):
  """Both read no lock and write theirs: the later write wins, the other is refused. Each run's
  first write waits until both have read, so both see no lock (the race the read-back settles)."""
  work = fake_bucket.bucket(tmp_path, monkeypatch) + "/run"
  epath.Path(work).mkdir(parents=True)
  outcomes, started, both_read = [], threading.Barrier(2), threading.Barrier(2)
  starters_to_write, count, write = [2], threading.Lock(), lease._write

  def write_after_both_read(path, owner):
    with count:  # the first two writes are the starters' (heartbeats begin after their settle)
      starter = starters_to_write[0] > 0
      starters_to_write[0] -= 1
    if starter:
      both_read.wait(timeout=30)
    write(path, owner)

  monkeypatch.setattr(lease, "_write", write_after_both_read)

  def start():
    started.wait()
    try:
      with workdir.workdir_lock(work, **LEASE):
        outcomes.append("held")
        time.sleep(1.0)
    except ValueError:
      outcomes.append("refused")

  threads = [threading.Thread(target=start) for _ in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert sorted(outcomes) == ["held", "refused"]
