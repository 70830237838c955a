"""Environments as the rollout engine's turns (`engine.run(turns=...)`, rollout/scheduler.Turns):
one episode per row, its tool calls run in a ToolPool off the decode loop, each observation handed
back as the token ids that go into the row.

  turns = EnvTurns({row: env}, tokenizer, pool)   # every env already reset on its problem
  rollout, stats = engine.run(..., turns=turns)
  grades = {row: turns.grade(row) for row in turns.envs}

A row's turn is decoded to text and given to its env: a final answer ends the row; a tool call is
submitted to the pool and the row waits (the other rows decode on); a malformed call is an
observation at once. An observation is rendered in the model's chat template
(`protocol.observation_text`), its tool response cut to the env's max_observation_tokens.
"""

import collections

import numpy as np

from sparrow_jax.data import rewards
from sparrow_jax.envs import protocol, tools


class EnvTurns:
  """engine.run's turns over `envs` (Requests row index -> its env, reset on the row's problem),
  decoding and encoding with `tokenizer`, running tool calls in `pool` (one caller: the engine's
  loop)."""

  def __init__(self, envs: dict, tokenizer, pool: tools.ToolPool):
    self.envs, self.tokenizer, self.pool = envs, tokenizer, pool
    self.problems = {row: env.problem for row, env in envs.items()}
    self.episode = dict.fromkeys(envs, 0)  # a restarted row's calls still running are not its own
    self.ready = {}  # row -> Step whose observation goes into the row
    self.counts = {row: collections.Counter() for row in envs}  # this episode's tool use

  def turn_ended(self, row: int, turn: list) -> bool:
    env = self.envs[row]
    step = env.step(self.tokenizer.decode(turn))
    if step.done:
      return False
    if step.call is None:
      self.ready[row] = step
      self.counts[row]["bad_calls"] += 1
    else:
      name, arguments = step.call
      self.pool.submit((row, self.episode[row]), env.tools[name], **arguments)
      self.counts[row]["tool_calls"] += 1
    return True

  def observations(self, wait: bool) -> dict:
    results = self.pool.ready()
    while wait and not (results or self.ready) and self.pool.pending():
      results = self.pool.wait()  # the pool ends a hung call at its timeout
    for result in results:
      row, episode = result.row_id
      if episode == self.episode[row]:
        self.ready[row] = self.envs[row].observe(result)
        self.counts[row][f"tool_{result.status}"] += 1
        self.counts[row]["tool_seconds"] += result.seconds
    out = {row: self._ids(row, step) for row, step in self.ready.items()}
    self.ready = {}
    return out

  def restart(self, row: int) -> None:
    self.episode[row] += 1
    self.ready.pop(row, None)
    self.counts[row] = collections.Counter()
    self.envs[row].reset(self.problems[row])

  def grade(self, row: int) -> rewards.Grade:
    """The row's reward: its env's grade, or 0 with reason "max_tokens" where the row reached its
    max_new tokens before its episode ended."""
    env = self.envs[row]
    return env.grade() if env.done else rewards.Grade(0.0, "max_tokens")

  def metrics(self, observed_BM, lengths_B) -> dict:
    """The episodes' tool use (this process's rows, as the rollout ended them) and the share of
    the completion tokens that are observations (`Rollout.observed`, `lengths`)."""
    total = sum(self.counts.values(), collections.Counter())
    turns = np.asarray([env.turns for env in self.envs.values()])
    written = np.arange(np.shape(observed_BM)[1])[None] < np.asarray(lengths_B)[:, None]
    return {
      "env/turns/mean": float(turns.mean()),
      "env/turns/max": int(turns.max()),
      "env/tool_calls": total["tool_calls"],
      "env/tool_errors": total["tool_error"],
      "env/tool_timeouts": total["tool_timeout"],
      "env/bad_calls": total["bad_calls"],
      "env/tool_seconds": float(total["tool_seconds"]),
      "env/observation_share": float(np.sum(observed_BM & written) / max(np.sum(written), 1)),
    }

  def _ids(self, row: int, step: protocol.Step) -> list:
    """The observation's token ids: the tool response (cut to the env's budget) in a user turn,
    then the next generation prompt."""
    text = protocol.observation_turn(self.envs[row].config, step.observation, self.tokenizer)
    return self.tokenizer.encode(text)
