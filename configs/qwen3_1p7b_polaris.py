"""Qwen3-1.7B, math RL on Polaris-53K with the paper's settings, on one node of 8 GPUs.

  python -m sparrow_jax.train --config=configs/qwen3_1p7b_polaris.py \\
      --config.model.hf_dir=/path/to/Qwen3-1.7B --config.task.path=/path/to/polaris-53k.parquet

The paper's recipe (SPARROW_BRIEF): 37K-token generation cutoff, n = 8, GRPO token-mean with clip
0.2 / 0.28 and dual clip 3, TIS (cap 2), no KL, temperature 1.0, page 16, the first 2 layers dense,
the published tau-0.86 schedule for this model, p5 in 2K-token bins; DistillSparse off. FSDP over
the node's 8 GPUs (params, grads and Adam states in eighths). Rollouts run in the engine
(rollout/engine.py): 256 rows a step, 32 per GPU, through 32 slots over a 60 GB page pool per GPU,
which holds ~36 rows of a long-tailed step (mean response half the cutoff) in flight; see the
rollout fields for why. Checked in tests/test_real_configs.py by lowering its step at full size on
8 fake devices; the pool and decode chunk by experiments/memory_report.py --config.parts=engine.
"""

import ml_collections

from configs import common


def get_config():
  c = ml_collections.ConfigDict()
  c.workdir = "runs/qwen3_1p7b_polaris"  # checkpoints, TensorBoard, metrics.jsonl; reused = resume
  c.seed = 0  # data order, LoRA init and rollout PRNG
  c.total_steps = 500  # RL steps
  c.ckpt_every = 10  # steps between orbax checkpoints (sharded: each host its part)
  c.keep_checkpoints = 3  # newest checkpoints kept
  c.max_nonfinite_steps = 3  # abort after this many skipped (non-finite) updates in a row
  c.restart_from_scratch = False  # True: a workdir whose checkpoints are all unreadable starts
  #                                    again at step 0 (False: refused, naming them)
  c.hardware = "h200"  # cost-model hardware for the predicted-speedup metric
  c.export_hf = True  # final policy as a Hugging Face dir in <workdir>/hf
  c.profile_steps = ()  # (start, stop): jax.profiler trace of those steps to <workdir>/profile

  c.mesh = common.mesh(data=1, fsdp=8, tensor=1)  # FSDP over the node's 8 GPUs
  c.distributed = common.distributed()  # one process drives the node's 8 GPUs

  c.model = common.model(hf_dir="checkpoints/Qwen3-1.7B", dtype="bfloat16")  # local HF dir
  c.task = common.task(name="math:polaris", path="data/polaris-53k.parquet")  # local file

  c.rollout = common.rollout(
    schedule="paper:qwen3-1.7b:0.86", dense_layers=2, page_score="mean", max_new_tokens=37 * 1024
  )  # the paper's math cutoff; its tables rank
  #                                    pages by mean key (quest: calibrate it for the model first)
  c.rollout.prompts_per_step = 32  # distinct prompts per step (x 8 samples = 256 rollouts, 32
  #                                    per GPU): a GPU whose rows have all ended idles until the
  #                                    step's longest row ends, so each gets more rows than slots
  c.rollout.engine_slots = 32  # rows each GPU decodes at once; the pool holds ~36 at the
  #                                    paper's long tail (cost_model.roofline_engine_rate, mean
  #                                    response half the cutoff), so slots bind, not pages
  c.rollout.pool_gb = 60.0  # KV page pool per GPU: ~510K tokens of 1.7B's bf16 KV; beside
  #                                    it 3.4 GB of gathered weights, the sharded train state and
  #                                    the decode chunk's temporaries, within an H200's 141 GB
  c.rollout.group_size = 8  # samples per prompt (n)
  c.rollout.max_prompt_len = 1024  # Polaris prompts with the chat template fit in 1K tokens
  c.rollout.num_top_logprobs = 0  # exact alpha is logged; the top-20 bound costs a vocab top-k

  c.rl = ml_collections.ConfigDict()
  c.rl.learning_rate = 1e-6  # AdamW peak learning rate (verl's default for RLVR at this size)
  c.rl.warmup_steps = 10  # linear warmup, then constant
  c.rl.weight_decay = 0.0  # AdamW decoupled weight decay
  c.rl.max_grad_norm = 1.0  # clip by global norm
  c.rl.estimator = "grpo"  # grpo | dr_grpo | rloo
  c.rl.grpo_std_ddof = 1  # group std: 1 unbiased (the reference's torch.std) | 0
  c.rl.eps_low = 0.2  # PPO clip below
  c.rl.eps_high = 0.28  # PPO clip above (clip-higher)
  c.rl.dual_clip = 3.0  # dual-clip c for negative advantages
  c.rl.tis_cap = 2.0  # truncated importance sampling cap C
  c.rl.tis_level = "token"  # token | sequence | none
  c.rl.loss_agg = "token-mean"  # the paper's aggregation
  c.rl.kl_coef = 0.0  # no KL to the reference (none kept)
  c.rl.entropy_coef = 0.0  # no entropy bonus
  c.rl.ppo_epochs = 1  # passes over each batch
  c.rl.num_minibatches = 4  # 4 updates of 64 rollouts per step
  c.rl.dapo_filter = False  # keep zero-variance groups (plain GRPO)
  c.rl.micro_batches = 8  # 8 rows per backward pass: one 38K row per GPU
  # Each backward pass (and no-grad slice) at the smallest of these that holds its longest row,
  # a minibatch's rows sorted by length into its micro-batches: responses average well under the
  # 37K cutoff (docs/configuration.md#length-buckets; memory per bucket: memory_report.py)
  c.rl.length_buckets = (4096, 8192, 16384, 38912)
  c.rl.mask_alpha_below = 0.0  # a completion token whose exact alpha is under this leaves the
  #                                    policy loss (mismatch masking; 0 = off)
  c.rl.mask_row_alpha_below = 0.0  # a row whose p1 alpha is under this leaves the loss whole
  #                                    (0 = off; why p1: docs/configuration.md#mismatch-masking)
  c.rl.off_policy_steps = 0  # on-policy (1: one-step-off, docs/async_rl.md)
  c.rl.remat = "full"  # per-layer remat: what 38K-token rows need
  c.rl.logits_chunk = 512  # positions per LM-head chunk

  c.distill = ml_collections.ConfigDict()
  c.distill.enabled = False  # DistillSparse off (the paper's main runs); see default.py
  c.distill.rank = 8  # LoRA rank
  c.distill.alpha = 16.0  # LoRA alpha
  c.distill.targets = "q,k,v,o,gate,up,down"  # all projections (the reference)
  c.distill.learning_rate = 1e-5  # Adam learning rate of the LoRA
  c.distill.kl_coef = 1e-3  # lambda of the k3 term (the paper)
  c.distill.ppo_coef = 1.0  # the sparse actor's own PPO term (the paper)
  c.distill.base = "pre_update"  # the LoRA update's base: the teacher's (docs/configuration.md)

  # Off: held-out problems are the task's first under eval.seed, which for a dataset task are its
  # own problems reordered (docs/configuration.md#evaluation-during-training).
  c.eval = common.evaluation()  # held-out evaluation every eval.every steps (0 = off)

  c.stats = common.stats(bin_size=2048)  # tau 0.86, the paper's 2K-token bins
  c.stats.exact_acceptance = True  # exact alpha (the paper's statistic) from a sparse no-grad pass
  c.stats.num_bins = 19  # 38K tokens / 2K
  return c
