"""The trainer on-policy against one step off (`rl.off_policy_steps = 1`) and one step off with
partial rollouts (`rollout.partial_groups`), side by side in one run on this machine: each setting
trains each job (the default one and a long-tailed one) for the same steps from scratch, and the
record keeps per step the wall time (`perf/step_s`), the part the trainer waited for rollouts
(`perf/rollout_wait_s`), the rollout's and the update's own times, the reward, the staleness
alpha, the response lengths and, with partial rollouts, the rows carried over and the tokens' lag.
The first step of a run compiles and is left out of the means.

  python experiments/bench_async.py --config=configs/bench_async.py \\
      [--config.record=docs/results/async_rl.json]

One step off overlaps the next step's rollouts (sampling and grading, in a thread) with the
update. On one machine whose rollout and update share its cores, the gain is bounded by what the
two leave idle of each other: the host's work in the rollout (scheduling, tokenizing, grading)
against the devices' work in the update, and the other way round. `docs/make_results_pages.py`
makes docs/results/async_rl.md from the record.
"""

import os
import shutil

from absl import app, flags
from ml_collections import config_flags
import numpy as np

from sparrow_jax import records
from sparrow_jax.rl import trainer

KEPT = (
  "perf/step_s",
  "perf/rollout_wait_s",
  "perf/train_step_s",
  "perf/rollout_tokens_per_s",
  "rollout/weights_step",
  "reward/mean",
  "acceptance_stale/mean",
  "acceptance/mean",
  "response_length/mean",
  "response_length/max",
  "rollout/rows_carried",
  "rollout/token_lag/mean",
  "rollout/token_lag/max",
)


def run_setting(
  config, job: str, name: str, off_policy_steps: int, partial_groups: int, max_carry_steps: int
) -> dict:
  """One setting's run of `job` from scratch -> its per-step metrics (KEPT) and the means over
  the steps after the first."""
  c = config[job].copy_and_resolve_references()
  c.workdir = os.path.join(config.workdir, job, name.replace(" ", "_").replace("+", "and"))
  shutil.rmtree(c.workdir, ignore_errors=True)
  c.total_steps, c.ckpt_every = config.steps, config.steps
  c.rl.off_policy_steps, c.rollout.partial_groups = off_policy_steps, partial_groups
  c.rollout.max_carry_steps = max_carry_steps
  rows = trainer.train(c)
  steps = [{k: row[k] for k in KEPT if k in row} for row in rows]
  timed = steps[1:]
  step_s = float(np.mean([s["perf/step_s"] for s in timed]))
  wait_s = float(np.mean([s["perf/rollout_wait_s"] for s in timed]))
  return dict(
    job=job,
    setting=name,
    off_policy_steps=off_policy_steps,
    partial_groups=partial_groups,
    max_carry_steps=max_carry_steps,
    step_s=step_s,
    idle_share=wait_s / step_s,
    train_step_s=float(np.mean([s["perf/train_step_s"] for s in timed])),
    steps=steps,
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  config = flags.FLAGS.config
  rows = []
  for job in config.jobs.split(","):
    first = None
    for name, *setting in config.settings:
      rows.append(run_setting(config, job, name, *setting))
      row, first = rows[-1], first or rows[-1]
      print(
        f"  {job} {name:24s} step {row['step_s']:.2f}s  ({first['step_s'] / row['step_s']:.2f}x "
        f"{first['setting']}'s speed)  trainer idle {100 * row['idle_share']:.0f}%",
        flush=True,
      )
  if config.record:
    results = dict(config=config.to_dict(), rows=rows)
    records.write_record(os.path.join(records.ROOT, config.record), results)
    print(f"    record: {config.record}")


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/bench_async.py", "experiment config")
  app.run(main)
