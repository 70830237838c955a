"""When a case's time is up: its own time (wall time less its waits for a CPU), the CPU time of the
sandbox's whole process tree, and a wall clock however starved."""

import os
import resource
import time

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")
TREE_CHECK_S = 0.05  # how often a case's process tree is weighed against its CPU budget


def _proc_times(pid):
  """(utime + stime, cutime + cstime) of `pid` in seconds (the second: its reaped children); zeros
  once it is gone."""
  try:
    with open(f"/proc/{pid}/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
    ticks = [int(f) for f in fields[11:15]]  # utime stime cutime cstime
    return (ticks[0] + ticks[1]) * TICK_S, (ticks[2] + ticks[3]) * TICK_S
  except (OSError, ValueError, IndexError):
    return 0.0, 0.0


def _run_delay_s(pid):
  """Seconds `pid` has been runnable but waiting for a CPU (/proc/<pid>/schedstat; 0 without it)."""
  try:
    with open(f"/proc/{pid}/schedstat", "rb") as f:
      return int(f.read().split()[1]) / 1e9
  except (OSError, ValueError, IndexError):
    return 0.0


def _tree_pids(job, case_pids):
  """The processes whose CPU time counts against the case: every process of the pid namespace but
  init and this harness; without one, every process of the sandbox uid; else the case processes."""
  if job["tree"] == "case":
    return case_pids
  me, pids = os.getpid(), []
  for entry in os.listdir("/proc"):
    if not entry.isdigit() or int(entry) in (1, me):
      continue
    try:
      if job["tree"] == "pidns" or os.stat(f"/proc/{entry}").st_uid == job["uid"]:
        pids.append(int(entry))
    except OSError:  # exited meanwhile
      pass
  return pids


def _tree_cpu_s(job, case_pids):
  """CPU seconds used so far by the sandbox's processes: the cgroup's own count where there is one,
  else the live processes' times plus those of the reaped ones (ours, and init's orphans)."""
  if job.get("cgroup_stat_fd") is not None:
    for line in os.pread(job["cgroup_stat_fd"], 4096, 0).decode().splitlines():
      if line.startswith("usage_usec "):
        return int(line.split()[1]) / 1e6
  own = resource.getrusage(resource.RUSAGE_CHILDREN)
  total = own.ru_utime + own.ru_stime + _proc_times(os.getppid())[1]
  for pid in _tree_pids(job, case_pids):
    total += sum(_proc_times(pid))
  return total


def _wait_wall(pid, timeout_s):
  deadline, pause = time.monotonic() + timeout_s, 0.001
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      return status
    left = deadline - time.monotonic()
    if left <= 0:
      return None
    time.sleep(min(pause, left))
    pause = min(pause * 2, 0.02)


def wait(pid, job, timeout_s, case_pids=(), own_clock=True):
  """Exit status of `pid`, or None once the case has used up its time on any of three clocks:
  `timeout_s` of its own time (wall time less the time its processes waited for a CPU, so that busy
  neighbours cannot time it out), the CPU budget over the sandbox's whole process tree (so that
  processes in sessions of their own, each a scheduling group of its own, cannot take the machine
  for longer), or `max_wall_s` of wall time, however starved. `own_clock` False: `timeout_s` of wall
  time only."""
  if not own_clock:
    return _wait_wall(pid, timeout_s)
  start, pause, tree_checked = time.monotonic(), 0.001, 0.0
  cpu_start = _tree_cpu_s(job, case_pids or (pid,))
  while True:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      return status
    wall = time.monotonic() - start
    # Script mode: the check and the candidate take turns, so their waits for a CPU add up.
    waited = sum(map(_run_delay_s, case_pids or (pid,)))
    if wall >= job["max_wall_s"] or wall - waited >= timeout_s:
      return None
    if wall - tree_checked >= TREE_CHECK_S:  # a walk over /proc: not at every poll
      tree_checked = wall
      if _tree_cpu_s(job, case_pids or (pid,)) - cpu_start >= job["tree_cpu_s"]:
        return None
    time.sleep(min(pause, timeout_s))
    pause = min(pause * 2, 0.02)
