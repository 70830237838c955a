"""Jit-compiled sampler: chunked dense prefill (once per GRPO group with `prefill_group`), then a
`lax.while_loop` of decode steps, dense or sparse.

The KV budget enters as a `schedule.BudgetTable` (a traced int32 table indexed by cached length,
built from any schedule outside jit), so switching schedules never recompiles; only the static cap on
selected pages (`max_selected`, the schedule's maximum rounded up to a power of two) is part of the
compiled shape. The sparsity policy itself (dense layers, page selection) is attention/policy.py's.
"""
import functools
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention import paged_cache, policy
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.mismatch.schedule import BudgetTable
from sparrow_jax.model import qwen3, sharding
from sparrow_jax.model.config import Qwen3Config


@flax.struct.dataclass
class Rollout:
  tokens: jax.Array          # [B, N] completion tokens (EOS kept), pad_id after each row's length
  logprobs: jax.Array        # [B, N] log-prob of each sampled token under the sampled distribution
  lengths: jax.Array         # [B] completion lengths
  top_logprobs: Optional[jax.Array] = None  # [B, N, k] top-k of those log-probs per step (if asked)
  top_ids: Optional[jax.Array] = None       # [B, N, k] their token ids


def check_geometry(schedule, sparse: SparseConfig) -> None:
  """A KVSchedule's page geometry (page size, always-kept pages) must be the sparse config's:
  SparseConfig is the one source of truth for the geometry the sampler reads with. Host-only (no
  JAX computation), so config validation can call it before jax.distributed starts."""
  geometry = (("page_size", sparse.page_size, "page size"),
              ("always_kept", sparse.always_kept, f"always-kept pages (sink_pages "
                                                  f"{sparse.sink_pages} + local_pages "
                                                  f"{sparse.local_pages})"))
  for name, want, what in geometry:
    if getattr(schedule, name, want) != want:
      raise ValueError(f"schedule.{name} = {getattr(schedule, name)} differs from the "
                       f"SparseConfig's {what}: {want}")


def budget_table(schedule, max_len: int, sparse: SparseConfig) -> np.ndarray:
  """Pages kept at each cached length 0..max_len, from any schedule with `budget_pages(len)`,
  after `check_geometry`."""
  check_geometry(schedule, sparse)
  budget = np.asarray(jax.device_get(schedule.budget_pages(jnp.arange(max_len + 1))), np.int32)
  pages = -(-np.arange(max_len + 1) // sparse.page_size)
  low = np.nonzero(budget < np.minimum(sparse.always_kept, pages))[0]
  if low.size:
    raise ValueError(f"KV budget {budget[low[0]]} pages at cached length {low[0]} is below the "
                     f"{sparse.always_kept} always-kept pages (sink_pages + local_pages)")
  return budget


def max_selected_pages(pages_by_len) -> int:
  """The static cap on selected pages for a budget table (or several stacked): its largest budget
  rounded up to a power of two, so tables of similar size share one compiled shape."""
  return 1 << max(int(np.max(pages_by_len)) - 1, 1).bit_length()


def sample_token(logits_BV, key, temperature: float, top_p: float, top_k: int):
  """Draws one token per row -> (token_B, logp_BV), logp being the log-probs of the distribution
  actually sampled: softmax(logits / temperature) truncated to the top-k tokens and then to the
  top-p mass, renormalised (-inf outside). Those are the behaviour log-probs that importance
  weights and acceptance need. Greedy when temperature == 0 (a point mass: log-prob 0)."""
  if temperature == 0.0:
    token_B = jnp.argmax(logits_BV, axis=-1)
    hit_BV = jnp.arange(logits_BV.shape[-1]) == token_B[:, None]
    return token_B, jnp.where(hit_BV, 0.0, -jnp.inf)
  logp_BV = jax.nn.log_softmax(logits_BV / temperature, axis=-1)
  if top_k > 0:
    kth = jax.lax.top_k(logp_BV, top_k)[0][:, -1:]
    logp_BV = jax.nn.log_softmax(jnp.where(logp_BV < kth, -jnp.inf, logp_BV), axis=-1)
  if top_p < 1.0:
    sorted_desc = -jnp.sort(-logp_BV, axis=-1)
    mass_before = jnp.cumsum(jnp.exp(sorted_desc), axis=-1) - jnp.exp(sorted_desc)
    cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    logp_BV = jax.nn.log_softmax(jnp.where(logp_BV < cutoff, -jnp.inf, logp_BV), axis=-1)
  return jax.random.categorical(key, logp_BV, axis=-1), logp_BV


@functools.partial(jax.jit, static_argnames=(
    "cfg", "max_new_tokens", "temperature", "top_p", "top_k", "eos_ids", "sparse", "max_selected",
    "num_top_logprobs", "pad_id", "cache_len", "prefill_group"))
def _generate(params, prompt_BT, prompt_len_B, key, budget, lora, *, cfg, max_new_tokens,
              temperature, top_p, top_k, eos_ids, sparse, max_selected, num_top_logprobs, pad_id,
              cache_len, prefill_group):
  B, N, g = prompt_BT.shape[0], max_new_tokens, prefill_group
  cache = paged_cache.init_cache(cfg, B // g, cache_len, sparse.page_size if sparse else 16,
                                 params["embed"].dtype, sparse.page_score if sparse else "mean")
  logits_BV, cache = qwen3.prefill(params, prompt_BT[::g], prompt_len_B[::g], cfg, cache, lora=lora)
  # each group's rows decode from their own copy of the one prefilled prompt, and each layer from
  # its own cache and weights (qwen3.decode_step)
  logits_BV = jnp.repeat(logits_BV, g, axis=0)
  caches = paged_cache.split_layers(cache, repeat=g)
  params, lora = qwen3.unstack_layers(params, lora)
  eos = jnp.asarray(eos_ids if eos_ids else (-1,), jnp.int32)

  def emit(t, logits_BV, state):
    token_B, logp_BV = sample_token(logits_BV, jax.random.fold_in(key, t), temperature, top_p, top_k)
    done_B = state["done"]
    token_B = jnp.where(done_B, pad_id, token_B).astype(jnp.int32)
    new = dict(
        state,
        token=token_B,
        tokens=state["tokens"].at[:, t].set(token_B),
        logprobs=state["logprobs"].at[:, t].set(
            jnp.where(done_B, 0.0, jnp.take_along_axis(logp_BV, token_B[:, None], 1)[:, 0])),
        lengths=state["lengths"] + (~done_B).astype(jnp.int32),
        done=done_B | jnp.isin(token_B, eos),
        t=t + 1)
    if num_top_logprobs:  # only when asked: a top-k over the vocabulary at every step
      top_lp, top_id = jax.lax.top_k(logp_BV, num_top_logprobs)
      new.update(top_lp=state["top_lp"].at[:, t].set(top_lp),
                 top_id=state["top_id"].at[:, t].set(top_id))
    return new

  state = dict(t=0, token=jnp.zeros((B,), jnp.int32), done=jnp.zeros((B,), bool),
               tokens=jnp.full((B, N), pad_id, jnp.int32), logprobs=jnp.zeros((B, N), jnp.float32),
               lengths=jnp.zeros((B,), jnp.int32), caches=caches)
  if num_top_logprobs:
    state.update(top_lp=jnp.zeros((B, N, num_top_logprobs), jnp.float32),
                 top_id=jnp.zeros((B, N, num_top_logprobs), jnp.int32))
  state = emit(0, logits_BV, state)

  def cond(state):
    return (state["t"] < N) & ~jnp.all(state["done"])

  attention_fn = (policy.decode_attention_fn(sparse, budget, max_selected) if sparse is not None
                  else policy.dense_decode_fn())

  def body(state):
    logits_BV, caches = qwen3.decode_step(params, state["token"], cfg, state["caches"],
                                          attention_fn=attention_fn, lora=lora)
    return emit(state["t"], logits_BV, dict(state, caches=caches))

  state = jax.lax.while_loop(cond, body, state)
  top = (state["top_lp"], state["top_id"]) if num_top_logprobs else (None, None)
  rollout = Rollout(state["tokens"], state["logprobs"], state["lengths"], *top)
  return jax.tree_util.tree_map(  # rows where the prompts were: each process's own
      lambda x: sharding.constrain(x, ("batch",) + ("length",) * (x.ndim - 1)), rollout)


def generate(params, cfg: Qwen3Config, prompt_BT, prompt_len_B, key, *, max_new_tokens: int,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             eos_ids: Sequence[int] = (), sparse: Optional[SparseConfig] = None, schedule=None,
             lora=None, num_top_logprobs: int = 0, pad_id: int = 0,
             max_selected: Optional[int] = None, prefill_group: int = 1) -> Rollout:
  """Samples completions for right-padded prompts (row b's prompt is prompt_BT[b, :prompt_len_B[b]]).

  prefill_group = n: the rows come in runs of n copies of one prompt (a GRPO group), prefilled once
  per run (n times less prefill compute; each row still decodes in its own cache).
  sparse=None: dense attention. sparse=SparseConfig(...) with a schedule (anything with
  `budget_pages(cached_len)`, checked by `budget_table`; a BudgetTable from it is used as is):
  block top-k decoding. `lora` (a model.lora.LoRA) is applied in this
  actor only. Rows stop at their first EOS (kept in the completion). Same key -> same output.
  """
  prompt_BT = jnp.asarray(prompt_BT, jnp.int32)
  prompt_len_B = jnp.asarray(prompt_len_B, jnp.int32)
  if max_new_tokens <= 0:
    raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
  if temperature < 0:
    raise ValueError(f"temperature must be >= 0, got {temperature}")
  if not 0.0 < top_p <= 1.0:
    raise ValueError(f"top_p must be in (0, 1], got {top_p}")
  T = prompt_BT.shape[1]
  # Checked on the rows this process holds (all of them in one process): no global gather.
  local_len = sharding.local_rows(prompt_len_B)
  if local_len.min() < 1 or local_len.max() > T:
    raise ValueError(f"prompt_len_B must lie in [1, {T}] (the prompt width), got "
                     f"{local_len.tolist()}")
  B = prompt_BT.shape[0]
  if prefill_group < 1 or B % prefill_group or len(local_len) % prefill_group:
    raise ValueError(f"prefill_group must be >= 1 and divide the {B} rows (and the "
                     f"{len(local_len)} of this process), got {prefill_group}")
  if prefill_group > 1:
    runs = lambda x: x.reshape(-1, prefill_group, *x.shape[1:])
    local_prompt = sharding.local_rows(prompt_BT)
    if not (np.all(runs(local_prompt) == runs(local_prompt)[:, :1])
            and np.all(runs(local_len) == runs(local_len)[:, :1])):
      raise ValueError(f"prefill_group={prefill_group}: the rows are not runs of "
                       f"{prefill_group} identical prompts")
  cache_len = T + max_new_tokens
  if cache_len > cfg.max_position_embeddings:
    raise ValueError(f"prompt ({T}) + max_new_tokens ({max_new_tokens}) = {cache_len} exceeds the "
                     f"cache / max_position_embeddings ({cfg.max_position_embeddings})")
  budget = None
  if sparse is not None:
    if schedule is None:
      raise ValueError("sparse generation needs a `schedule` (e.g. KVSchedule.fixed(pages))")
    if isinstance(schedule, BudgetTable):  # built and checked once by `budget_table` (trainer)
      budget = schedule
      if budget.pages_by_len.shape[0] < cache_len + 1:
        raise ValueError(f"the BudgetTable covers cached lengths up to "
                         f"{budget.pages_by_len.shape[0] - 1}, the rollout needs {cache_len}")
    else:
      budget = BudgetTable(jnp.asarray(budget_table(schedule, cache_len, sparse)))
    if max_selected is None:
      max_selected = max_selected_pages(sharding.to_host(budget.pages_by_len))
  return _generate(params, prompt_BT, prompt_len_B, key, budget, lora, cfg=cfg,
                   max_new_tokens=max_new_tokens, temperature=float(temperature),
                   top_p=float(top_p), top_k=int(top_k), eos_ids=tuple(int(e) for e in eos_ids),
                   sparse=sparse, max_selected=max_selected, num_top_logprobs=num_top_logprobs,
                   pad_id=pad_id, cache_len=cache_len, prefill_group=prefill_group)


def full_sequences(prompt_BT, prompt_len_B, rollout: Rollout, pad_id: int = 0):
  """Right-padded prompt + completion rows [B, T + N] (what the trainer re-scores), with the mask of
  completion tokens and each token's position."""
  prompt_BT = jnp.asarray(prompt_BT)
  B, T = prompt_BT.shape
  N = rollout.tokens.shape[1]
  idx_S = jnp.arange(T + N)
  in_prompt = idx_S[None] < prompt_len_B[:, None]
  gen_idx = jnp.clip(idx_S[None] - prompt_len_B[:, None], 0, N - 1)
  in_gen = ~in_prompt & (idx_S[None] < (prompt_len_B + rollout.lengths)[:, None])
  prompt_pad = jnp.pad(prompt_BT, ((0, 0), (0, N)), constant_values=pad_id)
  tokens = jnp.where(in_prompt, prompt_pad, jnp.take_along_axis(rollout.tokens, gen_idx, axis=1))
  return jnp.where(in_prompt | in_gen, tokens, pad_id), in_gen
