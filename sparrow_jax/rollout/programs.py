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
from typing import Any, Callable, NamedTuple, Optional

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
def prefill(params, lora, pool, prompt_BT, prompt_len_B, dest_BP, rows_Bn, key, *, cfg, sampling):
  """Prefills B prompts (each device its own: rows split like the pool's shards) into their
  shard's pool pages dest_BP and samples the first token of each prompt's n rows (rows_Bn)."""
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
  B, n = rows_Bn.shape
  keys_a = jax.vmap(lambda r: row_key(key, r, 0))(rows_Bn.reshape(B * n))
  logits_aV = jnp.repeat(logits_BV, n, axis=0)
  token_a, logp_a, top = sample_rows(logits_aV, keys_a, sampling)
  return pool, token_a.reshape(B, n), logp_a.reshape(B, n), top


@functools.partial(jax.jit, donate_argnames=("pool",))
def copy_pages(pool, src_YN, dst_YN):
  """Copies pool pages src -> dst on each shard (the prompt template into a row's first page)."""
  return page_pool.copy_pages(pool, src_YN, dst_YN)


@functools.partial(
  jax.jit, static_argnames=("cfg", "steps", "sparse", "sampling"), donate_argnames=("pool",)
)
def decode_chunk(params, lora, pool, budget, key, slots, *, cfg, steps, sparse, sampling):
  """Up to `steps` decode steps over every slot (stops early once no slot runs a row), selecting
  at most `budget.max_selected` pages (a static field: one compiled decode per cap).

  slots: dict of [B] arrays token (the last sampled, to append), length (tokens cached), n_gen
  (tokens generated), max_new, row, active, and page_table [B, P]. Returns the pool, the slots
  after the chunk and what each step emitted per slot ([B, steps]; a slot's tokens are its first
  n_gen_after - n_gen_before columns)."""
  params, lora = qwen3.unstack_layers(params, lora)
  attention_fn = policy.pool_decode_attention_fn(
    sparse, budget, None if budget is None else budget.max_selected
  )
  pad_id, num_top = sampling.pad_id, sampling.num_top_logprobs
  eos = jnp.asarray(sampling.eos_ids or (-1,), jnp.int32)
  B = slots["token"].shape[0]
  out = dict(
    tokens=jnp.full((B, steps), pad_id, jnp.int32), logprobs=jnp.zeros((B, steps), jnp.float32)
  )
  if num_top:
    out.update(
      top_lp=jnp.zeros((B, steps, num_top), jnp.float32),
      top_id=jnp.zeros((B, steps, num_top), jnp.int32),
    )

  def body(carry):
    j, pool, s, out = carry
    layers = page_pool.layer_views(pool, s["page_table"], s["length"], s["active"])
    logits_BV, layers = qwen3.decode_step(
      params, s["token"], cfg, layers, attention_fn=attention_fn, lora=lora
    )
    keys_B = jax.vmap(functools.partial(row_key, key))(s["row"], s["n_gen"])
    token_B, logp_B, top = sample_rows(logits_BV, keys_B, sampling)
    active = s["active"]
    out = dict(
      out,
      tokens=out["tokens"].at[:, j].set(jnp.where(active, token_B, pad_id)),
      logprobs=out["logprobs"].at[:, j].set(jnp.where(active, logp_B, 0.0)),
    )
    if num_top:
      out.update(
        top_lp=out["top_lp"].at[:, j].set(top[0]), top_id=out["top_id"].at[:, j].set(top[1])
      )
    n_gen = s["n_gen"] + active
    ended = active & (jnp.isin(token_B, eos) | (n_gen >= s["max_new"]))
    s = dict(
      s,
      token=jnp.where(active, token_B, s["token"]),
      length=s["length"] + active,
      n_gen=n_gen,
      active=active & ~ended,
    )
    return j + 1, page_pool.from_layers(pool, layers), s, out

  cond = lambda carry: (carry[0] < steps) & jnp.any(carry[2]["active"])
  steps_run, pool, slots, out = jax.lax.while_loop(cond, body, (0, pool, slots, out))
  return pool, slots, out, steps_run


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("pool",))
def observe(params, lora, pool, key, slots, tokens_BC, take_B, *, cfg, sampling):
  """Prefills up to C tokens into each observing slot's own pages, after what it has cached: the
  last token a row sampled and the tool observation that follows it (a multi-turn row paused on a
  tool call), in one dense pass over its cache (`qwen3.verify_step`), C at a time. Returns the
  pool and, from the logits after each slot's take_B-th token, the token its row samples next
  (with its row key at n_gen, as decoding draws it), its log-prob and top log-probs.

  slots: dict of [B] arrays length (tokens cached), n_gen, row, active (the slot observes), and
  page_table [B, P] covering the positions written. take_B: tokens of tokens_BC each slot writes
  (0 in a slot that does not observe)."""
  C = tokens_BC.shape[1]
  table_BP = jnp.pad(slots["page_table"], ((0, 0), (0, -(-C // pool.page_size) + 1)))
  length_B, active = slots["length"], slots["active"] & (take_B > 0)
  layers = page_pool.layer_views(pool, table_BP, length_B, active)
  attention_fn = policy.pool_verify_attention_fn()
  logits_BV, new_kv = qwen3.verify_step(
    params,
    tokens_BC,
    cfg,
    layers,
    attention_fn=attention_fn,
    lora=lora,
    at_B=jnp.maximum(take_B - 1, 0),
  )
  layers = tuple(x.write_span(k, v, length_B, take_B) for x, (k, v) in zip(layers, new_kv))
  keys_B = jax.vmap(functools.partial(row_key, key))(slots["row"], slots["n_gen"])
  token_B, logp_B, top = sample_rows(logits_BV, keys_B, sampling)
  return page_pool.from_layers(pool, layers), token_B, logp_B, top


class _Round(NamedTuple):
  """What every round of a speculative chunk shares (`speculative_chunk`)."""

  params: dict  # layers unstacked
  lora: Any  # the drafts' adapter (None: none)
  cfg: qwen3.Qwen3Config
  sampling: sampler.Sampling
  eos: jax.Array  # the token ids that end a row
  table_BP: jax.Array  # the slots' page tables, with trash-page columns for the overhang
  page_size: int
  dense_layers: int  # the first layers, which attend to every page
  draft: int  # the most drafts a round runs
  draft_fn: Callable  # the drafts' (sparse) attention
  verify_fn: Callable
  dense_fn: Callable  # decode attention of a program of dense rounds (draft = 0)
  pages_by_len: Optional[jax.Array]  # the sparse budget (None: dense drafts)
  draft_by_len: Optional[jax.Array]  # the regime switch's drafts per cached length


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
  round, its tokens the first n_gen_after - n_gen_before columns of the [B, rounds * (draft + 1)]
  outputs, which add `alpha` (each token's draft acceptance rate, NaN for a bonus token). With
  `budget.draft_by_len` (exact mode's regime switch) a row's round drafts that many tokens at its
  cached length, at most `draft`: 0 makes the round one dense decoding step (its token drawn from
  p_0 with the token's own key, as `decode_chunk` draws it), and `draft` = 0 compiles a program
  of such rounds only (the engine runs those chunks as `decode_chunk` itself).
  Returns (pool, slots, out, rounds run, per-slot counters: rounds, tokens emitted, drafts run,
  drafts judged (`EngineStats.judged`) and accepted among the emitted tokens, KV pages read and
  the pages dense decoding of the emitted tokens reads; for the engine's clock, the cached
  lengths its rounds started at, summed, and the draft steps its rounds ran (`_round_drafts`),
  summed)."""
  params, lora = qwen3.unstack_layers(params, lora)  # drafts: params + lora; verify: params
  C, Z, L = draft + 1, pool.page_size, cfg.num_hidden_layers
  r = _Round(
    params,
    lora,
    cfg,
    sampling,
    jnp.asarray(sampling.eos_ids or (-1,), jnp.int32),
    # Drafts and verification write up to `draft` positions past a row's last: trash-page columns.
    jnp.pad(slots["page_table"], ((0, 0), (0, -(-C // Z) + 1))),
    Z,
    L if sparse is None else min(sparse.dense_layers, L),
    draft,
    policy.pool_decode_attention_fn(
      sparse, budget, None if budget is None else budget.max_selected
    ),
    policy.pool_verify_attention_fn(),
    policy.pool_decode_attention_fn(None, None, None),
    None if budget is None else budget.pages_by_len,
    None if budget is None else budget.draft_by_len,
  )
  B, M = slots["token"].shape[0], rounds * C
  s0, out, count = slots, _round_outputs(B, M, sampling), _round_counters(B)

  def body(carry):
    j, pool, s, out, count = carry
    active, length = s["active"], s["length"]
    k_B = _drafts_per_row(r, length)
    keys_BC = jax.vmap(
      lambda row, t: jax.vmap(lambda c: row_key(key, row, t + c))(jnp.arange(C, dtype=t.dtype))
    )(s["row"], s["n_gen"])
    pool, drafts_Bd, logq_BdV, read_B = _draft(r, pool, s, k_B, keys_BC)
    layers, new_kv, logp_BCV = _verify(r, pool, s, drafts_Bd)
    emitted_BC, n_acc_B, logp_BC, alpha_Bd = jax.vmap(speculative.accept_round)(
      logp_BCV, logq_BdV, drafts_Bd, keys_BC, k_B
    )
    c_C = jnp.arange(C)
    m_B, first_eos_B = _kept(r, s, c_C, emitted_BC, n_acc_B)
    keep_B = jnp.where(active, n_acc_B + 1, 0)
    if draft:  # the cache keeps x_0 and the accepted drafts, as dense decoding of them leaves it
      layers = tuple(x.write_span(kv[0], kv[1], length, keep_B) for x, kv in zip(layers, new_kv))
    pool = page_pool.from_layers(pool, layers)
    cols_BC = jnp.where(
      c_C[None] < m_B[:, None], (s["n_gen"] - s0["n_gen"])[:, None] + c_C[None], M
    )
    out = _write_round(out, cols_BC, c_C, k_B, emitted_BC, logp_BC, alpha_Bd, logp_BCV, sampling)
    n_gen = s["n_gen"] + m_B
    ended = active & ((first_eos_B < m_B) | (n_gen >= s["max_new"]))
    last_B = jnp.take_along_axis(emitted_BC, n_acc_B[:, None], axis=1)[:, 0]
    count = _count_round(r, count, s, c_C, m_B, k_B, n_acc_B, read_B)
    s = dict(
      s,
      token=jnp.where(active, last_B, s["token"]),
      length=length + keep_B,
      n_gen=n_gen,
      active=active & ~ended,
    )
    return j + 1, pool, s, out, count

  cond = lambda carry: (carry[0] < rounds) & jnp.any(carry[2]["active"])
  rounds_run, pool, slots, out, count = jax.lax.while_loop(cond, body, (0, pool, slots, out, count))
  return pool, slots, out, rounds_run, count


def _round_outputs(B, M, sampling):
  """A speculative chunk's [B, M] output buffers, a column per emitted token."""
  out = dict(
    tokens=jnp.full((B, M), sampling.pad_id, jnp.int32),
    logprobs=jnp.zeros((B, M), jnp.float32),
    alpha=jnp.full((B, M), jnp.nan, jnp.float32),
  )
  if num_top := sampling.num_top_logprobs:
    out.update(
      top_lp=jnp.zeros((B, M, num_top), jnp.float32), top_id=jnp.zeros((B, M, num_top), jnp.int32)
    )
  return out


def _round_counters(B):
  """A speculative chunk's per-slot counters (`speculative_chunk`'s Returns), zero."""
  counts = ("rounds", "emitted", "drafted", "judged", "accepted", "cached", "round_drafts")
  pages = dict(read=jnp.zeros(B, jnp.float32), dense=jnp.zeros(B, jnp.float32))
  return dict({name: jnp.zeros(B, jnp.int32) for name in counts}, **pages)


def _round_drafts(r: _Round, active, k_B):
  """The draft steps a round runs: the most any running row's k_B asks for. Every slot computes
  them, whatever its own k, so they (with the program's verification width) set the round's
  cost."""
  return r.draft if r.draft_by_len is None else jnp.max(jnp.where(active, k_B, 0))


def _drafts_per_row(r: _Round, length_B):
  """The drafts each row runs this round (the loop runs the most any running row does)."""
  if r.draft_by_len is None:
    return jnp.full_like(length_B, r.draft)
  return jnp.minimum(r.draft_by_len[length_B], r.draft)


def _pages_read(r: _Round, length_B):
  """KV pages x layers a draft step at cached length length_B reads."""
  L, L_dense = r.cfg.num_hidden_layers, r.dense_layers
  pages = -(-length_B // r.page_size)
  sparse_pages = pages if r.pages_by_len is None else jnp.minimum(r.pages_by_len[length_B], pages)
  return (L_dense * pages + (L - L_dense) * sparse_pages).astype(jnp.float32)


def _draft(r: _Round, pool, s, k_B, keys_BC):
  """The round's drafts by the sparse actor, each row's first k_B of them counted -> (pool with
  their KV written, drafts_Bd, their log-q logq_BdV, KV pages x layers read_B)."""
  active, length = s["active"], s["length"]

  def draft_step(i, dc):
    pool, token, drafts_Bd, logq_BdV, read = dc
    layers = page_pool.layer_views(pool, r.table_BP, length + i, active)
    logits_BV, layers = qwen3.decode_step(
      r.params, token, r.cfg, layers, attention_fn=r.draft_fn, lora=r.lora
    )
    token, logq_BV = speculative.draft_tokens(logits_BV, keys_BC[:, i], r.sampling)
    return (
      page_pool.from_layers(pool, layers),
      token,
      drafts_Bd.at[:, i].set(token),
      logq_BdV.at[:, i].set(logq_BV),
      read + jnp.where(i < k_B, _pages_read(r, length + i + 1), 0.0),
    )

  B, k, V = length.shape[0], r.draft, r.cfg.vocab_size
  drafting = (pool, s["token"], jnp.zeros((B, k), jnp.int32), jnp.zeros((B, k, V)), jnp.zeros(B))
  if k:  # a program of dense rounds (k = 0) has no draft step to trace
    drafting = jax.lax.fori_loop(0, _round_drafts(r, active, k_B), draft_step, drafting)
  pool, _, drafts_Bd, logq_BdV, read_B = drafting
  return pool, drafts_Bd, logq_BdV, read_B


def _verify(r: _Round, pool, s, drafts_Bd):
  """The dense policy's pass over the round's last token and its drafts -> (the cache's layers,
  the drafts' new K/V (None without drafts), the dense log-probs logp_BCV)."""
  layers = page_pool.layer_views(pool, r.table_BP, s["length"], s["active"])
  if r.draft:
    tokens_BC = jnp.concatenate([s["token"][:, None], drafts_Bd], axis=1)
    logits_BCV, new_kv = qwen3.verify_step(
      r.params, tokens_BC, r.cfg, layers, attention_fn=r.verify_fn
    )
  else:  # a program of dense rounds: each a dense decode step, which appends x_0 as it does
    logits_BV, layers = qwen3.decode_step(
      r.params, s["token"], r.cfg, layers, attention_fn=r.dense_fn
    )
    logits_BCV, new_kv = logits_BV[:, None], None
  (B, C, V), t = logits_BCV.shape, r.sampling
  logp_BCV = sampler.sampled_logp(
    logits_BCV.reshape(B * C, V), t.temperature, t.top_p, t.top_k
  ).reshape(B, C, V)
  return layers, new_kv, logp_BCV


def _kept(r: _Round, s, c_C, emitted_BC, n_acc_B):
  """How many of the round's tokens each row keeps (up to its first EOS and its max_new; 0 in an
  idle slot) -> (m_B, the first EOS's offset or C)."""
  C = c_C.shape[0]
  eos_BC = jnp.isin(emitted_BC, r.eos) & (c_C[None] <= n_acc_B[:, None])
  first_eos_B = jnp.where(jnp.any(eos_BC, axis=1), jnp.argmax(eos_BC, axis=1), C)
  m_B = jnp.minimum(jnp.minimum(n_acc_B + 1, first_eos_B + 1), s["max_new"] - s["n_gen"])
  return jnp.where(s["active"], m_B, 0), first_eos_B


def _write_round(out, cols_BC, c_C, k_B, emitted_BC, logp_BC, alpha_Bd, logp_BCV, sampling):
  """The round's kept tokens written at their columns cols_BC (M: dropped) of `out`; a token past
  a row's k_B drafts (a bonus token) has alpha NaN."""
  B, C = cols_BC.shape
  rows_BC = jnp.broadcast_to(jnp.arange(B)[:, None], (B, C))
  put = lambda buf, x: buf.at[rows_BC, cols_BC].set(x, mode="drop")
  alpha_BC = jnp.pad(alpha_Bd, ((0, 0), (0, 1)), constant_values=jnp.nan)
  alpha_BC = jnp.where(c_C[None] < k_B[:, None], alpha_BC, jnp.nan)
  out = dict(
    out,
    tokens=put(out["tokens"], emitted_BC),
    logprobs=put(out["logprobs"], logp_BC),
    alpha=put(out["alpha"], alpha_BC),
  )
  if num_top := sampling.num_top_logprobs:
    top_lp, top_id = jax.lax.top_k(logp_BCV, num_top)
    out.update(top_lp=put(out["top_lp"], top_lp), top_id=put(out["top_id"], top_id))
  return out


def _count_round(r: _Round, count, s, c_C, m_B, k_B, n_acc_B, read_B):
  """The per-slot counters after the round. Only what the row emits counts: a draft is judged
  where the round emits a token at its offset (an accepted draft or the residual after it), so
  the bonus token and the drafts past a rejection or past a cut by EOS or max_new are not."""
  active, length, L, Z = s["active"], s["length"], r.cfg.num_hidden_layers, r.page_size
  dense_read_B = jnp.sum(
    jnp.where(c_C[None] < m_B[:, None], L * -(-(length[:, None] + c_C[None] + 1) // Z), 0), axis=1
  )
  return dict(
    rounds=count["rounds"] + active,
    emitted=count["emitted"] + m_B,
    drafted=count["drafted"] + jnp.where(active, k_B, 0),
    judged=count["judged"] + jnp.minimum(m_B, k_B),
    accepted=count["accepted"] + jnp.minimum(m_B, n_acc_B),
    read=count["read"] + jnp.where(active, read_B + L * -(-length // Z), 0.0),
    dense=count["dense"] + dense_read_B.astype(jnp.float32),
    cached=count["cached"] + jnp.where(active, length, 0),
    round_drafts=count["round_drafts"] + jnp.where(active, _round_drafts(r, active, k_B), 0),
  )
