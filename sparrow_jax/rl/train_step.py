"""The fused RL step: one `jax.jit` call per batch of sparse rollouts.

  dense re-score (grad pass)  -> logp_dense, the PPO "old" log-probs, the TIS numerator, the
                                 acceptance denominator and the DistillSparse teacher, all at once
  GRPO/DAPO loss x TIS        -> optax update of the base params
  sparse teacher-forced + LoRA -> PPO on the sparse actor + lambda * k3(dense || sparse)
                                 -> optax update of the LoRA params only (on the frozen pre-update
                                    base, the one the dense teacher log-probs come from)
  acceptance + tail stats     -> metrics
With one PPO update per batch (the default) the dense log-probs come out of the gradient pass
itself (ratio = exp(logp - stop_grad(logp)) = 1 with the right gradient), so nothing is computed
twice. With several epochs / minibatches a first no-grad pass fixes the old log-probs.

Sequences are right-padded rows of prompt + completion; every per-token array is aligned to them:
value[b, s] concerns token s (its log-prob given tokens < s), and `gen_mask[b, s]` marks completion
tokens. Non-finite losses or gradients skip the update (state unchanged; `metrics["skipped"]`).
"""
import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax

from sparrow_jax.mismatch import acceptance
from sparrow_jax.model import qwen3
from sparrow_jax.model.lora import LoRA
from sparrow_jax.rl import advantages, losses


@dataclasses.dataclass(frozen=True)
class StepConfig:
  group_size: int = 8
  estimator: str = "grpo"
  eps_low: float = 0.2
  eps_high: float = 0.28
  dual_clip: float = 3.0
  tis_cap: float = 2.0
  tis_level: str = "token"
  loss_agg: str = "token-mean"
  kl_coef: float = 0.0           # KL to the reference (initial) params; 0 = no reference kept
  kl_kind: str = "k3"
  entropy_coef: float = 0.0
  ppo_epochs: int = 1
  num_minibatches: int = 1
  dapo_filter: bool = False      # drop zero-variance groups from the loss (DAPO dynamic sampling)
  distill: bool = True           # DistillSparse LoRA update in the same step
  distill_kl_coef: float = 1e-3  # lambda of the k3 term
  distill_ppo_coef: float = 1.0  # weight of the sparse actor's own PPO term (the paper: 1)
  tau: float = 0.86              # acceptance threshold (for the "fraction under tau" metric)
  bin_size: int = 2048           # position bin of the tail statistics
  num_bins: int = 20
  temperature: float = 1.0       # rollout temperature (log-probs are of logits / temperature)


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: dict
  opt_state: optax.OptState
  lora: Optional[LoRA] = None
  lora_opt_state: Optional[optax.OptState] = None
  ref_params: Optional[dict] = None


def sequence_logprobs(logits_BSV, tokens_BS, temperature: float = 1.0):
  """[B, S] log-prob of token s from the logits at s - 1 (0 at s = 0)."""
  return _gather_next(jax.nn.log_softmax(logits_BSV / temperature, axis=-1), tokens_BS)


def _gather_next(logp_BSV, tokens_BS):
  logp = jnp.take_along_axis(logp_BSV[:, :-1], tokens_BS[:, 1:, None], axis=-1)[..., 0]
  return jnp.pad(logp, ((0, 0), (1, 0)))


def _valid_mask(batch):
  S = batch["tokens"].shape[1]
  return jnp.arange(S)[None] < (batch["prompt_len"] + jnp.sum(batch["gen_mask"], 1))[:, None]


def policy_loss(params, batch, adv_B, cfg, sc: StepConfig, logp_old_BS=None, ref_params=None):
  """Dense GRPO/DAPO loss with TIS. logp_old=None: the old policy is these params (one update)."""
  mask = batch["gen_mask"]
  logits = qwen3.forward(params, batch["tokens"], cfg, mask_BT=_valid_mask(batch))
  logp_BSV = jax.nn.log_softmax(logits / sc.temperature, axis=-1)  # shared by logp, entropy, top-k
  logp = _gather_next(logp_BSV, batch["tokens"])
  old = jax.lax.stop_gradient(logp) if logp_old_BS is None else logp_old_BS
  pg, clipped = losses.ppo_token_loss(logp, old, adv_B, sc.eps_low, sc.eps_high, sc.dual_clip)
  w = losses.tis_weight(old, batch["logp_rollout"], mask, sc.tis_cap, sc.tis_level)
  norm_len = mask.shape[1]
  loss = losses.aggregate(pg * w, mask, sc.loss_agg, norm_len)
  ent = losses.aggregate(losses.entropy(logp_BSV[:, :-1]), mask[:, 1:])
  loss = loss - sc.entropy_coef * ent
  if ref_params is not None and sc.kl_coef > 0:
    ref_logits = qwen3.forward(jax.lax.stop_gradient(ref_params), batch["tokens"], cfg,
                               mask_BT=_valid_mask(batch))
    ref_logp = sequence_logprobs(ref_logits, batch["tokens"], sc.temperature)
    loss = loss + sc.kl_coef * losses.aggregate(losses.kl_penalty(logp, ref_logp, sc.kl_kind), mask)
  aux = {"logp": jax.lax.stop_gradient(logp), "entropy": ent, "tis_weight": w,
         "clip_frac": losses.aggregate(clipped.astype(jnp.float32), mask),
         "top_logp": jax.lax.top_k(jax.lax.stop_gradient(logp_BSV), 20)
         if "top_logp" in batch else None}
  return loss, aux


def distill_loss(lora, params, batch, adv_B, logp_dense_BS, cfg, sc: StepConfig, sparse, schedule):
  """DistillSparse: PPO on the sparse actor's own rollouts (its rollout log-probs are the old
  policy) + lambda * k3(dense -> sparse+LoRA). Base params are frozen (stop_gradient)."""
  mask = batch["gen_mask"]
  logits = qwen3.forward(jax.lax.stop_gradient(params), batch["tokens"], cfg,
                         mask_BT=_valid_mask(batch), lora=lora, sparse=sparse, schedule=schedule,
                         prompt_len_B=batch["prompt_len"])
  logp_q = sequence_logprobs(logits, batch["tokens"], sc.temperature)
  pg, _ = losses.ppo_token_loss(logp_q, batch["logp_rollout"], adv_B, sc.eps_low, sc.eps_high,
                                sc.dual_clip)
  kl = losses.aggregate(losses.kl_penalty(logp_q, logp_dense_BS, "k3"), mask)
  loss = (sc.distill_ppo_coef * losses.aggregate(pg, mask, sc.loss_agg, mask.shape[1])
          + sc.distill_kl_coef * kl)
  return loss, {"distill_kl": kl}


def _guarded_update(optimizer, grads, opt_state, params, loss):
  """optax update, skipped (inputs returned unchanged) when the loss or a gradient is not finite."""
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, new_opt_state = optimizer.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
  return keep(new_params, params), keep(new_opt_state, opt_state), grad_norm, finite


def _minibatches(batch, adv_B, logp_old_BS, n):
  B = adv_B.shape[0]
  if B % n:
    raise ValueError(f"batch of {B} rows is not divisible into num_minibatches={n}")
  split = lambda x: x.reshape(n, B // n, *x.shape[1:])
  parts = jax.tree_util.tree_map(split, (batch, adv_B, logp_old_BS))
  return [jax.tree_util.tree_map(lambda x: x[i], parts) for i in range(n)]


def _acceptance_metrics(batch, logp_dense_BS, top_dense, sc: StepConfig):
  """Sampled-token estimator always; the top-k lower bound when the rollout carried top-20."""
  mask = batch["gen_mask"]
  positions = jnp.broadcast_to(jnp.arange(mask.shape[1])[None], mask.shape)
  alpha = acceptance.sampled_acceptance(logp_dense_BS, batch["logp_rollout"])
  stats = acceptance.tail_stats(alpha, mask, positions, sc.bin_size, sc.num_bins)
  metrics = {f"acceptance/{k}": v for k, v in stats.items()}
  metrics["acceptance/frac_below_tau"] = acceptance.fraction_below(alpha, mask, sc.tau)
  metrics["acceptance/histogram"] = acceptance.alpha_histogram(alpha, mask)
  if top_dense is not None:
    # the distribution that predicted token s sits at logits[s - 1]: shift to the token alignment
    shift = lambda x: jnp.pad(x[:, :-1], ((0, 0), (1, 0), (0, 0)))
    bound = acceptance.topk_acceptance_bound(shift(top_dense[0]), shift(top_dense[1]),
                                             batch["top_logp"], batch["top_ids"])
    metrics["acceptance/topk_bound_mean"] = jnp.sum(bound * mask) / jnp.maximum(jnp.sum(mask), 1)
  return metrics


def make_train_step(cfg, sc: StepConfig, optimizer, lora_optimizer=None, sparse=None, schedule=None):
  """Returns train_step(state, batch) -> (state, metrics), jit-compiled with the state donated.

  batch: tokens [B,S] int32, gen_mask [B,S] bool, prompt_len [B], logp_rollout [B,S] (the sparse
  sampler's log-probs, token-aligned), rewards [B]; optionally top_logp / top_ids [B,S,20].
  """
  if sc.distill and (lora_optimizer is None or sparse is None or schedule is None):
    raise ValueError("StepConfig.distill needs lora_optimizer, sparse and schedule")

  def train_step(state: TrainState, batch):
    if sc.dapo_filter:
      keep_B = jnp.repeat(advantages.informative_groups(batch["rewards"], sc.group_size),
                          sc.group_size)
      batch = dict(batch, gen_mask=batch["gen_mask"] & keep_B[:, None])
    mask = batch["gen_mask"]
    adv_B = advantages.advantages(batch["rewards"], sc.group_size, sc.estimator)
    grad_fn = jax.value_and_grad(policy_loss, has_aux=True)
    n_updates = sc.ppo_epochs * sc.num_minibatches
    params, opt_state = state.params, state.opt_state
    if n_updates == 1:
      (loss, aux), grads = grad_fn(params, batch, adv_B, cfg, sc, None, state.ref_params)
      params, opt_state, grad_norm, finite = _guarded_update(optimizer, grads, opt_state, params, loss)
      logp_dense = aux["logp"]
    else:
      logits = qwen3.forward(params, batch["tokens"], cfg, mask_BT=_valid_mask(batch))
      logp_dense = sequence_logprobs(logits, batch["tokens"], sc.temperature)
      for _ in range(sc.ppo_epochs):
        for mb, adv_mb, old_mb in _minibatches(batch, adv_B, logp_dense, sc.num_minibatches):
          (loss, aux), grads = grad_fn(params, mb, adv_mb, cfg, sc, old_mb, state.ref_params)
          params, opt_state, grad_norm, finite = _guarded_update(
              optimizer, grads, opt_state, params, loss)
      aux = dict(aux, top_logp=None)

    metrics = {"loss/policy": loss, "grad_norm/policy": grad_norm, "skipped": ~finite,
               "entropy": aux["entropy"], "ppo/clip_frac": aux["clip_frac"]}
    w = aux["tis_weight"]
    if w.shape == mask.shape:  # (last minibatch's weights otherwise)
      metrics.update({
          "tis/weight_mean": jnp.sum(w * mask) / jnp.maximum(jnp.sum(mask), 1),
          "tis/weight_min": jnp.min(jnp.where(mask, w, jnp.inf)),
          "tis/clipped_frac": jnp.sum((w >= sc.tis_cap) * mask) / jnp.maximum(jnp.sum(mask), 1)})
    lengths = jnp.sum(mask, 1)
    metrics.update({"reward/mean": jnp.mean(batch["rewards"]), "reward/std": jnp.std(batch["rewards"]),
                    "response_length/mean": jnp.mean(lengths), "response_length/max": jnp.max(lengths)})
    metrics.update(_acceptance_metrics(batch, logp_dense, aux["top_logp"], sc))

    lora, lora_opt_state = state.lora, state.lora_opt_state
    if sc.distill:
      # The teacher log-probs are those of the pre-update base, so the adapter is fitted on that
      # same base: fitting sparse(new base) + LoRA to dense(old base) would teach the adapter to
      # undo each policy update, and the actor would drift from the policy step after step.
      (d_loss, d_aux), d_grads = jax.value_and_grad(distill_loss, has_aux=True)(
          lora, state.params, batch, adv_B, logp_dense, cfg, sc, sparse, schedule)
      lora, lora_opt_state, d_norm, d_finite = _guarded_update(
          lora_optimizer, d_grads, lora_opt_state, lora, d_loss)
      metrics.update({"loss/distill": d_loss, "distill/k3": d_aux["distill_kl"],
                      "grad_norm/lora": d_norm, "skipped_lora": ~d_finite})
    new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state, lora=lora,
                              lora_opt_state=lora_opt_state)
    return new_state, metrics

  return jax.jit(train_step, donate_argnums=0)


def init_state(params, optimizer, lora: Optional[LoRA] = None, lora_optimizer=None,
               keep_reference: bool = False) -> TrainState:
  return TrainState(
      step=jnp.zeros((), jnp.int32), params=params, opt_state=optimizer.init(params), lora=lora,
      lora_opt_state=lora_optimizer.init(lora) if lora is not None else None,
      ref_params=jax.tree_util.tree_map(jnp.copy, params) if keep_reference else None)


def batch_from_rollout(prompt_BT, prompt_len_B, rollout, rewards_B):
  """Token-aligned train batch from a sampler Rollout and its rewards."""
  from sparrow_jax.rollout.sampler import full_sequences
  tokens, gen_mask = full_sequences(prompt_BT, prompt_len_B, rollout)
  S, N = tokens.shape[1], rollout.tokens.shape[1]
  j = jnp.clip(jnp.arange(S)[None] - prompt_len_B[:, None], 0, N - 1)
  align = lambda x: jnp.take_along_axis(x, j.reshape(j.shape + (1,) * (x.ndim - 2)), axis=1)
  batch = {"tokens": tokens, "gen_mask": gen_mask, "prompt_len": jnp.asarray(prompt_len_B, jnp.int32),
           "logp_rollout": jnp.where(gen_mask, align(rollout.logprobs), 0.0),
           "rewards": jnp.asarray(rewards_B, jnp.float32)}
  if rollout.top_logprobs is not None:
    batch["top_logp"] = align(rollout.top_logprobs)
    batch["top_ids"] = align(rollout.top_ids)
  return batch
