"""Paged KV cache with per-page mean keys (centroids), for block top-k sparse decoding.

Layout, stacked over layers (prefill scans its layers and indexes the cache with the layer; decoding
splits it into one single-layer cache per layer, `split_layers`):
  k_stored, v_stored [L, B, K, S, E]  S = P * Z: page p of (layer, sequence b, KV head k) is the
                                   contiguous block k[l, b, k, p*Z:(p+1)*Z]; a [..., P, Z, E] view is
                                   a free reshape. Keys and values of `dtype` (the model's: bfloat16
                                   at scale), read through `keys(layer)`, `values(layer)`. 2-byte
                                   floats are stored as uint16 bits: XLA CPU runs every bfloat16
                                   update of a buffer in float32, converting the whole cache there
                                   and back, 3x the KV in temporaries (experiments/memory_report.py),
                                   while integer writes stay in place on every backend. float32 is
                                   stored as is: its updates are in place, and XLA CPU copied a
                                   whole layer's cache at each decode step to read uint32 bits as
                                   float32 (the tiny default's sparse decode step: 10.6 -> 7.6 ms
                                   without that copy and the stacked-layer slice; README).
  centroids       [L, B, K, P, E]  mean key of each page, in the cache dtype (bfloat16 at scale: the
                                   scoring pass reads P x E of it per head and step, as much as a
                                   2K-token sparse read at 32K in float32, half that in bfloat16).
                                   Written whenever a token lands in a page, as the float32 mean of
                                   the page's Z cached slots (unwritten slots are zero) rounded to
                                   the cache dtype: final once the page is complete, and a partial
                                   page is never scored (it is always one of the `local_pages`).
  lengths         [B]              tokens cached per sequence (slot == position: rows are right-padded).
Why this layout: a selected page is one contiguous Z x E tile per (sequence, head), so a sparse read
is a gather of whole tiles (coalesced loads on GPU; on TPU 16 x 128 matches the (8, 128) vreg tiling
and one DMA per page), and the scoring pass reads only the P x E centroid block per head.
Why means of the cached slots: the trainer scores pages with the same means of the same keys in
the same dtype (`page_centroids`, `page_scores`), so the sampler picks the pages the trainer
picks; a running float32 sum would cost twice the bytes and a bfloat16 one would round sixteen
additions per page.
Sequences are independent (no shared page pool): RL rollouts have one static maximum length per batch.
"""
import flax.struct
import jax
import jax.numpy as jnp

from sparrow_jax.model import sharding


_STORED = {2: jnp.uint16}  # by itemsize; other dtypes are stored as they are


def to_stored(x):
  """x in its storage form: a free bitcast to uint16 for 2-byte floats, x itself otherwise
  (`from_stored` undoes it)."""
  stored = _STORED.get(jnp.dtype(x.dtype).itemsize)
  return x if stored is None else jax.lax.bitcast_convert_type(x, stored)


def from_stored(x, dtype):
  return x if x.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(x, jnp.dtype(dtype))


@flax.struct.dataclass
class PagedKVCache:
  k_stored: jax.Array
  v_stored: jax.Array
  centroids: jax.Array
  lengths: jax.Array
  page_size: int = flax.struct.field(pytree_node=False, default=16)
  dtype: str = flax.struct.field(pytree_node=False, default="float32")

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


def check_page_size(page_size) -> None:
  if not isinstance(page_size, int) or page_size <= 0 or page_size & (page_size - 1):
    raise ValueError(f"page_size must be a positive power of two, got {page_size!r}")


def init_cache(cfg, batch: int, max_len: int, page_size: int = 16, dtype=jnp.float32) -> PagedKVCache:
  """An empty cache holding at least max_len tokens (rounded up to whole pages)."""
  check_page_size(page_size)
  pages = -(-max_len // page_size)
  K, E, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
  stored = _STORED.get(jnp.dtype(dtype).itemsize, dtype)
  return constrain(PagedKVCache(
      k_stored=jnp.zeros((L, batch, K, pages * page_size, E), stored),
      v_stored=jnp.zeros((L, batch, K, pages * page_size, E), stored),
      centroids=jnp.zeros((L, batch, K, pages, E), dtype),
      lengths=jnp.zeros((batch,), jnp.int32),
      page_size=page_size, dtype=jnp.dtype(dtype).name))


def split_layers(cache: PagedKVCache, repeat: int = 1) -> tuple:
  """The cache as one single-layer cache per layer, each row repeated `repeat` times (a prompt
  group prefilled once, decoded `repeat` times): the form `qwen3.decode_step` carries. Split once,
  before a decode loop; the stacked cache is dead after it."""
  rows = lambda x: jnp.repeat(x, repeat, axis=1) if repeat > 1 else x
  lengths = jnp.repeat(cache.lengths, repeat) if repeat > 1 else cache.lengths
  return tuple(constrain(cache.replace(k_stored=rows(cache.k_stored[i:i + 1]),
                                       v_stored=rows(cache.v_stored[i:i + 1]),
                                       centroids=rows(cache.centroids[i:i + 1]), lengths=lengths))
               for i in range(cache.k_stored.shape[0]))


def constrain(cache: PagedKVCache) -> PagedKVCache:
  """The cache kept on its logical axes (sharding.CACHE_AXES: rows over data x fsdp, KV heads over
  tensor) on the enclosing mesh, so a decode loop never gathers it to one device."""
  return cache.replace(**{name: sharding.constrain(getattr(cache, name), axes)
                          for name, axes in sharding.CACHE_AXES.items()})


def page_centroids(k_BKSE, page_size: int):
  """Mean key per page [B, K, P, E] in the keys' dtype: the float32 mean of each page's Z slots (a
  partial last page padded with zeros), rounded. The sampler's cache and the trainer's sparse
  teacher forcing both score these."""
  B, K, S, E = k_BKSE.shape
  k = jnp.pad(k_BKSE.astype(jnp.float32), ((0, 0), (0, 0), (0, -S % page_size), (0, 0)))
  return k.reshape(B, K, -1, page_size, E).mean(axis=3).astype(k_BKSE.dtype)


def page_scores(qbar_BKXE, centroid_BKPE):
  """Scores [B, K, X, P] of X query-head means against the page centroids: the one scoring the
  sampler and the trainer use. The means are rounded to the centroids' dtype and the dot
  accumulates in float32, so bfloat16 centroids are read as stored (no float32 copy)."""
  return jnp.einsum("bkxe,bkpe->bkxp", qbar_BKXE.astype(centroid_BKPE.dtype), centroid_BKPE,
                    preferred_element_type=jnp.float32)


def write_chunk(cache: PagedKVCache, layer, start, k_BCKE, v_BCKE, valid_BC) -> PagedKVCache:
  """Writes a chunk of C tokens (C and start whole pages; layer and start may be traced) into
  slots [start, start + C) of `layer`, and the centroids of its pages (invalid tokens written as
  zero)."""
  Z = cache.page_size
  stored = lambda x: jnp.where(valid_BC[:, :, None, None], x, 0).astype(cache.dtype)
  k_BKCE, v_BKCE = stored(k_BCKE).transpose(0, 2, 1, 3), stored(v_BCKE).transpose(0, 2, 1, 3)
  put = lambda buf, x, at: jax.lax.dynamic_update_slice(buf, x[None], (layer, 0, 0, at, 0))
  return cache.replace(k_stored=put(cache.k_stored, to_stored(k_BKCE), start),
                       v_stored=put(cache.v_stored, to_stored(v_BKCE), start),
                       centroids=put(cache.centroids, page_centroids(k_BKCE, Z), start // Z))


def append(cache: PagedKVCache, layer, k_BKE, v_BKE, pos_B) -> PagedKVCache:
  """Writes one token per sequence at slot pos_B of `layer` and recomputes the centroid of its page
  from the page's Z cached slots (B x K x Z x E read: nothing next to the attention's)."""
  B, Z = k_BKE.shape[0], cache.page_size
  b_B = jnp.arange(B)
  k_stored = cache.k_stored.at[layer, b_B, :, pos_B].set(to_stored(k_BKE.astype(cache.dtype)))
  slots_BZ = (pos_B // Z)[:, None] * Z + jnp.arange(Z)
  page_BZKE = from_stored(k_stored[layer, b_B[:, None], :, slots_BZ], cache.dtype)
  centroid_BKE = page_centroids(page_BZKE.transpose(0, 2, 1, 3), Z)[:, :, 0]
  return cache.replace(
      k_stored=k_stored,
      v_stored=cache.v_stored.at[layer, b_B, :, pos_B].set(to_stored(v_BKE.astype(cache.dtype))),
      centroids=cache.centroids.at[layer, b_B, :, pos_B // Z].set(centroid_BKE))
