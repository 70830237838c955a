"""env:pointer_chase: follow a chain of keys through a lookup tool, one hop per turn.

A table maps each of `keys` keys (named from `key_space` names: k0000 .. k9999) to another; the
problem gives a start key and a hop count H. Each turn the model calls lookup(key) and the
observation holds the line `key -> next` (among `decoys` lines of other entries, shuffled, when
the context should grow with every hop); after H lookups it answers \\boxed{the key reached}.
The last chain key points on into the other keys, so the chain's end is known only by counting
hops. Everything is a pure function of (seed, problem position, key): an episode replays exactly.

What a perfect policy writes (`reference_actions`), short and regular for a tiny model:
  <tool_call>\\n{"name": "lookup", "arguments": {"key": "k0412"}}\\n</tool_call>   (H times)
  \\boxed{k0093}
"""

import dataclasses
from typing import Mapping

import numpy as np

from sparrow_jax.data import rewards
from sparrow_jax.data.tokenizer import tool_call_text
from sparrow_jax.envs import protocol, tools


def key_name(i: int, key_space: int = 10_000) -> str:
  """Key i of `key_space` names, all of one width: k0000 .. k9999 for 10,000."""
  return f"k{i:0{len(str(key_space - 1))}d}"


@dataclasses.dataclass(frozen=True)
class PointerChaseConfig(protocol.EnvConfig):
  hops: int = 3  # lookups from the start key to the answer
  keys: int = 64  # entries of the table: the chain's hops + 1 and the rest
  decoys: int = 0  # other entries' lines around the true one in each observation
  key_space: int = 10_000  # names keys are drawn from (100: k00 .. k99, a token each for a
  #                          small BPE, what a tiny model copies in one step)
  seed: int = 0
  MAY_BE_ZERO = ("decoys", "seed")

  def __post_init__(self):
    super().__post_init__()
    for name, ok, rule in (
      ("keys", self.keys >= self.hops + 1, f"must be >= hops + 1 ({self.hops + 1})"),
      ("keys", self.keys <= self.key_space, f"must be <= key_space ({self.key_space})"),
      ("decoys", self.decoys < self.keys, f"must be < keys ({self.keys})"),
      ("max_turns", self.max_turns > self.hops, f"must be > hops ({self.hops}): H calls + answer"),
    ):
      if not ok:
        raise ValueError(f"PointerChaseConfig.{name} = {getattr(self, name)!r} {rule}")


@dataclasses.dataclass(frozen=True)
class ChaseProblem:
  id: str
  position: int
  start: str
  hops: int
  answer: str
  table: dict  # key -> next key

  @property
  def question(self) -> str:
    return (
      f"Start at key {self.start}. Each lookup of a key gives its next key. Follow {self.hops} "
      "lookups, then answer with the key you reached as \\boxed{key}."
    )


def make_problem(config: PointerChaseConfig, position: int) -> ChaseProblem:
  """Problem `position` of the stream: a pure function of (config.seed, position)."""
  rng = np.random.default_rng([config.seed, position])
  drawn = rng.choice(config.key_space, size=config.keys, replace=False)
  names = [key_name(int(i), config.key_space) for i in drawn]
  chain, others = names[: config.hops + 1], names[config.hops + 1 :]
  # The chain's last key and every other key point along one cycle through the others, so that
  # every key has an entry and the chain does not visibly end.
  tail = [chain[-1]] + others
  table = dict(zip(chain, chain[1:]))
  table.update(zip(tail, (tail[1:] + tail[:1]) if others else [chain[0]]))
  return ChaseProblem(
    f"{config.seed}:{position}", position, chain[0], config.hops, chain[-1], table
  )


class Passages(Mapping):
  """key -> its observation: the line `key -> next` among `decoys` lines of other entries, in an
  order drawn from (seed, problem position, key)."""

  def __init__(self, problem: ChaseProblem, decoys: int, seed: int):
    self.problem, self.decoys, self.seed = problem, decoys, seed
    self.keys = sorted(problem.table)

  def __getitem__(self, key):
    table = self.problem.table
    if key not in table:
      raise KeyError(key)
    index = self.keys.index(key)
    rng = np.random.default_rng([self.seed, self.problem.position, index])
    others = [k for k in self.keys if k != key]
    picked = [others[int(i)] for i in rng.choice(len(others), size=self.decoys, replace=False)]
    lines = [f"{k} -> {table[k]}" for k in picked + [key]]
    return "\n".join(lines[int(i)] for i in rng.permutation(len(lines)))

  def __iter__(self):
    return iter(self.keys)

  def __len__(self):
    return len(self.keys)


def grade_answer(text: str, answer: str) -> rewards.Grade:
  """1.0 when the last \\boxed{} of the answer part (after </think>) is the key reached."""
  final = rewards.final_text(text)
  if final is None:
    return rewards.Grade(0.0, "unfinished_thinking")
  boxed = rewards.last_boxed(final)
  if not boxed:
    return rewards.Grade(0.0, "no_answer")
  return rewards.Grade(1.0, "correct") if boxed.strip() == answer else rewards.Grade(0.0, "wrong")


def reference_actions(problem: ChaseProblem) -> list:
  """The turns of a perfect policy: one lookup per hop, then the boxed answer."""
  keys, key = [], problem.start
  for _ in range(problem.hops):
    keys.append(key)
    key = problem.table[key]
  calls = [tool_call_text("lookup", {"key": k}) for k in keys]
  return calls + [f"\\boxed{{{problem.answer}}}"]


class PointerChaseEnv(protocol.ToolEnv):
  name = "env:pointer_chase"

  def __init__(self, config: PointerChaseConfig = PointerChaseConfig()):
    super().__init__(config)
    self.tools = {"lookup": tools.LookupTool({})}

  def sample(self, n: int, position: int) -> list:
    """Problems position .. position + n - 1 (a checkpoint stores the position only)."""
    return [make_problem(self.config, p) for p in range(position, position + n)]

  def first_messages(self, problem: ChaseProblem) -> list:
    passages = Passages(problem, self.config.decoys, self.config.seed)
    self.tools = {"lookup": tools.LookupTool(passages)}
    return [{"role": "user", "content": problem.question}]

  def grade_answer(self, text: str, problem: ChaseProblem) -> rewards.Grade:
    return grade_answer(text, problem.answer)

  def reference_actions(self, problem: ChaseProblem) -> list:
    return reference_actions(problem)
