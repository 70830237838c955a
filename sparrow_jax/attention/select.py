"""Block top-k page selection, shared by the sparse sampler and the sparse teacher-forced forward.

At a decode step the query is the newest token at position t (already written, so t + 1 tokens are
cached in ceil((t+1)/Z) pages). Per layer, sequence and KV head:
  - always kept: the first `sink_pages` pages (BOS / attention sink) and the last `local_pages`
    pages (the current, possibly partial, page is one of them);
  - scored: every other page (all complete) by `SparseConfig.page_score` with the mean of the
    group's query heads: "mean" dots it with the page's mean key (the paper), "quest" takes Quest's
    upper bound of its dot with any key of the page from per-channel key bounds
    (`paged_cache.PAGE_SCORES`);
  - kept: the top (budget - always_kept) scored pages, budget = schedule.budget_pages(t + 1).
Both paths score with `paged_cache.page_scores` on `paged_cache.page_summaries` of the same keys and
call `keep_pages`, so the sampler and the trainer pick the same pages by construction (ties broken
towards the lower page index). A budget covering every page gives exact dense attention. The
attention kernels take the selected page ids only: how pages are scored does not reach them.
"""

import dataclasses

import jax
import jax.numpy as jnp

from sparrow_jax.attention import paged_cache
from sparrow_jax.attention.reference import IMPLS

PAGE_SCORES = tuple(paged_cache.PAGE_SCORES)  # SparseConfig.page_score's values


@dataclasses.dataclass(frozen=True)
class SparseConfig:
  page_size: int = 16  # Z, tokens per page (Sparrow: 16 is on the cost/mismatch Pareto front)
  sink_pages: int = 1  # first pages always read (BOS / attention sink)
  local_pages: int = 2  # most recent pages always read (the partial current page included)
  dense_layers: int = 2  # the first layers stay dense
  attention_impl: str = "auto"  # "auto" (the GPU / TPU kernel on its platform, XLA elsewhere) |
  # "xla" | "pallas" (GPU, Triton) | "pallas_tpu" (TPU, Mosaic)
  page_score: str = "mean"  # how scored pages rank: "mean" (mean key, the paper) | "quest"
  # (per-channel key bounds: twice the cached summary bytes)

  def __post_init__(self):
    paged_cache.check_page_size(self.page_size)
    for name in ("sink_pages", "local_pages", "dense_layers"):
      if getattr(self, name) < 0:
        raise ValueError(f"SparseConfig.{name} must be >= 0, got {getattr(self, name)}")
    if self.local_pages < 1:
      # The current page is partial while it fills: as a scored page its summary would mix in the
      # keys written after the query in teacher forcing, so sampler and trainer would disagree.
      raise ValueError(
        f"SparseConfig.local_pages must be >= 1 (the current, partial page is "
        f"always read), got {self.local_pages}"
      )
    if self.attention_impl not in IMPLS:
      raise ValueError(
        f"SparseConfig.attention_impl must be one of {IMPLS}, got {self.attention_impl!r}"
      )
    if self.page_score not in PAGE_SCORES:
      raise ValueError(
        f"SparseConfig.page_score must be one of {PAGE_SCORES}, got {self.page_score!r}"
      )

  @property
  def always_kept(self) -> int:
    return self.sink_pages + self.local_pages


def _page_roles(num_pages: int, query_pos_a, sparse: SparseConfig):
  """Masks [..., P] of the always-kept pages and of the scored candidates, for a query at
  query_pos (whose cache holds query_pos + 1 tokens)."""
  p = jnp.arange(num_pages)
  n_pages = (query_pos_a // sparse.page_size + 1)[..., None]
  present = p < n_pages
  always = present & ((p < sparse.sink_pages) | (p >= n_pages - sparse.local_pages))
  return always, present & ~always


def keep_pages(scores_aP, query_pos_a, budget_a, sparse: SparseConfig):
  """Mask [..., P] of the pages read by a query at position query_pos with `budget` pages.

  The top n = budget - always_kept candidates, ties to the lower page index (lax.top_k's order,
  which the sampler's `decode_pages` uses): one descending sort gives the n-th value t and its page
  p_t, and the kept candidates are those above t plus those equal to t at pages <= p_t. (One sort
  instead of ranking by two argsorts: 2-3x less time in the sparse teacher-forced pass on CPU.)"""
  always, candidate = _page_roles(scores_aP.shape[-1], query_pos_a, sparse)
  masked = jnp.where(candidate, scores_aP.astype(jnp.float32), -jnp.inf)
  top_aP, top_idx_aP = jax.lax.top_k(masked, masked.shape[-1])
  n_a1 = jnp.broadcast_to(jnp.maximum(budget_a - sparse.always_kept, 0), masked.shape[:-1])[
    ..., None
  ]
  at = jnp.maximum(n_a1 - 1, 0)
  t_a1 = jnp.take_along_axis(top_aP, at, axis=-1)
  p_t_a1 = jnp.take_along_axis(top_idx_aP, at, axis=-1)
  page = jnp.arange(masked.shape[-1])
  top_n_aP = (masked > t_a1) | ((masked == t_a1) & (page <= p_t_a1))
  return always | (candidate & top_n_aP & (n_a1 > 0))


@jax.named_scope("page_selection")  # metadata: how a profile names its ops
def decode_pages(q_BKGE, summary_BKPRE, lengths_B, budget_B, sparse: SparseConfig, max_selected):
  """Page ids [B, K, N] (kept pages first, in ascending order, padded with valid ids) and their
  count [B, K].

  The same pages as `keep_pages`, found with one `lax.top_k` over the candidates instead of a full
  ranking (sorting all P pages twice per head costs more than the sparse attention at 32K): top_k
  orders equal scores by lower index, exactly like the stable descending rank.
  """
  B, K, P = summary_BKPRE.shape[:3]
  with jax.named_scope("page_scores"):
    qbar_BK1E = jnp.mean(q_BKGE.astype(jnp.float32), axis=2, keepdims=True)
    scores_BKP = paged_cache.page_scores(qbar_BK1E, summary_BKPRE, sparse.page_score)[:, :, 0]
  _, candidate_BKP = _page_roles(P, (lengths_B - 1)[:, None], sparse)
  n_top = min(max(max_selected - sparse.always_kept, 1), P)
  top_score_BKk, top_idx_BKk = jax.lax.top_k(jnp.where(candidate_BKP, scores_BKP, -jnp.inf), n_top)
  top_valid_BKk = (jnp.arange(n_top) < (budget_B - sparse.always_kept)[:, None, None]) & (
    top_score_BKk > -jnp.inf
  )
  # always-kept ids: the sink pages, then the local pages that are not sink pages themselves
  n_pages_B1 = ((lengths_B - 1) // sparse.page_size + 1)[:, None]
  sink_BA = jnp.broadcast_to(jnp.arange(sparse.sink_pages), (B, sparse.sink_pages))
  local_BA = n_pages_B1 - sparse.local_pages + jnp.arange(sparse.local_pages)
  always_BA = jnp.concatenate([sink_BA, local_BA], axis=1)
  always_valid_BA = jnp.concatenate([sink_BA < n_pages_B1, local_BA >= sparse.sink_pages], axis=1)
  ids_BKN = jnp.concatenate(
    [jnp.broadcast_to(always_BA[:, None], (B, K, always_BA.shape[1])), top_idx_BKk], axis=-1
  )
  valid_BKN = jnp.concatenate(
    [jnp.broadcast_to(always_valid_BA[:, None], (B, K, always_BA.shape[1])), top_valid_BKk], axis=-1
  )
  # Valid ids first and ascending (padding, P added to sort it last, after them): a gather that
  # walks the cache forwards is faster than one in score order on CPU (bench_decode.py).
  ids_BKN = jnp.clip(ids_BKN, 0, P - 1)
  sorted_BKN = jnp.sort(jnp.where(valid_BKN, ids_BKN, ids_BKN + P), axis=-1)
  page_idx_BKN = jnp.where(sorted_BKN < P, sorted_BKN, sorted_BKN - P)
  return page_idx_BKN.astype(jnp.int32), jnp.sum(valid_BKN, axis=-1).astype(jnp.int32)


def teacher_forced_keep(q_BTKGE, k_BSKE, prompt_len_B, schedule, sparse: SparseConfig):
  """Mask [B, K, T, P] of the pages each position's query read while decoding. Prompt positions
  were prefilled densely, so they keep every page. The materialised reference of what
  `blockwise.attention` selects per query block in sparse teacher forcing (tests compare them)."""
  T = q_BTKGE.shape[1]
  summary_BKPRE = paged_cache.page_summaries(
    k_BSKE.transpose(0, 2, 1, 3), sparse.page_size, sparse.page_score
  )
  qbar_BKTE = jnp.mean(q_BTKGE.astype(jnp.float32), axis=3).transpose(0, 2, 1, 3)
  scores_BKTP = paged_cache.page_scores(qbar_BKTE, summary_BKPRE, sparse.page_score)
  pos_T = jnp.arange(T)
  budget_BT = jnp.where(
    pos_T[None] < prompt_len_B[:, None],
    summary_BKPRE.shape[2],
    schedule.budget_pages(pos_T + 1)[None],
  )
  return keep_pages(scores_BKTP, pos_T[None, None], budget_BT[:, None], sparse)
