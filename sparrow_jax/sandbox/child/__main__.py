"""The process side of the code sandbox (see runner.py), run as a program: stdlib only, never
imported by the library.

Started by `runner.run_cases` as `python -I -B child/` in a fresh session with a scrubbed
environment, cwd = the private work directory, stdin = the job (JSON), stdout = the result stream.
Run as a directory, this folder is the first entry of sys.path even under -I, so its modules import
one another by their plain names, all of them at start (after init's pivot this folder is out of
sight). Process tree, each layer doing what only it can:

  outer (root or caller uid, parent's pid namespace; this module): reads the job, unshares
          net+mount+pid namespaces (or refuses to go on without them, unless the job asks for the
          fallback)
    init  (pid 1 of the new pid namespace; init.py): pivots into a new read-only root holding only
          the interpreter, its libraries, a private /tmp and /proc (mounts.py), maps the harness's
          user namespace; its exit makes the kernel kill everything left in the namespace (fork
          bombs, daemons, setsid escapers)
      harness (harness.py; sandbox uid in a user namespace of its own that allows no nested one, no
               capabilities, limits applied, not dumpable: privileges.py, seccomp.py): forks the
               case processes, kills them on timeout (cases.py, clocks.py)
        case  (rlimits for CPU, memory, file size, open files; candidate.py): runs the candidate
              program
        check (script mode only, same limits; check.py): runs the trusted check, calling the
              candidate's functions in the case process through a proxy that passes plain data
              only (wire.py)

Expected outputs never enter the sandbox: the harness reports raw outputs and the parent compares,
so a program that subverts the harness can still not forge a pass. A script-mode check cannot be
compared outside, so it runs in a process of its own that executes no candidate code: the candidate
can patch builtins, exit early, fork or forge output only in its own process, and a call that does
not come back as plain data fails the check. The check's source and a token come through a
descriptor that only the check process reads (the harness forks the candidate without them in its
memory); the check writes the token to a descriptor of its own only after running to its end, and
the parent accepts nothing else as a pass. Not being dumpable keeps the candidate (same uid) from
ptrace and from /proc/<pid>/{mem,fd} of the harness and the check. Result stream: one JSON object
per line, isolation facts first, then one line per case, then {"done": true}.
"""

import json
import os
import select
import shutil
import signal
import sys
import time

import init
import syscalls
import wire


def _map_user(uid, gid):
  """Maps the caller to root of the new user namespace so it can write files (unmapped ids
  cannot)."""
  for path, text in (
    ("/proc/self/uid_map", f"0 {uid} 1"),
    ("/proc/self/setgroups", "deny"),
    ("/proc/self/gid_map", f"0 {gid} 1"),
  ):
    with open(path, "w") as f:
      f.write(text)


def _watch_parent(job):
  """Ties the sandbox to the grader: its death sends us SIGTERM (PR_SET_PDEATHSIG), which only
  writes to the returned descriptor; a grader already gone makes it readable at once."""
  gone_r, gone_w = os.pipe()
  os.set_blocking(gone_w, False)
  signal.signal(signal.SIGTERM, lambda *_: None)
  signal.set_wakeup_fd(gone_w, warn_on_full_buffer=False)
  syscalls.call("prctl", syscalls.PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
  if os.getppid() != job["parent_pid"]:
    os.write(gone_w, b"x")
  return gone_r


def _wait_or_end(job, pid, out_fd, gone_fd):
  """Waits for init; if the grader dies first (its death signal, or no reader left on the result
  pipe), kills init, which ends every process of its pid namespace, and removes the sandbox's
  directory, so that a killed grader leaves nothing behind."""
  poller = select.poll()
  pidfd = os.pidfd_open(pid)
  poller.register(pidfd, select.POLLIN)
  poller.register(gone_fd, select.POLLIN)
  poller.register(out_fd, 0)  # POLLERR once the grader's end of the pipe is closed
  while True:
    events = dict(poller.poll())
    if pidfd in events:
      os.waitpid(pid, 0)
      return
    if gone_fd in events or out_fd in events:
      break
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
  os.kill(pid, signal.SIGKILL)
  os.waitpid(pid, 0)
  if not job["namespaces"] and job["uid"] is not None:  # no pid namespace ended them with init
    init.kill_uid(job["uid"])
  # Through descriptors opened before init pivoted the mount namespace that we share with it.
  if job["cgroup"]:  # leave it (into its parent), end what is left in it, remove it
    name, parent_fd = os.path.basename(job["cgroup"]), job["cgroup_parent_fd"]
    try:
      _write_at(parent_fd, "cgroup.procs", str(os.getpid()))
      _write_at(parent_fd, f"{name}/cgroup.kill", "1")
    except OSError:  # a kernel before 5.14 has no cgroup.kill: the pid namespace ended them
      pass
    for _ in range(200):
      try:
        os.rmdir(name, dir_fd=parent_fd)
        break
      except FileNotFoundError:
        break
      except OSError:  # its last processes are still exiting
        time.sleep(0.01)
  shutil.rmtree(os.path.basename(job["base"]), dir_fd=job["base_parent_fd"], ignore_errors=True)


def _write_at(dir_fd, path, text):
  fd = os.open(path, os.O_WRONLY, dir_fd=dir_fd)
  try:
    os.write(fd, text.encode())
  finally:
    os.close(fd)


def main():
  """The outer process: reads the job, joins the cgroup, unshares the namespaces and forks init,
  then waits for it or for the grader's death."""
  job = json.loads(sys.stdin.buffer.read())
  gone_fd = _watch_parent(job)
  os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
  out_fd = os.dup(1)
  # For the cleanup should the grader die: after init's pivot_root these paths are out of sight.
  job["base_parent_fd"] = os.open(os.path.dirname(job["base"]), os.O_RDONLY | os.O_DIRECTORY)
  if job["cgroup"]:  # before any other process exists: everything of the sandbox is in it
    try:
      parent = os.path.dirname(job["cgroup"])
      job["cgroup_parent_fd"] = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
      with open(os.path.join(job["cgroup"], "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
      job["cgroup_stat_fd"] = os.open(os.path.join(job["cgroup"], "cpu.stat"), os.O_RDONLY)
    except OSError as e:
      wire.emit(out_fd, {"setup_error": f"cannot join the sandbox's cgroup {job['cgroup']}: {e}"})
      return
  info = {"netns": False, "mountns": False, "pidns": False, "userns": False}
  if job["namespaces"]:
    root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    flags = (
      syscalls.CLONE_NEWNET
      | syscalls.CLONE_NEWNS
      | syscalls.CLONE_NEWPID
      | syscalls.CLONE_NEWIPC
      | syscalls.CLONE_NEWUTS
      | (0 if root else syscalls.CLONE_NEWUSER)
    )
    try:
      syscalls.call("unshare", flags)
      if not root:
        _map_user(uid, gid)
      info.update(netns=True, mountns=True, pidns=True, ipcns=True, utsns=True, userns=not root)
    except OSError as e:
      wire.emit(
        out_fd,
        {
          "setup_error": f"unshare({flags:#x}) refused: {e}; SandboxLimits(namespaces=False) "
          "runs the weaker fallback without namespaces, if that is acceptable"
        },
      )
      return
  pid = os.fork()
  if pid == 0:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    for fd in (gone_fd, job["base_parent_fd"], job.get("cgroup_parent_fd")):
      if fd is not None:  # the host's directories stay out of the sandbox's reach
        os.close(fd)
    init.run(job, out_fd, info)
  _wait_or_end(job, pid, out_fd, gone_fd)


if __name__ == "__main__":
  main()
