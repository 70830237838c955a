"""sparrow_jax: sparse-attention rollouts for long-context RL of Qwen3 models, in JAX."""

from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.mismatch.acceptance import acceptance_rate, tail_stats
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.model.hf import load_hf, save_hf
from sparrow_jax.model.qwen3 import init_params, token_logprobs
from sparrow_jax.rollout.engine import generate
from sparrow_jax.rollout.sampler import Rollout, Sampling
from sparrow_jax.sparsity.policy import forward
from sparrow_jax.sparsity.schedule import KVSchedule

__all__ = [
  "KVSchedule",
  "Qwen3Config",
  "Rollout",
  "Sampling",
  "SparseConfig",
  "acceptance_rate",
  "forward",
  "generate",
  "init_params",
  "load_hf",
  "save_hf",
  "tail_stats",
  "token_logprobs",
]
