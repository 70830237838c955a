"""Evaluate a checkpoint: mean@k and pass@k on a math / code task, dense or sparse generation.

  python experiments/evaluate.py --model_dir DIR --task math:reasoning_gym:basic_arithmetic \
      --num_problems 50 --samples 16 --k 1,4,16 --max_new_tokens 4096 --out eval.json \
      [--path DATA] [--temperature 1.0] [--top_p 1.0] [--batch_size 16] [--seed 0] [--step 0]
      [--sparse --schedule paper:qwen3-1.7b:0.86 --page_size 16 --dense_layers 2]
      [--logdir DIR]   # TensorBoard (default: the --out path without .json, + "_tb")

--task is a registry name (sparrow_jax.data.tasks.task_names(): math:aime, code:humaneval, ...,
math:reasoning_gym:<dataset>) read from --path, or "synthetic:pointer_chase". The task and the model
are built by the trainer's own `make_task` / `load_model`, and --schedule takes the trainer's spec
strings ('fixed:PAGES' | 'paper:MODEL:TAU' | a KVSchedule JSON path), so an evaluation sees exactly
what training saw. Problems are the task's first --num_problems in its (seeded) order; each is
sampled --samples (n) times with `sj.generate` (right-padded prompts, the tokenizer's EOS ids) in
batches of --batch_size rows of one static shape (one compile), and graded with task.grade: a
sample is correct when its grade reason is "correct" (math: math-verify match of the last \\boxed{};
code: all tests pass; pointer chase: exact final answer).

Metrics, each over problems:
  mean@k  the expected mean reward of k samples. For k <= n its unbiased estimate is the mean over
          all n samples, so it is the same for every k (reported per k so configs can ask for e.g.
          AMC's mean@4 by name).
  pass@k  the chance that at least one of k samples is correct, unbiased from n >= k samples with c
          correct (Chen et al. 2021): 1 - C(n - c, k) / C(n, k).
Results go to --out (JSON: settings, metrics, per-problem counts, grade reasons) and to TensorBoard
as eval/<metric> at --step (e.g. the checkpoint's training step, to plot checkpoints as curves).
"""
import argparse
import collections
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import ml_collections  # noqa: E402
import numpy as np  # noqa: E402

import sparrow_jax as sj  # noqa: E402
from sparrow_jax.attention.select import IMPLS  # noqa: E402
from sparrow_jax.mismatch.schedule import KVSchedule  # noqa: E402
from sparrow_jax.rl import trainer  # noqa: E402


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
    raise ValueError(f"--k must be comma-separated integers, got {text!r}") from None
  if not ks or ks[0] < 1 or ks[-1] > samples:
    raise ValueError(f"--k values must lie in [1, --samples={samples}], got {text!r}")
  return ks


def _config(args) -> ml_collections.ConfigDict:
  """The slice of a trainer config that trainer.make_task / load_model read."""
  return ml_collections.ConfigDict({
      "seed": args.seed,
      "task": {"name": args.task, "path": args.path, "min_hops": args.min_hops,
               "max_hops": args.max_hops},
      "model": {"hf_dir": args.model_dir, "preset": "", "dtype": args.dtype}})


def _problems(task, num_problems: int) -> list:
  if hasattr(task, "__len__"):  # a finite eval set; the synthetic task is an endless stream
    num_problems = min(num_problems or len(task), len(task))
  if num_problems < 1:
    raise ValueError("--num_problems must be >= 1 for a task without a fixed size "
                     f"({task.name})")
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


def evaluate(args) -> dict:
  """Generates, grades and summarizes; returns the results dict (also written to args.out)."""
  ks = parse_ks(args.k, args.samples)
  c = _config(args)
  task = trainer.make_task(c)
  cfg, params, tokenizer = trainer.load_model(c, task)
  sparse = schedule = None
  if args.sparse:
    sparse = sj.SparseConfig(page_size=args.page_size, dense_layers=args.dense_layers,
                             attention_impl=args.attention_impl)
    schedule = KVSchedule.parse(args.schedule, args.page_size, field="--schedule")
  problems = _problems(task, args.num_problems)
  n_rows = len(problems) * args.samples
  batch_size = min(args.batch_size, n_rows)
  mode = f"sparse ({args.schedule})" if sparse else "dense"
  print(f"{task.name}: {len(problems)} problems x {args.samples} samples, {mode}, max_new_tokens "
        f"{args.max_new_tokens}, temperature {args.temperature}, batches of {batch_size}", flush=True)

  key = jax.random.PRNGKey(args.seed)
  rewards_R, correct_R, lengths_R = np.zeros(n_rows), np.zeros(n_rows, bool), np.zeros(n_rows, int)
  reasons, t_start, generated = collections.Counter(), time.time(), 0
  for b, (start, take, prompt_BT, prompt_len_B) in enumerate(
      _prompt_batches(problems, args.samples, tokenizer, batch_size)):
    rollout = sj.generate(params, cfg, prompt_BT, prompt_len_B, jax.random.fold_in(key, b),
                          max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                          top_p=args.top_p, eos_ids=tokenizer.eos_ids, sparse=sparse,
                          schedule=schedule, pad_id=tokenizer.pad_id)
    tokens_BN, lengths_B = np.asarray(rollout.tokens), np.asarray(rollout.lengths)
    real = take[:min(batch_size, n_rows - start)]
    responses = [tokenizer.decode(tokens_BN[j, :lengths_B[j]]) for j in range(len(real))]
    grades = task.grade(responses, [problems[i // args.samples] for i in real])
    rewards_R[real] = [g.reward for g in grades]
    correct_R[real] = [g.reason == "correct" for g in grades]
    lengths_R[real] = lengths_B[:len(real)]
    reasons.update(g.reason for g in grades)
    generated += int(lengths_B.sum())
    done, elapsed = real[-1] + 1, time.time() - t_start
    print(f"  {done}/{n_rows} samples  reward {rewards_R[:done].mean():.3f}  correct "
          f"{correct_R[:done].mean():.3f}  {generated / elapsed:.1f} tok/s  "
          f"ETA {elapsed / done * (n_rows - done):.0f}s", flush=True)

  shape = (len(problems), args.samples)
  metrics = summarize(rewards_R.reshape(shape), correct_R.reshape(shape), ks)
  metrics["response_length/mean"] = float(lengths_R.mean())
  metrics["truncated_fraction"] = float(np.mean(lengths_R >= args.max_new_tokens))
  results = {
      "task": task.name, "path": args.path, "model_dir": args.model_dir, "step": args.step,
      "sparse": bool(sparse), "schedule": args.schedule if sparse else None,
      "num_problems": len(problems), "samples": args.samples, "k": ks,
      "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
      "top_p": args.top_p, "seed": args.seed, "metrics": metrics, "grade_reasons": dict(reasons),
      "generation_s": time.time() - t_start,
      "per_problem": [{"id": str(p.id), "correct": int(c), "mean_reward": float(r)}
                      for p, c, r in zip(problems, correct_R.reshape(shape).sum(1),
                                         rewards_R.reshape(shape).mean(1))]}
  for name, value in metrics.items():
    print(f"{name:>22}  {value:.4f}")
  _write(results, args)
  return results


def _write(results, args):
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(results, f, indent=2)
  from tensorboardX import SummaryWriter
  logdir = args.logdir or os.path.splitext(args.out)[0] + "_tb"
  with SummaryWriter(logdir) as writer:
    for name, value in results["metrics"].items():
      writer.add_scalar(f"eval/{name}", value, args.step)
  print(f"wrote {args.out} and TensorBoard scalars eval/* to {logdir}")


def parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--model_dir", required=True, help="HF Qwen3 dir with tokenizer.json")
  p.add_argument("--task", required=True,
                 help="registry name (math:aime, code:humaneval, math:reasoning_gym:<dataset>, ...) "
                      "or synthetic:pointer_chase")
  p.add_argument("--path", default="", help="local data file/dir of dataset tasks")
  p.add_argument("--num_problems", type=int, default=0, help="0 = all problems of a finite task")
  p.add_argument("--samples", type=int, default=16, help="n, samples per problem")
  p.add_argument("--k", default="1", help="comma-separated k <= n for mean@k / pass@k")
  p.add_argument("--max_new_tokens", type=int, default=4096)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--top_p", type=float, default=1.0)
  p.add_argument("--batch_size", type=int, default=16, help="rows per generate call")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--sparse", action="store_true", help="block top-k sparse generation")
  p.add_argument("--schedule", default="paper:qwen3-1.7b:0.86",
                 help="'fixed:PAGES' | 'paper:MODEL:TAU' | KVSchedule JSON path (with --sparse)")
  p.add_argument("--page_size", type=int, default=16)
  p.add_argument("--dense_layers", type=int, default=2)
  p.add_argument("--attention_impl", default="auto", choices=IMPLS)
  p.add_argument("--min_hops", type=int, default=128, help="synthetic:pointer_chase chain lengths")
  p.add_argument("--max_hops", type=int, default=128)
  p.add_argument("--seed", type=int, default=0, help="problem order and sampling key")
  p.add_argument("--step", type=int, default=0, help="TensorBoard step (e.g. the checkpoint's)")
  p.add_argument("--out", required=True, help="results JSON path")
  p.add_argument("--logdir", default="", help="TensorBoard dir (default: <out>_tb)")
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  if args.samples < 1 or args.max_new_tokens < 1 or args.batch_size < 1:
    raise ValueError(f"--samples, --max_new_tokens and --batch_size must be >= 1; got "
                     f"{args.samples}, {args.max_new_tokens}, {args.batch_size}")
  evaluate(args)


if __name__ == "__main__":
  main()
