"""experiments/bench_async.py: the trainer on-policy against one step off (rl.off_policy_steps),
the same job and steps, side by side in one run.

  python experiments/bench_async.py --config=configs/bench_async.py \\
      [--config.record=docs/results/async_rl.json]
"""

import ml_collections

from configs import default


def get_config():
  c = ml_collections.ConfigDict()
  # The settings in the order they run; "sync again" repeats the first: this machine's spread
  # between identical runs. Each: rl.off_policy_steps.
  c.settings = (("sync", 0), ("one_step_off", 1), ("sync again", 0))
  c.steps = 6  # steps a run trains; the first (it compiles) is left out of the timings
  c.workdir = "/tmp/bench_async"  # each setting's run under <workdir>/<setting>, started afresh
  c.record = ""  # write the results record here, e.g. docs/results/async_rl.json
  c.job = default.get_config()  # the job every setting runs (here: the default job)
  c.job.eval.every = 0  # no held-out evaluation: the step is what is timed
  return c
