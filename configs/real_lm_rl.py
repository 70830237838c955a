"""A short RL run on the real LM (SmolLM2-135M-Instruct imported from GGUF): GRPO + TIS with
block-sparse rollouts on short arithmetic problems with a \\boxed{} answer (reasoning-gym's
basic_arithmetic, generated offline; math-verify reward), sparse at the table calibrated on this
model (configs/real_lm_mismatch.py), against the dense baseline with --config.rollout.sparse=False.
docs/real_lm.md says what one step costs on a 2-core CPU.

  python experiments/import_gguf.py --config=configs/import_gguf.py --config.fetch=True
  python -m sparrow_jax.train --config=configs/real_lm_rl.py
  python -m sparrow_jax.train --config=configs/real_lm_rl.py --config.rollout.sparse=False \\
      --config.workdir=workdir/real_lm_rl_dense
"""

import os

from configs import common, default

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "sparrow_jax")  # model.gguf.DEFAULT_CACHE


def get_config():
  c = default.get_config()  # the trainer's fields; what differs is set below
  c.workdir = "workdir/real_lm_rl"  # checkpoints, TensorBoard events, metrics.jsonl
  c.total_steps = 20  # RL steps
  c.ckpt_every = 10  # steps between orbax checkpoints
  c.export_hf = False  # the policy stays in the checkpoints (a 135M float32 model)

  c.model = common.model(hf_dir=os.path.join(CACHE, "smollm2-135m-instruct"))  # the imported LM
  c.task = common.task(name="math:reasoning_gym:basic_arithmetic")  # offline problems, \boxed{}

  c.rollout = common.rollout(
    max_new_tokens=384,
    dense_layers=2,
    page_score="mean",
    schedule="assets/real_lm/schedule.json",
  )  # the tau-0.86 table calibrated on this model (mean scores, exact alpha, bins of 512)
  c.rollout.prompts_per_step = 2  # distinct prompts per step
  c.rollout.group_size = 8  # samples per prompt (n)
  c.rollout.max_prompt_len = 192  # the chat-formatted arithmetic prompts fit
  c.rollout.num_top_logprobs = 0  # exact alpha is logged (stats.exact_acceptance)

  c.rl.learning_rate = 1e-6  # AdamW peak learning rate (RLVR at small scale)
  c.rl.num_minibatches = 2  # 2 updates of 8 rollouts per step
  c.rl.remat = "full"  # 30 layers: keep each layer's input only

  c.distill.enabled = False  # plain sparse GRPO + TIS

  c.stats.bin_size = 512  # the calibration's bins
  c.stats.num_bins = 2  # prompt + 384 tokens fit in the first bin or two
  return c
