"""Math reward: last \\boxed{} + math-verify, table-driven; malformed input never raises."""

import threading

import pytest

from sparrow_jax.data.rewards import final_text, grade_math, last_boxed, math_reward

# (response, reference answer, expected reward)
CASES = [
  # equivalent forms
  ("The answer is \\boxed{\\frac{1}{2}}.", "1/2", 1.0),
  ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
  ("\\boxed{1/2}", "0.5", 1.0),
  ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
  ("\\boxed{\\tfrac{3}{4}}", "0.75", 1.0),
  ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
  ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0),
  ("\\boxed{10.0}", "10", 1.0),
  ("\\boxed{1,000}", "1000", 1.0),
  ("\\boxed{-4}", "-4", 1.0),
  ("\\boxed{1+x^2}", "x^2+1", 1.0),
  ("\\boxed{x = 5}", "5", 1.0),
  ("\\boxed{\\text{(B)}}", "B", 1.0),
  ("$\\boxed{142}$", 142, 1.0),  # integer reference (AIME/AMC columns)
  # units, percent, degrees
  ("\\boxed{5 \\text{ cm}}", "5", 1.0),
  ("\\boxed{5\\,\\mathrm{cm}}", "5", 1.0),
  ("\\boxed{50\\%}", "50", 1.0),
  ("\\boxed{90^\\circ}", "90", 1.0),
  # intervals and sets
  ("\\boxed{[1, 2)}", "[1,2)", 1.0),
  ("\\boxed{(1,2)}", "(1,2]", 0.0),
  ("\\boxed{(-\\infty, 3)}", "(-\\infty,3)", 1.0),
  ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", 1.0),
  # the last box counts
  ("\\boxed{1} at first, but finally \\boxed{2}", "2", 1.0),
  ("\\boxed{1} at first, but finally \\boxed{2}", "1", 0.0),
  ("<think>maybe \\boxed{4}</think>So the answer is \\boxed{3}.", "3", 1.0),
  # nested braces and the \boxed x form
  ("\\boxed{\\frac{1}{\\frac{1}{2}}}", "2", 1.0),
  ("\\boxed{{{7}}}", "7", 1.0),
  ("$\\boxed 7$", "7", 1.0),
  ("\\fbox{12}", "12", 1.0),
  # wrong, missing, unfinished
  ("\\boxed{4}", "-4", 0.0),
  ("\\boxed{\\pi}", "3.14159", 0.0),
  ("The answer is 3.", "3", 0.0),
  ("<think>\\boxed{3} but let me check", "3", 0.0),
  ("<think>ok</think>The answer is 3.", "3", 0.0),
  # restating the problem is no answer: operators left unevaluated, equations whose sides differ,
  # a decimal cut short of an exact value; hedging between values
  ("\\boxed{\\sum_{n=1}^{\\infty} \\frac{1}{2^n}}", "1", 0.0),
  ("\\boxed{\\int_0^1 2x\\,dx}", "1", 0.0),
  ("\\boxed{\\lim_{x\\to 0} \\frac{\\sin x}{x}}", "1", 0.0),
  ("\\boxed{\\det\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}}", "-2", 0.0),
  ("\\boxed{\\begin{vmatrix}1&2\\\\3&4\\end{vmatrix}}", "-2", 0.0),
  ("\\boxed{\\prod_{k=1}^{3} k}", "6", 0.0),
  ("\\boxed{6 = 5}", "5", 0.0),
  ("\\boxed{2 + 3 = 5}", "5", 1.0),
  ("\\boxed{0.333333}", "\\frac{1}{3}", 0.0),
  ("\\boxed{1.41421}", "\\sqrt{2}", 0.0),
  ("\\boxed{0.25}", "\\frac{1}{4}", 1.0),
  ("\\boxed{3 \\text{ or } 4}", "3", 0.0),
  ("\\boxed{\\int_0^1 x\\,dx}", "\\int_0^1 x\\,dx", 1.0),  # a reference in that form
  # garbage
  ("\\boxed{}{", "1", 0.0),
  ("\\boxed{\\frac{1}{", "1", 0.0),
  ("\\boxed{@#$%^&}", "1", 0.0),
  ("\\boxed{\\left(}", "1", 0.0),
  ("\\boxed{\\frac{}{}}", "1", 0.0),
  ("\\boxed{3}", "\\frac{", 0.0),
  ("", "1", 0.0),
]


@pytest.mark.parametrize("response,answer,expected", CASES)
def test_math_reward_table(response, answer, expected):
  assert math_reward(response, answer) == expected


@pytest.mark.parametrize(
  "response,reason",
  [
    ("\\boxed{3}", "correct"),
    ("\\boxed{4}", "wrong"),
    ("no box here", "no_answer"),
    ("\\boxed{3", "no_answer"),
    ("<think>still going \\boxed{3}", "unfinished_thinking"),
    ("\\boxed{\\sum_{n=1}^{3} 1}", "wrong_form"),
  ],
)
def test_grade_reasons(response, reason):
  assert grade_math(response, "3").reason == reason


def test_last_boxed_parsing():
  assert last_boxed("\\boxed{a} \\boxed{b{c}d}") == "b{c}d"
  assert last_boxed("\\boxed{\\{1,2\\}}") == "\\{1,2\\}"  # escaped braces do not nest
  assert last_boxed("so \\boxed 42.") == "42"
  assert last_boxed("\\boxed{1} then \\boxed{2") is None  # the last one is cut off
  assert last_boxed("\\boxedfoo") is None
  assert last_boxed("nothing") is None
  assert final_text("<think>a</think>b</think>c") == "c"
  assert final_text("plain") == "plain"
  assert final_text("<think>a") is None


def test_pathological_expression_times_out_instead_of_hanging():
  grade = grade_math("\\boxed{9^{9^{9^{9}}}}", "9", timeout_s=1)
  assert grade == (0.0, "timeout")


@pytest.mark.slow
def test_malformed_inputs_never_raise():
  garbage = [
    "\\boxed{\\sqrt[}",
    "\\boxed{\\begin{matrix}}",
    "\\boxed{\\frac{1}{0}}",
    "\\boxed{" + "(" * 300 + "}",
    "\\boxed{\x00\xff}",
    "\\boxed{\\int}",
    "\\boxed{1e999999}",
    "}}}{{{\\boxed{",
  ]
  for response in garbage:
    grade = grade_math(response, "1")
    assert grade.reward == 0.0 and grade.reason in (
      "wrong",
      "no_answer",
      "unparsable",
      "timeout",
      "error",
    ), (response, grade)


@pytest.mark.slow
def test_works_off_the_main_thread_with_its_timeout():
  """Off the main thread (no SIGALRM) grading runs in the thread's worker process: correct answers
  grade as usual and a power tower that would hang sympy times out."""
  out = []

  def grade_both():
    out.append(grade_math("\\boxed{9^{9^{9^{9^{9}}}}}", "1", timeout_s=2))
    out.append(grade_math("\\boxed{\\frac{2}{4}}", "0.5"))

  thread = threading.Thread(target=grade_both)
  thread.start()
  thread.join(timeout=120)
  assert not thread.is_alive() and out == [(0.0, "timeout"), (1.0, "correct")], out
