"""Verifiable rewards: math (the last \\boxed{} checked with math-verify) and code (tests in a
sandbox).

Graders never raise on what a model wrote: they return a `Grade` whose `reason` says why a response
got its reward, so the caller can count failures (no answer, unparsable LaTeX, timeouts, sandbox
errors) in state it owns. Only a malformed reference (a bad `tests` spec) raises ValueError.
"""

import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from typing import Any, NamedTuple

from sparrow_jax.sandbox import runner

log = logging.getLogger(__name__)

MATH_TIMEOUT_S = 5
WORKER_START_S = 20  # a math worker's start and imports (sympy), besides its grading timeouts
_BOX = re.compile(r"\\(?:boxed|fbox)")
_FENCE = re.compile(r"```([^\n`]*)\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = ("", "python", "python3", "py")


class Grade(NamedTuple):
  reward: float
  reason: (
    str  # math: correct wrong wrong_form no_answer unfinished_thinking unparsable bad_reference
    # timeout error
  )
  # code: correct partial wrong_answer runtime_error timeout output_limit no_code aborted
  #       sandbox_error grader_error budget_exceeded


def final_text(response: str) -> str | None:
  """The answer part of a response: after the last </think>; None while thinking is unfinished."""
  if "</think>" in response:
    return response.rsplit("</think>", 1)[1]
  return None if "<think>" in response else response


def last_boxed(text: str) -> str | None:
  """Content of the last \\boxed{...} (nested and escaped braces handled) or `\\boxed x`; else
  None."""
  matches = list(_BOX.finditer(text))
  if not matches:
    return None
  rest = text[matches[-1].end() :]
  body = rest.lstrip()
  if not body.startswith("{"):
    word = re.match(r"\s+([^\s$]+)", rest)
    return word.group(1).rstrip(".,;") if word else None
  depth, i = 0, 0
  while i < len(body):
    ch = body[i]
    if ch == "\\":
      i += 2
      continue
    depth += {"{": 1, "}": -1}.get(ch, 0)
    if depth == 0:
      return body[1:i].strip()
    i += 1
  return None


class _MathWorker:
  """A Python process that grades math on its main thread, where math-verify's SIGALRM timeouts
  work, for callers on other threads; one line of JSON each way per grade."""

  def __init__(self):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
      os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    )
    self.proc = subprocess.Popen(
      [sys.executable, "-c", "from sparrow_jax.data import rewards; rewards._serve_math()"],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      env=env,
      text=True,
    )

  def grade(self, response: str, answer: str, timeout_s: int, wait_s: float) -> Grade:
    self.proc.stdin.write(json.dumps([response, answer, timeout_s]) + "\n")
    self.proc.stdin.flush()
    if not select.select([self.proc.stdout], [], [], wait_s)[0]:
      raise TimeoutError(f"no grade within {wait_s}s")
    line = self.proc.stdout.readline()
    if not line:
      raise EOFError("the math worker died")
    return Grade(*json.loads(line))

  def kill(self):
    self.proc.kill()
    self.proc.wait()


def _serve_math():
  """The worker's loop: [response, answer, timeout_s] in, [reward, reason] out (stdout is the
  replies' alone: anything printed while grading goes to stderr)."""
  replies = os.fdopen(os.dup(1), "w")
  sys.stdout = sys.stderr
  for line in sys.stdin:
    response, answer, timeout_s = json.loads(line)
    replies.write(json.dumps(list(grade_math(response, answer, timeout_s=timeout_s))) + "\n")
    replies.flush()


_math_worker = threading.local()  # each grading thread's worker


def _grade_math_in_worker(response: str, answer: str, timeout_s: int) -> Grade:
  """grade_math off the main thread: in this thread's worker, waited for at most twice timeout_s
  (a parse and a comparison) plus its start; a worker that overruns or dies is killed and a new one
  serves the next call."""
  if getattr(_math_worker, "worker", None) is None:
    _math_worker.worker = _MathWorker()
  try:
    return _math_worker.worker.grade(response, answer, timeout_s, 2 * timeout_s + WORKER_START_S)
  except (TimeoutError, EOFError, OSError, ValueError) as e:
    log.warning("math worker: %s", e)
    _math_worker.worker.kill()
    _math_worker.worker = None
    return Grade(0.0, "timeout" if isinstance(e, TimeoutError) else "error")


def grade_math(response: str, answer: str, *, timeout_s: int = MATH_TIMEOUT_S) -> Grade:
  """1.0 when the last \\boxed{} of the response's answer part equals `answer` per math-verify,
  within timeout_s per parse and per comparison (on any thread)."""
  if threading.current_thread() is not threading.main_thread():
    return _grade_math_in_worker(response, answer, timeout_s)
  from math_verify import parse, verify  # slow import (sympy); only math grading needs it
  from math_verify.errors import TimeoutException

  text = final_text(response)
  if text is None:
    return Grade(0.0, "unfinished_thinking")
  boxed = last_boxed(text)
  if not boxed:
    return Grade(0.0, "no_answer")
  answer = str(answer).strip().strip("$")
  try:
    gold = parse(
      answer if "\\boxed" in answer else f"\\boxed{{{answer}}}",
      parsing_timeout=timeout_s,
      raise_on_error=True,
    )
    if not gold:
      return Grade(0.0, "bad_reference")
    pred = parse(f"\\boxed{{{boxed}}}", parsing_timeout=timeout_s, raise_on_error=True)
    if not pred:
      return Grade(0.0, "unparsable")
    ok = verify(gold, pred, timeout_seconds=timeout_s, raise_on_error=True)
    if ok and not _answer_form(answer, gold, boxed, pred, timeout_s):
      return Grade(0.0, "wrong_form")
  except TimeoutException:  # a BaseException in math-verify
    return Grade(0.0, "timeout")
  except Exception:  # sympy/latex2sympy failures on malformed LaTeX
    log.debug("math-verify failed on %r", boxed, exc_info=True)
    return Grade(0.0, "error")
  return Grade(1.0, "correct") if ok else Grade(0.0, "wrong")


# Operators that leave the work undone: a series, product, integral, limit, derivative or
# determinant that evaluates to the answer restates the problem (sympy would evaluate it).
_UNEVALUATED = re.compile(
  r"\\(?:sum|prod|int|iint|iiint|oint|lim|limsup|liminf|det|partial)(?![a-zA-Z])"
  r"|\\begin\{[vV]matrix\}"
  r"|\\[dt]?frac\{\s*(?:d|\\mathrm\{d\})\s*\}\{\s*(?:d|\\mathrm\{d\})\s*[a-zA-Z\\]"  # d/dx
)


def _expression(parsed):
  """The sympy expression of a math-verify parse, or None (a string only)."""
  import sympy

  return next((p for p in parsed if isinstance(p, sympy.Basic)), None)


def _answer_form(gold_text, gold, boxed, pred, timeout_s) -> bool:
  """Whether an answer that math-verify accepts is in the reference's form class: no operator left
  unevaluated that the reference lacks, no equation between values that differ (`6 = 5`), and no
  decimal for an exact reference unless it is exactly equal (`0.333333` is not 1/3)."""
  from math_verify import verify
  import sympy

  if _UNEVALUATED.search(boxed) and not _UNEVALUATED.search(gold_text):
    return False
  expr, gold_expr = _expression(pred), _expression(gold)
  if expr is None:
    return True
  calculus = (sympy.Sum, sympy.Product, sympy.Integral, sympy.Limit, sympy.Derivative)
  if expr.has(*calculus) and not (gold_expr is not None and gold_expr.has(*calculus)):
    return False
  if isinstance(expr, sympy.Equality) and not expr.free_symbols:
    if not verify(expr.lhs, expr.rhs, timeout_seconds=timeout_s, raise_on_error=True):
      return False
  if expr.atoms(sympy.Float) and gold_expr is not None and not gold_expr.atoms(sympy.Float):
    return verify(gold, pred, float_rounding=15, timeout_seconds=timeout_s, raise_on_error=True)
  return True


def math_reward(response: str, answer: str) -> float:
  return grade_math(response, answer).reward


@dataclasses.dataclass(frozen=True)
class CodeTests:
  """A code problem's tests. mode "stdio": inputs are stdin texts, outputs the expected stdout;
  "call": inputs are argument lists of fn_name, outputs its return values; "script": `script` (e.g.
  HumanEval's check) must run to its end, calling the program's functions (`prefix`, e.g. imports
  and the prompt's stubs and helpers, comes before both; see script_mode.candidate_names)."""

  mode: str
  inputs: tuple = (None,)
  outputs: tuple = (None,)
  fn_name: str | None = None
  prefix: str = ""
  script: str = ""


def _text(value, field):
  """A stdin/stdout value: a string, or a list of lines (some TACO rows)."""
  if isinstance(value, str):
    return value
  if isinstance(value, list) and all(isinstance(v, str) for v in value):
    return "\n".join(value) + "\n"
  raise ValueError(f"tests {field} must be strings or lists of lines, got {type(value).__name__}")


def parse_tests(tests: Any) -> CodeTests:
  """Validates a tests spec: a CodeTests, a dict or its JSON text (TACO's input_output) with
  inputs/outputs [+ fn_name], or with script [+ prefix]. Raises ValueError naming what is wrong."""
  if isinstance(tests, CodeTests):
    return tests
  if isinstance(tests, (str, bytes)):
    try:
      tests = json.loads(tests)
    except ValueError as e:
      raise ValueError(f"tests are not valid JSON: {e}") from None
  if not isinstance(tests, dict):
    raise ValueError(
      f"tests must be a dict with inputs/outputs or script, got {type(tests).__name__}"
    )
  if "script" in tests:
    if not isinstance(tests["script"], str) or not tests["script"].strip():
      raise ValueError("tests script must be a non-empty string")
    return CodeTests("script", prefix=str(tests.get("prefix") or ""), script=tests["script"])
  inputs, outputs = tests.get("inputs"), tests.get("outputs")
  if not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs:
    raise ValueError("tests need non-empty lists 'inputs' and 'outputs' (or a 'script')")
  if len(inputs) != len(outputs):
    raise ValueError(f"tests have {len(inputs)} inputs but {len(outputs)} outputs")
  fn_name = tests.get("fn_name")
  if fn_name:
    if not isinstance(fn_name, str):
      raise ValueError(f"tests fn_name must be a string, got {fn_name!r}")
    return CodeTests("call", tuple(inputs), tuple(outputs), fn_name=fn_name)
  return CodeTests(
    "stdio", tuple(_text(v, "inputs") for v in inputs), tuple(_text(v, "outputs") for v in outputs)
  )


def extract_code(response: str) -> str | None:
  """The last fenced ```python (or untagged ```) block of the response's answer part."""
  text = final_text(response)
  if text is None:
    return None
  blocks = [body for tag, body in _FENCE.findall(text) if tag.strip().lower() in _PYTHON_TAGS]
  return blocks[-1] if blocks else None


FLOAT_TOLERANCE = 1e-6  # relative and absolute, for expected values written as floats only


def _number(text: str):
  """A stdout token as an int (arbitrary size) or a float, else None."""
  try:
    return int(text)
  except ValueError:
    pass
  try:
    return float(text)
  except ValueError:
    return None


def _same_number(got, want) -> bool:
  """Integers compare exactly, at any size (Python compares an int with a float exactly, without
  converting); an expected float matches within FLOAT_TOLERANCE; a non-finite value never matches a
  finite one, and NaN matches nothing. Nothing here can raise."""
  if isinstance(want, int):
    return got == want
  if isinstance(got, int):
    try:
      got = float(got)
    except OverflowError:  # an int beyond float range is no float answer
      return False
  if not (math.isfinite(got) and math.isfinite(want)):
    return got == want
  return math.isclose(got, want, rel_tol=FLOAT_TOLERANCE, abs_tol=FLOAT_TOLERANCE)


def _same_stdout(got, want):
  """Token-wise, whitespace-insensitive; integer tokens exactly, float tokens of the expected
  output within FLOAT_TOLERANCE (how TACO-style judges compare)."""
  got, want = got.split(), want.split()
  if got == want:
    return True
  if len(got) != len(want):
    return False
  for a, b in zip(got, want):
    if a != b:
      a_num, b_num = _number(a), _number(b)
      if a_num is None or b_num is None or not _same_number(a_num, b_num):
        return False
  return True


def _equal(a, b):
  numbers = (int, float)
  if (
    isinstance(a, numbers)
    and isinstance(b, numbers)
    and not isinstance(a, bool)
    and not isinstance(b, bool)
  ):
    return _same_number(a, b)
  if isinstance(a, list) and isinstance(b, list):
    return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
  return a == b


def _same_result(got_json, want):
  """The program's JSON result against the expected value; a result too deep to parse or compare
  (RecursionError) is simply wrong."""
  try:
    got = json.loads(got_json)
    # TACO wraps each expected return value in a one-element list.
    return _equal(got, want) or (isinstance(want, list) and len(want) == 1 and _equal(got, want[0]))
  except (ValueError, RecursionError):
    return False


def _passed(tests, case):
  if case["status"] != "ok":
    return False
  if tests.mode == "stdio":
    return _same_stdout(case["stdout"], tests.outputs[case["case"]])
  if tests.mode == "call":
    return _same_result(case.get("result", ""), tests.outputs[case["case"]])
  return True  # script: the sandbox certified that the check ran to its end


def _judge(tests):
  """The streamed check of one case (see runner.run_cases); a grader bug fails the case, and
  grading the whole run then reports it."""

  def judge(case):
    try:
      return _passed(tests, case)
    except Exception:
      return False

  return judge


def grade_code(
  response: str, tests: Any, *, partial: bool = False, deadline: float | None = None, **limits
) -> Grade:
  """Runs the response's last code block on `tests` in a sandbox (`limits`: SandboxLimits fields),
  stopping at the first failing case unless `partial`. Reward 1.0 if every case passes else 0.0, or
  the passed fraction when `partial`; 0.0 "budget_exceeded" when `deadline` (time.monotonic())
  ends it first."""
  tests = parse_tests(tests)
  sandbox_limits = runner.SandboxLimits.make(**limits)
  program = extract_code(response)
  if program is None:
    return Grade(0.0, "no_code")
  if deadline is not None and time.monotonic() >= deadline:
    return Grade(0.0, "budget_exceeded")
  try:
    run = runner.run_cases(
      program,
      tests.mode,
      tests.inputs,
      fn_name=tests.fn_name,
      prefix=tests.prefix,
      script=tests.script,
      stop_on_failure=not partial,
      judge=_judge(tests),
      deadline=deadline,
      limits=sandbox_limits,
    )
  except OSError as e:  # e.g. no space for the work directory: the trainer must go on
    log.warning("code sandbox failed to start: %s", e)
    return Grade(0.0, "sandbox_error")
  if run.past_deadline:
    return Grade(0.0, "budget_exceeded")
  try:
    passed = sum(_passed(tests, case) for case in run.cases)
  except Exception:  # a grader bug must cost this response its reward, never the training run
    log.exception("grading a code response raised (a grader bug: please report it)")
    return Grade(0.0, "grader_error")
  total = len(tests.inputs)
  reward = passed / total if partial else float(passed == total)
  if passed == total:
    return Grade(reward, "correct")
  if not run.isolation:
    log.warning("code sandbox error: %s", run.error)
    return Grade(reward, "sandbox_error")
  cut = [c for c in run.cases if c["status"] == "output_limit"]  # it ended the run: say so
  failed = cut[0] if cut else next((c for c in run.cases if not _passed(tests, c)), None)
  if failed is None:
    reason = "aborted"
  else:
    reason = {"ok": "wrong_answer", "timeout": "timeout", "output_limit": "output_limit"}.get(
      failed["status"], "runtime_error"
    )
  return Grade(reward, "partial" if partial and passed else reason)


def code_reward(response: str, tests: Any, *, partial: bool = False, **limits) -> float:
  return grade_code(response, tests, partial=partial, **limits).reward


def grade_code_batch(responses, tests, *, partial=False, max_workers=None, **limits) -> list[Grade]:
  """grade_code over pairs, in a bounded pool of threads (each drives one sandbox process tree),
  all within `batch_budget_s` (a SandboxLimits field): past it, what has not finished scores 0,
  reason "budget_exceeded" (the trainer counts them from the grades)."""
  if len(responses) != len(tests):
    raise ValueError(f"{len(responses)} responses but {len(tests)} tests")
  budget_s = runner.SandboxLimits.make(**limits).batch_budget_s
  deadline = None if budget_s is None else time.monotonic() + budget_s
  workers = max_workers or os.cpu_count() or 1
  grade = lambda r, t: grade_code(r, t, partial=partial, deadline=deadline, **limits)
  with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
    return list(pool.map(grade, responses, tests))
