"""What the fused train step (rl/train_step.py) takes: its settings (`StepConfig`, one component
per experiment-config group, each field declared and checked once), its state (`TrainState` and
where it lives on a mesh) and its batch (`Batch`: right-padded prompt + completion rows, every
per-token array token-aligned: value[b, s] concerns token s, and `gen_mask[b, s]` marks completion
tokens)."""

import dataclasses
import functools
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import optax

from sparrow_jax import schema, sharding
from sparrow_jax.model import qwen3
from sparrow_jax.model.lora import LoRA
from sparrow_jax.rl import advantages, losses
from sparrow_jax.rollout import sampler
from sparrow_jax.sparsity import schedule

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
  # Multi-turn tasks only: the tails per turn (acceptance/*_turn, turn t = the tokens sampled
  # after t tool observations) of turns 0..turns-1; a row's later turns count overall only
  turns: int = 8

  def __post_init__(self):
    require = functools.partial(_require, self)
    require(0 < self.tau <= 1, "tau", "must lie in (0, 1]")
    require(schedule.is_quantile(self.quantile), "quantile", "must be a percentile in (0, 50)")
    require(self.bin_size >= 1, "bin_size", "must be >= 1")
    require(self.num_bins >= 1, "num_bins", "must be >= 1")
    require(self.turns >= 1, "turns", "must be >= 1")


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
  # rl.off_policy_steps = 1: the weights the rollouts of the step's update were sampled with (the
  # pre-update params of the step before), which the step measures staleness against; each step
  # leaves its own pre-update params here for the next.
  behaviour_params: Optional[dict] = None


def init_state(
  params,
  optimizer,
  lora: Optional[LoRA] = None,
  lora_optimizer=None,
  keep_reference: bool = False,
  keep_behaviour: bool = False,
) -> TrainState:
  copy = lambda: jax.tree_util.tree_map(jnp.copy, params)
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    params=params,
    opt_state=optimizer.init(params),
    lora=lora,
    lora_opt_state=lora_optimizer.init(lora) if lora is not None else None,
    ref_params=copy() if keep_reference else None,
    behaviour_params=copy() if keep_behaviour else None,
  )


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
    behaviour_params=None if state.behaviour_params is None else params,
  )


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
  # A multi-turn rollout's positions prefilled densely, as the prompt was (the sparse
  # teacher-forced pass reads them so): each tool observation, out of gen_mask, and the token
  # that ended the turn before it.
  context: Optional[jax.Array] = None  # [B, S] bool

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


def batch_from_rollout(prompt_BT, prompt_len_B, rollout: sampler.Rollout, rewards_B) -> Batch:
  """Token-aligned train batch from a sampler Rollout and its rewards. A multi-turn row's tool
  observations (`rollout.observed`) are holes in gen_mask: what the row conditions on, not
  actions, so out of the loss, TIS, the tails and the generated-token counts; with the turn end
  before each they are the batch's dense `context`."""
  tokens, gen_mask = sampler.full_sequences(prompt_BT, prompt_len_B, rollout)
  S, N = tokens.shape[1], rollout.tokens.shape[1]
  j = jnp.clip(jnp.arange(S)[None] - prompt_len_B[:, None], 0, N - 1)
  align = lambda x: (
    None if x is None else jnp.take_along_axis(x, j.reshape(j.shape + (1,) * (x.ndim - 2)), axis=1)
  )
  context = None
  if rollout.observed is not None:
    observed = gen_mask & align(rollout.observed)
    gen_mask = gen_mask & ~observed
    # The engine prefills each observation with the turn's last token before it (programs.observe)
    context = observed | jnp.pad(observed[:, 1:], ((0, 0), (0, 1)))
  return Batch(
    tokens=tokens,
    gen_mask=gen_mask,
    prompt_len=jnp.asarray(prompt_len_B, jnp.int32),
    logp_rollout=jnp.where(gen_mask, align(rollout.logprobs), 0.0),
    rewards=jnp.asarray(rewards_B, jnp.float32),
    top_logp=align(rollout.top_logprobs),
    top_ids=align(rollout.top_ids),
    context=context,
  )


def turn_index(batch):
  """[B, S] int32: each token's turn in its multi-turn row, the tool observations before it (0 up
  to the first). The turn end before an observation is sampled, so it stays in its turn."""
  observed = batch.context & ~batch.gen_mask
  starts = observed & ~jnp.pad(observed[:, :-1], ((0, 0), (1, 0)))
  return jnp.cumsum(starts, axis=1, dtype=jnp.int32)


def row_ends(batch):
  """[B] one past each row's last real token: the prompt and all up to the last completion token,
  so a token left out of the loss (a hole in gen_mask) still conditions the tokens after it."""
  pos_BS = jnp.arange(batch.tokens.shape[1])[None]
  return jnp.max(jnp.where(batch.gen_mask, pos_BS + 1, batch.prompt_len[:, None]), axis=1)


def valid_mask(batch):
  """The rows' real tokens (`row_ends`)."""
  return jnp.arange(batch.tokens.shape[1])[None] < row_ends(batch)[:, None]
