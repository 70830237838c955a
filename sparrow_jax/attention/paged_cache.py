"""Paged KV cache with per-page centroid sums, for block top-k sparse decoding.

Layout, per layer (a list over layers, so each layer's buffers update in place under donation):
  k[i], v[i]        [B, K, S, E]   S = P * Z: page p of (sequence b, KV head k) is the contiguous block
                                   k[i][b, k, p*Z:(p+1)*Z]; a [B, K, P, Z, E] view is a free reshape.
  centroid_sum[i]   [B, K, P, E]   float32 sum of the keys written to each page. The centroid is
                                   sum / count with count = clip(length - p*Z, 0, Z), derived from
                                   `lengths`, so appending a token costs O(K*E).
  lengths           [B]            tokens cached per sequence (slot == position: rows are right-padded).
Why this layout: a selected page is one contiguous Z x E tile per (sequence, head), so a sparse read
is a gather of whole tiles (coalesced loads on GPU; on TPU 16 x 128 matches the (8, 128) vreg tiling
and one DMA per page), and the scoring pass reads only the P x E centroid block per head.
Sequences are independent (no shared page pool): RL rollouts have one static maximum length per batch.
"""
import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class PagedKVCache:
  k: list
  v: list
  centroid_sum: list
  lengths: jax.Array
  page_size: int = flax.struct.field(pytree_node=False, default=16)

  @property
  def max_len(self) -> int:
    return self.k[0].shape[2]

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
  zeros = lambda shape, dt: [jnp.zeros(shape, dt) for _ in range(L)]
  return PagedKVCache(
      k=zeros((batch, K, pages * page_size, E), dtype),
      v=zeros((batch, K, pages * page_size, E), dtype),
      centroid_sum=zeros((batch, K, pages, E), jnp.float32),
      lengths=jnp.zeros((batch,), jnp.int32),
      page_size=page_size)


def write_prefill(cache: PagedKVCache, layer: int, k_BTKE, v_BTKE, mask_BT) -> PagedKVCache:
  """Writes a right-padded prompt's keys/values into slots [0, T) and their page sums."""
  B, T, K, E = k_BTKE.shape
  Z = cache.page_size
  pad = -T % Z
  k_masked = jnp.where(mask_BT[:, :, None, None], k_BTKE, 0).astype(jnp.float32)
  k_masked = jnp.pad(k_masked, ((0, 0), (0, pad), (0, 0), (0, 0)))
  sums_BKPE = k_masked.reshape(B, (T + pad) // Z, Z, K, E).sum(axis=2).transpose(0, 2, 1, 3)
  k_new, v_new, c_new = list(cache.k), list(cache.v), list(cache.centroid_sum)
  k_new[layer] = cache.k[layer].at[:, :, :T].set(k_BTKE.transpose(0, 2, 1, 3).astype(cache.k[layer].dtype))
  v_new[layer] = cache.v[layer].at[:, :, :T].set(v_BTKE.transpose(0, 2, 1, 3).astype(cache.v[layer].dtype))
  c_new[layer] = cache.centroid_sum[layer].at[:, :, :sums_BKPE.shape[2]].set(sums_BKPE)
  return cache.replace(k=k_new, v=v_new, centroid_sum=c_new)


def append(cache: PagedKVCache, layer: int, k_BKE, v_BKE, pos_B) -> PagedKVCache:
  """Writes one token per sequence at slot pos_B and adds its key to that page's sum."""
  b = jnp.arange(k_BKE.shape[0])
  k_new, v_new, c_new = list(cache.k), list(cache.v), list(cache.centroid_sum)
  k_new[layer] = cache.k[layer].at[b, :, pos_B].set(k_BKE.astype(cache.k[layer].dtype))
  v_new[layer] = cache.v[layer].at[b, :, pos_B].set(v_BKE.astype(cache.v[layer].dtype))
  c_new[layer] = cache.centroid_sum[layer].at[b, :, pos_B // cache.page_size].add(
      k_BKE.astype(jnp.float32))
  return cache.replace(k=k_new, v=v_new, centroid_sum=c_new)


def centroids(centroid_sum_BKPE, lengths_B, page_size: int):
  """Mean key per page (zero for empty pages)."""
  P = centroid_sum_BKPE.shape[2]
  count_BP = jnp.clip(lengths_B[:, None] - jnp.arange(P)[None] * page_size, 0, page_size)
  return centroid_sum_BKPE / jnp.maximum(count_BP, 1)[:, None, :, None]
