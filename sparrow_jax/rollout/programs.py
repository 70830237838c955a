"""The rollout engine's compiled programs: the group prefill into pool pages, the prompt-template
page copy, the decode chunk and exact mode's speculative chunk. The engine (rollout/engine.py) runs
them between the scheduler's steps (rollout/scheduler.py); experiments lower them to read their
memory and cost.

Each row samples with its own key, `row_key(key, row, t)` (the run's key folded with the row's
index, then the token's index), so its tokens and log-probs do not depend on its slot, the number of
slots, the chunk length, the admission order or a preemption. A slot that runs no row writes the
pool's trash page and reads nothing.
"""

import functools

import jax
import jax.numpy as jnp

from sparrow_jax.attention import page_pool, paged_cache
from sparrow_jax.model import qwen3
from sparrow_jax.rollout import sampler, speculative
from sparrow_jax.sparsity import policy


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


@functools.partial(
  jax.jit,
  static_argnames=("cfg", "rounds", "draft", "sparse", "sampling"),
  donate_argnames=("pool",),
)
def speculative_chunk(
  params, lora, pool, budget, key, slots, *, cfg, rounds, draft, sparse, sampling
):
  """Up to `rounds` speculative rounds (rollout/speculative.py) over every slot, `draft` drafts
  each: the sparse actor (params with `lora`, pages under `budget`) drafts, the dense policy
  (params alone) verifies. Slots as `decode_chunk`'s; a slot emits 1 to draft + 1 tokens a
  round, its tokens the first n_gen_after - n_gen_before columns of the [S, rounds * (draft + 1)]
  outputs, which add `alpha` (each token's draft acceptance rate, NaN for a bonus token). With
  `budget.draft_by_len` (exact mode's regime switch) a row's round drafts that many tokens at its
  cached length, at most `draft`: 0 makes the round one dense decoding step (its token drawn from
  p_0 as a bonus token is), and `draft` = 0 compiles the program for chunks with no drafts.
  Returns (pool, slots, out, rounds run, per-slot counters: rounds, tokens emitted, drafts run,
  drafts judged (`EngineStats.judged`) and accepted among the emitted tokens, KV pages read and
  the pages dense decoding of the emitted tokens reads)."""
  params, lora = qwen3.unstack_layers(params, lora)  # drafts: params + lora; verify: params
  draft_fn = policy.pool_decode_attention_fn(
    sparse, budget, None if budget is None else budget.max_selected
  )
  verify_fn = policy.pool_verify_attention_fn()
  dense_fn = policy.pool_decode_attention_fn(None, None, None)
  s0, k, C, Z = slots, draft, draft + 1, pool.page_size
  pad_id, num_top = sampling.pad_id, sampling.num_top_logprobs
  eos = jnp.asarray(sampling.eos_ids or (-1,), jnp.int32)
  S, W = slots["token"].shape[0], rounds * C
  # Drafts and verification write up to `draft` positions past a row's last: trash-page columns.
  table = jnp.pad(slots["page_table"], ((0, 0), (0, -(-C // Z) + 1)))
  L = cfg.num_hidden_layers
  L_dense = L if sparse is None else min(sparse.dense_layers, L)
  pages_by_len = None if budget is None else budget.pages_by_len
  out = dict(
    tokens=jnp.full((S, W), pad_id, jnp.int32),
    logprobs=jnp.zeros((S, W), jnp.float32),
    alpha=jnp.full((S, W), jnp.nan, jnp.float32),
  )
  if num_top:
    out.update(
      top_lp=jnp.zeros((S, W, num_top), jnp.float32), top_id=jnp.zeros((S, W, num_top), jnp.int32)
    )
  count = dict(
    rounds=jnp.zeros(S, jnp.int32),
    emitted=jnp.zeros(S, jnp.int32),
    drafted=jnp.zeros(S, jnp.int32),
    judged=jnp.zeros(S, jnp.int32),
    accepted=jnp.zeros(S, jnp.int32),
    read=jnp.zeros(S, jnp.float32),
    dense=jnp.zeros(S, jnp.float32),
  )

  def pages_read(length_S):  # KV pages x layers a decode step at cached length length_S reads
    pages = -(-length_S // Z)
    sparse_pages = pages if pages_by_len is None else jnp.minimum(pages_by_len[length_S], pages)
    return (L_dense * pages + (L - L_dense) * sparse_pages).astype(jnp.float32)

  draft_by_len = None if budget is None else budget.draft_by_len

  def body(carry):
    j, pool, s, out, count = carry
    active, length = s["active"], s["length"]
    # the drafts each row runs this round; the loop runs the most any running row does
    k_S = jnp.full_like(length, k) if draft_by_len is None else jnp.minimum(draft_by_len[length], k)
    keys_SC = jax.vmap(
      lambda r, t: jax.vmap(lambda c: row_key(key, r, t + c))(jnp.arange(C, dtype=t.dtype))
    )(s["row"], s["n_gen"])

    def draft_step(i, dc):
      pool, token, drafts_Sk, logq_SkV, read = dc
      layers = page_pool.layer_views(pool, table, length + i, active)
      logits_SV, layers = qwen3.decode_step(
        params, token, cfg, layers, attention_fn=draft_fn, lora=lora
      )
      token, logq_SV = speculative.draft_tokens(logits_SV, keys_SC[:, i], sampling)
      return (
        page_pool.from_layers(pool, layers),
        token,
        drafts_Sk.at[:, i].set(token),
        logq_SkV.at[:, i].set(logq_SV),
        read + jnp.where(i < k_S, pages_read(length + i + 1), 0.0),
      )

    V = cfg.vocab_size
    drafting = (pool, s["token"], jnp.zeros((S, k), jnp.int32), jnp.zeros((S, k, V)), jnp.zeros(S))
    if k:  # a program of dense rounds (k = 0) has no draft step to trace
      drafts_run = k if draft_by_len is None else jnp.max(jnp.where(active, k_S, 0))
      drafting = jax.lax.fori_loop(0, drafts_run, draft_step, drafting)
    pool, _, drafts_Sk, logq_SkV, read = drafting
    layers = page_pool.layer_views(pool, table, length, active)
    if k:
      tokens_SC = jnp.concatenate([s["token"][:, None], drafts_Sk], axis=1)
      logits_SCV, new_kv = qwen3.verify_step(params, tokens_SC, cfg, layers, attention_fn=verify_fn)
    else:  # a program of dense rounds: each a dense decode step, which appends x_0 as it does
      logits_SV, layers = qwen3.decode_step(params, s["token"], cfg, layers, attention_fn=dense_fn)
      logits_SCV = logits_SV[:, None]
    logp_SCV = sampler.sampled_logp(
      logits_SCV.reshape(S * C, V), sampling.temperature, sampling.top_p, sampling.top_k
    ).reshape(S, C, V)
    emitted_SC, n_acc_S, logp_SC, alpha_Sk = jax.vmap(speculative.accept_round)(
      logp_SCV, logq_SkV, drafts_Sk, keys_SC, k_S
    )
    # What the row keeps: up to its first EOS and its max_new.
    c_C = jnp.arange(C)
    eos_SC = jnp.isin(emitted_SC, eos) & (c_C[None] <= n_acc_S[:, None])
    first_eos_S = jnp.where(jnp.any(eos_SC, axis=1), jnp.argmax(eos_SC, axis=1), C)
    m_S = jnp.minimum(jnp.minimum(n_acc_S + 1, first_eos_S + 1), s["max_new"] - s["n_gen"])
    m_S = jnp.where(active, m_S, 0)
    keep_S = jnp.where(active, n_acc_S + 1, 0)
    if k:  # the cache keeps x_0 and the accepted drafts, as dense decoding of them leaves it
      layers = tuple(x.write_span(kv[0], kv[1], length, keep_S) for x, kv in zip(layers, new_kv))
    pool = page_pool.from_layers(pool, layers)
    cols_SC = jnp.where(
      c_C[None] < m_S[:, None], (s["n_gen"] - s0["n_gen"])[:, None] + c_C[None], W
    )
    rows_SC = jnp.broadcast_to(jnp.arange(S)[:, None], (S, C))
    put = lambda buf, x: buf.at[rows_SC, cols_SC].set(x, mode="drop")
    alpha_SC = jnp.pad(alpha_Sk, ((0, 0), (0, 1)), constant_values=jnp.nan)
    alpha_SC = jnp.where(c_C[None] < k_S[:, None], alpha_SC, jnp.nan)
    out = dict(
      out,
      tokens=put(out["tokens"], emitted_SC),
      logprobs=put(out["logprobs"], logp_SC),
      alpha=put(out["alpha"], alpha_SC),
    )
    if num_top:
      top_lp, top_id = jax.lax.top_k(logp_SCV, num_top)
      out.update(top_lp=put(out["top_lp"], top_lp), top_id=put(out["top_id"], top_id))
    n_gen = s["n_gen"] + m_S
    kept_eos = first_eos_S < m_S
    ended = active & (kept_eos | (n_gen >= s["max_new"]))
    last_S = jnp.take_along_axis(emitted_SC, n_acc_S[:, None], axis=1)[:, 0]
    dense_read_S = jnp.sum(
      jnp.where(c_C[None] < m_S[:, None], L * -(-(length[:, None] + c_C[None] + 1) // Z), 0), axis=1
    )
    # Only what the row emits counts: a draft is judged where the round emits a token at its
    # offset (an accepted draft or the residual after it), so the bonus token and the drafts past
    # a rejection or past a cut by EOS or max_new are not (m_S is 0 in an idle slot).
    count = dict(
      rounds=count["rounds"] + active,
      emitted=count["emitted"] + m_S,
      drafted=count["drafted"] + jnp.where(active, k_S, 0),
      judged=count["judged"] + jnp.minimum(m_S, k_S),
      accepted=count["accepted"] + jnp.minimum(m_S, n_acc_S),
      read=count["read"] + jnp.where(active, read + L * -(-length // Z), 0.0),
      dense=count["dense"] + dense_read_S.astype(jnp.float32),
    )
    s = dict(
      s,
      token=jnp.where(active, last_S, s["token"]),
      length=length + keep_S,
      n_gen=n_gen,
      active=active & ~ended,
    )
    return j + 1, pool, s, out, count

  cond = lambda carry: (carry[0] < rounds) & jnp.any(carry[2]["active"])
  rounds_run, pool, slots, out, count = jax.lax.while_loop(cond, body, (0, pool, slots, out, count))
  return pool, slots, out, rounds_run, count
