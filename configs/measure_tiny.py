"""Measures the shipped tiny model on held-out pointer-chasing problems, dense and sparse: the
figures of docs/embedded_default.md and assets/pointer_chase_tiny/measurements.json (minutes on a
laptop CPU). Model, task, rollout and stats fields mean what they mean in the trainer
(configs/common.py): the calibrated schedule checked here is the one the trainer uses.

  python experiments/measure_tiny.py --config=configs/measure_tiny.py
"""

import ml_collections

from configs import common


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 1234  # held-out task seed and sampling key (training used 0)
  c.out = ""  # results JSON ("" = <model.hf_dir>/measurements.json)

  c.model = common.model()  # the shipped tiny model
  c.task = common.task()  # synthetic:pointer_chase only; 128 hops: ~880-token sequences
  c.num_problems = 256  # held-out problems for the dense and small-budget scores
  c.num_accept = 64  # the first of them, sampled and scored under each budget
  c.budgets = "4,8,16,24,32"  # fixed KV budgets in pages (the 3 always-kept pages included)
  c.small_budget = 8  # the budget whose score is compared with dense on all problems
  c.batch_size = 64  # rows per generate call

  c.rollout = common.rollout(
    "temperature", "schedule", "page_size", "dense_layers", "attention_impl", "page_score"
  )  # schedule: the calibrated one
  #                                    ("" = skip the check), for page_score's ranking
  c.stats = common.stats()  # tau: p5 target of rollout.schedule in every bin; bin_size
  return c
