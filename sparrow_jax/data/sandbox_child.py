"""The process side of the code sandbox (see sandbox.py). Stdlib only; run as a script, never imported.

Started by `sandbox.run_cases` as `python -I -B sandbox_child.py` in a fresh session with a scrubbed
environment, cwd = the private work directory, stdin = the job (JSON), stdout = the result stream.
Process tree, each layer doing what only it can:

  outer (root or caller uid, parent's pid namespace): reads the job, unshares net+mount+pid namespaces
    init  (pid 1 of the new pid namespace): private /proc and /tmp mounts, exposes the interpreter; its
          exit makes the kernel kill everything left in the namespace (fork bombs, daemons, setsid escapers)
      harness (sandbox uid, limits applied): forks one child per test case, kills it on timeout
        case  (rlimits for CPU, memory, file size, open files): runs the candidate program

Expected outputs never enter the sandbox: the harness reports raw outputs and the parent compares, so a
program that subverts the harness can still not forge a pass. Result stream: one JSON object per line,
isolation facts first, then one line per case, then {"done": true}.
"""
import ctypes
import json
import os
import resource
import signal
import stat
import sys
import time
import types

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
STDERR_KEEP = 4096   # bytes of a case's stderr sent back (for debugging only)
# Imported before the uid drop when the interpreter's files are not readable by the sandbox uid and no
# mount namespace can expose them (root without CAP_SYS_ADMIN, e.g. Docker's default profile).
PREIMPORT = ("array", "bisect", "collections", "copy", "dataclasses", "datetime", "decimal", "enum",
             "fractions", "functools", "heapq", "itertools", "math", "operator", "queue", "random", "re",
             "statistics", "string", "traceback", "typing")

# Audit events refused to the program when no network namespace could be made: a Python-level fallback
# that native code could bypass, hence the ctypes and process-launch events too.
AUDIT_BLOCKED = frozenset((
    "socket.bind", "socket.connect", "socket.sendto", "socket.sendmsg", "socket.getaddrinfo",
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.call_function", "os.system", "os.exec", "os.posix_spawn",
    "os.spawn", "subprocess.Popen"))

_libc = ctypes.CDLL(None, use_errno=True)


def _libc_call(name, *args):
  if getattr(_libc, name)(*args) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"{name}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
  enc = lambda s: None if s is None else s.encode()
  _libc_call("mount", enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))


def _emit(fd, obj):
  os.write(fd, (json.dumps(obj, ensure_ascii=False) + "\n").encode("utf-8", "replace"))


def _others_can_enter(path):
  """Whether a uid with no special rights can traverse every directory down to `path` and read it."""
  parts = os.path.realpath(path).split(os.sep)
  for i in range(1, len(parts) + 1):
    mode = os.stat(os.sep.join(parts[:i]) or os.sep).st_mode
    if not mode & stat.S_IXOTH:
      return os.sep.join(parts[:i]) or os.sep
  return None if os.stat(path).st_mode & stat.S_IROTH else path


def _expose(paths):
  """Makes the interpreter's directories reachable for the sandbox uid inside the mount namespace.

  A directory on the way that others may not enter (pyenv or conda under a 0700 /root) is covered with
  an empty tmpfs, which also hides the rest of it, and the needed directories are bind-mounted back at
  their own paths (the interpreter's RUNPATH and sys.path stay valid). Returns the blocking directories.
  """
  fds, tops = {}, set()
  for path in paths:
    top = _others_can_enter(path)
    if top == path:
      raise OSError(f"{path} itself is not readable by others; pass python= an interpreter that is")
    if top:
      fds[path] = os.open(path, os.O_PATH)
      tops.add(top)
  tops = sorted(t for t in tops if not any(t.startswith(u + os.sep) for u in tops))
  for top in tops:
    _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
  for path, fd in fds.items():
    os.makedirs(path, mode=0o755, exist_ok=True)
    _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
    os.close(fd)
  return tops


def _mount_private(job, info):
  """Private mount tree: fresh /proc of the new pid namespace, size-capped tmpfs over shared temp dirs."""
  _mount(None, "/", None, MS_REC | MS_PRIVATE)
  if info["pidns"]:
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    info["private_proc"] = True
  for path in ("/tmp", "/var/tmp", "/dev/shm"):
    if os.path.isdir(path):
      _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['tmpfs_mb']}m,mode=1777")
  info["private_tmp"] = True
  # Work in the size-capped tmpfs rather than the parent's directory on disk, so that files a program
  # writes cannot fill the disk either.
  os.mkdir("/tmp/work", 0o700)
  if job["uid"] is not None:
    os.chown("/tmp/work", job["uid"], job["uid"])
  os.chdir("/tmp/work")
  if job["uid"] is not None:
    info["exposed"] = _expose(job["python_paths"])


def _set_limits(limits):
  for name, value in limits.items():
    resource.setrlimit(getattr(resource, name), value)


def _wait(pid, timeout_s):
  """Exit status of `pid`, or None if it ran past `timeout_s` of wall time."""
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


def _read(fd, limit):
  os.lseek(fd, 0, os.SEEK_SET)
  chunks, left = [], limit
  while left > 0:
    chunk = os.read(fd, min(left, 1 << 16))
    if not chunk:
      break
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks).decode("utf-8", "replace")


def _memfd(name, content=b""):
  fd = os.memfd_create(name, 0)
  os.write(fd, content)
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


def _refuse_network(event, args):
  if event in AUDIT_BLOCKED:
    raise PermissionError(f"sandbox: {event} is not allowed")


def _run_candidate(job, case, result_fd):
  """In the case process: executes the program as the job's mode asks. Never returns."""
  code = 1
  try:
    if job["audit_network"]:
      sys.addaudithook(_refuse_network)
    # A fresh __main__ so that `import __main__` finds the program, not this harness.
    main_module = types.ModuleType("__main__")
    sys.modules["__main__"] = main_module
    # Fresh buffered streams over the case's memfds (the harness's own were never read or written).
    sys.stdin, sys.stdout, sys.stderr = (
        open(fd, mode, encoding="utf-8", errors="replace", closefd=False)
        for fd, mode in ((0, "r"), (1, "w"), (2, "w")))
    sys.argv = ["solution.py"]
    if job["mode"] == "call":
      namespace = main_module.__dict__
      exec(compile(job["program"], "solution.py", "exec"), namespace)
      holder = namespace.get("Solution")
      fn = getattr(holder(), job["fn_name"]) if hasattr(holder, job["fn_name"]) else namespace[job["fn_name"]]
      result = fn(*case) if isinstance(case, list) else fn(case)
      os.write(result_fd, json.dumps(result, default=repr).encode())
    else:
      source = job["program"] if job["mode"] == "stdio" else "\n".join(
          [job["prefix"], job["program"], job["script"]])
      exec(compile(source, "solution.py", "exec"), main_module.__dict__)
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # the program's own failure: report it like a crash, with its traceback
    import traceback
    traceback.print_exc()
  finally:
    try:
      sys.stdout.flush()
      sys.stderr.flush()
    except BaseException:
      code = code or 1
    os._exit(code)


def _run_case(job, case):
  stdin_text = case if job["mode"] == "stdio" else ""
  fds = [_memfd("stdin", stdin_text.encode()), _memfd("stdout"), _memfd("stderr"), _memfd("result")]
  start = time.monotonic()
  pid = os.fork()
  if pid == 0:
    try:
      os.setpgid(0, 0)
      for target, fd in enumerate(fds):
        os.dup2(fd, target)
      os.closerange(4, 1 << 16)
      _set_limits(job["case_limits"])
    except BaseException:
      os._exit(125)
    _run_candidate(job, case, 3)
  status = _wait(pid, job["timeout_s"])
  for victim in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
    try:
      victim()
    except OSError:  # already gone
      pass
  if status is None:
    os.waitpid(pid, 0)
  outcome = {"status": "timeout" if status is None else "ok" if status == 0 else "error",
             "exit": None if status is None else os.waitstatus_to_exitcode(status),
             "time_s": round(time.monotonic() - start, 4),
             "stdout": _read(fds[1], job["output_bytes"]),
             "stderr": _read(fds[2], STDERR_KEEP)}
  if job["mode"] == "call":
    outcome["result"] = _read(fds[3], job["output_bytes"])
  for fd in fds:
    os.close(fd)
  return outcome


def _harness(job, out_fd, info):
  if job["uid"] is not None and "exposed" not in info:
    if any(_others_can_enter(p) for p in job["python_paths"]):
      for name in PREIMPORT:
        __import__(name)
      info["preimported_only"] = True
  # No setuid binary (su, sudo, ...) may give the program back any privilege.
  _libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
  if job["uid"] is not None:
    os.setgroups([])
    os.setgid(job["uid"])
    os.setuid(job["uid"])
  # RLIMIT_NPROC counts every process of the real uid: enforceable for a uid of our own (root drops to
  # one) or inside a new user namespace, not for a caller uid shared with the trainer's own threads.
  if job["uid"] is not None or info["userns"]:
    resource.setrlimit(resource.RLIMIT_NPROC, (job["nproc"], job["nproc"]))
    info["nproc"] = job["nproc"]
  info["uid"] = os.getuid()
  job["audit_network"] = not info["netns"]
  _emit(out_fd, {"isolation": info})
  for i, case in enumerate(job["cases"]):
    outcome = _run_case(job, case)
    _emit(out_fd, {"case": i, **outcome})
    if outcome["status"] != "ok" and job["stop_on_failure"]:
      break
  _emit(out_fd, {"done": True})
  os._exit(0)


def _kill_uid(uid):
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


def _init(job, out_fd, info):
  _libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  # Orphans of the program come to us (not to the machine's init), so we can reap them below.
  _libc_call("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
  if info["mountns"]:
    try:
      _mount_private(job, info)
    except OSError as e:
      info["mount_error"] = str(e)
  pid = os.fork()
  if pid == 0:
    try:
      _harness(job, out_fd, info)
    except BaseException as e:
      _emit(out_fd, {"sandbox_error": f"{type(e).__name__}: {e}"})
      os._exit(1)
  while os.wait()[0] != pid:  # reaps orphans too until the harness ends
    pass
  if not info["pidns"] and job["uid"] is not None:  # a pid namespace would end them all with us
    _kill_uid(job["uid"])
    _reap(block=True)
  _reap(block=False)
  os._exit(0)


def _map_user(uid, gid):
  """Maps the caller to root of the new user namespace so it can write files (unmapped ids cannot)."""
  for path, text in (("/proc/self/uid_map", f"0 {uid} 1"), ("/proc/self/setgroups", "deny"),
                     ("/proc/self/gid_map", f"0 {gid} 1")):
    with open(path, "w") as f:
      f.write(text)


def main():
  job = json.loads(sys.stdin.buffer.read())
  os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
  out_fd = os.dup(1)
  info = {"netns": False, "mountns": False, "pidns": False, "userns": False}
  if job["namespaces"]:
    root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | (0 if root else CLONE_NEWUSER)
    try:
      _libc_call("unshare", flags)
      if not root:
        _map_user(uid, gid)
      info.update(netns=True, mountns=True, pidns=True, userns=not root)
    except OSError as e:
      info["unshare_error"] = str(e)
  pid = os.fork()
  if pid == 0:
    _init(job, out_fd, info)
  os.waitpid(pid, 0)


if __name__ == "__main__":
  main()
