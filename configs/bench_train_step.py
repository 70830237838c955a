"""experiments/bench_train_step.py: the train step at the full row length vs with rl.length_buckets,
on the same long-tailed rows, timed side by side.

  python experiments/bench_train_step.py --config=configs/bench_train_step.py \\
      [--config.out=docs/results/train_step_buckets.json]
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.model = "default"  # default (the shipped tiny model's shape) | qwen3-1.7b (truncated)
  c.layers = 4  # layers kept of the qwen3-1.7b shape
  c.prompts = 4  # GRPO groups
  c.group_size = 8  # rows per group
  c.prompt = 512  # prompt tokens (every row's)
  c.cutoff = 1024  # max completion tokens; lengths geometric with mean cutoff / 2 (bench_engine)
  c.seed = 0  # the lengths, prompts, completions and rewards
  c.num_minibatches = 1  # updates per step
  c.micro_batches = 4  # backward passes per update: the rows sorted by length into them
  c.length_buckets = (640, 768, 1024, 1280)  # the bucketed setting's rl.length_buckets (the full
  #                                    row, prompt + cutoff, is always the last)
  c.dense_layers = 1  # layers kept dense by the sparse rollouts the step corrects for
  c.tau = 0.86  # the paper's Qwen3-1.7B budget table at this tau
  c.runs = 5  # timed steps per setting (median), after one warm-up step, interleaved
  c.out = ""  # also write the figures here, a results record (JSON); "" = print only
  return c
