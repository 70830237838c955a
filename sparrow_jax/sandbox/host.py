"""What a sandbox run holds on the host, made and removed: its uid, its directory (with the record
of the grader that made it) and its cgroup; and what a killed grader left of them, which the next
grader to start removes (remove_leftovers)."""

import functools
import json
import os
import random
import shutil
import signal
import tempfile
import threading
import time

UID_RANGE = (1 << 30, 1 << 20)  # start, size: ids far above any real account
NOBODY = 65534
PREFIX = "sparrow_sandbox_"
OWNER = "owner.json"  # in each sandbox directory: the grader that made it (see remove_leftovers)


class SandboxSetupError(OSError):
  """The sandbox could not be built as asked (namespaces refused, file system setup failed): nothing
  ran."""


def sandbox_uid():
  """A fresh uid per run when we are root and the id range is mapped here; else None (keep ours)."""
  if os.geteuid() != 0:
    return None
  start, size = UID_RANGE
  with open("/proc/self/uid_map") as f:
    ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
  if any(inner <= start and start + size <= inner + count for inner, _, count in ranges):
    return start + random.SystemRandom().randrange(size)
  return NOBODY


def kill_uid(uid):
  """SIGKILLs every process of `uid` (fallback cleanup when no pid namespace held them)."""
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        if os.stat(f"/proc/{entry}").st_uid == uid:
          os.kill(int(entry), signal.SIGKILL)
      except OSError:  # exited meanwhile
        pass


def remove_files_of(uid):
  """Fallback cleanup: what `uid` left in the shared temp directories (a fresh uid per run owns
  nothing else there)."""
  for directory in ("/tmp", "/var/tmp", "/dev/shm"):
    try:
      entries = list(os.scandir(directory))
    except OSError:  # no such directory here
      continue
    for entry in entries:
      try:
        if entry.stat(follow_symlinks=False).st_uid != uid:
          continue
        if entry.is_dir(follow_symlinks=False):
          shutil.rmtree(entry.path, ignore_errors=True)
        else:
          os.unlink(entry.path)
      except OSError:  # removed meanwhile
        pass


def _start_time(pid):
  """The start time of process `pid` (clock ticks since boot), or None if there is none: with the
  pid it names one process, even after the pid is reused."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      return int(f.read().rsplit(b")", 1)[1].split()[19])
  except (OSError, ValueError, IndexError):
    return None


def remove_leftovers(directory):
  """Removes the sandbox directories under `directory` whose grader is dead (killed before it could
  clean up), with what their processes left: the processes of their uid (the fallback without a pid
  namespace). Directories of a live grader, and any without an owner record, stay."""
  try:
    entries = [e for e in os.scandir(directory) if e.name.startswith(PREFIX) and e.is_dir()]
  except OSError:  # no such directory
    return
  for entry in entries:
    try:
      with open(os.path.join(entry.path, OWNER)) as f:
        owner = json.load(f)
      if _start_time(owner["pid"]) == owner["start"]:
        continue
    except (OSError, ValueError, KeyError, TypeError):  # none (yet), or not ours
      continue
    uid = owner.get("uid")
    if isinstance(uid, int) and UID_RANGE[0] <= uid < sum(UID_RANGE):
      kill_uid(uid)
    if isinstance(owner.get("cgroup"), str) and os.path.basename(owner["cgroup"]) == entry.name:
      remove_cgroup(owner["cgroup"])
    shutil.rmtree(entry.path, ignore_errors=True)


_cleaned, _cleaned_lock = set(), threading.Lock()


def _remove_leftovers_once(directory):
  with _cleaned_lock:
    if directory in _cleaned:
      return
    _cleaned.add(directory)
  remove_leftovers(directory)


def _own_cgroup():
  """Our cgroup v2 directory (from /proc/self/cgroup and where cgroup2 is mounted), or None."""
  try:
    with open("/proc/self/cgroup") as f:
      path = next(line[3:].strip() for line in f if line.startswith("0::"))
    with open("/proc/self/mountinfo") as f:
      mount = next(m.split()[4] for m in f if m.split(" - ")[1].split()[0] == "cgroup2")
  except (OSError, StopIteration, IndexError):
    return None
  return os.path.join(mount, path.lstrip("/"))


@functools.lru_cache
def _cgroup_root(setting):
  """Where sandbox cgroups are made for SandboxLimits.cpu_cgroup `setting`, or None: the CPU-budget
  path. A cgroup v2 directory qualifies when the cpu controller is enabled for its children and we
  may create them; raises SandboxSetupError for a named one that does not."""
  if setting == "none":
    return None
  directory = _own_cgroup() if setting == "auto" else setting
  try:
    with open(os.path.join(directory, "cgroup.subtree_control")) as f:
      usable = "cpu" in f.read().split() and os.access(directory, os.W_OK)
  except (OSError, TypeError):
    usable = False
  if not usable and setting != "auto":
    raise SandboxSetupError(
      f"SandboxLimits.cpu_cgroup={setting!r} is not a cgroup v2 directory that we may write with "
      "the cpu controller enabled for its children (cgroup.subtree_control)"
    )
  return directory if usable else None


def remove_cgroup(path):
  """Kills whatever is left in a sandbox's cgroup and removes it (rmdir waits for the last exit)."""
  try:
    with open(os.path.join(path, "cgroup.kill"), "w") as f:
      f.write("1")
  except OSError:  # gone, or a kernel before 5.14: the pid namespace ended them
    pass
  for _ in range(200):
    try:
      os.rmdir(path)
      return
    except FileNotFoundError:
      return
    except OSError:  # its last processes are still exiting
      time.sleep(0.01)


def make_run_dirs(work_root, uid, limits):
  """(the run's directory, its cgroup or None), with the record that lets a later start remove
  both if we are killed."""
  directory = work_root or tempfile.gettempdir()
  _remove_leftovers_once(directory)
  root = _cgroup_root(limits.cpu_cgroup)
  base = tempfile.mkdtemp(prefix=PREFIX, dir=directory)
  cgroup = None if root is None else os.path.join(root, os.path.basename(base))
  with open(os.path.join(base, OWNER), "w") as f:
    owner = {"pid": os.getpid(), "start": _start_time(os.getpid()), "uid": uid, "cgroup": cgroup}
    json.dump(owner, f)
  if cgroup is not None:
    try:
      os.mkdir(cgroup)
      with open(os.path.join(cgroup, "cpu.max"), "w") as f:
        f.write(f"{max(int(limits.cpus * 100_000), 1000)} 100000")
    except OSError as e:
      shutil.rmtree(base, ignore_errors=True)
      raise SandboxSetupError(f"cannot make the sandbox's cgroup {cgroup}: {e}") from None
  return base, cgroup
