"""Policy-gradient losses on sparse rollouts: PPO clipping, dual clip, truncated importance
sampling (TIS), mismatch masking, loss aggregation, and optional KL / entropy terms. All per-token
arrays are [B, T] with a mask of the completion tokens; everything is pure jnp.
"""

import jax
import jax.numpy as jnp

from sparrow_jax.mismatch import acceptance

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
TIS_LEVELS = ("token", "sequence", "none")
KL_KINDS = ("k1", "k3")
LOG_RATIO_CLAMP = 20.0  # |log ratio| bound before exp (verl's PPO ratio and low_var_kl)
K3_CAP = 10.0  # per-token k3 cap (verl's low_var_kl)
ROW_PERCENTILE = 1  # the row rule of `mismatch_mask` judges a row by this percentile of its alpha


def aggregate(loss_BT, mask_BT, mode: str = "token-mean", norm_len: float = 1.0):
  """token-mean: mean over all completion tokens of the batch (DAPO); seq-mean-token-mean: mean per
  sequence, then over sequences (GRPO); seq-mean-token-sum-norm: per-sequence sum / norm_len (a
  constant such as the max length, Dr. GRPO), then mean over sequences."""
  mask = mask_BT.astype(jnp.float32)
  if mode == "token-mean":
    return jnp.sum(loss_BT * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  if mode == "seq-mean-token-mean":
    per_seq = jnp.sum(loss_BT * mask, 1) / jnp.maximum(jnp.sum(mask, 1), 1.0)
    return jnp.mean(per_seq)
  if mode == "seq-mean-token-sum-norm":
    return jnp.mean(jnp.sum(loss_BT * mask, 1) / norm_len)
  raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {mode!r}")


def tis_weight(logp_old_BT, logp_rollout_BT, mask_BT, cap: float, level: str = "token"):
  """w = min(p_old / p_rollout, cap), a constant (no gradient). Corrects for sampling from the
  sparse policy while training the dense one. Sequence level uses the product of the token
  ratios."""
  if level == "none":
    return jnp.ones_like(logp_old_BT)
  log_ratio = jnp.where(mask_BT, logp_old_BT - logp_rollout_BT, 0.0)
  if level == "sequence":
    log_ratio = jnp.broadcast_to(jnp.sum(log_ratio, 1, keepdims=True), log_ratio.shape)
  elif level != "token":
    raise ValueError(f"TIS level must be one of {TIS_LEVELS}, got {level!r}")
  return jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_ratio), cap))


def mismatch_mask(alpha_BT, mask_BT, token_below: float, row_below: float):
  """Mismatch masking (as verl's rollout correction): a completion token whose acceptance alpha is
  under `token_below`, and every token of a row whose ROW_PERCENTILE-th percentile of alpha is
  under `row_below`, leave the loss (0 turns a rule off: alpha >= 0). Returns (the tokens kept
  [B, T], those the token rule drops [B, T], the rows the row rule drops [B])."""
  token_out_BT = mask_BT & (alpha_BT < token_below)
  row_out_B = acceptance.row_percentile(alpha_BT, mask_BT, ROW_PERCENTILE) < row_below
  return mask_BT & ~token_out_BT & ~row_out_B[:, None], token_out_BT, row_out_B


def ppo_token_loss(
  logp_BT, logp_old_BT, adv_B, eps_low: float, eps_high: float, dual_clip: float = 0.0
):
  """Clipped surrogate per token (to minimise) and whether the clip was active.

  With dual_clip = c > 1, negative-advantage tokens are additionally bounded by -c * A, so a huge
  ratio on a bad token cannot dominate the update (Ye et al. 2020)."""
  # Clamped before exp as verl does: an overflow would give inf * 0 = NaN gradients (a skipped
  # update) where the clip makes the gradient zero anyway.
  ratio = jnp.exp(jnp.clip(logp_BT - logp_old_BT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
  adv = adv_B[:, None]
  unclipped, clipped = -adv * ratio, -adv * jnp.clip(ratio, 1 - eps_low, 1 + eps_high)
  loss = jnp.maximum(unclipped, clipped)
  if dual_clip > 0:
    loss = jnp.where(adv < 0, jnp.minimum(loss, -adv * dual_clip), loss)
  return loss, clipped > unclipped


def kl_penalty(logp_BT, logp_ref_BT, kind: str = "k3"):
  """Per-token estimate of KL(pi || ref) from samples of pi: k1 = log pi - log ref;
  k3 = exp(d) - d - 1 with d = log ref - log pi (Schulman's low-variance, non-negative form),
  capped like verl's `low_var_kl`: d clamped to +-20, the per-token value to <= 10 (a token the
  policy all but rules out would otherwise contribute up to e^20 and swamp the batch)."""
  if kind == "k1":
    return logp_BT - logp_ref_BT
  if kind != "k3":
    raise ValueError(f"KL estimator must be one of {KL_KINDS}, got {kind!r}")
  d = jnp.clip(logp_ref_BT - logp_BT, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  return jnp.minimum(jnp.exp(d) - d - 1, K3_CAP)


def entropy(logits_BTV):
  """Entropy of softmax(logits) per position (log-probs work too: log_softmax is idempotent)."""
  logp = jax.nn.log_softmax(logits_BTV, axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
