"""experiments/bench_async.py: the trainer on-policy against one step off (rl.off_policy_steps)
and one step off with partial rollouts (rollout.partial_groups), the same jobs and steps, side by
side in one run.

  python experiments/bench_async.py --config=configs/bench_async.py \\
      [--config.record=docs/results/async_rl.json]
"""

import ml_collections

from configs import default


def get_config():
  c = ml_collections.ConfigDict()
  # The settings in the order they run; "sync again" repeats the first: this machine's spread
  # between identical runs. Each: (name, rl.off_policy_steps, rollout.partial_groups,
  # rollout.max_carry_steps); "carry bound 1" and "no carry bound" show what the bound changes of
  # the length bias (the default bound, 2, binds only where rows run longer than two steps).
  c.settings = (
    ("sync", 0, 0, 2),
    ("one_step_off", 1, 0, 2),
    ("one_step_off + partial", 1, 2, 2),
    ("one_step_off + partial, carry bound 1", 1, 2, 1),
    ("one_step_off + partial, no carry bound", 1, 2, 0),
    ("sync again", 0, 0, 2),
  )
  c.jobs = "default,long_tail"  # the jobs each setting runs (fields of this config)
  c.steps = 6  # steps a run trains; the first (it compiles) is left out of the timings
  c.workdir = "/tmp/bench_async"  # each run under <workdir>/<job>/<setting>, started afresh
  c.record = ""  # write the results record here, e.g. docs/results/async_rl.json
  c.default = default.get_config()  # the default job
  c.default.eval.every = 0  # no held-out evaluation: the step is what is timed
  # The default job with chains of 8 to 128 hops (uniform): answers of about 3 tokens a hop, so a
  # step's longest rows are several times its mean, the tail that holds up a synchronous step.
  c.long_tail = default.get_config()
  c.long_tail.eval.every = 0
  c.long_tail.task.min_hops = 8
  return c
