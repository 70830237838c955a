"""One run per workdir where there is no flock: an object store (gs://, s3://, any etils.epath URL).

The lock file holds its owner's id and the time of its last heartbeat, which a thread rewrites
every `lease_s / 10`. A lock whose heartbeat is older than `lease_s` belongs to a run that died
without releasing it (SIGKILL, a lost host) and is taken over. An object store offers no
create-if-absent through epath, so taking the lock is write-then-verify: write our record, wait
`settle_s`, read it back; of two runs that start together the later write wins, the other reads it
and is refused. A holder that finds another owner in the file at a heartbeat (it stalled past
`lease_s` and was taken over) stops at its next step (`check`).

What it guarantees: a second run is refused while the holder's heartbeat is fresh, and a dead
holder's workdir is free `lease_s` after its last heartbeat. It relies on read-after-write
consistency (GCS and S3 have it), on hosts' clocks agreeing to well under `lease_s`, and on two
starters' read-to-write gaps staying under `settle_s`; it is not a consensus protocol.
"""

import json
import os
import socket
import threading
import time
import uuid

from etils import epath

LEASE_S = 300.0  # a heartbeat every 30 s; a killed run's workdir is free 5 minutes after
SETTLE_S = 2.0


def _read(path: epath.Path) -> dict | None:
  """The lock file's record; None when there is none (or a write of it was torn)."""
  try:
    return json.loads(path.read_text())
  except (FileNotFoundError, ValueError):
    return None


def _write(path: epath.Path, owner: str) -> None:
  path.write_text(json.dumps({"owner": owner, "time": time.time()}))


def holder(record: dict, lease_s: float) -> str | None:
  """Who holds the lock by `record`, in words; None when its heartbeat is stale."""
  age = time.time() - record["time"]
  if age >= lease_s:
    return None
  return f"{record['owner']}, heartbeat {age:.0f}s ago, stale after {lease_s:.0f}s"


class Lease:
  """The lock on `path` while the `with` block lasts (a ValueError from `refused(holder)` when
  another run holds it)."""

  def __init__(self, path: str, refused, lease_s: float = LEASE_S, settle_s: float = SETTLE_S):
    self.path, self.refused = epath.Path(path), refused
    self.lease_s, self.settle_s = lease_s, settle_s
    self.owner = f"pid {os.getpid()} on {socket.gethostname()} ({uuid.uuid4().hex[:8]})"
    self.lost, self.stop = None, threading.Event()

  def __enter__(self):
    record = _read(self.path)
    held = record and holder(record, self.lease_s)
    if held:
      raise self.refused(held)
    _write(self.path, self.owner)
    time.sleep(self.settle_s)
    record = _read(self.path)
    if not record or record["owner"] != self.owner:  # another run wrote after us: it holds it
      raise self.refused(record["owner"] if record else "another process")
    self.thread = threading.Thread(target=self._heartbeat, daemon=True)
    self.thread.start()
    return self

  def _heartbeat(self) -> None:
    while not self.stop.wait(self.lease_s / 10):
      record = _read(self.path)
      if not record or record["owner"] != self.owner:
        self.lost = record["owner"] if record else "nobody (the lock file is gone)"
        return
      _write(self.path, self.owner)

  def check(self) -> None:
    """Raises when the lease was taken over (this run stalled past `lease_s`)."""
    if self.lost:
      raise RuntimeError(
        f"{self.path} is now held by {self.lost}: this run stalled past its {self.lease_s:.0f}s "
        "lease and another run took the workdir; stopping so the two do not write it together"
      )

  def __exit__(self, *exc):
    self.stop.set()
    self.thread.join()
    record = _read(self.path)
    if record and record["owner"] == self.owner:
      self.path.unlink(missing_ok=True)
