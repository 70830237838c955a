"""Qwen3-14B, math RL on Polaris-53K with the paper's settings, on 4 nodes of 8 GPUs (32).

  # one process per node, e.g. under SLURM (docs/many_devices.md):
  srun --nodes=4 --ntasks-per-node=1 python -m sparrow_jax.train \\
      --config=configs/qwen3_14b_polaris.py --config.model.hf_dir=/path/to/Qwen3-14B \\
      --config.task.path=/path/to/polaris-53k.parquet

The recipe of configs/qwen3_1p7b_polaris.py (the paper's) with what differs at 14B: the model's own
tau-0.86 table, FSDP within each node's 8 GPUs and data parallel over the 4 nodes, and 32 rows per
backward pass, one 38K row per GPU (its memory per GPU from experiments/memory_report.py's compile
on 8 fake devices is in docs/memory.md). Rollouts: 512 rows a step (two GRPO groups per GPU: a
group runs on one GPU), 16 slots over a 50 GB page pool per GPU. Checked in
tests/test_real_configs.py by lowering its step at full size on 32 fake devices.
"""

from configs import common, qwen3_1p7b_polaris


def get_config():
  c = qwen3_1p7b_polaris.get_config()
  c.workdir = "runs/qwen3_14b_polaris"  # checkpoints, TensorBoard, metrics.jsonl; reused = resume
  c.mesh = common.mesh(data=4, fsdp=8, tensor=1)  # FSDP within a node, data across the 4 nodes
  c.distributed.enabled = True  # one process per node; coordinator etc. detected (SLURM, ...)
  c.model.hf_dir = "checkpoints/Qwen3-14B"  # local HF dir
  c.rollout.schedule = "paper:qwen3-14b:0.86"  # the published table for this model
  c.rollout.prompts_per_step = 64  # x 8 samples = 512 rollouts, 16 per GPU (2 groups each)
  c.rollout.engine_slots = 16  # all of a GPU's rows at once; the pool holds ~21 at the
  #                                    paper's long tail (mean response half the cutoff)
  c.rollout.pool_gb = 50.0  # ~300K tokens of 14B's bf16 KV per GPU, beside 29.5 GB of
  #                                    weights gathered over fsdp and the sharded train state
  c.rl.num_minibatches = 2  # 2 updates of 256 rollouts per step ...
  c.rl.micro_batches = 8  # ... in 8 backward passes: one 38K row per GPU each
  return c
