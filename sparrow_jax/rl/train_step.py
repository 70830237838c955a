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
the rows of a minibatch sorted by length into its micro-batches first.

Sequences are right-padded rows of prompt + completion; every per-token array is aligned to them:
value[b, s] concerns token s (its log-prob given tokens < s), and `gen_mask[b, s]` marks completion
tokens. Non-finite losses or gradients skip the update (state unchanged; `metrics["skipped"]`).
"""

import dataclasses
import functools
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax

from sparrow_jax import schema, sharding
from sparrow_jax.mismatch import acceptance
from sparrow_jax.model import qwen3
from sparrow_jax.model.lora import LoRA
from sparrow_jax.rl import advantages, losses
from sparrow_jax.rollout import sampler
from sparrow_jax.sparsity import policy, schedule

DISTILL_BASES = ("pre_update", "updated")  # DistillConfig.base
TOP_K = 20  # top log-probs per token for the acceptance lower bound (the reference's k)
# The step traces each of its ppo_epochs x num_minibatches updates into its one program, so its
# compile time grows with their number; PPO's usual 1-4 epochs of up to 16 minibatches stay well
# under this.
MAX_UPDATES = 64


def _require(config, ok: bool, name: str, allowed: str) -> None:
  if not ok:
    raise ValueError(
      f"{type(config).__name__}.{name} = {getattr(config, name)!r} is invalid: {allowed}"
    )


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """The policy update: the experiment config's `rl` group (its optimizer fields are the
  trainer's)."""

  estimator: str = "grpo"
  grpo_std_ddof: int = 1  # 1: unbiased group std (the reference's torch.std); 0: population
  eps_low: float = 0.2
  eps_high: float = 0.28
  dual_clip: float = 3.0
  tis_cap: float = 2.0
  tis_level: str = "token"
  loss_agg: str = "token-mean"
  kl_coef: float = 0.0  # KL to the reference (initial) params; 0 = no reference kept
  kl_kind: str = "k3"
  entropy_coef: float = 0.0
  ppo_epochs: int = 1
  num_minibatches: int = 1
  dapo_filter: bool = False  # drop zero-variance groups from the loss (DAPO dynamic sampling)
  micro_batches: int = 1  # gradient accumulation: rows of a minibatch per backward pass / n
  # Row lengths the passes compile at (`bucket_lengths`): each slice of rows a pass runs (a
  # micro-batch, a no-grad slice) runs cut to the smallest that holds its longest row, the rows of
  # a minibatch sorted by length into its micro-batches first; () = every pass at the full length.
  length_buckets: tuple = ()
  # Mismatch masking (losses.mismatch_mask) by the exact alpha = sum_x min(p, q) of each completion
  # token, p the pre-update dense policy, q the rollout's: the dense policy loss leaves out a token
  # whose alpha is under mask_alpha_below, and every token of a row whose p1 alpha (over its
  # completion) is under mask_row_alpha_below; 0 = off. p1, not the min: a row's min falls with its
  # length and one outlier is the token rule's to drop, while p1 under the bar means over 1% of the
  # row is off the dense policy, a stretch the row's later tokens are conditioned on. On, the
  # alpha must be known before the first update: with one update a batch, a no-grad dense pass and
  # a no-grad sparse pass run first (the gradient passes give them otherwise).
  mask_alpha_below: float = 0.0
  mask_row_alpha_below: float = 0.0
  remat: str = "full"  # per-layer rematerialisation (qwen3.REMAT_POLICIES)
  logits_chunk: int = 512  # positions per LM-head chunk (qwen3.map_logits)

  def __post_init__(self):
    require = functools.partial(_require, self)
    require(self.estimator in advantages.ESTIMATORS, "estimator", f"one of {advantages.ESTIMATORS}")
    require(self.grpo_std_ddof in (0, 1), "grpo_std_ddof", "0 or 1")
    require(0 <= self.eps_low < 1, "eps_low", "must lie in [0, 1)")
    require(self.eps_high >= 0, "eps_high", "must be >= 0")
    require(self.dual_clip == 0 or self.dual_clip > 1, "dual_clip", "0 (off) or > 1")
    require(self.tis_cap >= 1, "tis_cap", "must be >= 1")
    require(self.tis_level in losses.TIS_LEVELS, "tis_level", f"one of {losses.TIS_LEVELS}")
    require(self.loss_agg in losses.AGGREGATIONS, "loss_agg", f"one of {losses.AGGREGATIONS}")
    require(self.kl_coef >= 0, "kl_coef", "must be >= 0")
    require(self.kl_kind in losses.KL_KINDS, "kl_kind", f"one of {losses.KL_KINDS}")
    require(self.entropy_coef >= 0, "entropy_coef", "must be >= 0 (a bonus; 0 = off)")
    require(self.num_minibatches >= 1, "num_minibatches", "must be >= 1")
    require(self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
    updates = self.ppo_epochs * self.num_minibatches
    require(
      updates <= MAX_UPDATES,
      "ppo_epochs" if self.ppo_epochs > 1 else "num_minibatches",
      f"ppo_epochs x num_minibatches = {updates} updates a step must be <= {MAX_UPDATES}: each "
      "is compiled into the step's one program",
    )
    require(self.micro_batches >= 1, "micro_batches", "must be >= 1")
    require(
      all(isinstance(n, int) and n >= 1 for n in self.length_buckets)
      and list(self.length_buckets) == sorted(set(self.length_buckets)),
      "length_buckets",
      "must be increasing positive token counts (() = off)",
    )
    require(0 <= self.mask_alpha_below <= 1, "mask_alpha_below", "must lie in [0, 1] (0 = off)")
    require(
      0 <= self.mask_row_alpha_below <= 1, "mask_row_alpha_below", "must lie in [0, 1] (0 = off)"
    )
    require(self.remat in qwen3.REMAT_POLICIES, "remat", f"one of {tuple(qwen3.REMAT_POLICIES)}")
    require(self.logits_chunk >= 1, "logits_chunk", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class DistillConfig:
  """DistillSparse in the same step: the `distill` group (its LoRA fields are the trainer's)."""

  enabled: bool = True
  kl_coef: float = 1e-3  # lambda of the k3 term
  ppo_coef: float = 1.0  # weight of the sparse actor's own PPO term (the paper: 1)
  # The base params the sparse actor runs on in each LoRA update; the teacher is always the dense
  # policy before that minibatch's base update. pre_update: the same base as the teacher, so the
  # adapter fits only the sparse/dense gap (fitting sparse(updated base) + LoRA to dense(old
  # base) also teaches the adapter to undo the base update). updated: the reference's order
  # (Infini-AI-Lab/Sparrow's dp_sparseloraactor.py runs the LoRA pass after the base
  # optimizer step).
  base: str = "pre_update"

  def __post_init__(self):
    _require(self, self.kl_coef >= 0, "kl_coef", "must be >= 0")
    _require(self, self.ppo_coef >= 0, "ppo_coef", "must be >= 0")
    _require(self, self.base in DISTILL_BASES, "base", f"one of {DISTILL_BASES}")


@dataclasses.dataclass(frozen=True)
class StatsConfig:
  """The acceptance tail statistics: the `stats` group."""

  exact_acceptance: bool = True  # log exact alpha = sum_x min(p, q) (see the module docstring)
  tau: float = 0.86  # acceptance threshold (for the "fraction under tau" metric)
  quantile: float = 5  # the tail percentile held at tau, logged beside p1/p5/p10/p50
  bin_size: int = 2048  # position bin of the tail statistics (schedule.position_bin)
  num_bins: int = 20

  def __post_init__(self):
    require = functools.partial(_require, self)
    require(0 < self.tau <= 1, "tau", "must lie in (0, 1]")
    require(schedule.is_quantile(self.quantile), "quantile", "must be a percentile in (0, 50)")
    require(self.bin_size >= 1, "bin_size", "must be >= 1")
    require(self.num_bins >= 1, "num_bins", "must be >= 1")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
  """What the step takes from how the rollouts were made: the `rollout` group's fields of these
  names (the rest are the engine's)."""

  group_size: int = 8
  page_size: int = 16  # KV page size: tokens are binned by whole pages cached
  temperature: float = 1.0  # rollout temperature (log-probs are of logits / temperature)

  def __post_init__(self):
    require = functools.partial(_require, self)
    require(self.group_size >= 2, "group_size", "must be >= 2 (GRPO groups)")
    require(
      isinstance(self.page_size, int)
      and self.page_size >= 1
      and not self.page_size & (self.page_size - 1),
      "page_size",
      "must be a power of two",
    )
    require(self.temperature > 0, "temperature", "must be > 0")


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """The train step's settings, one component per experiment-config group of the same name: each
  field is declared once, here, and `from_config` reads it from `config.<group>.<field>`."""

  rl: RLConfig = dataclasses.field(default_factory=RLConfig)
  distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
  stats: StatsConfig = dataclasses.field(default_factory=StatsConfig)
  rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)

  def __post_init__(self):
    page_size = self.rollout.page_size
    _require(
      self.stats,
      self.stats.bin_size % page_size == 0,
      "bin_size",
      f"must be a positive multiple of rollout.page_size ({page_size})",
    )
    _require(
      self.rl,
      all(n % page_size == 0 for n in self.rl.length_buckets),
      "length_buckets",
      f"must be multiples of rollout.page_size ({page_size}): whole pages, as the sampler reads",
    )

  @classmethod
  def from_config(cls, c) -> "StepConfig":
    """From an experiment config (ml_collections): each component from its group's fields of the
    same names (`schema.from_group`); a bad value names its `config.` field."""
    groups = {f.name: type(f.default_factory()) for f in dataclasses.fields(cls)}
    parts = {group: schema.from_group(component, c, group) for group, component in groups.items()}
    with schema.naming_config_fields(groups):
      return cls(**parts)


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: dict
  opt_state: optax.OptState
  lora: Optional[LoRA] = None
  lora_opt_state: Optional[optax.OptState] = None
  ref_params: Optional[dict] = None


@flax.struct.dataclass
class Batch:
  """One step's rollouts, token-aligned (value[b, s] concerns token s)."""

  tokens: jax.Array  # [B, S] int32 right-padded prompt + completion rows
  gen_mask: jax.Array  # [B, S] bool, the completion tokens
  prompt_len: jax.Array  # [B] int32, where decoding began
  logp_rollout: jax.Array  # [B, S] the sampler's (behaviour) log-prob of each completion token
  rewards: jax.Array  # [B] float32
  top_logp: Optional[jax.Array] = None  # [B, S, 20] the sampler's top-20 log-probs (if kept)
  top_ids: Optional[jax.Array] = None  # [B, S, 20] their token ids

  @classmethod
  def abstract(cls, rows: int, length: int, top_k: int = TOP_K) -> "Batch":
    """The shapes and dtypes of a batch, with the rollout's top-`top_k` log-probs (0: none)
    (jax.ShapeDtypeStruct leaves): to lower and compile the train step without allocating one
    (experiments/memory_report.py)."""
    sds = jax.ShapeDtypeStruct
    return cls(
      tokens=sds((rows, length), jnp.int32),
      gen_mask=sds((rows, length), bool),
      prompt_len=sds((rows,), jnp.int32),
      logp_rollout=sds((rows, length), jnp.float32),
      rewards=sds((rows,), jnp.float32),
      top_logp=sds((rows, length, top_k), jnp.float32) if top_k else None,
      top_ids=sds((rows, length, top_k), jnp.int32) if top_k else None,
    )


def next_token_aligned(x_BS):
  """Per-position values of the distribution at s (which predicts token s + 1) moved to the token
  alignment: out[:, s] = x[:, s - 1], out[:, 0] = 0 (trailing axes are carried along)."""
  pad = ((0, 0), (1, 0)) + ((0, 0),) * (x_BS.ndim - 2)
  return jnp.pad(x_BS[:, :-1], pad)


def row_ends(batch):
  """[B] one past each row's last real token: the prompt and all up to the last completion token,
  so a token left out of the loss (a hole in gen_mask) still conditions the tokens after it."""
  pos_BS = jnp.arange(batch.tokens.shape[1])[None]
  return jnp.max(jnp.where(batch.gen_mask, pos_BS + 1, batch.prompt_len[:, None]), axis=1)


def _valid_mask(batch):
  """The rows' real tokens (`row_ends`)."""
  return jnp.arange(batch.tokens.shape[1])[None] < row_ends(batch)[:, None]


def bucket_lengths(length_buckets, S: int) -> tuple:
  """The row lengths the passes over rows of S tokens compile at: the buckets under S, then S."""
  return tuple(n for n in length_buckets if n < S) + (S,)


def _batch_of(rows):
  return rows if isinstance(rows, Batch) else rows[0]


def in_length_bucket(fn, rows, lengths, *args):
  """fn(rows, *args) -> (out, per_row), run on `rows` (a Batch, or a tuple led by the Batch, of
  per-row arrays; sequence axis 1) cut to the smallest of `lengths` that holds their longest row
  (`row_ends`), per_row's arrays padded back to the full length lengths[-1] with zeros. One
  program: a lax.switch of one branch per length, of which only the chosen one runs."""
  if len(lengths) == 1:
    return fn(rows, *args)
  on_tokens = lambda f: lambda x: f(x) if x.ndim >= 2 else x

  def at_length(n):
    def run(rows, *args):
      cut = jax.tree_util.tree_map(on_tokens(lambda x: x[:, :n]), rows)
      out, per_row = fn(cut, *args)
      pad = lambda x: jnp.pad(x, ((0, 0), (0, lengths[-1] - n)) + ((0, 0),) * (x.ndim - 2))
      return out, jax.tree_util.tree_map(on_tokens(pad), per_row)

    return run

  i = jnp.searchsorted(jnp.asarray(lengths), jnp.max(row_ends(_batch_of(rows))))
  return jax.lax.switch(i, [at_length(n) for n in lengths], rows, *args)


def _by_length(rows, lengths):
  """`rows` sorted by length (`row_ends`) when there are buckets, so that consecutive slices of
  them fit short ones, and a function putting per-row results back in the given order."""
  if len(lengths) == 1:
    return rows, lambda per_row: per_row
  order = jnp.argsort(row_ends(_batch_of(rows)))
  back = jnp.argsort(order)
  take = lambda idx: lambda tree: jax.tree_util.tree_map(lambda x: x[idx] if x.ndim else x, tree)
  return take(order)(rows), take(back)


def hidden_states(params, batch, cfg, sc: StepConfig, lora=None, sparse=None, budget=None):
  """Final hidden states [B, S, D] of the dense policy (sparse=None) or of the rollout policy:
  sparse attention under the step's budget (exactly the pages the sampler read), with the LoRA when
  DistillSparse is on."""
  kwargs = dict(mask_BT=_valid_mask(batch), lora=lora, remat=sc.rl.remat)
  if sparse is not None:
    kwargs["attention_fn"] = policy.teacher_forced_attention_fn(sparse, budget, batch.prompt_len)
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


def accumulated_grad(loss_fn, diff, rows, n: int, loss_agg: str, lengths=None):
  """value_and_grad of loss_fn(diff, rows, weights) -> (loss, aux), summed over n equal slices of
  `rows` (a tuple led by the Batch, of per-row arrays; a lax.scan holds one slice's activations at
  a time). Each slice is weighted by its share of the whole batch's normalisers (tokens for token
  means, rows for the sequence means of `loss_agg`), so the sum is the whole batch's loss and
  gradient. Scalars in aux are summed, per-row arrays put back in row order. lengths
  (`bucket_lengths`): each slice runs `in_length_bucket`, the rows sorted by length first."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  lengths = lengths or (rows[0].tokens.shape[1],)

  def bucketed_grad(part, weights):
    (loss, aux), g = grad_fn(diff, part, weights)
    return (loss, g), aux

  if n == 1:
    (loss, grads), aux = in_length_bucket(bucketed_grad, rows, lengths, (1.0, 1.0))
    return (loss, aux), grads
  B = rows[0].gen_mask.shape[0]
  rows, in_row_order = _by_length(rows, lengths)
  parts = _row_slices(rows, n, "micro_batches")
  tokens_n = jnp.sum(parts[0].gen_mask, axis=(1, 2)).astype(jnp.float32)
  token_w_n = tokens_n / jnp.maximum(jnp.sum(tokens_n), 1.0)
  pg_w_n = token_w_n if loss_agg == "token-mean" else jnp.full((n,), 1.0 / n)

  def body(grads, xs):
    part, pg_w, token_w = xs
    (loss, g), aux = in_length_bucket(bucketed_grad, part, lengths, (pg_w, token_w))
    return jax.tree_util.tree_map(lambda a, b: a + b.astype(a.dtype), grads, g), (loss, aux)

  zeros = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, jnp.float32), diff)
  grads, (loss_n, aux_n) = jax.lax.scan(body, zeros, (parts, pg_w_n, token_w_n))
  grads = jax.tree_util.tree_map(lambda g, x: g.astype(x.dtype), grads, diff)
  merge = lambda y: jnp.sum(y, 0) if y.ndim == 1 else y.reshape(B, *y.shape[2:])
  return (jnp.sum(loss_n), in_row_order(jax.tree_util.tree_map(merge, aux_n))), grads


def _guarded_update(optimizer, grads, opt_state, params, loss):
  """optax update, skipped (inputs returned unchanged) when the loss or a gradient is not finite."""
  grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  updates, new_opt_state = optimizer.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
  return keep(new_params, params), keep(new_opt_state, opt_state), grad_norm, finite


def _rows(tree, stacked: bool = False):
  """Each array's rows constrained to the batch mesh axes (after a leading stack axis)."""
  lead = ("micro_batch",) if stacked else ()
  return jax.tree_util.tree_map(
    lambda x: sharding.constrain(x, lead + ("batch",) + ("length",) * (x.ndim - len(lead) - 1)),
    tree,
  )


def map_row_slices(fn, rows, n: int, lengths=None):
  """fn(rows) -> a pytree of per-row arrays, computed over n equal slices of `rows` (a Batch, or a
  tuple led by the Batch) in turn (a lax.map) and put back in row order: a no-grad pass over the
  whole batch then holds one slice's attention temporaries, as a gradient pass does (the default's
  pre-update passes over 32 rows had set its peak RSS). lengths (`bucket_lengths`): each slice
  runs `in_length_bucket`, the rows sorted by length first."""
  lengths = lengths or (_batch_of(rows).tokens.shape[1],)
  sliced = lambda rows: in_length_bucket(lambda r: ((), fn(r)), rows, lengths)[1]
  if n == 1:
    return sliced(rows)
  rows, in_row_order = _by_length(rows, lengths)
  out = jax.lax.map(sliced, _row_slices(rows, n, "num_minibatches x micro_batches"))
  return in_row_order(jax.tree_util.tree_map(lambda y: y.reshape(-1, *y.shape[2:]), out))


def _row_slices(rows, n: int, field: str):
  """`rows` (a pytree of per-row arrays) as n stacked equal slices of consecutive rows, each slice
  spread over the batch mesh axes."""
  B = jax.tree_util.tree_leaves(rows)[0].shape[0]
  if B % n:
    raise ValueError(f"a batch of {B} rows is not divisible into {field} = {n} slices")
  return _rows(jax.tree_util.tree_map(lambda x: x.reshape(n, B // n, *x.shape[1:]), rows), True)


def _minibatches(rows, n):
  """`rows` (a pytree of per-row arrays) as n minibatches of consecutive rows, each spread over the
  batch mesh axes again."""
  B = jax.tree_util.tree_leaves(rows)[0].shape[0]
  if B % n:
    raise ValueError(f"batch of {B} rows is not divisible into num_minibatches={n}")
  parts = jax.tree_util.tree_map(lambda x: x.reshape(n, B // n, *x.shape[1:]), rows)
  return [_rows(jax.tree_util.tree_map(lambda x: x[i], parts)) for i in range(n)]


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


def _acceptance_metrics(batch, logp_old_BS, top_old, alpha_BS, sc: StepConfig):
  """Tail stats per family of per-token acceptance, binned by `schedule.position_bin`:
  "acceptance" (exact alpha = sum_x min(p, q), when given), "acceptance_sampled"
  (min(1, p(x)/q(x)) of the sampled token: unbiased for the mean, biased low in the tail) and
  "acceptance_topk20" (the reference's lower bound from both top-20s, when the rollout has them)."""
  mask = batch.gen_mask
  positions = jnp.broadcast_to(jnp.arange(mask.shape[1])[None], mask.shape)
  families = {"acceptance_sampled": acceptance.sampled_acceptance(logp_old_BS, batch.logp_rollout)}
  if alpha_BS is not None:
    families["acceptance"] = alpha_BS
  if top_old is not None:
    families["acceptance_topk20"] = acceptance.topk_acceptance_bound(
      *top_old, batch.top_logp, batch.top_ids
    )
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
      acceptance.tail_percentiles(sc.stats.quantile),
    )
    metrics.update({f"{name}/{k}": v for k, v in stats.items()})
    metrics[f"{name}/histogram"] = acceptance.alpha_histogram(alpha, mask)
  return metrics


def state_sharding(state: TrainState, mesh, optimizer, lora_optimizer=None) -> TrainState:
  """Where each leaf of a (possibly abstract) TrainState lives on `mesh`: params, the reference
  params and the optimizer's moments by the params' logical axes (sharding.param_axes), the LoRA
  and its moments by the adapters' (sharding.lora_axes), scalars replicated."""
  rep = sharding.replicated(mesh)
  params = sharding.param_shardings(state.params, mesh)

  def opt(optim, opt_state, like):
    return optax.tree_map_params(
      optim,
      lambda _, s: s,
      opt_state,
      like,
      transform_non_params=lambda _: rep,
      is_leaf=lambda x: isinstance(x, jax.sharding.NamedSharding),
    )

  lora = lora_opt = None
  if state.lora is not None:
    lora = sharding.lora_shardings(state.lora, mesh)
    lora_opt = opt(lora_optimizer, state.lora_opt_state, lora)
  return TrainState(
    step=rep,
    params=params,
    opt_state=opt(optimizer, state.opt_state, params),
    lora=lora,
    lora_opt_state=lora_opt,
    ref_params=None if state.ref_params is None else params,
  )


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


def _dense_pass(params, batch, cfg, sc: StepConfig, slices, lengths):
  """The pre-update dense policy p over the batch, no gradient, `slices` slices of rows in turn:
  hidden states and `token_stats` (with the top-20 when the rollout kept its own)."""

  def dense(b):
    x_BSD = hidden_states(params, b, cfg, sc)
    return dict(hidden=x_BSD, **token_stats(params, x_BSD, b, cfg, sc, b.top_logp is not None))

  return map_row_slices(dense, batch, slices, lengths)


def make_train_step(
  cfg,
  sc: StepConfig,
  optimizer,
  lora_optimizer=None,
  sparse=None,
  state_shardings: Optional[TrainState] = None,
):
  """Returns train_step(state, batch, budget=None) -> (state, metrics), jit-compiled with the state
  donated.

  batch: a `Batch` (the top-20 bound is logged when it carries top_logp / top_ids). budget: the
  rollout's `schedule.BudgetTable` (traced: a new schedule stage does not recompile), required with
  `sparse` (the rollouts' SparseConfig; None = dense rollouts, whose q is p itself).
  state_shardings (`state_sharding(...)`): the state comes in and goes out on those shardings
  (so step n + 1 reuses step n's executable), the batch rows over the mesh's data x fsdp axes,
  budget and metrics replicated. Trace it under `jax.set_mesh(mesh)` for the activations'
  constraints.
  """
  if sc.distill.enabled and (lora_optimizer is None or sparse is None):
    raise ValueError("StepConfig.distill.enabled needs lora_optimizer and sparse")

  def train_step(state: TrainState, batch, budget=None):
    if (sparse is None) != (budget is None):
      raise ValueError(
        "train_step needs a budget (schedule.BudgetTable) exactly when the rollouts are sparse"
      )
    if sc.rl.dapo_filter:
      keep_B = jnp.repeat(
        advantages.informative_groups(batch.rewards, sc.rollout.group_size), sc.rollout.group_size
      )
      batch = batch.replace(gen_mask=batch.gen_mask & keep_B[:, None])
    adv_B = advantages.advantages(
      batch.rewards, sc.rollout.group_size, sc.rl.estimator, std_ddof=sc.rl.grpo_std_ddof
    )
    # Dense rollouts are the policy's own samples (alpha = 1): nothing to mask.
    masking = sparse is not None and (sc.rl.mask_alpha_below > 0 or sc.rl.mask_row_alpha_below > 0)
    single = sc.rl.ppo_epochs * sc.rl.num_minibatches == 1 and not masking
    # no-grad passes over the full batch run in slices of a gradient pass's rows
    pass_slices = sc.rl.num_minibatches * sc.rl.micro_batches
    lengths = bucket_lengths(sc.rl.length_buckets, batch.tokens.shape[1])
    acceptance_of = lambda dense, x_q: _rollout_acceptance(
      state, batch, dense, x_q, cfg, sc, sparse, budget, pass_slices, lengths
    )
    # The pre-update dense policy p over the full batch (hidden, logp, entropy_BS, top): with one
    # update it comes out of that update's gradient pass, else out of a no-grad pass first.
    dense = None
    if not single:
      dense = _dense_pass(state.params, batch, cfg, sc, pass_slices, lengths)
    alpha, loss_mask, mask_metrics = None, None, {}
    if masking:
      alpha = acceptance_of(dense, None)
      loss_mask, mask_metrics = mismatch_masking(batch, alpha, sc)
    params, opt_state = state.params, state.opt_state
    lora, lora_opt_state = state.lora, state.lora_opt_state
    base_rows, lora_rows, skipped, skipped_lora, x_q = [], [], [], [], None
    for _ in range(sc.rl.ppo_epochs):
      for mb, adv_mb, logp_p_mb, loss_mask_mb in _minibatches(
        (batch, adv_B, None if single else dense["logp"], loss_mask), sc.rl.num_minibatches
      ):
        loss_mb = mb if loss_mask_mb is None else mb.replace(gen_mask=loss_mask_mb)
        params, opt_state, aux, row, finite = dense_update(
          params, opt_state, optimizer, (loss_mb, adv_mb, logp_p_mb), cfg, sc, state.ref_params
        )
        dense = aux if single else dense
        base_rows.append((row, jnp.sum(loss_mb.gen_mask)))
        skipped.append(~finite)
        if sc.distill.enabled:
          # The teacher is the pre-update dense policy; the sparse actor runs on the base the
          # `distill.base` option names (DistillConfig). It keeps the tokens masking drops from
          # the dense loss (as verl's rollout correction masks the policy loss only): its PPO term
          # is on-policy (the old policy is the rollout's own) and its k3 term is what closes the
          # sparse/dense gap, widest at exactly those tokens.
          teacher = dense["logp"] if single else logp_p_mb
          base = state.params if sc.distill.base == "pre_update" else params
          lora, lora_opt_state, d_aux, row, d_finite = distill_update(
            lora,
            lora_opt_state,
            lora_optimizer,
            base,
            (mb, adv_mb, teacher),
            cfg,
            sc,
            sparse,
            budget,
          )
          # With one update on the pre-update base, its pass is exactly the rollout policy q's.
          x_q = d_aux["hidden"] if single and sc.distill.base == "pre_update" else None
          lora_rows.append((row, jnp.sum(mb.gen_mask)))
          skipped_lora.append(~d_finite)

    metrics = update_metrics(base_rows, lora_rows, skipped, skipped_lora)
    metrics.update(rollout_metrics(batch, dense, sc))
    metrics.update(mask_metrics)
    if sc.stats.exact_acceptance and alpha is None:
      alpha = acceptance_of(dense, x_q)
    metrics.update(_acceptance_metrics(batch, dense["logp"], dense.get("top"), alpha, sc))
    new_state = state.replace(
      step=state.step + 1,
      params=params,
      opt_state=opt_state,
      lora=lora,
      lora_opt_state=lora_opt_state,
    )
    return new_state, metrics

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


def init_state(
  params, optimizer, lora: Optional[LoRA] = None, lora_optimizer=None, keep_reference: bool = False
) -> TrainState:
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=optimizer.init(params),
    lora=lora,
    lora_opt_state=lora_optimizer.init(lora) if lora is not None else None,
    ref_params=jax.tree_util.tree_map(jnp.copy, params) if keep_reference else None,
  )


def batch_from_rollout(prompt_BT, prompt_len_B, rollout: sampler.Rollout, rewards_B) -> Batch:
  """Token-aligned train batch from a sampler Rollout and its rewards."""
  tokens, gen_mask = sampler.full_sequences(prompt_BT, prompt_len_B, rollout)
  S, N = tokens.shape[1], rollout.tokens.shape[1]
  j = jnp.clip(jnp.arange(S)[None] - prompt_len_B[:, None], 0, N - 1)
  align = lambda x: (
    None if x is None else jnp.take_along_axis(x, j.reshape(j.shape + (1,) * (x.ndim - 2)), axis=1)
  )
  return Batch(
    tokens=tokens,
    gen_mask=gen_mask,
    prompt_len=jnp.asarray(prompt_len_B, jnp.int32),
    logp_rollout=jnp.where(gen_mask, align(rollout.logprobs), 0.0),
    rewards=jnp.asarray(rewards_B, jnp.float32),
    top_logp=align(rollout.top_logprobs),
    top_ids=align(rollout.top_ids),
  )
