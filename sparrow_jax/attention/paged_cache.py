"""Paged KV cache with per-page centroid sums, for block top-k sparse decoding.

Layout, stacked over layers (the model scans its layers and indexes the cache with the layer):
  k_bits, v_bits  [L, B, K, S, E]  S = P * Z: page p of (layer, sequence b, KV head k) is the
                                   contiguous block k[l, b, k, p*Z:(p+1)*Z]; a [..., P, Z, E] view is
                                   a free reshape. Keys and values of `dtype` (the model's: bfloat16
                                   at scale) stored as unsigned integers of the same width and read
                                   through a free bitcast (`keys(layer)`, `values(layer)`): XLA CPU
                                   runs every bfloat16 update of a buffer in float32, converting
                                   the whole cache there and back, 3x the KV in temporaries
                                   (experiments/memory_report.py); integer writes stay in place on
                                   every backend.
  centroid_sum    [L, B, K, P, E]  float32 sum of the keys written to each page. The centroid is
                                   sum / count with count = clip(length - p*Z, 0, Z), derived from
                                   `lengths`, so appending a token costs O(K*E).
  lengths         [B]              tokens cached per sequence (slot == position: rows are right-padded).
Why this layout: a selected page is one contiguous Z x E tile per (sequence, head), so a sparse read
is a gather of whole tiles (coalesced loads on GPU; on TPU 16 x 128 matches the (8, 128) vreg tiling
and one DMA per page), and the scoring pass reads only the P x E centroid block per head.
Why float32 sums: the trainer scores pages with float32 means of the same keys, and the sampler must
pick the pages it picks; the sums are 1/Z of the keys, so float32 costs 2/Z = 1/8 of the K cache
(1/16 of K + V) where bfloat16 would cost half that and round sixteen additions per page.
Sequences are independent (no shared page pool): RL rollouts have one static maximum length per batch.
"""
import flax.struct
import jax
import jax.numpy as jnp

from sparrow_jax.model import sharding


_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def to_bits(x):
  """x as unsigned integers of its width (a free bitcast; `from_bits` undoes it)."""
  return jax.lax.bitcast_convert_type(x, _BITS[jnp.dtype(x.dtype).itemsize])


def from_bits(bits, dtype):
  return jax.lax.bitcast_convert_type(bits, jnp.dtype(dtype))


@flax.struct.dataclass
class PagedKVCache:
  k_bits: jax.Array
  v_bits: jax.Array
  centroid_sum: jax.Array
  lengths: jax.Array
  page_size: int = flax.struct.field(pytree_node=False, default=16)
  dtype: str = flax.struct.field(pytree_node=False, default="float32")

  def keys(self, layer):
    """Keys [B, K, S, E] of `layer` (traced is fine) in the cache dtype."""
    return from_bits(self.k_bits[layer], self.dtype)

  def values(self, layer):
    return from_bits(self.v_bits[layer], self.dtype)

  @property
  def max_len(self) -> int:
    return self.k_bits.shape[3]

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
  bits = _BITS[jnp.dtype(dtype).itemsize]
  return constrain(PagedKVCache(
      k_bits=jnp.zeros((L, batch, K, pages * page_size, E), bits),
      v_bits=jnp.zeros((L, batch, K, pages * page_size, E), bits),
      centroid_sum=jnp.zeros((L, batch, K, pages, E), jnp.float32),
      lengths=jnp.zeros((batch,), jnp.int32),
      page_size=page_size, dtype=jnp.dtype(dtype).name))


def constrain(cache: PagedKVCache) -> PagedKVCache:
  """The cache kept on its logical axes (sharding.CACHE_AXES: rows over data x fsdp, KV heads over
  tensor) on the enclosing mesh, so a decode loop never gathers it to one device."""
  return cache.replace(**{name: sharding.constrain(getattr(cache, name), axes)
                          for name, axes in sharding.CACHE_AXES.items()})


def write_chunk(cache: PagedKVCache, layer, start, k_BCKE, v_BCKE, valid_BC) -> PagedKVCache:
  """Writes a chunk of C tokens (C and start whole pages; layer and start may be traced) into
  slots [start, start + C) of `layer`, and the sums of its pages (invalid tokens written as zero)."""
  B, C, K, E = k_BCKE.shape
  Z = cache.page_size
  k_BCKE = jnp.where(valid_BC[:, :, None, None], k_BCKE, 0)
  v_BCKE = jnp.where(valid_BC[:, :, None, None], v_BCKE, 0)
  sums_BKPE = k_BCKE.astype(jnp.float32).reshape(B, C // Z, Z, K, E).sum(axis=2).transpose(0, 2, 1, 3)
  put = lambda buf, x, at: jax.lax.dynamic_update_slice(buf, x[None], (layer, 0, 0, at, 0))
  bits = lambda x: to_bits(x.astype(cache.dtype).transpose(0, 2, 1, 3))
  return cache.replace(k_bits=put(cache.k_bits, bits(k_BCKE), start),
                       v_bits=put(cache.v_bits, bits(v_BCKE), start),
                       centroid_sum=put(cache.centroid_sum, sums_BKPE, start // Z))


def append(cache: PagedKVCache, layer, k_BKE, v_BKE, pos_B) -> PagedKVCache:
  """Writes one token per sequence at slot pos_B of `layer` and adds its key to that page's sum."""
  b = jnp.arange(k_BKE.shape[0])
  bits = lambda x: to_bits(x.astype(cache.dtype))
  return cache.replace(
      k_bits=cache.k_bits.at[layer, b, :, pos_B].set(bits(k_BKE)),
      v_bits=cache.v_bits.at[layer, b, :, pos_B].set(bits(v_BKE)),
      centroid_sum=cache.centroid_sum.at[layer, b, :, pos_B // cache.page_size].add(
          k_BKE.astype(jnp.float32)))


def centroids(centroid_sum_BKPE, lengths_B, page_size: int):
  """Mean key per page (zero for empty pages)."""
  P = centroid_sum_BKPE.shape[2]
  count_BP = jnp.clip(lengths_B[:, None] - jnp.arange(P)[None] * page_size, 0, page_size)
  return centroid_sum_BKPE / jnp.maximum(count_BP, 1)[:, None, :, None]
