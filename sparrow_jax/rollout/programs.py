"""The rollout engine's compiled programs: the group prefill into pool pages, the prompt-template
page copy and the decode chunk. The engine (rollout/engine.py) runs them between the scheduler's
steps (rollout/scheduler.py); experiments lower them to read their memory and cost.

Each row samples with its own key, `row_key(key, row, t)` (the run's key folded with the row's
index, then the token's index), so its tokens and log-probs do not depend on its slot, the number of
slots, the chunk length, the admission order or a preemption. A slot that runs no row writes the
pool's trash page and reads nothing.
"""

import functools

import jax
import jax.numpy as jnp

from sparrow_jax.attention import page_pool, paged_cache
from sparrow_jax.sparsity import policy
from sparrow_jax.model import qwen3
from sparrow_jax.rollout import sampler


def row_key(key, row, t):
  """The key of row `row`'s token t: independent of where and when the row runs."""
  return jax.random.fold_in(jax.random.fold_in(key, row), t)


def sample_rows(logits_BV, keys_B, sampling: sampler.Sampling):
  """One token per row, each from its own key -> (token_B, logp_B, (top_lp, top_id) or None)."""
  s = sampling

  def one(logits_V, key):
    token, logp_V = sampler.sample_token(logits_V[None], key, s.temperature, s.top_p, s.top_k)
    return token[0], logp_V[0]

  token_B, logp_BV = jax.vmap(one)(logits_BV, keys_B)
  token_B = token_B.astype(jnp.int32)
  logp_B = jnp.take_along_axis(logp_BV, token_B[:, None], axis=1)[:, 0]
  top = jax.lax.top_k(logp_BV, s.num_top_logprobs) if s.num_top_logprobs else None
  return token_B, logp_B, top


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("pool",))
def prefill(params, lora, pool, prompt_BT, prompt_len_B, dest_BP, rows_BG, key, *, cfg, sampling):
  """Prefills B prompts (each device its own: rows split like the pool's shards) into their
  shard's pool pages dest_BP and samples the first token of each prompt's G rows."""
  Z, T = pool.page_size, prompt_BT.shape[1]
  chunk = min(-(-qwen3.PREFILL_CHUNK // Z) * Z, -(-T // Z) * Z)
  cache = paged_cache.init_cache(
    cfg, prompt_BT.shape[0], -(-T // chunk) * chunk, Z, pool.dtype, pool.page_score
  )
  logits_BV, cache = qwen3.prefill(params, prompt_BT, prompt_len_B, cfg, cache, lora=lora)
  dest_BP = jnp.pad(
    dest_BP, ((0, 0), (0, cache.num_pages - dest_BP.shape[1])), constant_values=page_pool.TRASH_PAGE
  )
  pool = page_pool.write_pages(pool, cache, dest_BP)
  B, G = rows_BG.shape
  keys_N = jax.vmap(lambda r: row_key(key, r, 0))(rows_BG.reshape(B * G))
  logits_NV = jnp.repeat(logits_BV, G, axis=0)
  token_N, logp_N, top = sample_rows(logits_NV, keys_N, sampling)
  return pool, token_N.reshape(B, G), logp_N.reshape(B, G), top


@functools.partial(jax.jit, donate_argnames=("pool",))
def copy_pages(pool, src_RN, dst_RN):
  """Copies pool pages src -> dst on each shard (the prompt template into a row's first page)."""
  return page_pool.copy_pages(pool, src_RN, dst_RN)


@functools.partial(
  jax.jit, static_argnames=("cfg", "steps", "sparse", "sampling"), donate_argnames=("pool",)
)
def decode_chunk(params, lora, pool, budget, key, slots, *, cfg, steps, sparse, sampling):
  """Up to `steps` decode steps over every slot (stops early once no slot runs a row), selecting
  at most `budget.max_selected` pages (a static field: one compiled decode per cap).

  slots: dict of [S] arrays token (the last sampled, to append), length (tokens cached), n_gen
  (tokens generated), max_new, row, active, and page_table [S, PR]. Returns the pool, the slots
  after the chunk and what each step emitted per slot ([S, steps]; a slot's tokens are its first
  n_gen_after - n_gen_before columns)."""
  params, lora = qwen3.unstack_layers(params, lora)
  attention_fn = policy.pool_decode_attention_fn(
    sparse, budget, None if budget is None else budget.max_selected
  )
  pad_id, num_top = sampling.pad_id, sampling.num_top_logprobs
  eos = jnp.asarray(sampling.eos_ids or (-1,), jnp.int32)
  S = slots["token"].shape[0]
  out = dict(
    tokens=jnp.full((S, steps), pad_id, jnp.int32), logprobs=jnp.zeros((S, steps), jnp.float32)
  )
  if num_top:
    out.update(
      top_lp=jnp.zeros((S, steps, num_top), jnp.float32),
      top_id=jnp.zeros((S, steps, num_top), jnp.int32),
    )

  def body(carry):
    j, pool, s, out = carry
    layers = page_pool.layer_views(pool, s["page_table"], s["length"], s["active"])
    logits_SV, layers = qwen3.decode_step(
      params, s["token"], cfg, layers, attention_fn=attention_fn, lora=lora
    )
    keys_S = jax.vmap(functools.partial(row_key, key))(s["row"], s["n_gen"])
    token_S, logp_S, top = sample_rows(logits_SV, keys_S, sampling)
    active = s["active"]
    out = dict(
      out,
      tokens=out["tokens"].at[:, j].set(jnp.where(active, token_S, pad_id)),
      logprobs=out["logprobs"].at[:, j].set(jnp.where(active, logp_S, 0.0)),
    )
    if num_top:
      out.update(
        top_lp=out["top_lp"].at[:, j].set(top[0]), top_id=out["top_id"].at[:, j].set(top[1])
      )
    n_gen = s["n_gen"] + active
    ended = active & (jnp.isin(token_S, eos) | (n_gen >= s["max_new"]))
    s = dict(
      s,
      token=jnp.where(active, token_S, s["token"]),
      length=s["length"] + active,
      n_gen=n_gen,
      active=active & ~ended,
    )
    return j + 1, page_pool.from_layers(pool, layers), s, out

  cond = lambda carry: (carry[0] < steps) & jnp.any(carry[2]["active"])
  steps_run, pool, slots, out = jax.lax.while_loop(cond, body, (0, pool, slots, out))
  return pool, slots, out, steps_run
