"""What every rollout shares: the Rollout record, how tokens are sampled (`Sampling`, with the
behaviour log-probs), the KV budget table a schedule compiles to, and the full sequences the trainer
re-scores. The engine (rollout/engine.py) samples with them.

The KV budget enters the engine as a `schedule.BudgetTable` (a traced int32 table indexed by cached
length, built from any schedule outside jit), so switching schedules never recompiles; only the
static cap on selected pages (`max_selected_pages`, the schedule's maximum rounded up to a power of
two) is part of the compiled shape.
"""

import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention.select import SparseConfig


@flax.struct.dataclass
class Rollout:
  """A batch of rollouts: host (numpy) arrays as `engine.run` gathers them, global arrays where
  they are placed on a mesh (the trainer's step, `generate` under a mesh)."""

  tokens: jax.Array  # [B, M] completion tokens (EOS kept), pad_id after each row's length
  logprobs: jax.Array  # [B, M] log-prob of each sampled token under the sampled distribution
  lengths: jax.Array  # [B] completion lengths
  top_logprobs: Optional[jax.Array] = None  # [B, M, k] top-k of those log-probs per step (if asked)
  top_ids: Optional[jax.Array] = None  # [B, M, k] their token ids
  # Speculative rollouts (rollout/speculative.py): the acceptance rate sum_x min(p, q) of the draft
  # at each token's position, NaN where no draft was proposed (a round's bonus token).
  alpha: Optional[jax.Array] = None  # [B, M]
  # Partial rollouts (`engine.Partial`): the policy version (trainer step) that sampled each
  # token, -1 after the row's end; a row carried over a step holds two or more.
  versions: Optional[jax.Array] = None  # [B, M] int32
  # Multi-turn rollouts (`engine.run` with turns): True at the tokens of tool observations, which
  # are context the row did not sample (their log-probs 0): out of the loss, TIS and the tails.
  observed: Optional[jax.Array] = None  # [B, M] bool


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How each token is drawn and how a row ends: a static argument of the compiled decode."""

  temperature: float = 1.0  # softmax temperature; 0 = greedy
  top_p: float = 1.0  # nucleus mass kept (1 = off)
  top_k: int = 0  # most likely tokens kept (0 = off)
  eos_ids: tuple = ()  # a row ends at its first one (kept in the completion)
  pad_id: int = 0  # fills each row after its end
  num_top_logprobs: int = 0  # each step's top-k log-probs kept in the Rollout (0 = off)

  def __post_init__(self):
    object.__setattr__(self, "eos_ids", tuple(int(e) for e in self.eos_ids))
    if not self.temperature >= 0:
      raise ValueError(f"Sampling.temperature must be >= 0, got {self.temperature}")
    if not 0.0 < self.top_p <= 1.0:
      raise ValueError(f"Sampling.top_p must be in (0, 1], got {self.top_p}")
    for name in ("top_k", "num_top_logprobs"):
      if getattr(self, name) < 0:
        raise ValueError(f"Sampling.{name} must be >= 0 (0 = off), got {getattr(self, name)}")


def check_geometry(schedule, sparse: SparseConfig) -> None:
  """A KVSchedule's page geometry (page size, always-kept pages) must be the sparse config's:
  SparseConfig is the one source of truth for the geometry the sampler reads with. Host-only (no
  JAX computation), so config validation can call it before jax.distributed starts."""
  geometry = (
    ("page_size", sparse.page_size, "page size"),
    (
      "always_kept",
      sparse.always_kept,
      f"always-kept pages (sink_pages {sparse.sink_pages} + local_pages {sparse.local_pages})",
    ),
  )
  for name, want, what in geometry:
    if getattr(schedule, name, want) != want:
      raise ValueError(
        f"schedule.{name} = {getattr(schedule, name)} differs from the "
        f"SparseConfig's {what}: {want}"
      )


def budget_table(schedule, max_len: int, sparse: SparseConfig) -> np.ndarray:
  """Pages kept at each cached length 0..max_len, from any schedule with `budget_pages(len)`,
  after `check_geometry`."""
  check_geometry(schedule, sparse)
  budget = np.asarray(jax.device_get(schedule.budget_pages(jnp.arange(max_len + 1))), np.int32)
  pages = -(-np.arange(max_len + 1) // sparse.page_size)
  low = np.nonzero(budget < np.minimum(sparse.always_kept, pages))[0]
  if low.size:
    raise ValueError(
      f"KV budget {budget[low[0]]} pages at cached length {low[0]} is below the "
      f"{sparse.always_kept} always-kept pages (sink_pages + local_pages)"
    )
  return budget


def max_selected_pages(pages_by_len) -> int:
  """The static cap on selected pages for a budget table (or several stacked): its largest budget
  rounded up to a power of two, so tables of similar size share one compiled shape."""
  return 1 << max(int(np.max(pages_by_len)) - 1, 1).bit_length()


def sampled_logp(logits_BV, temperature: float, top_p: float, top_k: int):
  """Log-probs [B, V] of the distribution a token is drawn from: softmax(logits / temperature)
  truncated to the top-k tokens and then to the top-p mass, renormalised (-inf outside); at
  temperature 0 the point mass on the argmax (log-prob 0)."""
  if temperature == 0.0:
    hit_BV = jnp.arange(logits_BV.shape[-1]) == jnp.argmax(logits_BV, axis=-1)[:, None]
    return jnp.where(hit_BV, 0.0, -jnp.inf)
  logp_BV = jax.nn.log_softmax(logits_BV / temperature, axis=-1)
  if top_k > 0:
    kth = jax.lax.top_k(logp_BV, top_k)[0][:, -1:]
    logp_BV = jax.nn.log_softmax(jnp.where(logp_BV < kth, -jnp.inf, logp_BV), axis=-1)
  if top_p < 1.0:
    sorted_desc = -jnp.sort(-logp_BV, axis=-1)
    mass_before = jnp.cumsum(jnp.exp(sorted_desc), axis=-1) - jnp.exp(sorted_desc)
    cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logp_BV = jax.nn.log_softmax(jnp.where(logp_BV < cutoff, -jnp.inf, logp_BV), axis=-1)
  return logp_BV


def sample_token(logits_BV, key, temperature: float, top_p: float, top_k: int):
  """Draws one token per row -> (token_B, logp_BV), logp being the log-probs of the distribution
  actually sampled (`sampled_logp`): those are the behaviour log-probs that importance weights and
  acceptance need. Greedy when temperature == 0."""
  logp_BV = sampled_logp(logits_BV, temperature, top_p, top_k)
  if temperature == 0.0:
    return jnp.argmax(logits_BV, axis=-1), logp_BV
  return jax.random.categorical(key, logp_BV, axis=-1), logp_BV


def full_sequences(prompt_BT, prompt_len_B, rollout: Rollout, pad_id: int = 0):
  """Right-padded prompt + completion rows [B, T + M] (what the trainer re-scores), with the mask of
  completion tokens and each token's position."""
  prompt_BT = jnp.asarray(prompt_BT)
  B, T = prompt_BT.shape
  M = rollout.tokens.shape[1]
  idx_S = jnp.arange(T + M)
  in_prompt = idx_S[None] < prompt_len_B[:, None]
  gen_idx = jnp.clip(idx_S[None] - prompt_len_B[:, None], 0, M - 1)
  in_gen = ~in_prompt & (idx_S[None] < (prompt_len_B + rollout.lengths)[:, None])
  prompt_pad = jnp.pad(prompt_BT, ((0, 0), (0, M)), constant_values=pad_id)
  tokens = jnp.where(in_prompt, prompt_pad, jnp.take_along_axis(rollout.tokens, gen_idx, axis=1))
  return jnp.where(in_prompt | in_gen, tokens, pad_id), in_gen
