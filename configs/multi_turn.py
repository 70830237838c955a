"""Multi-turn default: GRPO on env:pointer_chase with the tiny Qwen3 of
assets/pointer_chase_turns_tiny, on a laptop CPU in minutes. Each row is an episode: the model
calls the lookup tool once a hop, each observation (the hop's line among decoys) is prefilled into
the row's own pages while the other rows decode on, and after the last hop it answers
\\boxed{key}; reward 1 for the key reached. Observations are context: they are out of the loss,
TIS and the tails (docs/multi_turn.md). Rollouts in exact mode, as the single-turn default's.

The model (0.46M params) learnt the format from reference episodes on other tables
(configs/pretrain_tiny_turns.py), stopped while it still misreads keys at temperature 1, so the
reward leaves RL room.

  python -m sparrow_jax.train --config=configs/multi_turn.py [--config.total_steps=20 ...]
"""

from configs import common, default, pretrain_tiny_turns


def get_config():
  c = default.get_config()  # every field as the single-turn default's, but for these
  c.workdir = "workdir/multi_turn"  # checkpoints, TensorBoard, metrics.jsonl; reused = resume
  c.total_steps = 50  # RL steps
  c.model.hf_dir = "assets/pointer_chase_turns_tiny"  # pretrained on the environment's format
  c.task.name = "env:pointer_chase"  # an environment: its fields in c.env
  # The format the model was pretrained on (16-entry tables of 100 key names, each observation the
  # hop's line, no tool list, thinking off), at 4 hops, on RL's tables (seed 0, not
  # pretraining's 1), with the default's max_turns.
  c.env = pretrain_tiny_turns.get_config().env
  c.env.update(hops=4, seed=0, max_turns=common.env().max_turns)
  c.rollout.prompts_per_step = 8  # distinct prompts per step: at 4 (x 8 rows) and lr 2e-4 the
  #                                    reward stayed near its start over 28 steps
  c.rl.learning_rate = 5e-4  # AdamW peak learning rate (1e-3 collapsed the reward to 0)
  c.rollout.max_prompt_len = 64  # the prompt is ~45 tokens
  c.rollout.max_new_tokens = 192  # a 4-hop episode is ~150 tokens, observations included
  c.rollout.schedule = "fixed:6"  # 6 pages of 16 a sparse layer reads: sink, local and the top
  #                                    pages (an uncalibrated budget: rows are up to 256 tokens)
  c.stats.bin_size = 32  # position bins of the tails
  c.stats.num_bins = 8  # rows of up to 256 tokens
  c.stats.turns = c.env.get_ref("max_turns")  # the tails per turn (acceptance/*_turn): every turn
  #                                    a row has (env.max_turns, as set on the command line)
  return c
