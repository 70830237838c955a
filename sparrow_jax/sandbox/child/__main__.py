"""The process side of the code sandbox (see runner.py). Stdlib only; run as a program, never
imported.

Started by `runner.run_cases` as `python -I -B child/` in a fresh session with a scrubbed
environment, cwd = the private work directory, stdin = the job (JSON), stdout = the result stream.
Process tree, each layer doing what only it can:

  outer (root or caller uid, parent's pid namespace): reads the job, unshares net+mount+pid
          namespaces (or refuses to go on without them, unless the job asks for the fallback)
    init  (pid 1 of the new pid namespace): pivots into a new read-only root holding only the
          interpreter, its libraries, a private /tmp and /proc (see _mount_private), maps the
          harness's user namespace; its exit makes the kernel kill everything left in the namespace
          (fork bombs, daemons, setsid escapers)
      harness (sandbox uid in a user namespace of its own that allows no nested one, no
               capabilities, limits applied, not dumpable): forks the case processes, kills them on
               timeout
        case  (rlimits for CPU, memory, file size, open files): runs the candidate program
        check (script mode only, same limits): runs the trusted check, calling the candidate's
              functions in the case process through a proxy that passes plain data only

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

import ast
import builtins
import ctypes
import errno
import fcntl
import json
import os
import resource
import select
import shutil
import signal
import stat
import sys
import time
import types

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC = 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # glibc has no wrapper
# The kernel key syscalls (add_key, request_key, keyctl) and the seccomp audit arch, per machine.
KEY_SYSCALLS = {"x86_64": ((248, 249, 250), 0xC000003E), "aarch64": ((217, 218, 219), 0xC00000B7)}
KEYCTL_JOIN_SESSION_KEYRING, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 22, 2
SECCOMP_RET_KILL_PROCESS = 0x80000000
_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# What the program's root holds besides the interpreter's own directories (job["python_paths"]): the
# shared libraries that the interpreter and its extension modules load. Missing ones are skipped;
# top-level symlinks (merged /usr: /lib -> usr/lib) are recreated as symlinks.
SYSTEM_PATHS = (
  "/usr",
  "/bin",
  "/sbin",
  "/lib",
  "/lib32",
  "/lib64",
  "/libx32",
  "/etc/ld.so.cache",
  "/etc/localtime",
)
DEVICES = ("null", "zero", "full", "random", "urandom")
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38
STDERR_KEEP = 4096  # bytes of a case's stderr sent back (for debugging only)
SECRET_BYTES = 1 << 26  # most the check's source and token may take
CASE_FLUSH_S = 1.0  # script mode: seconds the candidate has to flush and exit after the check ends
PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)
PLAIN_CONTAINERS = (list, tuple, set, frozenset)
PLAIN_DEPTH = 60  # nesting of plain data; the parser refuses ~200 levels of brackets
# Imported before the uid drop in the explicit fallback without namespaces (no mount namespace to
# expose the interpreter) when the interpreter's files are not readable by the sandbox uid; reported
# as "preimported_only" in the isolation facts.
PREIMPORT = (
  "array",
  "bisect",
  "collections",
  "copy",
  "dataclasses",
  "datetime",
  "decimal",
  "enum",
  "fractions",
  "functools",
  "heapq",
  "itertools",
  "math",
  "operator",
  "queue",
  "random",
  "re",
  "statistics",
  "string",
  "traceback",
  "typing",
)

# Audit events refused to the program when no network namespace could be made: a Python-level
# fallback that native code could bypass, hence the ctypes and process-launch events too.
AUDIT_BLOCKED = frozenset(
  (
    "socket.bind",
    "socket.connect",
    "socket.sendto",
    "socket.sendmsg",
    "socket.getaddrinfo",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "ctypes.call_function",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "subprocess.Popen",
  )
)

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
  """Whether a uid with no special rights can traverse every directory down to `path` and read
  it."""
  parts = os.path.realpath(path).split(os.sep)
  for i in range(1, len(parts) + 1):
    mode = os.stat(os.sep.join(parts[:i]) or os.sep).st_mode
    if not mode & stat.S_IXOTH:
      return os.sep.join(parts[:i]) or os.sep
  return None if os.stat(path).st_mode & stat.S_IROTH else path


def _bind_read_only(source, target):
  _mount(source, target, None, MS_BIND | MS_REC)
  # A remount must repeat the flags that a user namespace locked on the source mount (EPERM
  # otherwise); these ST_ statvfs flags have the values of their MS_ mount flags, the atime modes do
  # not.
  flags = os.statvfs(target).f_flag
  kept = flags & (os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME)
  atime = 0 if flags & os.ST_NOATIME else MS_RELATIME if flags & os.ST_RELATIME else MS_STRICTATIME
  _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept | atime)


def _expose(root, paths, optional, uid):
  """Bind-mounts each of `paths` read-only at its own path under `root` (the interpreter's RUNPATH
  and sys.path stay valid), creating the directories on the way in root's tmpfs with mode 0755, so
  that a directory others may not enter (pyenv or conda under a 0700 /root) hides nothing but the
  rest of it. A missing path is skipped if `optional`, else an error, as is one that `uid` (if not
  None) could not read. Returns the paths exposed."""
  exposed = []
  for path in paths:
    target = root + path
    if os.path.islink(path) and os.path.dirname(path) == os.sep:
      os.symlink(os.readlink(path), target)
      continue
    if not os.path.exists(path):
      if optional:
        continue
      raise OSError(f"{path} does not exist, so the sandbox cannot expose it")
    if uid is not None and _others_can_enter(path) == path:
      raise OSError(f"{path} itself is not readable by others, so sandbox uid {uid} cannot use it")
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if os.path.isdir(path):
      os.makedirs(target, mode=0o755, exist_ok=True)
    elif not os.path.exists(target):
      os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _bind_read_only(path, target)
    exposed.append(path)
  return exposed


def _pivot(root):
  """Makes `root` the root of the mount namespace and detaches the old one: unlike chroot, no path
  and no chroot escape leads back to the host's files."""
  number = SYS_PIVOT_ROOT.get(os.uname().machine)
  if number is None:
    raise OSError(f"no pivot_root syscall number known for machine {os.uname().machine!r}")
  os.chdir(root)
  _libc_call("syscall", ctypes.c_long(number), b".", b".")  # the old root ends up stacked on "/"
  _libc_call("umount2", b".", MNT_DETACH)
  os.chdir("/")


def _mount_private(job, info):
  """The program's whole file system: a new read-only root (a tmpfs mounted over our work directory)
  holding read-only binds of the interpreter, its libraries and SYSTEM_PATHS, a few devices, a fresh
  /proc of the new pid namespace and size-capped tmpfs /tmp and /dev/shm; nothing else of the host
  (project tree, data, home directories, other runs' temp files) exists in it."""
  _mount(None, "/", None, MS_REC | MS_PRIVATE)
  root = os.getcwd()
  _mount("tmpfs", root, "tmpfs", MS_NOSUID, "size=1m,mode=0755")
  # The temp directories first: the checkout or venv may live under /tmp, exposed on top of them.
  for path in ("/tmp", "/dev/shm"):
    os.makedirs(root + path, mode=0o755)
    _mount(
      "tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['tmpfs_mb']}m,mode=1777"
    )
  info["private_tmp"] = True
  info["exposed"] = _expose(root, job["python_paths"], optional=False, uid=job["uid"])
  _expose(root, SYSTEM_PATHS, optional=True, uid=None)
  # Each exposed site-packages becomes an empty directory holding only the solution packages.
  info["solution_packages"] = []
  for site in job["site_packages"]:
    if os.path.isdir(root + site):
      _mount("tmpfs", root + site, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
      inside = [p for p in job["solution_paths"] if p.startswith(site + os.sep)]
      info["solution_packages"] += _expose(root, inside, optional=False, uid=job["uid"])
      _mount(None, root + site, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
  for name in DEVICES:
    os.close(os.open(f"{root}/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
    _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
  for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
    os.symlink(f"/proc/self/fd/{fd}", f"{root}/dev/{name}")
  os.symlink("/proc/self/fd", f"{root}/dev/fd")
  os.mkdir(root + "/proc", 0o555)
  _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  info["private_proc"] = True
  _pivot(root)
  _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
  info["private_root"] = True
  # Work in the size-capped tmpfs, so that files a program writes cannot fill the disk either.
  os.mkdir("/tmp/work", 0o700)
  if job["uid"] is not None:
    os.chown("/tmp/work", job["uid"], job["uid"])
  os.chdir("/tmp/work")


def _set_limits(limits):
  for name, value in limits.items():
    resource.setrlimit(getattr(resource, name), value)


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


def _wait(pid, job, timeout_s, case_pids=(), own_clock=True):
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


# --------------------------------------------------------------------- plain data between processes


def _plain(value, depth=0):
  """Whether `value` is plain data: exact builtin scalars and containers of them. Subclasses are not
  (their __eq__, __hash__ or __repr__ would be the candidate's code)."""
  kind = type(value)
  if kind in PLAIN_SCALARS:
    return True
  if depth >= PLAIN_DEPTH:
    return False
  if kind is dict:
    return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
  return kind in PLAIN_CONTAINERS and all(_plain(v, depth + 1) for v in value)


def _literal(node):
  """The value that the expression `node` of ascii(plain data) spells, built from exact builtin
  types (unlike ast.literal_eval, also nan and inf); ValueError for any other expression."""
  if isinstance(node, ast.Constant) and type(node.value) in PLAIN_SCALARS:
    return node.value
  if isinstance(node, ast.Name) and node.id in ("nan", "inf"):
    return float(node.id)
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
    value = _literal(node.operand)
    if type(value) in (int, float):
      return -value
  elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
    return {ast.Tuple: tuple, ast.List: list, ast.Set: set}[type(node)](map(_literal, node.elts))
  elif isinstance(node, ast.Dict) and None not in node.keys:
    return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
  elif (
    isinstance(node, ast.Call)
    and isinstance(node.func, ast.Name)
    and not node.keywords
    and node.func.id in ("set", "frozenset")
    and all(isinstance(a, ast.Set) for a in node.args)
    and len(node.args) <= 1
  ):  # ascii(set()), ascii(frozenset({1}))
    return {"set": set, "frozenset": frozenset}[node.func.id](*map(_literal, node.args))
  raise ValueError(f"not plain data: {ast.dump(node)[:100]}")


def _write_all(fd, data):
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view) :]


def _read_exactly(fd, size):
  chunks = []
  while size:
    chunk = os.read(fd, min(size, 1 << 16))
    if not chunk:
      raise EOFError("the other process hung up")
    chunks.append(chunk)
    size -= len(chunk)
  return b"".join(chunks)


def _send(fd, value):
  """One message: its 8-byte length, then ascii(value), which the receiver rebuilds with
  _literal."""
  if not _plain(value):
    raise TypeError(
      f"only plain data crosses between the check and the candidate, not {value!r:.100}"
    )
  text = ascii(value).encode()
  _write_all(fd, len(text).to_bytes(8, "big") + text)


def _receive(fd, limit):
  size = int.from_bytes(_read_exactly(fd, 8), "big")
  if size > limit:
    raise ValueError(f"a message of {size} bytes, over the limit of {limit}")
  return _literal(ast.parse(_read_exactly(fd, size).decode("ascii"), mode="eval").body)


# ----------------------------------------------------------------------------------- case processes


def _fresh_main():
  """A fresh __main__ module (so that `import __main__` finds the program, not this harness) and
  fresh buffered streams over descriptors 0-2 (the harness's own were never read or written)."""
  main_module = types.ModuleType("__main__")
  sys.modules["__main__"] = main_module
  sys.stdin, sys.stdout, sys.stderr = (
    open(fd, mode, encoding="utf-8", errors="replace", closefd=False)
    for fd, mode in ((0, "r"), (1, "w"), (2, "w"))
  )
  sys.argv = ["solution.py"]
  return main_module.__dict__


def _lookup(namespace, fn_name):
  """The program's function `fn_name`, or the method of that name of its class Solution."""
  holder = namespace.get("Solution")
  return getattr(holder(), fn_name) if hasattr(holder, fn_name) else namespace[fn_name]


def _builtin_base(cls):
  """The name of the nearest builtin class of an exception type (the check rebuilds that one)."""
  return next(c.__name__ for c in cls.__mro__ if getattr(builtins, c.__name__, None) is c)


def _serve(namespace, requests_fd, replies_fd):
  """In the case process, once the program ran: answers the check's calls until it hangs up."""
  while True:
    try:
      name, args, kwargs = _receive(requests_fd, sys.maxsize)
    except EOFError:
      return
    try:
      result = _lookup(namespace, name)(*args, **kwargs)
      reply = (
        ("return", result)
        if _plain(result)
        else ("invalid", f"{name} returned a {type(result).__name__}, which is not plain data")
      )
    except Exception as e:  # the check may expect it; a BaseException ends this process instead
      reply = ("raise", _builtin_base(type(e)), str(e))
    _send(replies_fd, reply)


def _flush_and_exit(code):
  try:
    sys.stdout.flush()
    sys.stderr.flush()
  except BaseException:
    code = code or 1
  os._exit(code)


def _run_candidate(job, case):
  """In the case process: executes the program as the job's mode asks. Never returns.
  Descriptors: 0-2 stdio; call mode: 3 the result; script mode: 3 requests in, 4 replies out."""
  code = 1
  try:
    if job["audit_network"]:
      sys.addaudithook(_refuse_network)
    namespace = _fresh_main()
    if job["mode"] == "call":
      exec(compile(job["program"], "solution.py", "exec"), namespace)
      fn = _lookup(namespace, job["fn_name"])
      result = fn(*case) if isinstance(case, list) else fn(case)
      os.write(3, json.dumps(result, default=repr).encode())
    elif job["mode"] == "stdio":
      exec(compile(job["program"], "solution.py", "exec"), namespace)
    else:
      exec(compile("\n".join([job["prefix"], job["program"]]), "solution.py", "exec"), namespace)
      _serve(namespace, 3, 4)
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # the program's own failure: report it like a crash, with its traceback
    import traceback

    traceback.print_exc()
  finally:
    _flush_and_exit(code)


class BrokenCandidate(BaseException):
  """The candidate's process died or broke the protocol. A BaseException, so that `except Exception`
  in a check does not swallow it; the check fails even where a bare `except:` does."""


def _exception(type_name, message):
  """The exception a candidate's function raised, rebuilt as the builtin type the reply names."""
  cls = getattr(builtins, type_name, None)
  if not (isinstance(cls, type) and issubclass(cls, Exception)):
    raise ValueError(f"the candidate raised {type_name!r}, not a builtin Exception type")
  if issubclass(
    cls, (StopIteration, StopAsyncIteration)
  ):  # would end a check's `for x in map(f, ...)`
    return RuntimeError(f"the candidate raised {type_name}: {message}")
  try:
    return cls(message)
  except Exception:  # a type whose constructor wants more (UnicodeDecodeError, ExceptionGroup)
    return Exception(f"{type_name}: {message}")


class _Candidate:
  """The check's handle on the case process: arguments and return values cross as plain data and
  exceptions as a builtin type and message. Anything else (a dead process, a malformed or non-plain
  reply) marks the candidate broken for good, which fails the check."""

  def __init__(self, requests_fd, replies_fd, limit):
    self.requests_fd, self.replies_fd, self.limit = requests_fd, replies_fd, limit
    self.broken = None

  def function(self, name):
    def call(*args, **kwargs):
      return self.call(name, args, kwargs)

    call.__name__ = call.__qualname__ = name
    return call

  def call(self, name, args, kwargs):
    if self.broken is None:
      try:
        _send(self.requests_fd, (name, args, kwargs))
        reply = _receive(self.replies_fd, self.limit)
        if type(reply) is tuple and len(reply) == 2 and reply[0] == "return":
          return reply[1]
        if (
          type(reply) is tuple and len(reply) == 3 and reply[0] == "raise" and type(reply[2]) is str
        ):
          error = _exception(reply[1], reply[2])
        else:
          raise ValueError(f"malformed reply {reply!r:.200}")
      except Exception as e:
        self.broken = f"call of {name}: {type(e).__name__}: {e}"
      else:
        raise error
    raise BrokenCandidate(self.broken)


def _run_check(job):
  """In the check process, which runs no candidate code: the trusted prefix and check script, with
  the candidate's functions bound to proxies. Writes the token (descriptor 3) only if the check ran
  to its end and every call came back well-formed. Descriptors: 0-2 stdio, 3 verdict, 4 requests
  out, 5 replies in, 6 the check's source and token."""
  code = 1
  try:
    # The candidate (same uid) may signal us: blocked, a signal can only kill or stop us, which
    # fails.
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    secret = json.loads(_read(6, SECRET_BYTES))
    os.close(6)
    namespace = _fresh_main()
    exec(compile(job["prefix"], "prefix.py", "exec"), namespace)
    candidate = _Candidate(4, 5, job["output_bytes"])
    namespace.update({name: candidate.function(name) for name in job["names"]})
    exec(compile(secret["script"], "check.py", "exec"), namespace)
    if candidate.broken is not None:  # the check caught BrokenCandidate
      raise BrokenCandidate(candidate.broken)
    os.write(3, secret["token"].encode())
    code = 0
  except BaseException:  # a failed assertion, or any error: no token
    import traceback

    traceback.print_exc()
  finally:
    _flush_and_exit(code)


def _place(fds):
  """Puts fds[i] at descriptor i and closes every other one. Copies above the targets come first, so
  that no source is overwritten before it is placed."""
  high = [fcntl.fcntl(fd, fcntl.F_DUPFD, len(fds)) for fd in fds]
  for target, fd in enumerate(high):
    os.dup2(fd, target)
  os.closerange(len(fds), 1 << 16)


def _spawn(job, fds, body):
  """Forks a case process: its own process group, `fds` at descriptors 0.., the case limits; it runs
  body(), which never returns."""
  pid = os.fork()
  if pid == 0:
    try:
      os.setpgid(0, 0)
      _place(fds)
      _set_limits(job["case_limits"])
    except BaseException:
      os._exit(125)
    body()
  return pid


def _stop(pid, status):
  """Kills the process and its group; reaps it unless `status` says that _wait did."""
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
    "stdout": _read(stdout_fd, job["output_bytes"]),
    "stderr": _read(stderr_fd, STDERR_KEEP),
  }


def _run_case(job, case):
  """Stdio and call modes: one case process; the parent judges its output or result."""
  stdin_text = case if job["mode"] == "stdio" else ""
  fds = [_memfd("stdin", stdin_text.encode()), _memfd("stdout"), _memfd("stderr"), _memfd("result")]
  start = time.monotonic()
  pid = _spawn(job, fds, lambda: _run_candidate(job, case))
  status = _wait(pid, job, job["timeout_s"])
  _stop(pid, status)
  outcome = _outcome(job, status, start, fds[1], fds[2])
  if job["mode"] == "call":
    outcome["result"] = _read(fds[3], job["output_bytes"])
  for fd in fds:
    os.close(fd)
  return outcome


def _run_script(job):
  """Script mode: the check process and the candidate's case process, joined by two pipes; the
  outcome is the check's, with its verdict (the token, or not) for the parent to judge."""
  requests, replies = os.pipe(), os.pipe()
  check_fds = [
    _memfd("stdin"),
    _memfd("stdout"),
    _memfd("stderr"),
    _memfd("verdict"),
    requests[1],
    replies[0],
    job["secret_fd"],
  ]
  case_fds = [_memfd("stdin"), _memfd("stdout"), _memfd("stderr"), requests[0], replies[1]]
  start = time.monotonic()
  check = _spawn(job, check_fds, lambda: _run_check(job))
  os.close(job["secret_fd"])  # before the candidate's process is forked: only the check holds it
  case = _spawn(job, case_fds, lambda: _run_candidate(job, None))
  for fd in requests + replies:  # so that each side sees EOF once the other is gone
    os.close(fd)
  status = _wait(check, job, job["timeout_s"], case_pids=(check, case))
  _stop(check, status)
  # With the check gone the candidate reads EOF and flushes its stdout; killed at once it could lose
  # it.
  left_s = job["timeout_s"] - (time.monotonic() - start)
  _stop(case, _wait(case, job, min(CASE_FLUSH_S, max(left_s, 0.0)), own_clock=False))
  outcome = {
    **_outcome(job, status, start, case_fds[1], case_fds[2]),
    "check_stderr": _read(check_fds[2], STDERR_KEEP),
    "verdict": _read(check_fds[3], 256),
  }
  for fd in check_fds[:4] + case_fds[:3]:
    os.close(fd)
  return outcome


def _close_user_namespaces(mapped_fd):
  """In the harness, in a user namespace of its own that init mapped (see _fork_harness): its limit
  of user namespaces goes to 0. The kernel checks that limit of every ancestor when one is created,
  so the program can create none (no unshare(CLONE_NEWUSER) to regain capabilities, mount or pivot),
  and, without capabilities in this namespace, cannot raise the limit again."""
  if os.read(mapped_fd, 1) != b"m":
    raise OSError("init did not map the harness's user namespace")
  with open("/proc/sys/user/max_user_namespaces", "w") as f:
    f.write("0")


def _close_keyrings():
  """A new empty session keyring (the grader's keys stay out of reach), then a seccomp filter that
  fails add_key, request_key and keyctl with EPERM (and every x32-ABI syscall on x86_64, which would
  reach them under other numbers) and kills the process on a syscall of any other architecture
  (i386's int 0x80 on x86_64, arm32 on aarch64: other tables, other numbers). Returns whether the
  filter is in place (False on a machine with no known syscall numbers, or where seccomp is refused:
  the new keyring still holds)."""
  syscalls, arch = KEY_SYSCALLS.get(os.uname().machine, ((), None))
  if syscalls:
    _libc.syscall(ctypes.c_long(syscalls[2]), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None)
  if arch is None:
    return False
  ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
  allow, refuse, kill = 0x7FFF0000, 0x00050000 | errno.EPERM, SECCOMP_RET_KILL_PROCESS
  add_key, request_key, keyctl = syscalls
  program = [
    (ld, 0, 0, 4),
    (jeq, 1, 0, arch),
    (ret, 0, 0, kill),  # another arch (int 0x80, compat entry points): its own syscall numbers
    (ld, 0, 0, 0),
    (jge, 4, 0, 0x40000000),
    (jeq, 3, 0, add_key),
    (jeq, 2, 0, request_key),
    (jeq, 1, 0, keyctl),
    (ret, 0, 0, allow),
    (ret, 0, 0, refuse),
  ]

  class Filter(ctypes.Structure):
    _fields_ = [
      ("code", ctypes.c_uint16),
      ("jt", ctypes.c_uint8),
      ("jf", ctypes.c_uint8),
      ("k", ctypes.c_uint32),
    ]

  class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

  filters = (Filter * len(program))(*[Filter(*f) for f in program])
  try:
    _libc_call(
      "prctl",
      PR_SET_SECCOMP,
      SECCOMP_MODE_FILTER,
      ctypes.byref(Program(len(program), filters)),
      0,
      0,
    )
  except OSError:
    return False
  return True


def _drop_capabilities():
  """Empties every capability set (a uid change does that only from root to non-root; a caller uid
  stays 0 in its user namespace). No new privileges then keeps an execve from getting any back."""
  header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
  _libc_call("capset", header, (ctypes.c_uint32 * 6)())


def _harness(job, out_fd, info):
  if job["uid"] is not None and "exposed" not in info:  # the explicit fallback: no mount namespace
    if any(_others_can_enter(p) for p in job["python_paths"]):
      for name in PREIMPORT:
        __import__(name)
      info["preimported_only"] = True
  # No setuid binary (su, sudo, ...) may give the program back any privilege.
  _libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
  info["seccomp_keys"] = _close_keyrings()
  if job["uid"] is not None:
    os.setgroups([])
    os.setgid(job["uid"])
    os.setuid(job["uid"])
  if "user_namespaces" in info:
    _drop_capabilities()
  # Files the program creates in a shared /tmp (the fallback's) stay unreadable to concurrent runs.
  os.umask(0o077)
  # Explicit (a uid change does it only while fs.suid_dumpable is 0): a process of the sandbox uid
  # may not ptrace or read /proc/<pid>/{mem,fd} of this harness or of the processes it forks.
  _libc_call("prctl", PR_SET_DUMPABLE, 0, 0, 0, 0)
  # RLIMIT_NPROC counts every process of the real uid: enforceable for a uid of our own (root drops
  # to one) or inside a new user namespace, not for a caller uid shared with the trainer's own
  # threads.
  if job["uid"] is not None or info["userns"]:
    resource.setrlimit(resource.RLIMIT_NPROC, (job["nproc"], job["nproc"]))
    info["nproc"] = job["nproc"]
  info["uid"] = os.getuid()
  job["audit_network"] = not info["netns"]
  job["tree"] = "pidns" if info["pidns"] else "uid" if job["uid"] is not None else "case"
  info["cpu_share"] = "cgroup" if job.get("cgroup_stat_fd") is not None else "tree_cpu_budget"
  _emit(out_fd, {"isolation": info})
  sent = 0
  for i, case in enumerate(job["cases"]):
    outcome = _run_script(job) if job["mode"] == "script" else _run_case(job, case)
    sent += sum(len(v) for v in outcome.values() if isinstance(v, str))
    if sent > job["batch_output_bytes"]:  # a flood of output: the rest of the run is not worth it
      _emit(
        out_fd,
        {
          "case": i,
          "status": "output_limit",
          "exit": None,
          "time_s": outcome["time_s"],
          "stdout": "",
          "stderr": "",
        },
      )
      break
    _emit(out_fd, {"case": i, **outcome})
    if outcome["status"] != "ok" and job["stop_on_failure"]:
      break
    _kill_leftovers(job)
  _emit(out_fd, {"done": True})
  os._exit(0)


def _kill_leftovers(job):
  """Ends what a case left running (children in sessions of their own), so that it neither runs
  beside the next case nor counts against its CPU budget: every process this harness may signal,
  which the pid namespace or the sandbox uid confine to the sandbox."""
  if job["tree"] != "case":
    try:
      os.kill(-1, signal.SIGKILL)
    except OSError:  # none left
      pass


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
        _libc_call("unshare", CLONE_NEWUSER)
        os.write(ready_w, b"u")
        _close_user_namespaces(mapped_r)
        info["user_namespaces"] = 0
    except OSError as e:
      _emit(out_fd, {"setup_error": f"cannot keep user namespaces from the program: {e}"})
      os._exit(1)
    os.close(ready_w)
    os.close(mapped_r)
    try:
      _harness(job, out_fd, info)
    except BaseException as e:
      _emit(out_fd, {"sandbox_error": f"{type(e).__name__}: {e}"})
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
    _emit(out_fd, {"setup_error": f"cannot map the harness's user namespace ({ids}): {e}"})
    os.kill(pid, signal.SIGKILL)
  os.close(ready_r)
  os.close(mapped_w)
  return pid


def _init(job, out_fd, info):
  _libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
  # Orphans of the program come to us (not to the machine's init), so we can reap them below.
  _libc_call("prctl", PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
  if info["mountns"]:
    try:
      _mount_private(job, info)
    except OSError as e:  # never a silent downgrade to a sandbox that sees the host's files
      _emit(out_fd, {"setup_error": f"cannot build the sandbox's file system: {e}"})
      os._exit(1)
  pid = _fork_harness(job, out_fd, info)
  while os.wait()[0] != pid:  # reaps orphans too until the harness ends
    pass
  if not info["pidns"] and job["uid"] is not None:  # a pid namespace would end them all with us
    _kill_uid(job["uid"])
    _reap(block=True)
  _reap(block=False)
  os._exit(0)


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
  _libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
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
    _kill_uid(job["uid"])
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
      _emit(out_fd, {"setup_error": f"cannot join the sandbox's cgroup {job['cgroup']}: {e}"})
      return
  info = {"netns": False, "mountns": False, "pidns": False, "userns": False}
  if job["namespaces"]:
    root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    flags = (
      CLONE_NEWNET
      | CLONE_NEWNS
      | CLONE_NEWPID
      | CLONE_NEWIPC
      | CLONE_NEWUTS
      | (0 if root else CLONE_NEWUSER)
    )
    try:
      _libc_call("unshare", flags)
      if not root:
        _map_user(uid, gid)
      info.update(netns=True, mountns=True, pidns=True, ipcns=True, utsns=True, userns=not root)
    except OSError as e:
      _emit(
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
    _init(job, out_fd, info)
  _wait_or_end(job, pid, out_fd, gone_fd)


if __name__ == "__main__":
  main()
