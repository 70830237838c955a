"""Qwen3-14B, math RL on Polaris-53K with the paper's settings, on 4 nodes of 8 GPUs (32).

  # one process per node, e.g. under SLURM (README "Many devices and hosts"):
  srun --nodes=4 --ntasks-per-node=1 python -m sparrow_jax.train \\
      --config=configs/qwen3_14b_polaris.py --config.model.hf_dir=/path/to/Qwen3-14B \\
      --config.task.path=/path/to/polaris-53k.parquet

The recipe of configs/qwen3_1p7b_polaris.py (the paper's) with what differs at 14B: the model's own
tau-0.86 table, FSDP within each node's 8 GPUs and data parallel over the 4 nodes, and 32 rows per
backward pass, one 38K row per GPU (74 GB per GPU in experiments/memory_report.py's compile on 8
fake devices). The sampler holds 2 rows x 38K per GPU (~13 GB of bf16 KV). Checked in
tests/test_real_configs.py by lowering its step at full size on 32 fake devices.
"""
from configs import common, qwen3_1p7b_polaris


def get_config():
  c = qwen3_1p7b_polaris.get_config()
  c.workdir = "runs/qwen3_14b_polaris"  # checkpoints, TensorBoard, metrics.jsonl; reused = resume
  c.mesh = common.mesh(data=4, fsdp=8, tensor=1)  # FSDP within a node, data across the 4 nodes
  c.distributed.enabled = True       # one process per node; coordinator etc. detected (SLURM, ...)
  c.model.hf_dir = "checkpoints/Qwen3-14B"  # local HF dir
  c.rollout.schedule = "paper:qwen3-14b:0.86"  # the published table for this model
  c.rl.num_minibatches = 2           # 2 updates of 32 rollouts per step ...
  c.rl.micro_batches = 1             # ... each one backward pass: one 38K row per GPU
  return c
