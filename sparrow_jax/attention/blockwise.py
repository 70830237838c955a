"""Blockwise (flash) causal attention in jnp: teacher forcing, training and chunked prefill without
ever holding a [T, S] score matrix.

Queries go in blocks of `block_q`; each block walks the key blocks it can see (a while loop that
stops at the causal edge, so no work is spent above the diagonal) with an online softmax in float32.
The matmuls accumulate in float32; their operands are float32 on CPU and the inputs' 16-bit dtype
on accelerators (`_operand_dtype`, decided when traced), as fused attention kernels take them.
The backward pass is written by hand (`jax.custom_vjp`): it keeps only the output and the per-row
log-sum-exp and recomputes each block's probabilities, so memory is linear in length whatever the
autodiff of the loops would have saved. The jnp reference that materialises everything is
`reference.dense_attention` (and `select.teacher_forced_keep` for the sparse mask); tests compare.

Layout: q_BTKGE (G query heads per KV head), keys and values k_BKSE / v_BKSE: the paged cache's
layout, so chunked prefill reads the cache directly. Query t sits at slot q_offset + t and may read
slot s iff s <= q_offset + t and key_valid_BS[b, s]. A query with nothing to read gives zeros.

Sparse teacher forcing: with `select_fn` and `budget_BT`, each query also reads only the pages that
`select_fn(scores_BKQP, query_pos, budget)` keeps, scored as the sparse sampler scores them
(`paged_cache.page_scores` of the group's mean query against the `page_score` summaries of the
pages); the keep mask is made per query block (never [T, P] at once) and made again in the backward
pass.
"""

import functools
import math
from typing import Callable, NamedTuple, Optional

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

from sparrow_jax import sharding
from sparrow_jax.attention import paged_cache

BLOCK_Q = 1024  # queries per block: [K, G, 1024, 1024] f32 scores = 8 MiB per query head
BLOCK_K = 1024  # keys per block (a multiple of the page size): fewer, larger loop steps on CPU


def _round_up(n, m):
  return -(-n // m) * m


def attention(
  q_BTKGE,
  k_BKSE,
  v_BKSE,
  key_valid_BS,
  *,
  q_offset=0,
  budget_BT=None,
  select_fn: Optional[Callable] = None,
  page_size: int = 16,
  page_score: str = "mean",
  block_q: int = BLOCK_Q,
  block_k: int = BLOCK_K,
):
  """softmax(q k^T / sqrt(E)) v over the causal, valid (and, if sparse, selected) keys; returns
  q's shape and dtype. q_offset (traced is fine): the slot of the first query. Sparse when
  `select_fn` is given: select_fn(scores_BKQP, query_pos_11Q, budget_B1Q) -> keep_BKQP, with pages
  scored by `page_score` (a paged_cache.PAGE_SCORES key)."""
  B, T, K, G, E = q_BTKGE.shape
  S = k_BKSE.shape[2]
  if (select_fn is None) != (budget_BT is None):
    raise ValueError("sparse blockwise attention needs both select_fn and budget_BT")
  bq = min(block_q, _round_up(T, 8))
  bk = _round_up(min(block_k, _round_up(S, page_size)), page_size)
  Tp, Sp = _round_up(T, bq), _round_up(S, bk)
  q = jnp.pad(q_BTKGE, ((0, 0), (0, Tp - T), (0, 0), (0, 0), (0, 0)))
  pad_s = ((0, 0), (0, 0), (0, Sp - S), (0, 0))
  k, v = jnp.pad(k_BKSE, pad_s), jnp.pad(v_BKSE, pad_s)
  valid = jnp.pad(key_valid_BS.astype(bool), ((0, 0), (0, Sp - S)))
  budget = (
    None if budget_BT is None else jnp.pad(budget_BT.astype(jnp.int32), ((0, 0), (0, Tp - T)))
  )
  geometry = _Geometry(
    bq, bk, page_size, 1.0 / math.sqrt(E), select_fn, page_score, _operand_dtype(q_BTKGE.dtype)
  )
  out = _flash(geometry, q, k, v, valid, jnp.asarray(q_offset, jnp.int32), budget)
  return out[:, :T]


class _Geometry(NamedTuple):
  """The static part of one call (block sizes, scale, the selection rule)."""

  bq: int
  bk: int
  page_size: int
  scale: float
  select_fn: Optional[Callable]
  page_score: str
  operand: jnp.dtype  # of the matmuls (which accumulate in float32)


def _operand_dtype(dtype):
  """float32 on CPU (which has no fast 16-bit dots) and for float32 inputs, else the inputs'."""
  cpu = sharding.platform() == "cpu" or jnp.dtype(dtype).itemsize > 2
  return jnp.dtype(jnp.float32) if cpu else jnp.dtype(dtype)


def _dot(g: _Geometry, spec, a, b):
  return jnp.einsum(
    spec, a.astype(g.operand), b.astype(g.operand), preferred_element_type=jnp.float32
  )


def _block_mask(g: _Geometry, i, j, q_offset, valid_BS, keep_BKQP):
  """[B, K or 1, 1, bq, bk] mask of query block i against key block j."""
  qpos = q_offset + i * g.bq + jnp.arange(g.bq)
  kpos = j * g.bk + jnp.arange(g.bk)
  mask = (kpos[None] <= qpos[:, None])[None, None, None]
  mask = mask & jax.lax.dynamic_slice_in_dim(valid_BS, j * g.bk, g.bk, axis=1)[:, None, None, None]
  if keep_BKQP is not None:
    pages = g.bk // g.page_size
    keep = jax.lax.dynamic_slice_in_dim(keep_BKQP, j * pages, pages, axis=3)
    mask = mask & jnp.repeat(keep, g.page_size, axis=3)[:, :, None]
  return mask


def _summaries(g: _Geometry, k):
  """The page summaries the selection scores against (None when dense), once per call."""
  if g.select_fn is None:
    return None
  return paged_cache.page_summaries(jax.lax.stop_gradient(k), g.page_size, g.page_score)


def _query_block(g: _Geometry, i, q, k, summary_BKPRE, q_offset, budget):
  """Query block i [B, K, G, Q, E] (Q = bq), its page-keep mask (or None) and how many key blocks
  it can see. Pages are scored in float32 whatever the operands, as the sampler scores them."""
  q_BKGQE = jax.lax.dynamic_slice_in_dim(q, i * g.bq, g.bq, axis=1)
  q_BKGQE = q_BKGQE.transpose(0, 2, 3, 1, 4)
  keep = None
  if g.select_fn is not None:
    scores = paged_cache.page_scores(
      jnp.mean(jax.lax.stop_gradient(q_BKGQE).astype(jnp.float32), axis=2),
      summary_BKPRE,
      g.page_score,
    )
    qpos = q_offset + i * g.bq + jnp.arange(g.bq)
    budget_BQ = jax.lax.dynamic_slice_in_dim(budget, i * g.bq, g.bq, axis=1)
    keep = g.select_fn(scores, qpos[None, None], budget_BQ[:, None])
  last_query = q_offset + (i + 1) * g.bq - 1
  n_kb = jnp.clip(last_query // g.bk + 1, 0, k.shape[2] // g.bk)
  return q_BKGQE, keep, n_kb


def _scores(g, q_BKGQE, k, j):
  k_BKTE = jax.lax.dynamic_slice_in_dim(k, j * g.bk, g.bk, axis=2)
  return _dot(g, "bkgqe,bkse->bkgqs", q_BKGQE, k_BKTE) * g.scale, k_BKTE


def _forward(g: _Geometry, q, k, v, valid, q_offset, budget):
  """(out [B, Tp, K, G, E] in q's dtype, lse [nq, B, K, G, bq])."""
  B, Tp, K, G, E = q.shape
  summary_BKPRE = _summaries(g, k)

  def one_block(i):
    q_BKGQE, keep, n_kb = _query_block(g, i, q, k, summary_BKPRE, q_offset, budget)

    def step(j, carry):
      m, denom, acc = carry
      s, _ = _scores(g, q_BKGQE, k, j)
      s = jnp.where(_block_mask(g, i, j, q_offset, valid, keep), s, -jnp.inf)
      m_new = jnp.maximum(m, jnp.max(s, axis=-1))
      m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
      p = jnp.exp(s - m_safe[..., None])
      correction = jnp.exp(m - m_safe)
      v_BKTE = jax.lax.dynamic_slice_in_dim(v, j * g.bk, g.bk, axis=2)
      acc = acc * correction[..., None] + _dot(g, "bkgqs,bkse->bkgqe", p, v_BKTE)
      return m_new, denom * correction + jnp.sum(p, axis=-1), acc

    init = (
      jnp.full((B, K, G, g.bq), -jnp.inf),
      jnp.zeros((B, K, G, g.bq)),
      jnp.zeros((B, K, G, g.bq, E)),
    )
    m, denom, acc = jax.lax.fori_loop(0, n_kb, step, init)
    out = acc / jnp.where(denom == 0.0, 1.0, denom)[..., None]
    lse = jnp.where(denom > 0.0, m + jnp.log(jnp.where(denom > 0.0, denom, 1.0)), jnp.inf)
    return out.transpose(0, 3, 1, 2, 4).astype(q.dtype), lse

  out, lse = jax.lax.map(one_block, jnp.arange(Tp // g.bq))
  return out.transpose(1, 0, 2, 3, 4, 5).reshape(B, Tp, K, G, E), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flash(g, q, k, v, valid, q_offset, budget):
  return _forward(g, q, k, v, valid, q_offset, budget)[0]


def _flash_fwd(g, q, k, v, valid, q_offset, budget):
  out, lse = _forward(g, q, k, v, valid, q_offset, budget)
  # Named for the "attention" remat policy (qwen3.REMAT_POLICIES), which keeps them so that a
  # rematerialised layer's backward does not run this forward (and its page selection) again.
  out, lse = checkpoint_name(out, "attention_out"), checkpoint_name(lse, "attention_lse")
  return out, (q, k, v, valid, q_offset, budget, out, lse)


def _flash_bwd(g, residuals, d_out):
  """FlashAttention-2's backward: per query block, recompute p = exp(s - lse) block by block and
  accumulate dq locally, dk and dv into full-length float32 buffers."""
  q, k, v, valid, q_offset, budget, out, lse = residuals
  B, Tp, K, G, E = q.shape
  to_block = lambda x, i: (
    jax.lax.dynamic_slice_in_dim(x, i * g.bq, g.bq, axis=1)
    .astype(jnp.float32)
    .transpose(0, 2, 3, 1, 4)
  )

  summary_BKPRE = _summaries(g, k)

  def one_block(i, carry):
    dq, dk, dv = carry
    q_BKGQE, keep, n_kb = _query_block(g, i, q, k, summary_BKPRE, q_offset, budget)
    do_BKGQE = to_block(d_out, i)
    delta = jnp.sum(do_BKGQE * to_block(out, i), axis=-1)  # [B, K, G, Q]
    lse_BKGQ = lse[i]

    def step(j, inner):
      dq_BKGQE, dk, dv = inner
      s, k_BKTE = _scores(g, q_BKGQE, k, j)
      mask = _block_mask(g, i, j, q_offset, valid, keep)
      p = jnp.where(mask, jnp.exp(s - lse_BKGQ[..., None]), 0.0)
      v_BKTE = jax.lax.dynamic_slice_in_dim(v, j * g.bk, g.bk, axis=2)
      dp = _dot(g, "bkgqe,bkse->bkgqs", do_BKGQE, v_BKTE)
      ds = p * (dp - delta[..., None]) * g.scale
      dq_BKGQE = dq_BKGQE + _dot(g, "bkgqs,bkse->bkgqe", ds, k_BKTE)
      add = lambda acc, x: jax.lax.dynamic_update_slice_in_dim(
        acc, jax.lax.dynamic_slice_in_dim(acc, j * g.bk, g.bk, axis=2) + x, j * g.bk, axis=2
      )
      dk = add(dk, _dot(g, "bkgqs,bkgqe->bkse", ds, q_BKGQE))
      dv = add(dv, _dot(g, "bkgqs,bkgqe->bkse", p, do_BKGQE))
      return dq_BKGQE, dk, dv

    dq_BKGQE, dk, dv = jax.lax.fori_loop(
      0, n_kb, step, (jnp.zeros(q_BKGQE.shape, jnp.float32), dk, dv)
    )
    dq = jax.lax.dynamic_update_slice_in_dim(
      dq, dq_BKGQE.transpose(0, 3, 1, 2, 4).astype(dq.dtype), i * g.bq, axis=1
    )
    return dq, dk, dv

  init = (
    jnp.zeros(q.shape, q.dtype),
    jnp.zeros(k.shape, jnp.float32),
    jnp.zeros(v.shape, jnp.float32),
  )
  dq, dk, dv = jax.lax.fori_loop(0, Tp // g.bq, one_block, init)
  return dq, dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_flash.defvjp(_flash_fwd, _flash_bwd)
