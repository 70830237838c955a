"""Which tail predicts training? The threshold sweep (configs/tau_sweep.py) with the percentile held
at tau as its axis: quest tables holding p1 >= 0.86 and p1 >= 0.94 beside the p5 >= 0.86 table and
dense rollouts, on seeds the shipped sweep did not use. docs/threshold_sweep.md has the criterion,
written before the runs, and the result.

  python experiments/calibrate_schedule.py --config=configs/calibrate.py \\
      --config.out_dir=assets/pointer_chase_tiny/quantile_sweep/calibration   # p1, p5, ... surface
  python experiments/tau_sweep.py --config=configs/quantile_sweep.py

Every table comes from the one calibration above (the same rollouts and alphas; its surface keeps
p1, p5, p10 and p50), so the tables differ only by the percentile and tau they hold.
"""

from configs import tau_sweep


def get_config():
  c = tau_sweep.get_config()
  c.sweep_dir = "workdir/quantile_sweep"  # its sweep.json and plot are shipped in
  #                                    assets/pointer_chase_tiny/quantile_sweep/
  c.runs = "dense,quest"
  c.quest_tables = "5:0.86,1:0.86,1:0.94"  # QUANTILE:TAU per quest run
  c.quest_surface = "assets/pointer_chase_tiny/quantile_sweep/calibration/surface.json"
  c.seeds = "2,3,4"  # the shipped sweep used 0 and 1
  return c
