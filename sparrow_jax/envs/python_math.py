"""env:python_math: a math problem the model may work out with a Python tool, answered in \\boxed{}.

The problems are a single-turn math task's (sparrow_jax.data.tasks: `dataset` names it, as
config.task.name would, e.g. math:reasoning_gym:basic_arithmetic generated offline, or math:gsm8k
with `path` a local parquet/jsonl/json file), in the same shuffled stream (`Task.sample`), and the
final answer gets the same grade the single-turn task gives it (rewards.grade_math, math-verify).
Each turn the model may call python(code): the program runs in the project's sandbox
(tools.PythonTool, its limits) and the observation is its exit status, stdout and stderr; a turn
without a call is the final answer.

A turn calling the tool, then (as the next user turn) its observation, then the final answer:
  <tool_call>\\n{"name": "python", "arguments": {"code": "print(17 * 23 - 5)"}}\\n</tool_call>
  exit status: 0\\nstdout:\\n386\\n\\nstderr:\\n
  The answer is \\boxed{386}.
"""

import dataclasses
import functools

from sparrow_jax.data import rewards, tasks
from sparrow_jax.data.tokenizer import tool_call_text
from sparrow_jax.envs import protocol, tools
from sparrow_jax.sandbox import runner

# What the user turn asks after the problem: the tool is named here too (not only in the system
# turn's tool list), since a small instruct model reads the request more than the list.
INSTRUCTION = (
  "You may call the python tool to run a Python program and read what it prints. Put your final "
  "answer within \\boxed{}."
)


def math_dataset(name: str) -> bool:
  """Whether `name` is a math task of the task registry (what `dataset` may name)."""
  if name.startswith(tasks.REASONING_GYM):
    return len(name) > len(tasks.REASONING_GYM)
  return tasks.FORMATS.get(name, ("",))[0] == "math"


@dataclasses.dataclass(frozen=True)
class PythonMathConfig(protocol.EnvConfig):
  dataset: str = "math:reasoning_gym:basic_arithmetic"  # the math task the problems come from
  #                          (a tasks.make_task name: math:gsm8k, math:dapo, ... read `path`;
  #                          math:reasoning_gym:<dataset> generates them offline)
  path: str = ""  # the dataset's local parquet/jsonl/json file or directory ("" for
  #                          reasoning-gym, which reads none)
  limit: int = 0  # the first problems kept (reasoning-gym: how many are generated, 0: its 1000;
  #                          a file: 0 keeps all)
  seed: int = 0  # the problems' shuffled order (and reasoning-gym's generator), as a task's seed
  code_timeout_s: float = 2.0  # the sandbox's clock for one program (SandboxLimits.timeout_s):
  #                          a loop ends there, its output so far in the observation
  example: bool = False  # an example turn before the problem (a question and the python call
  #                          on it, example_messages), so a small model that does not follow the
  #                          tool list still sees a call to copy
  MAY_BE_ZERO = ("limit", "seed")

  def __post_init__(self):
    super().__post_init__()
    name = type(self).__name__
    for field in ("dataset", "path"):
      if not isinstance(getattr(self, field), str):
        raise ValueError(f"{name}.{field} must be a string, got {getattr(self, field)!r}")
    math_names = [n for n in tasks.task_names() if n.startswith("math:")]
    for field, ok, rule in (
      ("dataset", math_dataset(self.dataset), f"must be a math task, one of {math_names}"),
      (
        "path",
        not (self.dataset.startswith(tasks.REASONING_GYM) and self.path),
        f"must be '' for {self.dataset} (reasoning-gym generates its problems)",
      ),
      (
        "path",
        self.path or self.dataset.startswith(tasks.REASONING_GYM),
        f"must name {self.dataset}'s local data file or directory",
      ),
      (
        "code_timeout_s",
        self.code_timeout_s < self.tool_timeout_s,
        f"must be < tool_timeout_s ({self.tool_timeout_s!r}): a looping program then reports "
        "its own timeout and output, not the pool's bare one",
      ),
    ):
      if not ok:
        raise ValueError(f"{name}.{field} = {getattr(self, field)!r} {rule}")


@functools.lru_cache(maxsize=4)
def load_task(dataset: str, path: str, limit: int, seed: int) -> tasks.Task:
  """The single-turn task the problems come from, loaded once per process and source: every
  step's sample() makes a fresh env, and a dataset is read (or generated) in seconds. A Task is
  frozen, so sharing it is safe. A source that cannot be read raises naming the field."""
  try:
    return tasks.make_task(dataset, path or None, seed=seed, limit=limit or None)
  except (ValueError, OSError) as e:
    raise ValueError(
      f"{PythonMathConfig.__name__}.dataset = {dataset!r} with path = {path!r} cannot be read: {e}"
    ) from None


# The example turn, written by hand (not drawn from any dataset: no problem's answer leaks). It
# stops at the call: shown the tool's response and a final answer too, SmolLM2-135M-Instruct copies
# the response, writing `<tool_response>` where a call goes, and never calls (docs/multi_turn.md).
EXAMPLE_QUESTION, EXAMPLE_CODE = "Calculate 17 * 23 - 5.", "print(17 * 23 - 5)"


def user_turn(question: str) -> dict:
  return {"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}


def example_messages() -> list:
  """The example as chat turns: a question and the assistant turn calling the tool on it, in the
  chat template's tool format."""
  call = tool_call_text("python", {"code": EXAMPLE_CODE})
  return [user_turn(EXAMPLE_QUESTION), {"role": "assistant", "content": call}]


def first_messages(question: str, example: bool = False) -> list:
  """The episode's opening: the problem and how to use the tool and answer, after the worked
  example when asked."""
  return (example_messages() if example else []) + [user_turn(question)]


class PythonMathEnv(protocol.ToolEnv):
  name = "env:python_math"

  def __init__(self, config: PythonMathConfig = PythonMathConfig()):
    super().__init__(config)
    limits = runner.SandboxLimits(timeout_s=config.code_timeout_s)
    self.tools = {"python": tools.PythonTool(limits)}

  def sample(self, n: int, position: int) -> list:
    """Problems position .. position + n - 1 of the dataset's shuffled stream (tasks.Problem, as
    the single-turn task samples them under the same seed)."""
    c = self.config
    return load_task(c.dataset, c.path, c.limit, c.seed).sample(n, position)

  def first_messages(self, problem: tasks.Problem) -> list:
    return first_messages(problem.question, self.config.example)

  def grade_answer(self, text: str, problem: tasks.Problem) -> rewards.Grade:
    """The single-turn math task's grade (Task.grade of a math task, default options)."""
    return rewards.grade_math(text, problem.reference)
