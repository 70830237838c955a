"""Does mismatch masking recover training? The quantile sweep's (configs/quantile_sweep.py)
p5 >= 0.86 quest table, the one that trains far below dense, again on its seeds 2, 3 and 4, with
`rl.mask_alpha_below = 0.1`: completion tokens whose exact alpha is under 0.1 leave the dense policy
loss (docs/configuration.md#mismatch-masking). docs/threshold_sweep.md has the criterion, written
before the runs, and the result; dense and the unmasked table are the quantile sweep's runs
(docs/results/quantile_sweep.json), not rerun.

  python experiments/tau_sweep.py --config=configs/mask_sweep.py \\
      --config.record=docs/results/mask_sweep.json

The table comes from the quantile sweep's calibration surface, so it is the same table.
"""

from configs import quantile_sweep


def get_config():
  c = quantile_sweep.get_config()
  c.sweep_dir = "workdir/mask_sweep"  # its sweep.json and plot are shipped in
  #                                    assets/pointer_chase_tiny/mask_sweep/
  c.runs = "quest"
  c.quest_tables = "5:0.86"  # the quantile sweep's p5 >= 0.86 table only
  c.train.rl.mask_alpha_below = 0.1  # the near-zero-alpha tokens leave the dense loss
  return c
