"""An environment as the trainer's task (`config.task.name = "env:NAME"`, its fields in the config's
`env` group): each row plays its own episode of the problem its group was given, through the
rollout engine's turns, and its reward is the episode's grade.

  task = EnvTask("env:pointer_chase", registry.env_config("env:pointer_chase", hops=3))
  problems = task.sample(n, position)          # EnvProblems: prompt = the first turn's template
  turns = task.turns(row_problems, tokenizer)  # engine.run(..., turns=turns)
  grades = [turns.grade(row) for row in rows]  # after the rollout
"""

import dataclasses
from typing import Any

from sparrow_jax.envs import protocol, registry
from sparrow_jax.envs import turns as turns_lib


@dataclasses.dataclass(frozen=True)
class EnvProblem:
  id: str
  prompt: str  # the episode's first messages in the chat template, its tools in the system turn
  problem: Any  # the environment's own problem, which each row's env is reset on


class EnvTask:
  """The problems of environment `name` (a registry name) under `config` (its EnvConfig), and the
  turns a rollout of them plays; `tool_workers` tool calls run at once."""

  kind = "env"
  own_tokenizer = None  # the model's tokenizer renders the template

  def __init__(self, name: str, config, tool_workers: int = 4):
    if not (isinstance(tool_workers, int) and tool_workers > 0):
      raise ValueError(f"EnvTask.tool_workers must be a positive int, got {tool_workers!r}")
    self.name, self.config, self.tool_workers = name, config, tool_workers

  def _env(self):
    return registry.ENVS[self.name][1](self.config)

  def sample(self, n: int, position: int) -> list:
    """Problems position .. position + n - 1 of the environment's stream (a pure function of its
    config and the position, as a task's)."""
    env = self._env()
    return [EnvProblem(p.id, protocol.prompt_text(env, p), p) for p in env.sample(n, position)]

  def turns(self, problems: dict, tokenizer) -> turns_lib.EnvTurns:
    """The turns of a rollout whose Requests row `row` plays `problems[row]` (an EnvProblem), one
    fresh env per row, their calls in one pool."""
    envs = {}
    for row, problem in problems.items():
      envs[row] = self._env()
      envs[row].reset(problem.problem)
    return turns_lib.EnvTurns(envs, tokenizer, self.config.pool(self.tool_workers))
