"""The fused RL step: one `jax.jit` call per batch of sparse rollouts.

  pre-update passes (full batch) -> the dense policy p (PPO "old" log-probs, TIS numerator,
                                    DistillSparse teacher, top-20) and the rollout policy q
  per minibatch (x ppo_epochs)   -> `dense_update`: GRPO/DAPO x TIS, optax update of the base
                                    params; then `distill_update`: PPO on the sparse actor +
                                    lambda * k3(p || q), optax update of the LoRA only, on the
                                    frozen base `distill.base` names (pre-update by default)
  metrics (full batch)           -> `update_metrics` (losses averaged over minibatches),
                                    `rollout_metrics` (TIS, entropy, rewards, lengths) and
                                    `_acceptance_metrics`: acceptance tail stats (exact alpha, the
                                    sampled estimator and the top-20 bound)
With one PPO update per batch (the default) p comes out of the gradient pass itself (ratio =
exp(logp - stop_grad(logp)) = 1 with the right gradient), and q out of the DistillSparse gradient
pass, so nothing is computed twice. With several updates, a no-grad pass fixes p first, and exact
acceptance costs one more no-grad sparse teacher-forced pass for q (as it does without distill).
Mismatch masking (rl.mask_alpha_below, rl.mask_row_alpha_below) picks the loss's tokens by that
alpha, so with it on both no-grad passes run before the first update.

Memory is linear in the row length: every pass is `qwen3.forward_hidden` (scanned, rematerialised
layers, blockwise attention) and every vocabulary-sized quantity (log-probs, entropy, top-20, exact
alpha) comes from `qwen3.map_logits` in sequence chunks; `micro_batches` accumulates each update's
gradient over slices of its rows inside the jit (the losses' normalisers stay those of the whole
minibatch, so the update is the same). With `length_buckets`, each such slice of rows runs cut to
the smallest bucket that holds its longest row (`in_length_bucket`, a lax.switch: one program),
the rows of a minibatch sorted by length into its micro-batches first (rl/accumulation.py).

What the step takes (its StepConfig, TrainState and token-aligned Batch) is in rl/step_schema.py.
Non-finite losses or gradients skip the update (state unchanged; `metrics["skipped"]`).
"""

import jax
import jax.numpy as jnp
import optax

from sparrow_jax import sharding
from sparrow_jax.mismatch import acceptance
from sparrow_jax.model import qwen3
from sparrow_jax.rl import advantages, losses
from sparrow_jax.rl.accumulation import (
  accumulated_grad,
  bucket_lengths,
  map_row_slices,
  minibatches,
)
from sparrow_jax.rl.step_schema import TOP_K, StepConfig, TrainState, turn_index, valid_mask
from sparrow_jax.sparsity import policy


def next_token_aligned(x_BS):
  """Per-position values of the distribution at s (which predicts token s + 1) moved to the token
  alignment: out[:, s] = x[:, s - 1], out[:, 0] = 0 (trailing axes are carried along)."""
  pad = ((0, 0), (1, 0)) + ((0, 0),) * (x_BS.ndim - 2)
  return jnp.pad(x_BS[:, :-1], pad)


def hidden_states(params, batch, cfg, sc: StepConfig, lora=None, sparse=None, budget=None):
  """Final hidden states [B, S, D] of the dense policy (sparse=None) or of the rollout policy:
  sparse attention under the step's budget (exactly the pages the sampler read), with the LoRA when
  DistillSparse is on."""
  kwargs = dict(mask_BT=valid_mask(batch), lora=lora, remat=sc.rl.remat)
  if sparse is not None:
    kwargs["attention_fn"] = policy.teacher_forced_attention_fn(
      sparse, budget, batch.prompt_len, batch.context
    )
  return qwen3.forward_hidden(params, batch.tokens, cfg, **kwargs)


def token_stats(params, x_BSD, batch, cfg, sc: StepConfig, with_top: bool = False):
  """From the hidden states, per token s (token alignment): "logp" of token s under
  softmax(logits / temperature) at s - 1, the "entropy_BS" of that distribution, and (if asked)
  its "top" TOP_K (log-probs, ids). Chunked with the LM head: no [B, S, V] array."""

  def fn(logits, targets_BC):
    logp_BCV = jax.nn.log_softmax(logits[0] / sc.rollout.temperature, axis=-1)
    out = {
      "logp": jnp.take_along_axis(logp_BCV, targets_BC[..., None], axis=-1)[..., 0],
      "entropy_BS": losses.entropy(logp_BCV),
    }
    if with_top:
      out["top"] = jax.lax.top_k(logp_BCV, TOP_K)
    return out

  stats = qwen3.map_logits(
    params, cfg, fn, (x_BSD,), (jnp.roll(batch.tokens, -1, axis=1),), chunk=sc.rl.logits_chunk
  )
  return jax.tree_util.tree_map(next_token_aligned, stats)


def policy_loss(
  params,
  batch,
  adv_B,
  cfg,
  sc: StepConfig,
  logp_old_BS=None,
  ref_params=None,
  weights=(1.0, 1.0),
  norm_len=None,
):
  """Dense GRPO/DAPO loss with TIS. logp_old=None: the old policy is these params (one update),
  and aux carries its hidden states and token statistics for the step's metrics. weights = (of the
  policy-gradient term, of the token-mean terms): a micro-batch's share of its minibatch. norm_len:
  the seq-mean-token-sum-norm constant, the batch's full row length (rows cut to a length bucket
  keep it); None = this batch's."""
  mask = batch.gen_mask
  x_BSD = hidden_states(params, batch, cfg, sc)
  stats = token_stats(
    params, x_BSD, batch, cfg, sc, logp_old_BS is None and batch.top_logp is not None
  )
  logp = stats["logp"]
  old = jax.lax.stop_gradient(logp) if logp_old_BS is None else logp_old_BS
  pg, clipped = losses.ppo_token_loss(
    logp, old, adv_B, sc.rl.eps_low, sc.rl.eps_high, sc.rl.dual_clip
  )
  w = losses.tis_weight(old, batch.logp_rollout, mask, sc.rl.tis_cap, sc.rl.tis_level)
  pg_weight, token_weight = weights
  norm_len = mask.shape[1] if norm_len is None else norm_len
  loss = pg_weight * losses.aggregate(pg * w, mask, sc.rl.loss_agg, norm_len)
  if sc.rl.entropy_coef:
    loss = loss - token_weight * sc.rl.entropy_coef * losses.aggregate(stats["entropy_BS"], mask)
  if ref_params is not None and sc.rl.kl_coef > 0:
    ref_params = jax.lax.stop_gradient(ref_params)
    ref_logp = token_stats(ref_params, hidden_states(ref_params, batch, cfg, sc), batch, cfg, sc)[
      "logp"
    ]
    loss = loss + token_weight * sc.rl.kl_coef * losses.aggregate(
      losses.kl_penalty(logp, ref_logp, sc.rl.kl_kind), mask
    )
  aux = {"clip_frac": token_weight * losses.aggregate(clipped.astype(jnp.float32), mask)}
  if logp_old_BS is None:
    aux.update(hidden=jax.lax.stop_gradient(x_BSD), **jax.lax.stop_gradient(stats))
  return loss, aux


def distill_loss(
  lora,
  params,
  batch,
  adv_B,
  logp_dense_BS,
  cfg,
  sc: StepConfig,
  sparse,
  budget,
  weights=(1.0, 1.0),
  norm_len=None,
):
  """DistillSparse: PPO on the sparse actor's own rollouts (its rollout log-probs are the old
  policy) + lambda * k3(dense -> sparse+LoRA). Base params are frozen (stop_gradient). aux carries
  the sparse+LoRA hidden states (with the pre-update adapter: exactly the rollout policy q).
  weights, norm_len: as `policy_loss`'s."""
  mask = batch.gen_mask
  params = jax.lax.stop_gradient(params)
  x_BSD = hidden_states(params, batch, cfg, sc, lora, sparse, budget)
  logp_q = token_stats(params, x_BSD, batch, cfg, sc)["logp"]
  pg, _ = losses.ppo_token_loss(
    logp_q, batch.logp_rollout, adv_B, sc.rl.eps_low, sc.rl.eps_high, sc.rl.dual_clip
  )
  pg_weight, token_weight = weights
  kl = token_weight * losses.aggregate(losses.kl_penalty(logp_q, logp_dense_BS, "k3"), mask)
  loss = (
    pg_weight
    * sc.distill.ppo_coef
    * losses.aggregate(pg, mask, sc.rl.loss_agg, mask.shape[1] if norm_len is None else norm_len)
    + sc.distill.kl_coef * kl
  )
  return loss, {"distill_kl": kl, "hidden": jax.lax.stop_gradient(x_BSD)}


def _guarded_update(optimizer, grads, opt_state, params, loss):
  """optax update, skipped (inputs returned unchanged) when the loss or a gradient is not finite."""
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, new_opt_state = optimizer.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
  return keep(new_params, params), keep(new_opt_state, opt_state), grad_norm, finite


def _token_weighted(rows):
  """Token-weighted mean of each metric over the updates' rows [(metrics, tokens), ...]."""
  tokens = jnp.stack([n for _, n in rows]).astype(jnp.float32)
  weights = tokens / jnp.maximum(tokens.sum(), 1.0)
  return {k: sum(w * m[k] for w, (m, _) in zip(weights, rows)) for k in rows[0][0]}


def exact_acceptance(params, x_p_BSD, x_q_BSD, cfg, sc: StepConfig):
  """alpha_BS = sum_x min(p, q) per token (token alignment) from the hidden states of p and q,
  chunked with the LM head."""
  fn = lambda logits: acceptance.acceptance_rate(logits[0], logits[1], sc.rollout.temperature)
  alpha = qwen3.map_logits(params, cfg, fn, (x_p_BSD, x_q_BSD), chunk=sc.rl.logits_chunk)
  return next_token_aligned(alpha)


def _acceptance_metrics(batch, logp_old_BS, top_old, alpha_BS, stale_BS, sc: StepConfig):
  """Tail stats per family of per-token acceptance, binned by `schedule.position_bin`:
  "acceptance" (exact alpha = sum_x min(p, q), when given), "acceptance_sampled"
  (min(1, p(x)/q(x)) of the sampled token: unbiased for the mean, biased low in the tail; q the
  sampler's own, so with stale rollouts it carries staleness and sparsity together),
  "acceptance_stale" (exact alpha of the stale dense policy against p, when given) and
  "acceptance_topk20" (the reference's lower bound from both top-20s, when the rollout has them)."""
  mask = batch.gen_mask
  positions = jnp.broadcast_to(jnp.arange(mask.shape[1])[None], mask.shape)
  families = {"acceptance_sampled": acceptance.sampled_acceptance(logp_old_BS, batch.logp_rollout)}
  if alpha_BS is not None:
    families["acceptance"] = alpha_BS
  if stale_BS is not None:
    families["acceptance_stale"] = stale_BS
  if top_old is not None:
    families["acceptance_topk20"] = acceptance.topk_acceptance_bound(
      *top_old, batch.top_logp, batch.top_ids
    )
  percentiles = acceptance.tail_percentiles(sc.stats.quantile)
  # a multi-turn batch's tails also per turn; single-turn steps lower as before
  turn_BS = None if batch.context is None else turn_index(batch)
  metrics = {}
  for name, alpha in families.items():
    stats = acceptance.tail_stats(
      alpha,
      mask,
      positions,
      sc.stats.bin_size,
      sc.stats.num_bins,
      sc.rollout.page_size,
      sc.stats.tau,
      percentiles,
    )
    if turn_BS is not None:
      stats |= acceptance.turn_stats(
        alpha, mask, turn_BS, sc.stats.turns, sc.stats.tau, percentiles
      )
    metrics.update({f"{name}/{k}": v for k, v in stats.items()})
    metrics[f"{name}/histogram"] = acceptance.alpha_histogram(alpha, mask)
  return metrics


def dense_update(params, opt_state, optimizer, rows, cfg, sc: StepConfig, ref_params=None):
  """One update of the base params on a minibatch rows = (batch, adv_B, logp_old_BS or None: the
  old policy is `params` itself, one update per batch). Returns (params, opt_state, aux of
  `policy_loss`, its metrics row, finite: whether the update was applied)."""
  S = rows[0].tokens.shape[1]
  loss_fn = lambda p, rows, w: policy_loss(
    p, rows[0], rows[1], cfg, sc, rows[2], ref_params, w, norm_len=S
  )
  (loss, aux), grads = accumulated_grad(
    loss_fn,
    params,
    rows,
    sc.rl.micro_batches,
    sc.rl.loss_agg,
    bucket_lengths(sc.rl.length_buckets, S),
  )
  params, opt_state, grad_norm, finite = _guarded_update(optimizer, grads, opt_state, params, loss)
  metrics = {"loss/policy": loss, "grad_norm/policy": grad_norm, "ppo/clip_frac": aux["clip_frac"]}
  return params, opt_state, aux, metrics, finite


def distill_update(
  lora, lora_opt_state, lora_optimizer, base_params, rows, cfg, sc: StepConfig, sparse, budget
):
  """One DistillSparse update of the LoRA on a minibatch rows = (batch, adv_B, dense teacher
  log-probs), the sparse actor run on `base_params` (frozen). Returns (lora, lora_opt_state, aux of
  `distill_loss`, its metrics row, finite)."""
  S = rows[0].tokens.shape[1]
  loss_fn = lambda lora, rows, w: distill_loss(
    lora, base_params, rows[0], rows[1], rows[2], cfg, sc, sparse, budget, w, norm_len=S
  )
  (loss, aux), grads = accumulated_grad(
    loss_fn,
    lora,
    rows,
    sc.rl.micro_batches,
    sc.rl.loss_agg,
    bucket_lengths(sc.rl.length_buckets, S),
  )
  lora, lora_opt_state, grad_norm, finite = _guarded_update(
    lora_optimizer, grads, lora_opt_state, lora, loss
  )
  metrics = {"loss/distill": loss, "distill/k3": aux["distill_kl"], "grad_norm/lora": grad_norm}
  return lora, lora_opt_state, aux, metrics, finite


def update_metrics(base_rows, lora_rows, skipped, skipped_lora):
  """The updates' metrics: each row [(metrics, tokens), ...] token-weighted over the minibatches,
  and the skipped-update counts (skipped: [~finite] of each base update, skipped_lora of each LoRA
  update; empty without DistillSparse)."""
  metrics = _token_weighted(base_rows)
  metrics["skipped_updates"] = jnp.sum(jnp.stack(skipped))
  metrics["skipped"] = metrics["skipped_updates"] > 0
  if lora_rows:
    metrics.update(_token_weighted(lora_rows))
    metrics["skipped_lora"] = jnp.any(jnp.stack(skipped_lora))
  return metrics


def rollout_metrics(batch, dense, sc: StepConfig):
  """The batch's metrics under the pre-update dense policy `dense` (logp, entropy_BS): entropy,
  TIS weights, rewards, lengths (the acceptance tail stats: `_acceptance_metrics`)."""
  mask = batch.gen_mask
  w = losses.tis_weight(dense["logp"], batch.logp_rollout, mask, sc.rl.tis_cap, sc.rl.tis_level)
  n_gen = jnp.maximum(jnp.sum(mask), 1)
  lengths = jnp.sum(mask, 1)
  metrics = {
    "entropy": losses.aggregate(dense["entropy_BS"], mask),
    "tis/weight_mean": jnp.sum(w * mask) / n_gen,
    "tis/weight_min": jnp.min(jnp.where(mask, w, jnp.inf)),
    "tis/clipped_frac": jnp.sum((w >= sc.rl.tis_cap) * mask) / n_gen,
    "reward/mean": jnp.mean(batch.rewards),
    "reward/std": jnp.std(batch.rewards),
    "response_length/mean": jnp.mean(lengths),
    "response_length/max": jnp.max(lengths),
  }
  return metrics


def mismatch_masking(batch, alpha_BS, sc: StepConfig):
  """The completion tokens the dense policy loss keeps under rl.mask_alpha_below and
  rl.mask_row_alpha_below (losses.mismatch_mask), and "mask/token_frac" (share of the completion
  tokens the token rule drops), "mask/row_frac" (share of the rows the row rule drops)."""
  keep_BS, token_out_BS, row_out_B = losses.mismatch_mask(
    alpha_BS, batch.gen_mask, sc.rl.mask_alpha_below, sc.rl.mask_row_alpha_below
  )
  metrics = {
    "mask/token_frac": jnp.sum(token_out_BS) / jnp.maximum(jnp.sum(batch.gen_mask), 1),
    "mask/row_frac": jnp.mean(row_out_B),
  }
  return keep_BS, metrics


def _rollout_acceptance(state, batch, dense, x_q_BSD, cfg, sc, sparse, budget, slices, lengths):
  """Exact alpha_BS between the pre-update dense policy and the rollout policy q (the state's
  params and LoRA under the sparse budget: x_q_BSD when a gradient pass computed it, else a no-grad
  pass), over `slices` slices of the rows in turn."""
  if sparse is None:
    return jnp.where(batch.gen_mask, 1.0, 0.0)  # dense rollouts: the rollout policy is p itself

  def alpha(rows):
    b, x_p_BSD, x_q_BSD = rows
    if x_q_BSD is None:
      x_q_BSD = hidden_states(state.params, b, cfg, sc, state.lora, sparse, budget)
    return exact_acceptance(state.params, x_p_BSD, x_q_BSD, cfg, sc)

  return map_row_slices(alpha, (batch, dense["hidden"], x_q_BSD), slices, lengths)


def _stale_acceptance(state, batch, x_p_BSD, cfg, sc: StepConfig, slices, lengths):
  """Exact alpha_BS between the dense policy of the weights that sampled the rollouts one step
  ago (state.behaviour_params: rl.off_policy_steps) and the pre-update dense policy p (x_p_BSD its
  hidden states) on the same tokens: what staleness alone costs, whatever the rollouts' sparsity
  (the sparse actor against p, at the current weights, is "acceptance")."""
  behaviour, params = state.behaviour_params, state.params
  logits = lambda w, x_BCD: qwen3.unembed(w, x_BCD, cfg)
  fn = lambda x_b, x_p: acceptance.acceptance_rate(
    logits(behaviour, x_b), logits(params, x_p), sc.rollout.temperature
  )

  def alpha(rows):
    b, x_p_BSD = rows
    x_b_BSD = hidden_states(behaviour, b, cfg, sc)
    return next_token_aligned(qwen3.map_sequence(fn, (x_b_BSD, x_p_BSD), sc.rl.logits_chunk))

  return map_row_slices(alpha, (batch, jax.lax.stop_gradient(x_p_BSD)), slices, lengths)


def _dense_pass(params, batch, cfg, sc: StepConfig, slices, lengths):
  """The pre-update dense policy p over the batch, no gradient, `slices` slices of rows in turn:
  hidden states and `token_stats` (with the top-20 when the rollout kept its own)."""

  def dense(b):
    x_BSD = hidden_states(params, b, cfg, sc)
    return dict(hidden=x_BSD, **token_stats(params, x_BSD, b, cfg, sc, b.top_logp is not None))

  return map_row_slices(dense, batch, slices, lengths)


def _advantages(batch, sc: StepConfig):
  """The batch (DAPO's filter: the completion tokens of zero-variance groups left out of the
  loss) and its rows' advantages."""
  if sc.rl.dapo_filter:
    keep_B = jnp.repeat(
      advantages.informative_groups(batch.rewards, sc.rollout.group_size), sc.rollout.group_size
    )
    batch = batch.replace(gen_mask=batch.gen_mask & keep_B[:, None])
  adv_B = advantages.advantages(
    batch.rewards, sc.rollout.group_size, sc.rl.estimator, std_ddof=sc.rl.grpo_std_ddof
  )
  return batch, adv_B


def _updates(state, batch, adv_B, p_logp_BS, loss_mask_BS, cfg, sc, optimizers, sparse, budget):
  """The step's ppo_epochs x num_minibatches updates in turn: per minibatch, `dense_update` of the
  base params, then (DistillSparse) `distill_update` of the LoRA. p_logp_BS: the pre-update dense
  log-probs (None with one update: its gradient pass is the old policy). loss_mask_BS: the tokens
  the dense loss keeps (None: gen_mask). Returns (the state with the updated params and LoRA,
  its step count unchanged; `update_metrics`; the aux of the last dense update; the sparse actor's
  hidden states when they are exactly the rollout policy q's: one update on the pre-update base,
  else None)."""
  optimizer, lora_optimizer = optimizers
  params, opt_state = state.params, state.opt_state
  lora, lora_opt_state = state.lora, state.lora_opt_state
  base_rows, lora_rows, skipped, skipped_lora, x_q_BSD = [], [], [], [], None
  single = p_logp_BS is None
  for _ in range(sc.rl.ppo_epochs):
    for mb, adv_mb, logp_p_mb, loss_mask_mb in minibatches(
      (batch, adv_B, p_logp_BS, loss_mask_BS), sc.rl.num_minibatches
    ):
      loss_mb = mb if loss_mask_mb is None else mb.replace(gen_mask=loss_mask_mb)
      params, opt_state, aux, row, finite = dense_update(
        params, opt_state, optimizer, (loss_mb, adv_mb, logp_p_mb), cfg, sc, state.ref_params
      )
      base_rows.append((row, jnp.sum(loss_mb.gen_mask)))
      skipped.append(~finite)
      if sc.distill.enabled:
        # The teacher is the pre-update dense policy; the sparse actor runs on the base the
        # `distill.base` option names (DistillConfig). It keeps the tokens masking drops from
        # the dense loss (as verl's rollout correction masks the policy loss only): its PPO term
        # is on-policy (the old policy is the rollout's own) and its k3 term is what closes the
        # sparse/dense gap, widest at exactly those tokens.
        teacher = aux["logp"] if logp_p_mb is None else logp_p_mb
        base = state.params if sc.distill.base == "pre_update" else params
        lora, lora_opt_state, d_aux, row, d_finite = distill_update(
          lora, lora_opt_state, lora_optimizer, base, (mb, adv_mb, teacher), cfg, sc, sparse, budget
        )
        # With one update on the pre-update base, its pass is exactly the rollout policy q's.
        x_q_BSD = d_aux["hidden"] if single and sc.distill.base == "pre_update" else None
        lora_rows.append((row, jnp.sum(mb.gen_mask)))
        skipped_lora.append(~d_finite)
  metrics = update_metrics(base_rows, lora_rows, skipped, skipped_lora)
  updated = state.replace(
    params=params, opt_state=opt_state, lora=lora, lora_opt_state=lora_opt_state
  )
  return updated, metrics, aux, x_q_BSD


def make_train_step(
  cfg, sc: StepConfig, optimizer, lora_optimizer=None, sparse=None, state_shardings=None
):
  """The fused RL step of the module docstring, jit-compiled with the state donated.

  Args:
    cfg: the model's Qwen3Config.
    sc: the step's settings (`StepConfig.from_config(config)`).
    optimizer: the optax optimizer of the base params.
    lora_optimizer: the optax optimizer of the DistillSparse LoRA (needed with distill on).
    sparse: the rollouts' SparseConfig; None = dense rollouts, whose q is p itself.
    state_shardings: `step_schema.state_sharding(...)`: the state in and out on them (step n + 1
      reuses step n's executable), the batch rows over data x fsdp, budget and metrics replicated
      (trace under `jax.set_mesh(mesh)`). None: wherever jit puts them.

  Returns:
    train_step(state, batch, budget=None) -> (state, metrics): batch a `Batch` (with top_logp /
    top_ids, the top-20 bound is logged); budget the rollout's `schedule.BudgetTable` (traced: a
    new stage does not recompile), given exactly when `sparse` is.
  """
  if sc.distill.enabled and (lora_optimizer is None or sparse is None):
    raise ValueError("StepConfig.distill.enabled needs lora_optimizer and sparse")

  def train_step(state: TrainState, batch, budget=None):
    if (sparse is None) != (budget is None):
      raise ValueError(
        "train_step needs a budget (schedule.BudgetTable) exactly when the rollouts are sparse"
      )
    batch, adv_B = _advantages(batch, sc)
    # Dense rollouts are the policy's own samples (alpha = 1): nothing to mask.
    masking = sparse is not None and (sc.rl.mask_alpha_below > 0 or sc.rl.mask_row_alpha_below > 0)
    single = sc.rl.ppo_epochs * sc.rl.num_minibatches == 1 and not masking
    # no-grad passes over the full batch run in slices of a gradient pass's rows
    pass_slices = sc.rl.num_minibatches * sc.rl.micro_batches
    lengths = bucket_lengths(sc.rl.length_buckets, batch.tokens.shape[1])
    acceptance_of = lambda p, x_q_BSD: _rollout_acceptance(
      state, batch, p, x_q_BSD, cfg, sc, sparse, budget, pass_slices, lengths
    )
    # p, the pre-update dense policy over the full batch (hidden, logp, entropy_BS, top): a no-grad
    # pass before the updates, except with one update, whose gradient pass gives it.
    p_no_grad = None if single else _dense_pass(state.params, batch, cfg, sc, pass_slices, lengths)
    alpha_BS, loss_mask_BS, mask_metrics = None, None, {}
    if masking:
      alpha_BS = acceptance_of(p_no_grad, None)
      loss_mask_BS, mask_metrics = mismatch_masking(batch, alpha_BS, sc)
    p_logp_BS = None if single else p_no_grad["logp"]
    updated, metrics, last_aux, x_q_BSD = _updates(
      state,
      batch,
      adv_B,
      p_logp_BS,
      loss_mask_BS,
      cfg,
      sc,
      (optimizer, lora_optimizer),
      sparse,
      budget,
    )
    p = last_aux if single else p_no_grad
    metrics.update(rollout_metrics(batch, p, sc))
    metrics.update(mask_metrics)
    if sc.stats.exact_acceptance and alpha_BS is None:
      alpha_BS = acceptance_of(p, x_q_BSD)
    stale_BS = None
    if (
      state.behaviour_params is not None
    ):  # one step off: the next update's rollouts are this one's
      stale_BS = _stale_acceptance(state, batch, p["hidden"], cfg, sc, pass_slices, lengths)
      updated = updated.replace(behaviour_params=state.params)
    metrics.update(_acceptance_metrics(batch, p["logp"], p.get("top"), alpha_BS, stale_BS, sc))
    return updated.replace(step=state.step + 1), metrics

  if state_shardings is None:
    return jax.jit(train_step, donate_argnums=0)
  mesh = state_shardings.step.mesh
  rep = sharding.replicated(mesh)
  return jax.jit(
    train_step,
    donate_argnums=0,
    in_shardings=(state_shardings, sharding.rows(mesh), rep),
    out_shardings=(state_shardings, rep),
  )
