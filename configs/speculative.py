"""Exact mode on the embedded default job (configs/default.py, whose `rollout.speculate = 4` it
states again for the training test written before its runs), so
every rollout is the dense policy's own sample (the sparse actor, quest's tau-0.86 table and the
DistillSparse LoRA, drafts 4 tokens a round; the dense policy verifies them in one pass) while the
drafts still read the sparse budget. docs/rollout_engine.md has the round and the training test.

  python -m sparrow_jax.train --config=configs/speculative.py [--config.seed=2 ...]
  python experiments/speculative_training.py --config=configs/speculative_training.py  # the test
"""

from configs import default


def get_config():
  c = default.get_config()
  c.workdir = "workdir/speculative"  # checkpoints, TensorBoard events, metrics.jsonl
  c.rollout.speculate = 4  # draft tokens per round (0 = off: rows sampled from the sparse actor)
  return c
