"""Pretrains the multi-turn default's model (assets/pointer_chase_turns_tiny): a tiny Qwen3 learns
env:pointer_chase's tool format from reference episodes (experiments/pretrain_tiny.py's Episodes
corpus: each hop a lookup call and its observation, then the boxed answer), on a CPU.

  nice -n 10 python experiments/pretrain_tiny.py --config=configs/pretrain_tiny_turns.py \\
      --config.export_dir=assets/pointer_chase_turns_tiny   # the shipped model
"""

from configs import common, pretrain_tiny


def get_config():
  c = pretrain_tiny.get_config()  # the loop's fields and the tiny architecture, as the default's
  c.workdir = "workdir/pretrain_tiny_turns"  # checkpoints, TensorBoard, metrics.jsonl, hf/
  c.corpus = "env:pointer_chase"  # reference episodes of this environment, not synthetic chains
  # The environment as configs/multi_turn.py plays it, on other tables (seed 1, RL's is 0).
  # Thinking off: a turn is its call or answer at once, the short format a tiny model can learn.
  # Keys from 100 names (k00 .. k99), each one token: a lookup copies one token, as in the
  # single-turn default's vocabulary (a 2-layer model did not learn to copy multi-token keys).
  c.env = common.env(
    "env:pointer_chase",
    keys=16,
    decoys=0,
    key_space=100,
    enable_thinking=False,
    list_tools=False,
    max_turns=12,
    seed=1,
  )
  c.vocab_size = 512  # the byte-level BPE's size (+ the template's tags and whole_tokens)
  c.whole_tokens = tuple(f"k{i:02d}" for i in range(100))  # one token per key name
  c.bpe_episodes = 200  # reference episodes the BPE is trained on
  c.total_steps = 625  # AdamW steps: stopped while it still misreads keys at temperature 1
  # (min_hops, max_hops, row_len, rows): ~2K tokens a step. The system turn's tool list is ~230
  # tokens of every episode and a hop ~40: long chains put more lookups in a step's tokens.
  c.levels = ((1, 4, 256, 8), (2, 8, 512, 4))
  c.arch.max_position_embeddings = 1024  # longest position (episode + RL's max_new_tokens)
  return c
