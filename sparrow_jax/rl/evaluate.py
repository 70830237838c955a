"""Evaluate a policy: mean@k and pass@k on a math / code task, dense or sparse generation. The CLI
(experiments/evaluate.py) and the threshold sweep call `evaluate(config)`.

  python experiments/evaluate.py --config=configs/evaluate.py [--config.model.hf_dir=DIR ...]

configs/evaluate.py documents every field (and a math example). config.task.name is a registry name
(sparrow_jax.data.tasks.task_names(): math:aime, code:humaneval, ..., math:reasoning_gym:<dataset>)
read from config.task.path, or "synthetic:pointer_chase". The task and the model are built by the
trainer's own `make_task` / `load_model` (rl/run_config.py) from this config's model, task and
seed, and config.rollout.schedule takes the trainer's spec strings ('fixed:PAGES' |
'paper:MODEL:TAU' | a KVSchedule JSON path), so an evaluation sees exactly what training saw.
Problems are the task's first config.num_problems in its (seeded) order; each is sampled
config.samples (n) times with `sj.generate` (right-padded prompts, the tokenizer's EOS ids) in
batches of config.batch_size rows of one static shape (one compile), and graded with task.grade: a
sample is correct when its grade reason is "correct" (math: math-verify match of the last
\\boxed{}; code: all tests pass; pointer chase: exact final answer).

Metrics, each over problems:
  mean@k  the expected mean reward of k samples. For k <= n its unbiased estimate is the mean over
          all n samples, so it is the same for every k (reported per k so configs can ask for e.g.
          AMC's mean@4 by name).
  pass@k  the chance that at least one of k samples is correct, unbiased from n >= k samples with c
          correct (Chen et al. 2021): 1 - C(n - c, k) / C(n, k).
Results go to config.out (JSON: settings, metrics, per-problem counts, grade reasons) and to
TensorBoard as eval/<metric> at config.step (e.g. the checkpoint's training step, to plot
checkpoints as curves).
"""

import collections
import functools
import json
import os
import time
from typing import NamedTuple

import jax
import numpy as np

import sparrow_jax as sj
from sparrow_jax import schema
from sparrow_jax.rl import run_config
from sparrow_jax.sparsity.schedule import KVSchedule


def pass_at_k(n: int, c: int, k: int) -> float:
  """Unbiased pass@k from n samples of which c are correct: 1 - C(n - c, k) / C(n, k), computed as
  1 - prod_{i = n - c + 1}^{n} (1 - k / i), which never forms the (huge) binomials."""
  if not 0 <= c <= n or not 1 <= k <= n:
    raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def summarize(rewards_PN, correct_PN, ks) -> dict:
  """{"mean@k", "pass@k"} averaged over problems, from [problems, n] rewards and correctness."""
  rewards_PN, correct_PN = np.asarray(rewards_PN, np.float64), np.asarray(correct_PN, bool)
  n = rewards_PN.shape[1]
  metrics = {}
  for k in ks:
    metrics[f"mean@{k}"] = float(rewards_PN.mean())
    metrics[f"pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in correct_PN.sum(1)]))
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
  tokens_RT, lengths_R = tokenizer.encode_batch([problems[i].prompt for i in rows])
  for start in range(0, len(rows), batch_size):
    take = np.arange(start, min(start + batch_size, len(rows)))
    take = np.concatenate([take, np.full(batch_size - len(take), take[0])])
    yield start, take, tokens_RT[take], lengths_R[take]


class Graded(NamedTuple):
  """Every sample's completion and grade, problem-major: problem i's n samples are rows i * n on."""

  responses: list
  rewards_R: np.ndarray
  correct_R: np.ndarray
  lengths_R: np.ndarray
  reasons: collections.Counter


def sample_and_grade(generate, tokenizer, task, problems, samples, key, batch_size, progress=False):
  """Graded samples of each problem, `samples` times: generate(prompt_BT, prompt_len_B, key) ->
  Rollout (sj.generate with the policy and its settings bound) in batches of `batch_size` rows
  (batch b under fold_in(key, b)), graded with task.grade; `progress` prints a line a batch."""
  n_rows = len(problems) * samples
  responses, rewards_R, correct_R = [""] * n_rows, np.zeros(n_rows), np.zeros(n_rows, bool)
  lengths_R, reasons = np.zeros(n_rows, int), collections.Counter()
  t_start, generated = time.time(), 0
  for b, (start, take, prompt_BT, prompt_len_B) in enumerate(
    _prompt_batches(problems, samples, tokenizer, batch_size)
  ):
    rollout = generate(prompt_BT, prompt_len_B, jax.random.fold_in(key, b))
    tokens_BN, lengths_B = np.asarray(rollout.tokens), np.asarray(rollout.lengths)
    real = take[: min(batch_size, n_rows - start)]
    texts = [tokenizer.decode(tokens_BN[j, : lengths_B[j]]) for j in range(len(real))]
    grades = task.grade(texts, [problems[i // samples] for i in real])
    for i, text in zip(real, texts):
      responses[i] = text
    rewards_R[real] = [g.reward for g in grades]
    correct_R[real] = [g.reason == "correct" for g in grades]
    lengths_R[real] = lengths_B[: len(real)]
    reasons.update(g.reason for g in grades)
    generated += int(lengths_B.sum())
    done, elapsed = real[-1] + 1, time.time() - t_start
    if progress:
      print(
        f"  {done}/{n_rows} samples  reward {rewards_R[:done].mean():.3f}  correct "
        f"{correct_R[:done].mean():.3f}  {generated / elapsed:.1f} tok/s  "
        f"ETA {elapsed / done * (n_rows - done):.0f}s",
        flush=True,
      )
  return Graded(responses, rewards_R, correct_R, lengths_R, reasons)


def score(graded: Graded, samples: int, ks, max_new_tokens: int) -> dict:
  """mean@k and pass@k over problems, the mean response length and the truncated share."""
  shape = (-1, samples)
  metrics = summarize(graded.rewards_R.reshape(shape), graded.correct_R.reshape(shape), ks)
  metrics["response_length/mean"] = float(graded.lengths_R.mean())
  metrics["truncated_fraction"] = float(np.mean(graded.lengths_R >= max_new_tokens))
  return metrics


def evaluate(c) -> dict:
  """Generates, grades and summarizes; returns the results dict (also written to c.out)."""
  r = c.rollout
  if c.samples < 1 or r.max_new_tokens < 1 or c.batch_size < 1:
    raise ValueError(
      f"config.samples, config.rollout.max_new_tokens and config.batch_size must be "
      f">= 1; got {c.samples}, {r.max_new_tokens}, {c.batch_size}"
    )
  ks = parse_ks(c.k, c.samples)
  task = run_config.make_task(c)
  cfg, params, tokenizer = run_config.load_model(c, task)
  sparse = schedule = None
  if r.sparse:
    sparse = schema.from_group(sj.SparseConfig, c, "rollout")
    schedule = KVSchedule.parse(r.schedule, r.page_size, field="config.rollout.schedule")
  problems = first_problems(task, c.num_problems)
  batch_size = min(c.batch_size, len(problems) * c.samples)
  mode = f"sparse ({r.schedule})" if sparse else "dense"
  print(
    f"{task.name}: {len(problems)} problems x {c.samples} samples, {mode}, max_new_tokens "
    f"{r.max_new_tokens}, temperature {r.temperature}, batches of {batch_size}",
    flush=True,
  )
  generate = functools.partial(
    sj.generate,
    params,
    cfg,
    max_new_tokens=r.max_new_tokens,
    sampling=run_config.sampling(c, tokenizer),
    sparse=sparse,
    schedule=schedule,
  )
  t_start = time.time()
  graded = sample_and_grade(
    generate, tokenizer, task, problems, c.samples, jax.random.PRNGKey(c.seed), batch_size, True
  )
  metrics = score(graded, c.samples, ks, r.max_new_tokens)
  shape = (len(problems), c.samples)
  results = {
    "task": task.name,
    "path": c.task.path,
    "model_dir": c.model.hf_dir,
    "step": c.step,
    "sparse": bool(sparse),
    "schedule": r.schedule if sparse else None,
    "num_problems": len(problems),
    "samples": c.samples,
    "k": ks,
    "max_new_tokens": r.max_new_tokens,
    "temperature": r.temperature,
    "top_p": r.top_p,
    "seed": c.seed,
    "metrics": metrics,
    "grade_reasons": dict(graded.reasons),
    "generation_s": time.time() - t_start,
    "per_problem": [
      {"id": str(p.id), "correct": int(n), "mean_reward": float(mean)}
      for p, n, mean in zip(
        problems,
        graded.correct_R.reshape(shape).sum(1),
        graded.rewards_R.reshape(shape).mean(1),
      )
    ],
  }
  for name, value in metrics.items():
    print(f"{name:>22}  {value:.4f}")
  _write(results, c)
  return results


def _write(results, c):
  os.makedirs(os.path.dirname(os.path.abspath(c.out)), exist_ok=True)
  with open(c.out, "w") as f:
    json.dump(results, f, indent=2)
  from tensorboardX import SummaryWriter

  logdir = c.logdir or os.path.splitext(c.out)[0] + "_tb"
  with SummaryWriter(logdir) as writer:
    for name, value in results["metrics"].items():
      writer.add_scalar(f"eval/{name}", value, c.step)
  print(f"wrote {c.out} and TensorBoard scalars eval/* to {logdir}")
