"""Grading compares numbers without ever raising: integers exactly at any size, floats within
rewards.FLOAT_TOLERANCE only where the expected value is a float, non-finite values never equal to
finite ones. Whatever a program returns or prints is a reward, never an exception in training."""

import math

import pytest

from sparrow_jax.data import rewards

LIMITS = dict(timeout_s=5.0, memory_mb=512, nproc=32, output_bytes=1 << 16)


def fenced(code):
  return f"```python\n{code}\n```"


def call_tests(output):
  return {"fn_name": "f", "inputs": [[1]], "outputs": [[output]]}


@pytest.mark.parametrize(
  "body, expected, reward",
  ids=lambda v: str(v)[:24],
  argvalues=[
    ("import math\n  return math.factorial(200)", 3, 0.0),  # int beyond float range
    ("import math\n  return math.factorial(200)", 2.5, 0.0),  # ... against a float
    ("import math\n  return math.factorial(200)", math.factorial(200), 1.0),
    ("return 10**400 + 1", 10**400, 0.0),  # exact, not relative
    ("return 1000000000", 1000000007, 0.0),
    ("return 3.0", 3, 1.0),  # an int-valued float is that int
    ("return 0.1 + 0.2", 0.3, 1.0),  # floats: within the tolerance
    ("return float('inf')", 10**400, 0.0),
    ("return float('nan')", 1.5, 0.0),
  ],
)
def test_call_mode_numbers(body, expected, reward):
  got = rewards.grade_code(fenced(f"def f(a):\n  {body}"), call_tests(expected), **LIMITS)
  assert got.reward == reward, got
  assert got.reason in ("correct", "wrong_answer"), got


def test_deeply_nested_result_is_wrong_not_a_crash():
  # the program lifts its own recursion limit, so its result is written as 20,000-deep JSON,
  # deeper than the grading process's json.loads can parse
  program = (
    "import sys\nsys.setrecursionlimit(10**6)\ndef f(a):\n  x = []\n"
    "  for _ in range(20000):\n    x = [x]\n  return x"
  )
  got = rewards.grade_code(fenced(program), call_tests(1), **LIMITS)
  assert got == rewards.Grade(0.0, "wrong_answer"), got


@pytest.mark.parametrize(
  "printed, expected, passes",
  ids=lambda v: str(v)[:24],
  argvalues=[
    ("1000000000", "1000000007", False),  # integers exactly (no relative tolerance)
    ("1000000007", "1000000007", True),
    ("inf", "1" + "0" * 400, False),  # inf never equals a finite answer
    ("nan", "0.5", False),
    ("0.30000000000000004", "0.3", True),  # an expected float: within the tolerance
    ("0.3001", "0.3", False),
    ("3", "3.0", True),
    ("1" + "0" * 400, "1" + "0" * 399 + "1", False),
  ],
)
def test_stdout_numbers(printed, expected, passes):
  assert rewards._same_stdout(printed + "\n", expected + "\n") is passes


def test_grader_bug_costs_the_reward_not_the_run(monkeypatch):
  def broken(tests, case):
    raise OverflowError("a grader bug")

  monkeypatch.setattr(rewards, "_passed", broken)
  got = rewards.grade_code(fenced("def f(a):\n  return 1"), call_tests(1), **LIMITS)
  assert got == rewards.Grade(0.0, "grader_error")
