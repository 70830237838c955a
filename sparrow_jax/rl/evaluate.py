"""Scoring a policy on a task: its completions sampled and graded in static-shape batches
(`sample_and_grade`), mean@k and pass@k over problems (`score`), and the held-out evaluation's
config component (`EvalConfig`, run during training by hooks.Evaluation). The standalone
evaluation of a checkpoint is experiments/evaluate.py.

Metrics, each over problems:
  mean@k  the expected mean reward of k samples. For k <= n its unbiased estimate is the mean over
          all n samples, so it is the same for every k (reported per k so configs can ask for e.g.
          AMC's mean@4 by name).
  pass@k  the chance that at least one of k samples is correct, unbiased from n >= k samples with c
          correct (Chen et al. 2021): 1 - C(n - c, k) / C(n, k).
A sample is correct when its grade reason is "correct" (math: math-verify match of the last
\\boxed{}; code: all tests pass; pointer chase: exact final answer).
"""

import collections
import dataclasses
import time
from typing import NamedTuple

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """The held-out evaluation during training, a config component (`schema.from_group(EvalConfig,
  c, "eval")`; hooks.Evaluation runs it with rl/evaluate.py)."""

  every: int = 0  # steps between evaluations (0: off)
  problems: int = 16  # the held-out task's first problems (0: all of a finite task)
  samples: int = 4  # n per problem: mean@n, pass@1 and pass@n
  completions: int = 2  # completions shown per evaluation and mode (each problem's first sample)
  seed: int = 1234  # the held-out task's seed and the sampling key

  def __post_init__(self):
    for name in ("every", "problems", "samples", "completions", "seed"):
      value, least = getattr(self, name), 1 if name == "samples" else 0
      if not (isinstance(value, int) and not isinstance(value, bool) and value >= least):
        raise ValueError(f"EvalConfig.{name} = {value!r} is invalid: must be an int >= {least}")

  @property
  def ks(self) -> list:
    return sorted({1, self.samples})


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples of which c are correct: 1 - C(n - c, k) / C(n, k), computed as
  1 - prod_{i = n - c + 1}^{n} (1 - k / i), which never forms the (huge) binomials."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def summarize(rewards_Bn, correct_Bn, ks) -> dict:
  """{"mean@k", "pass@k"} averaged over problems, from [problems, n] rewards and correctness."""
  rewards_Bn, correct_Bn = np.asarray(rewards_Bn, np.float64), np.asarray(correct_Bn, bool)
  n = rewards_Bn.shape[1]
  metrics = {}
  for k in ks:
    metrics[f"mean@{k}"] = float(rewards_Bn.mean())
    metrics[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct_Bn.sum(1)]))
  return metrics


def parse_ks(text: str, samples: int) -> list:
  try:
    ks = sorted({int(k) for k in text.split(",") if k.strip()})
  except ValueError:
    raise ValueError(f"config.k must be comma-separated integers, got {text!r}") from None
  if not ks or ks[0] < 1 or ks[-1] > samples:
    raise ValueError(f"config.k values must lie in [1, config.samples={samples}], got {text!r}")
  return ks


def first_problems(task, num_problems: int, field: str = "config.num_problems") -> list:
  """The task's first `num_problems` (0: all of a finite task); `field` names the setting."""
  if hasattr(task, "__len__"):  # a finite eval set; the synthetic task is an endless stream
    num_problems = min(num_problems or len(task), len(task))
  if num_problems < 1:
    raise ValueError(
      f"{field} = {num_problems} must be >= 1 for a task without a fixed size ({task.name})"
    )
  return task.sample(num_problems, 0)


def _prompt_batches(problems, samples, tokenizer, batch_size):
  """Rows (problem index per row) and right-padded prompt batches of one static shape; the last
  batch is filled up by repeating its first row (those extra outputs are dropped)."""
  rows = [i for i in range(len(problems)) for _ in range(samples)]
  tokens_aT, lengths_a = tokenizer.encode_batch([problems[i].prompt for i in rows])
  for start in range(0, len(rows), batch_size):
    take = np.arange(start, min(start + batch_size, len(rows)))
    take = np.concatenate([take, np.full(batch_size - len(take), take[0])])
    yield start, take, tokens_aT[take], lengths_a[take]


class Graded(NamedTuple):
  """Every sample's completion and grade, problem-major: problem i's n samples are rows i * n on."""

  responses: list
  rewards_a: np.ndarray
  correct_a: np.ndarray
  lengths_a: np.ndarray
  reasons: collections.Counter


def sample_and_grade(generate, tokenizer, task, problems, samples, key, batch_size, progress=False):
  """Graded samples of each problem, `samples` times: generate(prompt_BT, prompt_len_B, key,
  turns=...) -> Rollout (sj.generate with the policy and its settings bound) in batches of
  `batch_size` rows (batch b under fold_in(key, b)), graded with task.grade; an environment's
  rows (task.kind "env") each play an episode (generate's `turns`) and take its grade.
  `progress` prints a line a batch."""
  n_rows = len(problems) * samples
  responses, rewards_a, correct_a = [""] * n_rows, np.zeros(n_rows), np.zeros(n_rows, bool)
  lengths_a, reasons = np.zeros(n_rows, int), collections.Counter()
  t_start, generated = time.time(), 0
  for b, (start, take, prompt_BT, prompt_len_B) in enumerate(
    _prompt_batches(problems, samples, tokenizer, batch_size)
  ):
    key_b, turns = jax.random.fold_in(key, b), None
    if task.kind == "env":
      turns = task.turns({j: problems[i // samples] for j, i in enumerate(take)}, tokenizer)
    rollout = generate(prompt_BT, prompt_len_B, key_b, turns=turns)
    tokens_BM, lengths_B = np.asarray(rollout.tokens), np.asarray(rollout.lengths)
    real = take[: min(batch_size, n_rows - start)]
    texts = [tokenizer.decode(tokens_BM[j, : lengths_B[j]]) for j in range(len(real))]
    if turns is None:
      grades = task.grade(texts, [problems[i // samples] for i in real])
    else:
      grades = [turns.grade(j) for j in range(len(real))]
    for i, text in zip(real, texts):
      responses[i] = text
    rewards_a[real] = [g.reward for g in grades]
    correct_a[real] = [g.reason == "correct" for g in grades]
    lengths_a[real] = lengths_B[: len(real)]
    reasons.update(g.reason for g in grades)
    generated += int(lengths_B.sum())
    done, elapsed = real[-1] + 1, time.time() - t_start
    if progress:
      print(
        f"  {done}/{n_rows} samples  reward {rewards_a[:done].mean():.3f}  correct "
        f"{correct_a[:done].mean():.3f}  {generated / elapsed:.1f} tok/s  "
        f"ETA {elapsed / done * (n_rows - done):.0f}s",
        flush=True,
      )
  return Graded(responses, rewards_a, correct_a, lengths_a, reasons)


def score(graded: Graded, samples: int, ks, max_new_tokens: int) -> dict:
  """mean@k and pass@k over problems, the mean response length and the truncated share."""
  shape = (-1, samples)
  metrics = summarize(graded.rewards_a.reshape(shape), graded.correct_a.reshape(shape), ks)
  metrics["response_length/mean"] = float(graded.lengths_a.mean())
  metrics["truncated_fraction"] = float(np.mean(graded.lengths_a >= max_new_tokens))
  return metrics
