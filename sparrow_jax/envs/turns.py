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
    self._observe(results)
    out = {row: self._ids(row, step) for row, step in self.ready.items()}
    self.ready = {}
    return out

  def _observe(self, results) -> None:
    """The pool's results as their rows' ready observations (a restarted row's old call's are
    dropped)."""
    for result in results:
      row, episode = result.row_id
      if row in self.envs and episode == self.episode[row]:
        self.ready[row] = self.envs[row].observe(result)
        self.counts[row][f"tool_{result.status}"] += 1
        self.counts[row]["tool_seconds"] += result.seconds

  def restart(self, row: int) -> None:
    self.episode[row] += 1
    self.ready.pop(row, None)
    self.counts[row] = collections.Counter()
    self.envs[row].reset(self.problems[row])

  # -- rows carried over steps (a partial rollout's: rl/rollouts.Carried)

  def add(self, other: "EnvTurns") -> None:
    """Takes the rows of `other` (a later step's new rows, their envs reset) into these turns."""
    for row, env in other.envs.items():
      self.envs[row], self.problems[row] = env, other.problems[row]
      self.episode[row], self.counts[row] = 0, collections.Counter()

  def drop(self, rows) -> None:
    """Forgets `rows` (taken out of the rollout and graded)."""
    for row in rows:
      for by_row in (self.envs, self.problems, self.episode, self.counts):
        del by_row[row]
      self.ready.pop(row, None)

  def state(self) -> dict:
    """Each row's episode as JSON, its call in flight waited for first (it ends by its timeout)
    and its observation kept: what a checkpoint keeps of rows carried over steps. `restore` puts
    it back into turns of the same rows' problems."""
    while self.pool.pending():
      self._observe(self.pool.wait())
    return {
      str(row): {
        "env": env.state(),
        "episode": self.episode[row],
        "counts": dict(self.counts[row]),
        "ready": [self.ready[row].observation, self.ready[row].reason]
        if row in self.ready
        else None,
      }
      for row, env in self.envs.items()
    }

  def restore(self, state: dict) -> None:
    """The episodes of `state()` back into these turns, made on the same rows' problems."""
    for key, saved in state.items():
      row = int(key)
      self.envs[row].restore(self.problems[row], saved["env"])
      self.episode[row], self.counts[row] = saved["episode"], collections.Counter(saved["counts"])
      if saved["ready"] is not None:
        self.ready[row] = protocol.Step(saved["ready"][0], False, saved["ready"][1])

  def grade(self, row: int) -> rewards.Grade:
    """The row's reward: its env's grade, or 0 with reason "max_tokens" where the row reached its
    max_new tokens before its episode ended."""
    env = self.envs[row]
    return env.grade() if env.done else rewards.Grade(0.0, "max_tokens")

  def tallies(self, observed_BM, lengths_B, rows) -> dict:
    """The episodes' tool use (of `rows`, this process's, as the rollout ended them) and their
    observation and written completion tokens (`Rollout.observed`, `lengths` of those rows), as
    JSON sums: what `metrics` makes every process's step tags of."""
    total = sum((self.counts[row] for row in rows), collections.Counter())
    turns = [self.envs[row].turns for row in rows]
    written = np.arange(np.shape(observed_BM)[1])[None] < np.asarray(lengths_B)[:, None]
    return {
      "rows": len(turns),
      "turns": sum(turns),
      "turns_max": max(turns, default=0),
      "observed": int(np.sum(observed_BM & written)),
      "written": int(np.sum(written)),
      **{name: total[name] for name in TALLIED},
    }

  def metrics(self, observed_BM, lengths_B, rows) -> dict:
    """`metrics` of this process's `tallies` alone."""
    return metrics([self.tallies(observed_BM, lengths_B, rows)])

  def _ids(self, row: int, step: protocol.Step) -> list:
    """The observation's token ids: the tool response (cut to the env's budget) in a user turn,
    then the next generation prompt."""
    text = protocol.observation_turn(self.envs[row].config, step.observation, self.tokenizer)
    return self.tokenizer.encode(text)


# EnvTurns.counts' tallies: each a sum over rows and processes
TALLIED = ("tool_calls", "tool_error", "tool_timeout", "bad_calls", "tool_seconds")


def metrics(tallies: list) -> dict:
  """The step's env/* tags of every process's `EnvTurns.tallies`."""
  total = {name: sum(t[name] for t in tallies) for name in ("rows", "turns", *TALLIED)}
  observed, written = (sum(t[name] for t in tallies) for name in ("observed", "written"))
  return {
    "env/turns/mean": total["turns"] / max(total["rows"], 1),
    "env/turns/max": max(t["turns_max"] for t in tallies),
    "env/tool_calls": total["tool_calls"],
    "env/tool_errors": total["tool_error"],
    "env/tool_timeouts": total["tool_timeout"],
    "env/bad_calls": total["bad_calls"],
    "env/tool_seconds": float(total["tool_seconds"]),
    "env/observation_share": observed / max(written, 1),
  }
