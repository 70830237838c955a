"""Evaluate a policy: mean@k and pass@k on a math / code task, dense or sparse generation.

  python experiments/evaluate.py --config=configs/evaluate.py [--config.model.hf_dir=DIR ...]

configs/evaluate.py documents every field (and a math example). config.task.name is a registry name
(sparrow_jax.data.tasks.task_names(): math:aime, code:humaneval, ..., math:reasoning_gym:<dataset>)
read from config.task.path, or "synthetic:pointer_chase". The task and the model are built by the
trainer's own builders (sparrow_jax.rl.build) from this config's model, task and seed, and
config.rollout.schedule takes the trainer's spec strings ('fixed:PAGES' | 'paper:MODEL:TAU' | a
KVSchedule JSON path), so an evaluation sees exactly what training saw. Problems are the task's
first config.num_problems in its (seeded) order; each is sampled config.samples (n) times with
`sj.generate` (right-padded prompts, the tokenizer's EOS ids) in batches of config.batch_size rows
of one static shape (one compile), graded with task.grade and scored by sparrow_jax.rl.evaluate.
Results go to config.out (JSON: settings, metrics, per-problem counts, grade reasons) and to
TensorBoard as eval/<metric> at config.step (e.g. the checkpoint's training step, to plot
checkpoints as curves). The threshold sweep (experiments/tau_sweep.py) calls `evaluate(config)`.
"""

import functools
import json
import os
import time

from absl import app, flags
import jax
from ml_collections import config_flags

import sparrow_jax as sj
from sparrow_jax import schema
from sparrow_jax.rl import build
from sparrow_jax.rl.evaluate import first_problems, parse_ks, sample_and_grade, score
from sparrow_jax.sparsity.schedule import KVSchedule


def evaluate(c) -> dict:
  """Generates, grades and summarizes; returns the results dict (also written to c.out)."""
  r = c.rollout
  if c.samples < 1 or r.max_new_tokens < 1 or c.batch_size < 1:
    raise ValueError(
      f"config.samples, config.rollout.max_new_tokens and config.batch_size must be "
      f">= 1; got {c.samples}, {r.max_new_tokens}, {c.batch_size}"
    )
  ks = parse_ks(c.k, c.samples)
  task = build.make_task(c)
  cfg, params, tokenizer = build.load_model(c, task)
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
    sampling=build.sampling(c, tokenizer),
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
        graded.correct_a.reshape(shape).sum(1),
        graded.rewards_a.reshape(shape).mean(1),
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


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  evaluate(flags.FLAGS.config)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "configs/evaluate.py", "experiment config")
  app.run(main)
