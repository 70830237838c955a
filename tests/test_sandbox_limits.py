"""Code sandbox, what one submission cannot do to grading: starve its neighbours of CPU, make a
wrong answer cost every case, reach syscalls through another architecture, or outlive a killed
grader."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from sparrow_jax.data import rewards
from sparrow_jax.sandbox import host, runner

LIMITS = dict(timeout_s=1.0, memory_mb=256, nproc=32, output_bytes=1 << 16)
ADD = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
# About a third of a CPU second, well inside the timeout when it has a CPU to itself.
BUSY_ADD = "s = sum(range(6_000_000))\na, b = map(int, input().split())\nprint(a + b)"
# Answers right just inside the timeout (sleeping costs no CPU), with busy children in sessions of
# their own running meanwhile and left behind.
SETSID_FLOOD = (
  "import os, time\nfor _ in range(24):\n  try:\n    if os.fork() == 0:\n      os.setsid()\n"
  "      while True:\n        pass\n  except OSError:\n    break\n"
  "time.sleep(0.8)\na, b = map(int, input().split())\nprint(a + b)"
)
SIX = {"inputs": [f"{i} 1\n" for i in range(6)], "outputs": [f"{i + 1}\n" for i in range(6)]}


def fenced(program):
  return f"```python\n{program}\n```\n"


@pytest.mark.slow
def test_a_correct_program_beside_a_setsid_flood_passes():
  """Each setsid() child is a scheduling group of its own, so the flood would take nearly every CPU
  from its neighbour: the neighbour's clock does not count the time it waited for a CPU, what a case
  leaves running ends with it, and a case's whole process tree stops at its CPU budget."""
  grades = rewards.grade_code_batch(
    [fenced(SETSID_FLOOD), fenced(BUSY_ADD)], [SIX, SIX], max_workers=2, **LIMITS
  )
  assert grades[1] == (1.0, "correct"), grades


def test_a_wrong_answer_stops_at_its_first_failing_case(monkeypatch):
  runs = []
  run_cases = runner.run_cases
  monkeypatch.setattr(
    runner, "run_cases", lambda *a, **k: runs.append(run_cases(*a, **k)) or runs[-1]
  )
  tests = {"inputs": [f"{i} 1\n" for i in range(20)], "outputs": [f"{i + 1}\n" for i in range(20)]}
  assert rewards.grade_code(fenced("print(0)"), tests, **LIMITS) == (0.0, "wrong_answer")
  assert len(runs[0].cases) == 1
  # Partial credit still runs every case.
  assert rewards.grade_code(fenced("print(1)"), tests, partial=True, **LIMITS).reward == 1 / 20
  assert len(runs[1].cases) == 20


def test_a_grading_batch_past_its_budget_scores_0_with_its_reason():
  slow = fenced("import time\ntime.sleep(0.5)\na, b = map(int, input().split())\nprint(a + b)")
  tests = {"inputs": ["1 2\n"] * 8, "outputs": ["3\n"] * 8}
  grades = rewards.grade_code_batch(
    [slow, slow], [tests, tests], max_workers=2, batch_budget_s=1.5, **LIMITS
  )
  assert grades == [(0.0, "budget_exceeded")] * 2


def test_syscalls_of_another_architecture_kill_the_program():
  """int 0x80 enters the kernel's i386 table, where the key syscalls have other numbers."""
  if os.uname().machine != "x86_64":
    pytest.skip("the i386 entry point exists on x86_64 only")
  program = (
    "import ctypes, mmap\n"
    "code = bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3])  # mov eax, getpid; int 0x80; ret\n"
    "page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
    "page.write(code)\n"
    "f = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))\n"
    "print('reached', f(), flush=True)"
  )
  run = runner.run_cases(program, "stdio", [""], limits=runner.SandboxLimits(**LIMITS))
  case = run.cases[0]
  assert run.isolation["seccomp_keys"], run.isolation
  assert "reached" not in case["stdout"] and case["exit"] == -signal.SIGSYS, case


def _descendants(pid):
  children = {}
  for entry in filter(str.isdigit, os.listdir("/proc")):
    try:
      with open(f"/proc/{entry}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
      continue
    children.setdefault(ppid, []).append(int(entry))
  stack, out = [pid], []
  while stack:
    for child in children.get(stack.pop(), []):
      out.append(child)
      stack.append(child)
  return out


def _alive(pid):
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except OSError:
    return False


def _wait_for(condition, limit_s):
  deadline = time.monotonic() + limit_s
  while not condition() and time.monotonic() < deadline:
    time.sleep(0.05)
  return condition()


def test_a_killed_grader_leaves_no_process_and_no_directory(tmp_path):
  grader = (
    "import sys\nfrom sparrow_jax.sandbox import runner\n"
    "runner.run_cases('while True:\\n  pass', 'stdio', [''] * 3, work_root=sys.argv[1],"
    " limits=runner.SandboxLimits(timeout_s=30.0, cpu_s=60))"
  )
  proc = subprocess.Popen([sys.executable, "-c", grader, str(tmp_path)])
  try:
    # The outer process, init, the harness and the case process.
    assert _wait_for(lambda: len(_descendants(proc.pid)) >= 4, 60), _descendants(proc.pid)
    tree = _descendants(proc.pid)
    assert list(tmp_path.iterdir())
  finally:
    proc.kill()
    proc.wait()
  assert _wait_for(lambda: not any(map(_alive, tree)) and not list(tmp_path.iterdir()), 10), (
    [p for p in tree if _alive(p)],
    list(tmp_path.iterdir()),
  )


def test_startup_removes_only_the_leftovers_of_dead_graders(tmp_path):
  dead = subprocess.Popen([sys.executable, "-c", "pass"])
  dead.wait()
  owners = {"dead": (dead.pid, 1), "live": (os.getpid(), host._start_time(os.getpid()))}
  for name, (pid, start) in owners.items():
    directory = tmp_path / f"sparrow_sandbox_{name}"
    directory.mkdir()
    (directory / "owner.json").write_text(json.dumps({"pid": pid, "start": start}))
  (tmp_path / "sparrow_sandbox_unowned").mkdir()  # another version's, or still being made
  host.remove_leftovers(str(tmp_path))
  assert sorted(p.name for p in tmp_path.iterdir()) == [
    "sparrow_sandbox_live",
    "sparrow_sandbox_unowned",
  ]


def test_a_named_cgroup_must_have_the_cpu_controller_for_its_children(tmp_path):
  (tmp_path / "cgroup.subtree_control").write_text("cpu io memory\n")
  assert host._cgroup_root(str(tmp_path)) == str(tmp_path)
  (tmp_path / "cgroup.subtree_control").write_text("io memory\n")
  host._cgroup_root.cache_clear()
  with pytest.raises(host.SandboxSetupError, match="cpu controller"):
    host._cgroup_root(str(tmp_path))
  assert host._cgroup_root("none") is None
  with pytest.raises(ValueError, match="cpu_cgroup"):
    runner.SandboxLimits(cpu_cgroup="")
