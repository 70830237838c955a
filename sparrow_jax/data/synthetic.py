"""Pointer chasing: a synthetic verifiable long-CoT task whose every step retrieves from far back.

The prompt holds a shuffled table of `key value ;` entries over single-token symbols. The table is
two chains: the real one s_0 -> s_1 -> ... -> s_H -> end and a distractor chain d_0 -> ... -> end,
so the final answer cannot be read off the table without following the chain from the start. The
response writes every hop out, then the answer:

  prompt:   <|im_start|> user table x17 x4 ; x9 end ; ... ; start x3 <|im_end|> <|im_start|>
            assistant
  response: x3 x88 ; x88 x17 ; x17 x4 ; ... ; x9 end ; answer x9 <|im_end|>

Why this shape: each hop `a b ;` is a copy of the previous value (local) followed by a lookup of `a`
in the table (anywhere in the prompt, up to ~900 tokens back), so attention must be peaked on a
far-back page at every hop and a small KV budget hurts exactly those tokens. Every hop is learnable
on its own (an induction-style lookup gives signal from the first step; nothing needs the whole
chain solved before the loss moves), and the stop is itself a lookup (`end`), so there is no
counting. Symbols never repeat within the chain, so a hop can not be copied from earlier in the
response.

Interface as sparrow_jax.data.tasks.Task: `sample(n, position)` (problem i is a pure function of
(seed, position + i)), `reward(responses, problems)`, `grade(...)` -> rewards.Grade list, plus
`accuracy(...)`. Responses may be text or token ids (padding after <|im_end|> is ignored).

Scoring: a hop is right when it starts from the previous hop's value (the start symbol for the
first), its key is on the chain and not credited before, and its value is the table's value for that
key. The per-step score is the number of right hops among the first H + 1 written, over H + 1: a
dense reward that credits every chain entry followed correctly even after an earlier slip, but not a
loop back over entries already followed (a slip to an earlier key would otherwise re-earn them) nor
a walk down the distractor chain. Accuracy is the exact final answer.
"""

import dataclasses
import json
from typing import Sequence, Union

import numpy as np
import tokenizers

from sparrow_jax.data import rewards
from sparrow_jax.data.tokenizer import Tokenizer

IM_START, IM_END, EOT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SPECIAL_TOKENS = (EOT, IM_START, IM_END)  # ids 0, 1, 2: pad = <|endoftext|>, EOS = <|im_end|>
WORDS = ("user", "assistant", "table", "start", "answer", "end", ";")
NUM_SYMBOLS = 200


def symbol(i: int) -> str:
  return f"x{i}"


def vocab() -> list:
  """Every token in id order (specials first)."""
  return list(SPECIAL_TOKENS) + list(WORDS) + [symbol(i) for i in range(NUM_SYMBOLS)]


def build_tokenizer() -> tokenizers.Tokenizer:
  """Word-level tokenizer over `vocab()`: whitespace-split words, special tokens matched first."""
  words = vocab()
  model = tokenizers.models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=EOT)
  tok = tokenizers.Tokenizer(model)
  tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIAL_TOKENS])
  return tok


def tokenizer_config() -> dict:
  """tokenizer_config.json for transformers' AutoTokenizer next to the tokenizer.json."""
  return {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": IM_END,
    "pad_token": EOT,
    "bos_token": None,
    "unk_token": EOT,
    "model_max_length": 4096,
    "clean_up_tokenization_spaces": False,
  }


def save_tokenizer(directory: str):
  build_tokenizer().save(f"{directory}/tokenizer.json")
  with open(f"{directory}/tokenizer_config.json", "w") as f:
    json.dump(tokenizer_config(), f, indent=2)


@dataclasses.dataclass(frozen=True)
class Problem:
  prompt: str
  prompt_ids: tuple  # token ids, ending with `<|im_start|> assistant`
  table: dict  # key symbol -> value symbol (or "end")
  start: str
  chain: tuple  # s_0 .. s_H: the reference hops are (s_i, s_i+1) then (s_H, end)
  answer: str  # s_H
  reference: str  # the reference response text (without the closing <|im_end|>)
  reference_ids: tuple  # its ids, closing <|im_end|> included
  id: str = ""

  @property
  def num_steps(self) -> int:
    return len(self.chain)


@dataclasses.dataclass(frozen=True)
class PointerChase:
  """The task. `min_hops..max_hops` is H (the response writes H + 1 hops); the distractor chain has
  `distractor_min + round(distractor_frac * H)` keys at most and `distractor_min` at least, drawn
  uniformly. The defaults are the evaluation setting: about 490 prompt and 390 response tokens."""

  min_hops: int = 128
  max_hops: int = 128
  distractor_min: int = 2
  distractor_frac: float = 0.25
  seed: int = 0
  name: str = "synthetic:pointer_chase"
  kind: str = "synthetic"

  def __post_init__(self):
    for name, ok, allowed in (
      ("min_hops", self.min_hops >= 1, "must be >= 1"),
      ("max_hops", self.max_hops >= self.min_hops, f"must be >= min_hops ({self.min_hops})"),
      ("distractor_min", self.distractor_min >= 1, "must be >= 1"),
      ("distractor_frac", self.distractor_frac >= 0, "must be >= 0"),
      (
        "max_hops",
        self.max_keys <= NUM_SYMBOLS,
        f"with distractor_frac {self.distractor_frac} needs {self.max_keys} symbols, more "
        f"than the {NUM_SYMBOLS} there are",
      ),
    ):
      if not ok:
        raise ValueError(f"PointerChase.{name} = {getattr(self, name)!r} is invalid: {allowed}")

  @property
  def max_keys(self) -> int:
    return self.max_hops + 1 + self.max_distractors(self.max_hops)

  def max_distractors(self, hops: int) -> int:
    return self.distractor_min + int(round(self.distractor_frac * hops))

  @property
  def max_prompt_len(self) -> int:
    return 3 * self.max_keys + 8

  @property
  def max_response_len(self) -> int:
    return 3 * (self.max_hops + 1) + 3

  @property
  def tokenizer(self) -> tokenizers.Tokenizer:
    return _TOKENIZER

  @property
  def eos_id(self) -> int:
    return SPECIAL_TOKENS.index(IM_END)

  @property
  def pad_id(self) -> int:
    return SPECIAL_TOKENS.index(EOT)

  @property
  def own_tokenizer(self) -> Tokenizer:
    """The task's vocabulary as the trainer's Tokenizer (the `Task` protocol: a randomly
    initialised model is sized to it, and an exported policy carries it; see `save_tokenizer`)."""
    return Tokenizer(tok=self.tokenizer, eos_ids=(self.eos_id,), pad_id=self.pad_id)

  def save_tokenizer(self, directory: str):
    save_tokenizer(directory)

  def encode(self, text: str) -> list:
    return self.tokenizer.encode(text).ids

  def decode(self, ids) -> str:
    return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

  def sample(self, n: int, position: Union[int, np.random.Generator]) -> list:
    """Problems position .. position + n - 1 of the task's endless stream (problem i depends only on
    (seed, i), so a checkpoint stores just the position); or `n` draws from a numpy Generator."""
    if isinstance(position, np.random.Generator):
      return [self._one(position, "") for _ in range(n)]
    return [
      self._one(np.random.default_rng([self.seed, i]), f"{self.seed}:{i}")
      for i in range(position, position + n)
    ]

  def _one(self, rng: np.random.Generator, problem_id: str) -> Problem:
    hops = int(rng.integers(self.min_hops, self.max_hops + 1))
    n_distract = int(rng.integers(self.distractor_min, self.max_distractors(hops) + 1))
    syms = [symbol(int(i)) for i in rng.permutation(NUM_SYMBOLS)[: hops + 1 + n_distract]]
    chain, distract = syms[: hops + 1], syms[hops + 1 :]
    table = {}
    for seq in (chain, distract):
      table.update(zip(seq, seq[1:] + ["end"]))
    keys = list(table)
    order = rng.permutation(len(keys))
    entries = " ".join(f"{keys[i]} {table[keys[i]]} ;" for i in order)
    prompt = f"{IM_START} user table {entries} start {chain[0]} {IM_END} {IM_START} assistant"
    hop_text = " ".join(f"{a} {table[a]} ;" for a in chain)
    reference = f"{hop_text} answer {chain[-1]}"
    return Problem(
      prompt=prompt,
      prompt_ids=tuple(self.encode(prompt)),
      table=table,
      start=chain[0],
      chain=tuple(chain),
      answer=chain[-1],
      reference=reference,
      reference_ids=tuple(self.encode(f"{reference} {IM_END}")),
      id=problem_id,
    )

  def _words(self, response) -> list:
    """Response words up to the first <|im_end|> (or padding), from text or token ids."""
    if not isinstance(response, str):
      response = self.decode(response)
    words = response.split()
    for stop in (IM_END, EOT):
      if stop in words:
        words = words[: words.index(stop)]
    return words

  def step_scores(self, response, problem: Problem) -> float:
    """Right hops (see the module docstring) among the response's first H + 1, over H + 1."""
    words = self._words(response)
    if "answer" in words:
      words = words[: words.index("answer")]
    chain, credited, expected = set(problem.chain), set(), problem.start
    for j in range(min(len(words) // 3, problem.num_steps)):
      a, b, sep = words[3 * j : 3 * j + 3]
      if (
        a == expected and sep == ";" and a in chain and a not in credited and problem.table[a] == b
      ):
        credited.add(a)
      expected = b
    return len(credited) / problem.num_steps

  def is_correct(self, response, problem: Problem) -> bool:
    """Exact final answer: the word after the first `answer` is s_H."""
    words = self._words(response)
    return "answer" in words[:-1] and words[words.index("answer") + 1] == problem.answer

  def reward(self, responses: Sequence, problems: Sequence[Problem]) -> np.ndarray:
    """Per-step score per response (float32 in [0, 1]), the dense RL reward."""
    _check_pairs(responses, problems)
    return np.array([self.step_scores(r, p) for r, p in zip(responses, problems)], np.float32)

  def accuracy(self, responses: Sequence, problems: Sequence[Problem]) -> np.ndarray:
    """1.0 where the final answer is exactly right, else 0.0."""
    _check_pairs(responses, problems)
    return np.array([self.is_correct(r, p) for r, p in zip(responses, problems)], np.float32)

  def grade(self, responses: Sequence, problems: Sequence[Problem]) -> list:
    """rewards.Grade(per-step score, reason): correct (final answer right), partial (some steps
    right), wrong (none)."""
    scores, correct = self.reward(responses, problems), self.accuracy(responses, problems)
    return [
      rewards.Grade(float(s), "correct" if c else "partial" if s > 0 else "wrong")
      for s, c in zip(scores, correct)
    ]


def _check_pairs(responses, problems):
  if len(responses) != len(problems):
    raise ValueError(
      f"got {len(responses)} responses for {len(problems)} problems; they must pair up one to one"
    )


_TOKENIZER = build_tokenizer()
