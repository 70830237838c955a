"""The jnp references: decode attention over the paged KV cache (dense, block-sparse), which the
Pallas kernel in kernels/ twins (the dispatch between them is sparsity/policy.py), and the
teacher-forced attention that materialises every score (`dense_attention`), which the blockwise
attention (attention/blockwise.py) twins.

Cache layout (see paged_cache.py): k_cache_BKSE / v_cache_BKSE with S = P * Z; page p of (b, k)
is k_cache_BKSE[b, k, p*Z:(p+1)*Z]. Positions < lengths_B[b] are valid (the decode token
included). Sparse selection: the first n_valid_BK[b, k] entries of page_idx_BKN[b, k] are distinct
page ids in any order; the rest are padding that holds a valid page id and is masked here. Within
a selected page, positions >= lengths_B[b] are masked (the partial last page).

Both references take the softmax in float32 and return q's dtype. A row with nothing to attend to
(n_valid == 0, or length 0) returns zeros, not NaN: its max score is -inf, replaced by 0 so every
exp() is 0, and its zero normaliser is replaced by 1.

Laid out for XLA on CPU, where the rollout runs without a GPU (experiments/bench_attention.py):
  - sparse: a gather that feeds a dot is materialised, so gathering all B*K rows at once writes
    and re-reads 2 x B*K*N*Z*E values (2 x 32 MiB for Qwen3-1.7B, batch 4, a 2K budget), out of
    cache. `lax.map` over the B*K rows gathers one row's pages at a time (2 x 1 MiB, cache
    resident), faster than the batched layouts and than a batched take_along_axis + einsum
    (docs/decode_speed.md).
  - dense: one batched einsum over (b, k) with the G query heads on the matmul's M dimension;
    mapping over rows is slower here (each row's K/V slice is copied out for its dot).
  - float32 caches (the CPU default): XLA CPU runs a bfloat16 gather or loop-sliced bfloat16 array
    in float32 and hoists the conversion of the whole cache out of the row loop, so bfloat16 caches
    make both functions several times slower here (5x for sparse at 16K). On GPU the Pallas kernel
    reads bfloat16 pages directly.
"""

import math

import jax
import jax.numpy as jnp

from sparrow_jax.attention import paged_cache

IMPLS = ("auto", "xla", "pallas", "pallas_tpu")  # decode attention implementations (policy.py)


def default_scale(head_dim: int) -> float:
  return 1.0 / math.sqrt(head_dim)


def check_sparse_args(
  q_BKGE, k_cache_BKSE, v_cache_BKSE, page_idx_BKN, n_valid_BK, lengths_B, page_size
) -> None:
  """Static shape checks shared by the reference and the Pallas kernel."""
  paged_cache.check_page_size(page_size)
  B, K, _, E = q_BKGE.shape
  S = k_cache_BKSE.shape[2]
  if k_cache_BKSE.shape != (B, K, S, E) or v_cache_BKSE.shape != k_cache_BKSE.shape:
    raise ValueError(
      f"k_cache/v_cache must be [B, K, S, E] = {(B, K, 'S', E)} like q_BKGE "
      f"{q_BKGE.shape}, got {k_cache_BKSE.shape} and {v_cache_BKSE.shape}"
    )
  if S % page_size:
    raise ValueError(f"cache length S={S} must be a multiple of page_size={page_size}")
  _check_selection(page_idx_BKN, n_valid_BK, lengths_B, B, K)


def _check_selection(page_idx_BKN, n_valid_BK, lengths_B, B, K) -> None:
  if page_idx_BKN.ndim != 3 or page_idx_BKN.shape[:2] != (B, K):
    raise ValueError(
      f"page_idx_BKN must be [B, K, N] with B, K = {(B, K)}, got {page_idx_BKN.shape}"
    )
  if n_valid_BK.shape != (B, K):
    raise ValueError(f"n_valid_BK must be [B, K] = {(B, K)}, got {n_valid_BK.shape}")
  if lengths_B.shape != (B,):
    raise ValueError(f"lengths_B must be [B] = {(B,)}, got {lengths_B.shape}")


def masked_softmax(s_aT, valid_aT):
  """Softmax over the last axis with the invalid entries masked (valid broadcasts against s). A row
  with nothing valid gives zeros, not NaN: its max is -inf, replaced by 0 so every exp() is 0, and
  its zero normaliser by 1. Shared by every jnp attention (decode and teacher-forced)."""
  s_aT = jnp.where(valid_aT, s_aT, -jnp.inf)
  m_a1 = jnp.max(s_aT, axis=-1, keepdims=True)
  p_aT = jnp.exp(s_aT - jnp.where(jnp.isfinite(m_a1), m_a1, 0.0))
  l_a1 = jnp.sum(p_aT, axis=-1, keepdims=True)
  return p_aT / jnp.where(l_a1 == 0.0, 1.0, l_a1)


def dense_attention(q_BTKGE, k_BSKE, v_BSKE, allowed_BTS):
  """Softmax attention in float32 over the allowed (query, key) pairs, allowed_BTS or allowed_BKTS
  per KV head; a row with no allowed key (a padding query) gives zeros. Holds [B, K, G, T, S]
  scores: a reference for short rows (tests, pretrain_tiny's packed documents)."""
  E = q_BTKGE.shape[-1]
  s_BKGTS = jnp.einsum(
    "btkge,bske->bkgts", q_BTKGE, k_BSKE, preferred_element_type=jnp.float32
  ) / math.sqrt(E)
  allowed = allowed_BTS[:, None, None] if allowed_BTS.ndim == 3 else allowed_BTS[:, :, None]
  p_BKGTS = masked_softmax(s_BKGTS, allowed)
  return jnp.einsum("bkgts,bske->btkge", p_BKGTS, v_BSKE.astype(jnp.float32))


def _softmax_av(s_aGT, valid_aT, v_aTE):
  """softmax(s) @ v over the last axis of s with invalid slots masked; all-masked rows give 0."""
  p_aGT = masked_softmax(s_aGT, valid_aT[..., None, :])
  return jnp.einsum("...gt,...te->...ge", p_aGT, v_aTE.astype(jnp.float32))


def dense_decode_attention(q_BKGE, k_cache_BKSE, v_cache_BKSE, lengths_B, *, scale=None):
  """Attention of one decode query per sequence over the whole cache (positions < lengths_B)."""
  B, K, G, E = q_BKGE.shape
  S = k_cache_BKSE.shape[2]
  scale = default_scale(E) if scale is None else scale
  s_BKGS = (
    jnp.einsum(
      "bkge,bkse->bkgs",
      q_BKGE.astype(k_cache_BKSE.dtype),
      k_cache_BKSE,
      preferred_element_type=jnp.float32,
    )
    * scale
  )
  valid_B11S = (jnp.arange(S) < lengths_B[:, None])[:, None, :]
  return _softmax_av(s_BKGS, valid_B11S, v_cache_BKSE).astype(q_BKGE.dtype)


def check_paged_args(
  q_BKGE, k_pages_XZE, v_pages_XZE, page_idx_BKN, logical_idx_BKN, n_valid_BK, lengths_B
) -> None:
  """Static shape checks of the paged form, shared by the reference and the Pallas kernels."""
  B, K, _, E = q_BKGE.shape
  if k_pages_XZE.ndim != 3 or k_pages_XZE.shape[2] != E or v_pages_XZE.shape != k_pages_XZE.shape:
    raise ValueError(
      f"k_pages/v_pages must be [X, Z, E] with E = {E}, got {k_pages_XZE.shape} and "
      f"{v_pages_XZE.shape}"
    )
  paged_cache.check_page_size(k_pages_XZE.shape[1])
  _check_selection(page_idx_BKN, n_valid_BK, lengths_B, B, K)
  if logical_idx_BKN.shape != page_idx_BKN.shape:
    raise ValueError(
      f"logical_idx_BKN must be shaped like page_idx_BKN {page_idx_BKN.shape}, "
      f"got {logical_idx_BKN.shape}"
    )


def rows_as_pages(k_cache_BKSE, v_cache_BKSE, page_idx_BKN, page_size):
  """Per-row caches as the paged form: every (row, head)'s pages laid end to end as one flat page
  array [B * K * P, Z, E] (a free reshape), page ids into it, and the row's own page ids as the
  logical ids that positions come from."""
  B, K, S, E = k_cache_BKSE.shape
  P = S // page_size
  flat = lambda c: c.reshape(B * K * P, page_size, E)
  base_BK1 = (jnp.arange(B * K, dtype=jnp.int32) * P).reshape(B, K, 1)
  logical_BKN = jnp.clip(page_idx_BKN.astype(jnp.int32), 0, P - 1)
  return flat(k_cache_BKSE), flat(v_cache_BKSE), base_BK1 + logical_BKN, logical_BKN


def _paged_row(q_GE, k_pages_XZE, v_pages_XZE, page_idx_N, logical_idx_N, n_valid, length, scale):
  """One (sequence, KV head): gather the selected pages, then masked softmax attention."""
  N = page_idx_N.shape[0]
  _, Z, E = k_pages_XZE.shape
  # mode="clip" clamps the N page ids once; the default fill mode would add a per-element select.
  k_TE = k_pages_XZE.at[page_idx_N].get(mode="clip").reshape(N * Z, E)
  v_TE = v_pages_XZE.at[page_idx_N].get(mode="clip").reshape(N * Z, E)
  s_GT = jnp.einsum("ge,te->gt", q_GE.astype(jnp.float32), k_TE.astype(jnp.float32)) * scale
  pos_T = (logical_idx_N[:, None] * Z + jnp.arange(Z)).reshape(N * Z)
  slot_T = jnp.arange(N * Z) // Z
  valid_T = (slot_T < n_valid) & (pos_T < length)
  return _softmax_av(s_GT, valid_T, v_TE)


def _row_reader(N: int, scale):
  """One (sequence, KV head)'s attention reading only a prefix of its N page slots that holds its
  n_valid pages (none, a power of two, or all N: a lax.switch, so one branch runs). The valid
  pages come first, so a prefix loses nothing: a finished row reads nothing and any other at most
  twice its own pages, whatever the longest row beside it holds."""
  sizes = sorted({min(1 << i, N) for i in range(max(N - 1, 1).bit_length() + 1)})

  def prefix(size):
    def read(q_GE, k_pages_XZE, v_pages_XZE, page_idx_N, logical_idx_N, n_valid, length):
      return _paged_row(
        q_GE,
        k_pages_XZE,
        v_pages_XZE,
        page_idx_N[:size],
        logical_idx_N[:size],
        n_valid,
        length,
        scale,
      )

    return read

  def nothing(q_GE, *_):
    return jnp.zeros(q_GE.shape, jnp.float32)

  def row(q_GE, k_pages_XZE, v_pages_XZE, page_idx_N, logical_idx_N, n_valid, length):
    branch = jnp.where(
      (n_valid > 0) & (length > 0), jnp.searchsorted(jnp.asarray(sizes), n_valid) + 1, 0
    )
    return jax.lax.switch(
      branch,
      [nothing] + [prefix(s) for s in sizes],
      q_GE,
      k_pages_XZE,
      v_pages_XZE,
      page_idx_N,
      logical_idx_N,
      n_valid,
      length,
    )

  return row


def paged_decode_attention(
  q_BKGE,
  k_pages_XZE,
  v_pages_XZE,
  page_idx_BKN,
  logical_idx_BKN,
  n_valid_BK,
  lengths_B,
  *,
  scale=None,
):
  """Attention of one decode query per (sequence b, KV head k) over pages of a flat page array:
  the first n_valid_BK[b, k] entries of page_idx_BKN[b, k] are distinct page ids into k_pages_XZE /
  v_pages_XZE (any order; the rest are padding holding a valid id, masked), and logical_idx_BKN
  holds each one's page number in the row, which gives its positions: a token at position >=
  lengths_B[b] is masked (the partial last page). The form a page pool is read in (the page id is
  physical, the logical id comes from the row's page table); per-row caches reach it through
  `rows_as_pages`. Each row reads about its own n_valid pages (`_row_reader`)."""
  check_paged_args(
    q_BKGE, k_pages_XZE, v_pages_XZE, page_idx_BKN, logical_idx_BKN, n_valid_BK, lengths_B
  )
  B, K, G, E = q_BKGE.shape
  N = page_idx_BKN.shape[2]
  scale = default_scale(E) if scale is None else scale
  read = _row_reader(N, scale)
  rows = (
    q_BKGE.reshape(B * K, G, E),
    page_idx_BKN.reshape(B * K, N),
    logical_idx_BKN.reshape(B * K, N),
    n_valid_BK.reshape(B * K),
    jnp.repeat(lengths_B, K),
  )
  out_aGE = jax.lax.map(lambda row: read(row[0], k_pages_XZE, v_pages_XZE, *row[1:]), rows)
  return out_aGE.reshape(B, K, G, E).astype(q_BKGE.dtype)


def _verify_row(q_CGE, k_pages_XZE, v_pages_XZE, page_idx_N, length, k_new_CE, v_new_CE, scale):
  """One (sequence, KV head) of `paged_verify_attention`."""
  N = page_idx_N.shape[0]
  _, Z, E = k_pages_XZE.shape
  C = q_CGE.shape[0]
  f32 = lambda x: x.astype(jnp.float32)
  k_TE = jnp.concatenate(
    [f32(k_pages_XZE.at[page_idx_N].get(mode="clip").reshape(N * Z, E)), f32(k_new_CE)]
  )
  v_TE = jnp.concatenate([v_pages_XZE.at[page_idx_N].get(mode="clip").reshape(N * Z, E), v_new_CE])
  s_CGT = jnp.einsum("cge,te->cgt", f32(q_CGE), k_TE) * scale
  cached_CT = jnp.broadcast_to(jnp.arange(N * Z) < length, (C, N * Z))
  causal_CC = jnp.arange(C)[None, :] <= jnp.arange(C)[:, None]
  return _softmax_av(s_CGT, jnp.concatenate([cached_CT, causal_CC], axis=1), v_TE)


def paged_verify_attention(
  q_BKCGE, k_pages_XZE, v_pages_XZE, page_idx_BKN, lengths_B, k_new_BKCE, v_new_BKCE, *, scale=None
):
  """Attention of C consecutive queries per (sequence b, KV head k), at positions lengths_B[b] + c,
  over the sequence's cached tokens (positions < lengths_B[b] of its pages page_idx_BKN[b, k], in
  logical order, ids into the flat page arrays) and causally over the C new keys and values
  k_new_BKCE, v_new_BKCE (not cached yet): the dense verification pass of speculative decoding,
  which reads each page once for all C queries. With C = 1 it is `paged_decode_attention` with
  every cached page selected and the new token in the cache."""
  B, K, C, G, E = q_BKCGE.shape
  N = page_idx_BKN.shape[2]
  scale = default_scale(E) if scale is None else scale
  new = lambda x: x.reshape(B * K, C, E).astype(k_pages_XZE.dtype)
  rows = (
    q_BKCGE.reshape(B * K, C, G, E),
    page_idx_BKN.reshape(B * K, N),
    jnp.repeat(lengths_B, K),
    new(k_new_BKCE),
    new(v_new_BKCE),
  )
  out = jax.lax.map(
    lambda row: _verify_row(row[0], k_pages_XZE, v_pages_XZE, *row[1:], scale), rows
  )
  return out.reshape(B, K, C, G, E).astype(q_BKCGE.dtype)


def per_row(paged_fn):
  """The per-row-cache form of a paged attention (`paged_decode_attention`'s contract):
  sparse_decode_attention(q_BKGE, k_cache_BKSE, v_cache_BKSE, page_idx_BKN, n_valid_BK, lengths_B,
  *, page_size, **paged_fn's keywords), the caches read as pages by `rows_as_pages`."""

  def sparse_decode_attention(
    q_BKGE, k_cache_BKSE, v_cache_BKSE, page_idx_BKN, n_valid_BK, lengths_B, *, page_size, **kwargs
  ):
    check_sparse_args(
      q_BKGE, k_cache_BKSE, v_cache_BKSE, page_idx_BKN, n_valid_BK, lengths_B, page_size
    )
    k_pages, v_pages, flat_idx, logical_idx = rows_as_pages(
      k_cache_BKSE, v_cache_BKSE, page_idx_BKN, page_size
    )
    return paged_fn(
      q_BKGE, k_pages, v_pages, flat_idx, logical_idx, n_valid_BK, lengths_B, **kwargs
    )

  sparse_decode_attention.__doc__ = (
    f"{paged_fn.__module__}.{paged_fn.__name__} over per-row caches (see reference.per_row)."
  )
  return sparse_decode_attention


# Attention of one decode query per sequence over the selected pages of its own cache (module doc).
sparse_decode_attention = per_row(paged_decode_attention)
