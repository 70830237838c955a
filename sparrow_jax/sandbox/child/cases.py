"""One test case, as the harness runs it: its processes forked with the case limits, waited for on
the clocks, stopped, and their outcome read back."""

import os
import resource
import signal
import time

import candidate
import check
import clocks
import descriptors

STDERR_KEEP = 4096  # bytes of a case's stderr sent back (for debugging only)
CASE_FLUSH_S = 1.0  # script mode: seconds the candidate has to flush and exit after the check ends


def _set_limits(limits):
  for name, value in limits.items():
    resource.setrlimit(getattr(resource, name), value)


def _spawn(job, fds, body):
  """Forks a case process: its own process group, `fds` at descriptors 0.., the case limits; it runs
  body(), which never returns."""
  pid = os.fork()
  if pid == 0:
    try:
      os.setpgid(0, 0)
      descriptors.place(fds)
      _set_limits(job["case_limits"])
    except BaseException:
      os._exit(125)
    body()
  return pid


def _stop(pid, status):
  """Kills the process and its group; reaps it unless `status` says that clocks.wait did."""
  for victim in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
    try:
      victim()
    except OSError:  # already gone
      pass
  if status is None:
    os.waitpid(pid, 0)


def _outcome(job, status, start, stdout_fd, stderr_fd):
  return {
    "status": "timeout" if status is None else "ok" if status == 0 else "error",
    "exit": None if status is None else os.waitstatus_to_exitcode(status),
    "time_s": round(time.monotonic() - start, 4),
    "stdout": descriptors.read(stdout_fd, job["output_bytes"]),
    "stderr": descriptors.read(stderr_fd, STDERR_KEEP),
  }


def run_case(job, case):
  """Stdio and call modes: one case process; the parent judges its output or result."""
  stdin_text = case if job["mode"] == "stdio" else ""
  fds = [
    descriptors.memfd("stdin", stdin_text.encode()),
    descriptors.memfd("stdout"),
    descriptors.memfd("stderr"),
    descriptors.memfd("result"),
  ]
  start = time.monotonic()
  pid = _spawn(job, fds, lambda: candidate.run(job, case))
  status = clocks.wait(pid, job, job["timeout_s"])
  _stop(pid, status)
  outcome = _outcome(job, status, start, fds[1], fds[2])
  if job["mode"] == "call":
    outcome["result"] = descriptors.read(fds[3], job["output_bytes"])
  for fd in fds:
    os.close(fd)
  return outcome


def run_script(job):
  """Script mode: the check process and the candidate's case process, joined by two pipes; the
  outcome is the check's, with its verdict (the token, or not) for the parent to judge."""
  requests, replies = os.pipe(), os.pipe()
  check_fds = [
    descriptors.memfd("stdin"),
    descriptors.memfd("stdout"),
    descriptors.memfd("stderr"),
    descriptors.memfd("verdict"),
    requests[1],
    replies[0],
    job["secret_fd"],
  ]
  case_fds = [
    descriptors.memfd("stdin"),
    descriptors.memfd("stdout"),
    descriptors.memfd("stderr"),
    requests[0],
    replies[1],
  ]
  start = time.monotonic()
  check_pid = _spawn(job, check_fds, lambda: check.run(job))
  os.close(job["secret_fd"])  # before the candidate's process is forked: only the check holds it
  case_pid = _spawn(job, case_fds, lambda: candidate.run(job, None))
  for fd in requests + replies:  # so that each side sees EOF once the other is gone
    os.close(fd)
  status = clocks.wait(check_pid, job, job["timeout_s"], case_pids=(check_pid, case_pid))
  _stop(check_pid, status)
  # With the check gone the candidate reads EOF and flushes its stdout; killed at once it could lose
  # it.
  left_s = job["timeout_s"] - (time.monotonic() - start)
  _stop(case_pid, clocks.wait(case_pid, job, min(CASE_FLUSH_S, max(left_s, 0.0)), own_clock=False))
  outcome = {
    **_outcome(job, status, start, case_fds[1], case_fds[2]),
    "check_stderr": descriptors.read(check_fds[2], STDERR_KEEP),
    "verdict": descriptors.read(check_fds[3], 256),
  }
  for fd in check_fds[:4] + case_fds[:3]:
    os.close(fd)
  return outcome
