"""experiments/bench_multiturn.py: the multi-turn default's environment and tiny model with long
observations, dense vs lossy sparse vs exact mode, and with slow tools.

  python experiments/bench_multiturn.py --config=configs/bench_multiturn.py \\
      [--config.out=docs/results/multi_turn_workload.json]
"""

import ml_collections

from configs import multi_turn


def get_config():
  c = ml_collections.ConfigDict()
  c.runs = 2  # timed calls per setting (median), interleaved, after one warm-up call each
  c.seed = 0  # the rollouts' sampling key (every setting the same)
  c.drafts = (4,)  # exact mode's draft counts, a setting each
  c.slow_tool_s = 1.0  # what a slow lookup adds, on the odd rows of the slow-tool settings
  c.out = ""  # also write the figures here as a results record ("" = print only)
  c.run = multi_turn.get_config()  # the trainer config the rollouts are built from
  c.run.env.update(keys=100, decoys=24)  # each lookup: the hop's line among 24 other entries
  c.run.env.max_turns = 6  # 4 hops and the answer, and a spare turn
  c.run.env.tool_workers = 16  # calls run at once: the slow rows' calls all in flight
  c.run.rollout.max_new_tokens = 896  # observations included (~130 tokens a lookup); the
  #                                       prompt (64) and this fit the model's 1024 positions
  c.run.rollout.prompts_per_step = 4  # problems, each group_size (8) rows
  c.run.rollout.schedule = "fixed:8"  # pages of 16 a sparse layer reads (sink, local, top)
  return c
