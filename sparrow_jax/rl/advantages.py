"""Group-relative advantages: each prompt is sampled `group_size` times and rewards are compared
within the group. Rows are laid out group-major: rows [g*G, (g+1)*G) share a prompt.
A group whose rewards are all equal carries no signal and gets zero advantage.
"""

import jax.numpy as jnp

ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def _groups(rewards_B, group_size):
  if rewards_B.shape[0] % group_size:
    raise ValueError(
      f"batch of {rewards_B.shape[0]} rows is not a multiple of group_size {group_size}"
    )
  return rewards_B.reshape(-1, group_size).astype(jnp.float32)


def advantages(
  rewards_B, group_size: int, estimator: str = "grpo", eps: float = 1e-6, std_ddof: int = 1
):
  """Per-row advantages [B].

  grpo: (r - group mean) / group std (DeepSeekMath; by default the unbiased std, std_ddof=1, as the
  reference's `torch.std`; 0 for the population std); dr_grpo: r - group mean, no std (Dr. GRPO,
  Liu et al. 2025, which removes the difficulty bias of the std); rloo: r - mean of the *other*
  rows of the group (leave-one-out baseline, Ahmadian et al. 2024).
  """
  if estimator not in ESTIMATORS:
    raise ValueError(f"advantage estimator must be one of {ESTIMATORS}, got {estimator!r}")
  r_Bn = _groups(rewards_B, group_size)
  mean = jnp.mean(r_Bn, axis=1, keepdims=True)
  if estimator == "grpo":
    std = jnp.std(r_Bn, axis=1, keepdims=True, ddof=std_ddof)
    adv = jnp.where(std > eps, (r_Bn - mean) / jnp.maximum(std, eps), 0.0)
  elif estimator == "dr_grpo":
    adv = r_Bn - mean
  else:
    adv = (r_Bn - mean) * group_size / (group_size - 1)
  return adv.reshape(-1)


def informative_groups(rewards_B, group_size: int, eps: float = 1e-6):
  """DAPO dynamic sampling: which groups of group_size rows have reward variance (the others are
  filtered), one flag a group."""
  return jnp.std(_groups(rewards_B, group_size), axis=1) > eps
