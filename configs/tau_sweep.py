"""Threshold sweep: the default RL job (configs/default.py, same seeds, same prompts) under dense
rollouts, calibrated schedules at several tau, a fixed aggressive budget and the closed-loop
budgets, to put stability (reward, held-out score, p5 per bin) against cost (KV read, speedup).
docs/threshold_sweep.md has what each run records and the figure.

  python experiments/tau_sweep.py --config=configs/tau_sweep.py              # the full sweep
  python experiments/tau_sweep.py --config=configs/tau_sweep.py --config.sweep_dir=/tmp/tiny \\
      --config.runs=dense,tau --config.taus=0.86 --config.seeds=0 --config.train.total_steps=2 \\
      --config.eval.num_problems=4 --config.eval.samples=1 \\
      --config.train.task.min_hops=8 --config.train.task.max_hops=8 \\
      --config.train.rollout.max_new_tokens=32 --config.train.rl.num_minibatches=2  # smoke

Schedules at tau come from the shipped p5 surface (calibrate.choose_schedule), nothing is
re-calibrated. On that surface p5 is a cliff (it jumps from ~0 to > 0.95 between neighbouring
candidates), so every tau in (0.49, 0.95] picks the same table (top-k 21 25 31 37 37 from bin 3):
0.5, 0.7, 0.86 and 0.94 are one run, shared (sweep.json says which); 0.99 (25 31 37 45 45) is the
tau above that moves the budget, and 0.3 (21 21 31 31 31) the one below.
"""

import ml_collections

from configs import default


def get_config():
  c = ml_collections.ConfigDict()
  c.sweep_dir = "workdir/tau_sweep"  # one trainer workdir per run (<setting>_seed<k>), schedules/,
  #                                    sweep.json and tau_sweep.png; re-running skips finished runs
  #                                    and resumes partial ones
  c.runs = "dense,tau,fixed,adaptive,quest,quest_adaptive"  # settings to run, in plot order: dense
  #                                    rollouts, one run per tau in `taus`, fixed:P per P in
  #                                    `fixed_pages`, adaptive:`adaptive_tau`, quest page scores
  #                                    from each of `quest_tables` and from it adaptive
  c.taus = "0.3,0.5,0.7,0.86,0.94,0.99"  # p5 thresholds; each picks its table from `surface` (taus
  #                                    that pick the same table share one run, see the docstring)
  c.surface = "assets/pointer_chase_tiny/calibration/surface.json"  # p5 per candidate per bin
  #                                    (experiments/calibrate_schedule.py writes it)
  # 8 pages in all (top-k 5 + the 3 always kept): a third of the smallest budget the tau-0.5 table
  # gives a generated token (21 + 3, bin 3), p5 < 1e-4 in every bin on the surface, and a held-out
  # per-step score of 0.067 vs 0.422 dense before any training (docs/embedded_default.md): the
  # collapse end of the front. 64 pages hold every row's whole cache (512 + 400 tokens = 57 pages):
  # the sparse run's machinery (sparse sampler, DistillSparse, TIS, exact alpha) at no sparsity,
  # the control that tells the cost of sparsity from the cost of the machinery.
  c.fixed_pages = "8,64"  # fixed budgets, one run each (pages, always-kept included)
  c.adaptive_tau = 0.86  # adaptive:TAU:<the tau-TAU table's JSON>: the closed loop's
  #                                    target and starting table (docs/closed_loop.md)
  c.quest_tables = "5:0.86"  # quest: page_score "quest" with, per QUANTILE:TAU, the table
  #                                    holding that percentile >= TAU (p5 >= 0.86) on
  c.quest_surface = "assets/pointer_chase_tiny/calibration_quest/surface.json"  # quest's surface
  c.seeds = "0,1"  # trainer seeds (init, rollout keys, prompt order) per setting
  c.window = 10  # steps averaged for the first / last figures and p5 per bin
  c.record = ""  # also write the settings' summary (and, with two percentiles, the
  #                                    quantile test's verdict) as a results record here
  c.base = ""  # a finished sweep.json whose other settings and runs this one
  #                                    keeps (a setting run here replaces its namesake), e.g. the
  #                                    shipped assets/pointer_chase_tiny/tau_sweep/sweep.json to
  #                                    re-run some settings only (with runs="": report it as is,
  #                                    docs/results/threshold_sweep.md); "" = none

  # The RL job, configs/default.py as is; each run sets workdir, seed, rollout.sparse and
  # rollout.schedule (so they are not here), and dense runs turn distill off (it adapts the
  # sparse actor). Override any field as --config.train.<field>=<value>.
  c.train = default.get_config()
  for name in ("workdir", "seed"):
    del c.train[name]
  for name in ("sparse", "schedule"):
    del c.train.rollout[name]
  c.train.rollout.page_score = (
    "mean"  # `surface` is the mean-key centroids' (quest runs set theirs)
  )
  c.train.rollout.speculate = 0  # the sweep studies lossy rollouts: rows are the sparse actor's

  # Held-out score of each run's exported policy (<workdir>/hf): experiments/evaluate.py, dense,
  # on the run's task and max_new_tokens, written to <workdir>/eval.json.
  c.eval = ml_collections.ConfigDict()
  c.eval.seed = 1234  # held-out problems and sampling key (training used `seeds`)
  c.eval.num_problems = 128  # held-out problems (the held-out figures in docs/ use 128 x 2)
  c.eval.samples = 2  # samples per problem
  c.eval.batch_size = 64  # rows per generate call
  return c
