"""A pool of KV pages shared by the running rows of a rollout (continuous batching): rows take pages
as they grow and give them back when they end, and a GRPO group's prompt pages are shared by its
rows. Which page belongs to whom is the host scheduler's business (rollout/engine.py); on the device
a row is its page table (logical page -> physical page) and its length.

Layout, one array per layer (decoding runs its layers unrolled, each on its own buffer, as with the
per-row cache, `paged_cache.split_layers`):
  k_stored, v_stored  [K, X, Z, E]  page x of KV head k is the Z x E tile [k, x]: the kernels read
                                    the pool as a flat page array [K * X, Z, E] (a free reshape),
                                    page id k * X + x. Stored as `paged_cache.stored_dtype`.
  summaries           [K, X, R, E]  each page's summary (`paged_cache.page_summaries`), what page
                                    selection scores; recomputed whenever a token lands in the page.
Physical page 0 is the trash page: slots that are not running write there and nothing reads it, so
a decode step over every slot needs no scatter mask.
"""
import flax.struct
import jax
import jax.numpy as jnp

from sparrow_jax.attention import paged_cache

TRASH_PAGE = 0


@flax.struct.dataclass
class PagePool:
  k_stored: tuple              # per layer [K, X, Z, E]
  v_stored: tuple
  summaries: tuple             # per layer [K, X, R, E]
  page_size: int = flax.struct.field(pytree_node=False, default=16)
  dtype: str = flax.struct.field(pytree_node=False, default="float32")
  page_score: str = flax.struct.field(pytree_node=False, default="mean")

  @property
  def num_pages(self) -> int:
    return self.k_stored[0].shape[1]


def page_bytes(cfg, page_size: int, dtype, page_score: str) -> int:
  """Bytes of one physical page over every layer: keys, values and summary."""
  rows = paged_cache.page_score_fns(page_score).rows
  K, E, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
  return L * K * E * (2 * page_size + rows) * jnp.dtype(dtype).itemsize


def init_pool(cfg, num_pages: int, page_size: int = 16, dtype=jnp.float32,
              page_score: str = "mean") -> PagePool:
  """An empty pool of num_pages pages (page TRASH_PAGE included)."""
  paged_cache.check_page_size(page_size)
  if num_pages < 2:
    raise ValueError(f"a page pool needs at least 2 pages (one is the trash page), got {num_pages}")
  rows = paged_cache.page_score_fns(page_score).rows
  K, E, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
  stored = paged_cache.stored_dtype(dtype)
  kv = lambda: tuple(jnp.zeros((K, num_pages, page_size, E), stored) for _ in range(L))
  return PagePool(k_stored=kv(), v_stored=kv(),
                  summaries=tuple(jnp.zeros((K, num_pages, rows, E), dtype) for _ in range(L)),
                  page_size=page_size, dtype=jnp.dtype(dtype).name, page_score=page_score)


@flax.struct.dataclass
class PoolLayer:
  """One layer of the pool with the slots' page tables: what `qwen3.decode_step` carries per layer
  in place of a `paged_cache.PagedKVCache` (same `append_token`, `lengths`, `constrain`)."""
  k_stored: jax.Array          # [K, X, Z, E]
  v_stored: jax.Array
  summaries: jax.Array         # [K, X, R, E]
  page_table: jax.Array        # [B, PR] physical page of each slot's logical page
  lengths: jax.Array           # [B] tokens cached per slot
  active: jax.Array            # [B] the slot runs a row (others write the trash page, read nothing)
  page_size: int = flax.struct.field(pytree_node=False, default=16)
  dtype: str = flax.struct.field(pytree_node=False, default="float32")
  page_score: str = flax.struct.field(pytree_node=False, default="mean")

  def pages(self):
    """Keys and values as flat page arrays [K * X, Z, E] in the cache dtype (free reshapes)."""
    flat = lambda x: paged_cache.from_stored(x.reshape(-1, *x.shape[2:]), self.dtype)
    return flat(self.k_stored), flat(self.v_stored)

  def append_token(self, k_BKE, v_BKE, pos_B) -> "PoolLayer":
    """Writes one token per running slot at position pos_B and recomputes its page's summary
    from the page's Z slots (as paged_cache.append does)."""
    Z = self.page_size
    page_B = jnp.where(self.active, jnp.take_along_axis(self.page_table, (pos_B // Z)[:, None],
                                                        axis=1)[:, 0], TRASH_PAGE)
    at = (slice(None), page_B, pos_B % Z)
    put = lambda buf, x_BKE: buf.at[at].set(paged_cache.to_stored(
        x_BKE.astype(self.dtype)).transpose(1, 0, 2))
    k_stored = put(self.k_stored, k_BKE)
    page_BKZE = paged_cache.from_stored(k_stored[:, page_B], self.dtype).transpose(1, 0, 2, 3)
    summary_BKRE = paged_cache.page_summaries(page_BKZE, Z, self.page_score)[:, :, 0]
    return self.replace(k_stored=k_stored, v_stored=put(self.v_stored, v_BKE),
                        summaries=self.summaries.at[:, page_B].set(summary_BKRE.transpose(1, 0, 2, 3)))

  def constrain(self) -> "PoolLayer":
    return self  # one device's pool: nothing to place


def layer_views(pool: PagePool, page_table_BN, lengths_B, active_B) -> tuple:
  """The pool as one PoolLayer per layer, sharing the slots' page tables."""
  return tuple(PoolLayer(k, v, s, page_table_BN, lengths_B, active_B, page_size=pool.page_size,
                         dtype=pool.dtype, page_score=pool.page_score)
               for k, v, s in zip(pool.k_stored, pool.v_stored, pool.summaries))


def from_layers(pool: PagePool, layers) -> PagePool:
  return pool.replace(k_stored=tuple(c.k_stored for c in layers),
                      v_stored=tuple(c.v_stored for c in layers),
                      summaries=tuple(c.summaries for c in layers))


def write_pages(pool: PagePool, cache: paged_cache.PagedKVCache, row: int, dest_P) -> PagePool:
  """Copies row `row` of a prefilled per-row cache ([L, B, K, P * Z, E]) into pool pages dest_P
  (physical ids; TRASH_PAGE for pages not to keep), keys, values and summaries."""
  Z = pool.page_size
  as_pages = lambda x: x[:, row].reshape(x.shape[0], x.shape[2], -1, Z, x.shape[-1])
  k_LKPZE, v_LKPZE = as_pages(cache.k_stored), as_pages(cache.v_stored)
  s_LKPRE = cache.summaries[:, row]
  return pool.replace(
      k_stored=tuple(p.at[:, dest_P].set(k) for p, k in zip(pool.k_stored, k_LKPZE)),
      v_stored=tuple(p.at[:, dest_P].set(v) for p, v in zip(pool.v_stored, v_LKPZE)),
      summaries=tuple(p.at[:, dest_P].set(s) for p, s in zip(pool.summaries, s_LKPRE)))


def copy_pages(pool: PagePool, src_N, dst_N) -> PagePool:
  """Copies physical pages src_N onto dst_N (pairs with dst TRASH_PAGE do nothing useful)."""
  copy = lambda x: x.at[:, dst_N].set(x[:, src_N])
  return pool.replace(k_stored=tuple(map(copy, pool.k_stored)),
                      v_stored=tuple(map(copy, pool.v_stored)),
                      summaries=tuple(map(copy, pool.summaries)))
