"""Exact mode's training test (docs/rollout_engine.md, written before its runs): the default job
with rollout.speculate = 4 (configs/speculative.py) on the dense runs' seeds, each exported policy
scored on the threshold sweep's held-out problems, against the shipped dense runs.

  python experiments/speculative_training.py --config=configs/speculative_training.py
"""

import ml_collections

from configs import speculative, tau_sweep


def get_config():
  c = ml_collections.ConfigDict()
  c.sweep_dir = "workdir/speculative_training"  # one trainer workdir per seed (speculate_seed<k>);
  #                                    a finished run is skipped, a partial one resumes
  c.seeds = "2,3,4"  # the shipped dense runs' seeds
  c.dense = "assets/pointer_chase_tiny/quantile_sweep/sweep.json"  # their sweep (setting "dense")
  c.window = 10  # steps averaged for the first / last figures (as the sweep's)
  c.record = ""  # write the summary and the verdict as a results record here ("" = none)
  c.train = speculative.get_config()  # the RL job; each run sets workdir and seed
  for name in ("workdir", "seed"):
    del c.train[name]
  c.eval = tau_sweep.get_config().eval  # the sweep's held-out evaluation, unchanged
  return c
