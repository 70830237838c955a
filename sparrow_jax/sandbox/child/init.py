"""Init, pid 1 of the sandbox's pid namespace: builds the file system, forks the harness into a user
namespace of its own, reaps what the program leaves; its exit makes the kernel kill the rest."""

import os
import signal

import harness
import mounts
import privileges
import syscalls
import wire


def kill_uid(uid):
  """SIGKILLs every process of `uid` (where no pid namespace ends them with init)."""
  for entry in os.listdir("/proc"):
    try:
      if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
        os.kill(int(entry), signal.SIGKILL)
    except OSError:  # exited meanwhile
      pass


def _reap(block):
  while True:
    try:
      if os.waitpid(-1, 0 if block else os.WNOHANG)[0] == 0:
        return
    except ChildProcessError:
      return


def _fork_harness(job, out_fd, info):
  """Forks the harness; with the namespaces, into a new user namespace that we map from outside it
  (allowed to map any of our ids, which a process cannot do for itself): the sandbox uid to itself
  and nothing else (root stays unmapped there), or for a caller uid our 0 to its 0. Returns its
  pid."""
  ready_r, ready_w = os.pipe()
  mapped_r, mapped_w = os.pipe()
  pid = os.fork()
  if pid == 0:
    os.close(ready_r)
    os.close(mapped_w)
    try:
      if info["pidns"]:
        syscalls.call("unshare", syscalls.CLONE_NEWUSER)
        os.write(ready_w, b"u")
        privileges.close_user_namespaces(mapped_r)
        info["user_namespaces"] = 0
    except OSError as e:
      wire.emit(out_fd, {"setup_error": f"cannot keep user namespaces from the program: {e}"})
      os._exit(1)
    os.close(ready_w)
    os.close(mapped_r)
    try:
      harness.run(job, out_fd, info)
    except BaseException as e:
      wire.emit(out_fd, {"sandbox_error": f"{type(e).__name__}: {e}"})
      os._exit(1)
  os.close(ready_w)
  os.close(mapped_r)
  ids = "0 0 1" if job["uid"] is None else f"{job['uid']} {job['uid']} 1"
  try:
    if os.read(ready_r, 1) == b"u":
      for name in ("uid_map", "gid_map"):
        with open(f"/proc/{pid}/{name}", "w") as f:
          f.write(ids)
      os.write(mapped_w, b"m")
  except OSError as e:
    wire.emit(out_fd, {"setup_error": f"cannot map the harness's user namespace ({ids}): {e}"})
    os.kill(pid, signal.SIGKILL)
  os.close(ready_r)
  os.close(mapped_w)
  return pid


def run(job, out_fd, info):
  """Init's whole life: tied to the outer process, it builds the file system, forks the harness and
  reaps until the harness ends, then exits. Never returns."""
  syscalls.call("prctl", syscalls.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  # Orphans of the program come to us (not to the machine's init), so we can reap them below.
  syscalls.call("prctl", syscalls.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
  if info["mountns"]:
    try:
      mounts.mount_private(job, info)
    except OSError as e:  # never a silent downgrade to a sandbox that sees the host's files
      wire.emit(out_fd, {"setup_error": f"cannot build the sandbox's file system: {e}"})
      os._exit(1)
  pid = _fork_harness(job, out_fd, info)
  while os.wait()[0] != pid:  # reaps orphans too until the harness ends
    pass
  if not info["pidns"] and job["uid"] is not None:  # a pid namespace would end them all with us
    kill_uid(job["uid"])
    _reap(block=True)
  _reap(block=False)
  os._exit(0)
