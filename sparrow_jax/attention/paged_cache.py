"""Paged KV cache with per-page key summaries (mean keys, or Quest's per-channel bounds), for block
top-k sparse decoding.

Layout, stacked over layers (prefill scans its layers and indexes the cache with the layer; decoding
splits it into one single-layer cache per layer, `split_layers`):
  k_stored, v_stored [L, B, K, S, E]  S = P * Z: page p of (layer, sequence b, KV head k) is the
                                   contiguous block k[l, b, k, p*Z:(p+1)*Z]; a [..., P, Z, E] view
                                   is a free reshape. Keys and values of `dtype` (the model's:
                                   bfloat16 at scale), read through `keys(layer)`,
                                   `values(layer)`. On XLA CPU 2-byte floats are stored as uint16
                                   bits (`stored_dtype`): it runs every bfloat16 update of a
                                   buffer in float32, converting the whole cache there and back
                                   (several times the KV in temporaries;
                                   experiments/memory_report.py), while integer writes stay in
                                   place. Everything else is stored as itself: XLA CPU copied a
                                   whole layer's cache at each decode step to read uint32 bits as
                                   float32 (docs/decode_speed.md).
  summaries    [L, B, K, P, R, E]  what each page is scored by (`page_summaries`), R rows per page
                                   by `SparseConfig.page_score`: "mean" R = 1, the mean key (the
                                   paper's centroid); "quest" R = 2, the per-channel max and min key
                                   (Quest's bounds), twice the bytes. In the cache dtype (bfloat16
                                   at scale): the scoring pass reads P x R x E of it per head and
                                   step; at R = 1 as much as a 2K-token sparse read at 32K in
                                   float32, half that in bfloat16 (1/32 of the KV at Z = 16; R = 2:
                                   1/16). Written whenever a token lands in a page, from the page's
                                   Z cached slots (unwritten slots are zero): final once the page is
                                   complete, and a partial page is never scored (it is always one
                                   of the `local_pages`), so no zero slot reaches a score.
  lengths         [B]              tokens cached per sequence (slot == position: rows are
                                   right-padded).
Why this layout: a selected page is one contiguous Z x E tile per (sequence, head), so a sparse read
is a gather of whole tiles (coalesced loads on GPU; on TPU 16 x 128 matches the (8, 128) vreg tiling
and one DMA per page), and the scoring pass reads only the P x R x E summary block per head.
Why summaries of the cached slots: the trainer scores pages with the same summaries of the same
keys in the same dtype (`page_summaries`, `page_scores`), so the sampler picks the pages the
trainer picks; a running float32 sum would cost twice the bytes and a bfloat16 one would round
sixteen additions per page.
Here every sequence owns its P pages: this is the prefill's cache. The engine's prefill program
writes it into the shared page pool (attention/page_pool.py: rows take pages as they grow, a GRPO
group's rows share its prompt pages), and decoding reads the pool through per-layer views that
stand in for a single-layer cache of this module (`page_pool.layer_views`).
"""

from typing import Callable, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from sparrow_jax import sharding


def stored_dtype(dtype):
  """How keys and values of `dtype` are stored: 2-byte floats as uint16 bits on XLA CPU (its
  bfloat16 updates run in float32 over the whole buffer; integer writes stay in place), every dtype
  as itself elsewhere (accelerators update bfloat16 in place, and reading bits as bfloat16 would
  cost a copy of the cache per read, as reading uint32 as float32 did on CPU)."""
  dtype = jnp.dtype(dtype)
  return jnp.dtype(jnp.uint16) if dtype.itemsize == 2 and sharding.platform() == "cpu" else dtype


def to_stored(x):
  """x in its storage form (`stored_dtype`): a free bitcast, or x itself (`from_stored` undoes
  it)."""
  stored = stored_dtype(x.dtype)
  return x if stored == x.dtype else jax.lax.bitcast_convert_type(x, stored)


def from_stored(x, dtype):
  return x if x.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))


@flax.struct.dataclass
class PagedKVCache:
  k_stored: jax.Array
  v_stored: jax.Array
  summaries: jax.Array
  lengths: jax.Array
  page_size: int = flax.struct.field(pytree_node=False, default=16)
  dtype: str = flax.struct.field(pytree_node=False, default="float32")
  page_score: str = flax.struct.field(pytree_node=False, default="mean")  # a PAGE_SCORES key

  def keys(self, layer):
    """Keys [B, K, S, E] of `layer` (traced is fine) in the cache dtype."""
    return from_stored(self.k_stored[layer], self.dtype)

  def values(self, layer):
    return from_stored(self.v_stored[layer], self.dtype)

  @property
  def max_len(self) -> int:
    return self.k_stored.shape[3]

  @property
  def num_pages(self) -> int:
    return self.max_len // self.page_size

  def append_token(self, k_BKE, v_BKE, pos_B) -> "PagedKVCache":
    """`append` into this single-layer cache (what `qwen3.decode_step` calls on each layer)."""
    return append(self, 0, k_BKE, v_BKE, pos_B)

  def constrain(self) -> "PagedKVCache":
    return constrain(self)


def check_page_size(page_size) -> None:
  if not isinstance(page_size, int) or page_size <= 0 or page_size & (page_size - 1):
    raise ValueError(f"page_size must be a positive power of two, got {page_size!r}")


def init_cache(
  cfg, batch: int, max_len: int, page_size: int = 16, dtype=jnp.float32, page_score: str = "mean"
) -> PagedKVCache:
  """An empty cache holding at least max_len tokens (rounded up to whole pages), with the page
  summaries `page_score` scores."""
  check_page_size(page_size)
  rows = page_score_fns(page_score).rows
  pages = -(-max_len // page_size)
  K, E, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
  stored = stored_dtype(dtype)
  return constrain(
    PagedKVCache(
      k_stored=jnp.zeros((L, batch, K, pages * page_size, E), stored),
      v_stored=jnp.zeros((L, batch, K, pages * page_size, E), stored),
      summaries=jnp.zeros((L, batch, K, pages, rows, E), dtype),
      lengths=jnp.zeros((batch,), jnp.int32),
      page_size=page_size,
      dtype=jnp.dtype(dtype).name,
      page_score=page_score,
    )
  )


def split_layers(cache: PagedKVCache, repeat: int = 1) -> tuple:
  """The cache as one single-layer cache per layer, each row repeated `repeat` times (a prompt
  group prefilled once, decoded `repeat` times): the form `qwen3.decode_step` carries. Split once,
  before a decode loop; the stacked cache is dead after it."""
  rows = lambda x: jnp.repeat(x, repeat, axis=1) if repeat > 1 else x
  lengths = jnp.repeat(cache.lengths, repeat) if repeat > 1 else cache.lengths
  return tuple(
    constrain(
      cache.replace(
        k_stored=rows(cache.k_stored[i : i + 1]),
        v_stored=rows(cache.v_stored[i : i + 1]),
        summaries=rows(cache.summaries[i : i + 1]),
        lengths=lengths,
      )
    )
    for i in range(cache.k_stored.shape[0])
  )


def constrain(cache: PagedKVCache) -> PagedKVCache:
  """The cache kept on its logical axes (sharding.CACHE_AXES: rows over data x fsdp, KV heads over
  tensor) on the enclosing mesh, so a decode loop never gathers it to one device."""
  return cache.replace(
    **{
      name: sharding.constrain(getattr(cache, name), axes)
      for name, axes in sharding.CACHE_AXES.items()
    }
  )


class PageScore(NamedTuple):
  """One way to score pages: `summary` (keys [B, K, P, Z, E] -> [B, K, P, rows, E], what the cache
  keeps per page) and `query` (group-mean queries [B, K, T, E] -> [B, K, T, rows, E]); a page's
  score is the dot of the two over (rows, E)."""

  rows: int
  summary: Callable
  query: Callable


def _mean_summary(k_BKPZE):
  """The float32 mean of each page's Z slots, rounded to the keys' dtype."""
  return k_BKPZE.astype(jnp.float32).mean(axis=3, keepdims=True).astype(k_BKPZE.dtype)


def _bounds_summary(k_BKPZE):
  """Each channel's max and min over the page's Z slots (exact in any dtype)."""
  return jnp.stack([k_BKPZE.max(axis=3), k_BKPZE.min(axis=3)], axis=3)


def _bounds_query(qbar_BKTE):
  """q's positive part meets the max row, its negative part the min row, so the dot is Quest's
  sum_e max(q_e max_e, q_e min_e): an upper bound of q . k over the page's keys, as one matmul."""
  return jnp.stack([jnp.maximum(qbar_BKTE, 0), jnp.minimum(qbar_BKTE, 0)], axis=-2)


# SparseConfig.page_score -> its PageScore. "mean": the paper's mean-key centroid; "quest": the
# per-channel key bounds of Quest (Tang et al. 2024), scored with the group-mean query.
PAGE_SCORES = {
  "mean": PageScore(1, _mean_summary, lambda qbar_BKTE: qbar_BKTE[..., None, :]),
  "quest": PageScore(2, _bounds_summary, _bounds_query),
}


def page_score_fns(page_score: str) -> PageScore:
  if page_score not in PAGE_SCORES:
    raise ValueError(f"page_score must be one of {tuple(PAGE_SCORES)}, got {page_score!r}")
  return PAGE_SCORES[page_score]


def page_summaries(k_BKSE, page_size: int, page_score: str):
  """Page summaries [B, K, P, R, E] in the keys' dtype (a partial last page padded with zeros). The
  sampler's cache and the trainer's sparse teacher forcing both score these."""
  B, K, S, E = k_BKSE.shape
  k = jnp.pad(k_BKSE, ((0, 0), (0, 0), (0, -S % page_size), (0, 0)))
  return page_score_fns(page_score).summary(k.reshape(B, K, -1, page_size, E))


def page_scores(qbar_BKTE, summary_BKPRE, page_score: str):
  """Scores [B, K, T, P] of T query-head means against the page summaries: the one scoring the
  sampler and the trainer use. The query features are rounded to the summaries' dtype and the dot
  accumulates in float32, so bfloat16 summaries are read as stored (no float32 copy). (rows, E)
  merge into one contracted axis, a free reshape: with two contracted axes XLA CPU transposes
  the whole summary block before its dot, at every decode step (bench_decode.py)."""
  feature_BKTRE = page_score_fns(page_score).query(qbar_BKTE).astype(summary_BKPRE.dtype)
  flat = lambda x: x.reshape(*x.shape[:-2], -1)
  return jnp.einsum(
    "bktf,bkpf->bktp", flat(feature_BKTRE), flat(summary_BKPRE), preferred_element_type=jnp.float32
  )


def write_chunk(cache: PagedKVCache, layer, start, k_BCKE, v_BCKE, valid_BC) -> PagedKVCache:
  """Writes a chunk of C tokens (C and start whole pages; layer and start may be traced) into
  slots [start, start + C) of `layer`, and the summaries of its pages (invalid tokens written as
  zero)."""
  Z = cache.page_size
  stored = lambda x: jnp.where(valid_BC[:, :, None, None], x, 0).astype(cache.dtype)
  k_BKCE, v_BKCE = stored(k_BCKE).transpose(0, 2, 1, 3), stored(v_BCKE).transpose(0, 2, 1, 3)
  put = lambda buf, x, at: jax.lax.dynamic_update_slice(
    buf, x[None], (layer, 0, 0, at) + (0,) * (buf.ndim - 4)
  )
  return cache.replace(
    k_stored=put(cache.k_stored, to_stored(k_BKCE), start),
    v_stored=put(cache.v_stored, to_stored(v_BKCE), start),
    summaries=put(cache.summaries, page_summaries(k_BKCE, Z, cache.page_score), start // Z),
  )


def append(cache: PagedKVCache, layer, k_BKE, v_BKE, pos_B) -> PagedKVCache:
  """Writes one token per sequence at slot pos_B of `layer` and recomputes the summary of its page
  from the page's Z cached slots (B x K x Z x E read: nothing next to the attention's)."""
  B, Z = k_BKE.shape[0], cache.page_size
  b_B = jnp.arange(B)
  k_stored = cache.k_stored.at[layer, b_B, :, pos_B].set(to_stored(k_BKE.astype(cache.dtype)))
  slots_BZ = (pos_B // Z)[:, None] * Z + jnp.arange(Z)
  page_BZKE = from_stored(k_stored[layer, b_B[:, None], :, slots_BZ], cache.dtype)
  summary_BKRE = page_summaries(page_BZKE.transpose(0, 2, 1, 3), Z, cache.page_score)[:, :, 0]
  return cache.replace(
    k_stored=k_stored,
    v_stored=cache.v_stored.at[layer, b_B, :, pos_B].set(to_stored(v_BKE.astype(cache.dtype))),
    summaries=cache.summaries.at[layer, b_B, :, pos_B // Z].set(summary_BKRE),
  )
