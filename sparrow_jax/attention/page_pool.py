"""A pool of KV pages per device, shared by the running rows of a rollout (continuous batching):
rows take pages as they grow and give them back when they end, and a GRPO group's prompt pages
are shared by its rows. Which page belongs to whom is the host scheduler's business
(rollout/scheduler.py); on the device a row is its page table (logical page -> physical page of its
device's pool) and its length.

Layout, one array per layer (decoding runs its layers unrolled, each on its own buffer, as with
the per-row cache, `paged_cache.split_layers`):
  k_stored, v_stored  [Y, K, X, Z, E]  Y row shards (the devices rows are split over, data x fsdp;
                                       1 without a mesh), each with its own X pages per KV head
                                       (KV heads split over tensor). Page x of head k of a shard is
                                       the Z x E tile [y, k, x]: the kernels read a shard as a flat
                                       page array [K * X, Z, E] (a free reshape), page id k * X + x.
                                       Stored as `paged_cache.stored_dtype`.
  summaries           [Y, K, X, R, E]  each page's summary (`paged_cache.page_summaries`), what
                                       page selection scores; recomputed whenever a token lands.
Slots (the rows decoding together) are [Y * slots] arrays split over the same devices, so every
read and write of a slot stays on its device: `per_device` runs them under `shard_map`.
Physical page 0 of every shard is the trash page: slots that run no row write there and nothing
reads it, so a decode step over every slot needs no scatter mask.
"""

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
import numpy as np

from sparrow_jax import sharding
from sparrow_jax.attention import paged_cache

TRASH_PAGE = 0
POOL_AXES = ("batch", "kv_heads", "pages", "cache_len", "head_dim")
SUMMARY_AXES = ("batch", "kv_heads", "pages", "summary_rows", "head_dim")


@flax.struct.dataclass
class PagePool:
  k_stored: tuple  # per layer [Y, K, X, Z, E]
  v_stored: tuple
  summaries: tuple  # per layer [Y, K, X, R, E]
  page_size: int = flax.struct.field(pytree_node=False, default=16)
  dtype: str = flax.struct.field(pytree_node=False, default="float32")
  page_score: str = flax.struct.field(pytree_node=False, default="mean")

  @property
  def num_pages(self) -> int:
    return self.k_stored[0].shape[2]

  @property
  def shards(self) -> int:
    return self.k_stored[0].shape[0]


def row_shards() -> int:
  """Devices the rows are split over on the enclosing mesh (data x fsdp); 1 without one."""
  mesh = jax.sharding.get_abstract_mesh()
  return 1 if mesh.empty else int(np.prod([mesh.shape[a] for a in sharding.BATCH]))


def page_bytes(cfg, page_size: int, dtype, page_score: str) -> int:
  """Bytes of one physical page over every layer: keys, values and summary."""
  rows = paged_cache.page_score_fns(page_score).rows
  K, E, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
  return L * K * E * (2 * page_size + rows) * jnp.dtype(dtype).itemsize


def init_pool(
  cfg, num_pages: int, page_size: int = 16, dtype=jnp.float32, page_score: str = "mean"
) -> PagePool:
  """An empty pool of num_pages pages (page TRASH_PAGE included) per row shard of the enclosing
  mesh, created on its devices (nothing of its size on the host)."""
  paged_cache.check_page_size(page_size)
  if num_pages < 2:
    raise ValueError(f"a page pool needs at least 2 pages (one is the trash page), got {num_pages}")
  rows = paged_cache.page_score_fns(page_score).rows
  Y, K, E, L = row_shards(), cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
  stored = paged_cache.stored_dtype(dtype)
  kv_shape, summary_shape = (Y, K, num_pages, page_size, E), (Y, K, num_pages, rows, E)

  def zeros():
    kv = lambda: tuple(jnp.zeros(kv_shape, stored) for _ in range(L))
    return PagePool(
      k_stored=kv(),
      v_stored=kv(),
      summaries=tuple(jnp.zeros(summary_shape, dtype) for _ in range(L)),
      page_size=page_size,
      dtype=jnp.dtype(dtype).name,
      page_score=page_score,
    )

  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return zeros()
  on = lambda axes, shape: NamedSharding(mesh, sharding.spec(axes, shape, mesh))
  out = jax.eval_shape(zeros).replace(
    k_stored=(on(POOL_AXES, kv_shape),) * L,
    v_stored=(on(POOL_AXES, kv_shape),) * L,
    summaries=(on(SUMMARY_AXES, summary_shape),) * L,
  )
  return jax.jit(zeros, out_shardings=out)()


def per_device(fn, args, axes, out_axes):
  """fn(*args) on each device's share (shard_map on the enclosing mesh; a plain call without one):
  args[i] split along its logical axes axes[i] (the pool's leading Y axis is 1 per device), the
  outputs along out_axes (each (logical axes, shape)). Slots and pages never leave their device."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(*args)
  in_specs = tuple(sharding.spec(a, x.shape, mesh) for a, x in zip(axes, args))
  out_specs = tuple(sharding.spec(a, shape, mesh) for a, shape in out_axes)
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)(
    *args
  )


SLOT_AXES = ("batch",)


@flax.struct.dataclass
class PoolLayer:
  """One layer of the pool with the slots' page tables: what `qwen3.decode_step` carries per layer
  in place of a `paged_cache.PagedKVCache` (same `append_token`, `lengths`, `constrain`)."""

  k_stored: jax.Array  # [Y, K, X, Z, E]
  v_stored: jax.Array
  summaries: jax.Array  # [Y, K, X, R, E]
  page_table: jax.Array  # [B, P] physical page (of the slot's shard) of each logical page
  lengths: jax.Array  # [B] tokens cached per slot
  active: jax.Array  # [B] the slot runs a row (others write the trash page, read nothing)
  page_size: int = flax.struct.field(pytree_node=False, default=16)
  dtype: str = flax.struct.field(pytree_node=False, default="float32")
  page_score: str = flax.struct.field(pytree_node=False, default="mean")

  def append_token(self, k_BKE, v_BKE, pos_B) -> "PoolLayer":
    """Writes one token per running slot at position pos_B and recomputes its page's summary
    from the page's Z slots (as paged_cache.append does), each on its own device."""
    Z, dtype, score = self.page_size, self.dtype, self.page_score

    def local(k_stored, v_stored, summaries, page_table, active, k_BKE, v_BKE, pos_B):
      # Written through the flat page view the kernels read ([K * X, ...], `local_pages`): an
      # update indexed on the leading axis only lets XLA keep the pool's row-major layout (a
      # scatter with K as a window dimension made TPU relayout the whole pool around the loop).
      shape = k_stored.shape
      K, X = shape[1], shape[2]
      flat = lambda x: x.reshape(K * X, *x.shape[3:])
      page_B = jnp.where(
        active, jnp.take_along_axis(page_table, (pos_B // Z)[:, None], axis=1)[:, 0], TRASH_PAGE
      )
      id_BK = page_B[:, None] + (jnp.arange(K, dtype=page_B.dtype) * X)[None]
      at = (id_BK, (pos_B % Z)[:, None])
      put = lambda buf, x_BKE: buf.at[at].set(paged_cache.to_stored(x_BKE.astype(dtype)))
      k_flat = put(flat(k_stored), k_BKE)
      page_BKZE = paged_cache.from_stored(k_flat[id_BK], dtype)
      summary_BKRE = paged_cache.page_summaries(page_BKZE, Z, score)[:, :, 0]
      return (
        k_flat.reshape(shape),
        put(flat(v_stored), v_BKE).reshape(shape),
        flat(summaries).at[id_BK].set(summary_BKRE).reshape(summaries.shape),
      )

    pools = (self.k_stored, self.v_stored, self.summaries)
    pool_axes = (POOL_AXES, POOL_AXES, SUMMARY_AXES)
    k_stored, v_stored, summaries = per_device(
      local,
      pools + (self.page_table, self.active, k_BKE, v_BKE, pos_B),
      pool_axes + (SLOT_AXES, SLOT_AXES, ("batch", "kv_heads"), ("batch", "kv_heads"), SLOT_AXES),
      tuple(zip(pool_axes, (x.shape for x in pools))),
    )
    return self.replace(k_stored=k_stored, v_stored=v_stored, summaries=summaries)

  def write_span(self, k_BCKE, v_BCKE, pos_B, keep_B) -> "PoolLayer":
    """Writes C tokens per running slot at positions pos_B .. pos_B + C - 1, the first keep_B of
    k_BCKE / v_BCKE and zeros for the rest (what a slot that never cached them holds), and
    recomputes the summaries of the pages they touch from their Z slots: after a speculative round
    the cache holds exactly what decoding the kept tokens one by one would have left (a quest
    max/min cannot be un-maxed, so summaries are rebuilt, not patched). Positions past the slot's
    page table go to the trash page."""
    Z, dtype, score = self.page_size, self.dtype, self.page_score
    C = k_BCKE.shape[1]

    def local(k_stored, v_stored, summaries, page_table, active, k_BCKE, v_BCKE, pos_B, keep_B):
      shape = k_stored.shape
      K, X, PR = shape[1], shape[2], page_table.shape[1]
      flat = lambda x: x.reshape(K * X, *x.shape[3:])
      pos_BC = pos_B[:, None] + jnp.arange(C, dtype=pos_B.dtype)
      logical_BC = pos_BC // Z
      page_BC = jnp.take_along_axis(page_table, jnp.minimum(logical_BC, PR - 1), axis=1)
      page_BC = jnp.where(active[:, None] & (logical_BC < PR), page_BC, TRASH_PAGE)
      id_BCK = page_BC[:, :, None] + (jnp.arange(K, dtype=page_BC.dtype) * X)[None, None]
      at = (id_BCK, (pos_BC % Z)[:, :, None])
      kept_BC11 = (jnp.arange(C)[None] < keep_B[:, None])[:, :, None, None]
      put = lambda buf, x_BCKE: buf.at[at].set(
        paged_cache.to_stored(jnp.where(kept_BC11, x_BCKE, 0).astype(dtype))
      )
      k_flat = put(flat(k_stored), k_BCKE)
      pages_BCKZE = paged_cache.from_stored(k_flat[id_BCK], dtype)
      B = pages_BCKZE.shape[0]
      summary = paged_cache.page_summaries(pages_BCKZE.reshape(B * C, K, Z, -1), Z, score).reshape(
        B, C, K, *summaries.shape[3:]
      )
      return (
        k_flat.reshape(shape),
        put(flat(v_stored), v_BCKE).reshape(shape),
        flat(summaries).at[id_BCK].set(summary).reshape(summaries.shape),
      )

    pools = (self.k_stored, self.v_stored, self.summaries)
    pool_axes = (POOL_AXES, POOL_AXES, SUMMARY_AXES)
    kv_axes = ("batch", "length", "kv_heads")
    k_stored, v_stored, summaries = per_device(
      local,
      pools + (self.page_table, self.active, k_BCKE, v_BCKE, pos_B, keep_B),
      pool_axes + (SLOT_AXES, SLOT_AXES, kv_axes, kv_axes, SLOT_AXES, SLOT_AXES),
      tuple(zip(pool_axes, (x.shape for x in pools))),
    )
    return self.replace(k_stored=k_stored, v_stored=v_stored, summaries=summaries)

  def constrain(self) -> "PoolLayer":
    return self  # per_device keeps every array on its shards


def local_pages(k_stored, v_stored, dtype):
  """One device's pool shard ([1, K, X, Z, E]) as flat page arrays [K * X, Z, E] in the cache
  dtype (free reshapes)."""
  flat = lambda x: paged_cache.from_stored(x.reshape(-1, *x.shape[3:]), dtype)
  return flat(k_stored), flat(v_stored)


def layer_views(pool: PagePool, page_table_BP, lengths_B, active_B) -> tuple:
  """The pool as one PoolLayer per layer, sharing the slots' page tables."""
  return tuple(
    PoolLayer(
      k,
      v,
      s,
      page_table_BP,
      lengths_B,
      active_B,
      page_size=pool.page_size,
      dtype=pool.dtype,
      page_score=pool.page_score,
    )
    for k, v, s in zip(pool.k_stored, pool.v_stored, pool.summaries)
  )


def from_layers(pool: PagePool, layers) -> PagePool:
  return pool.replace(
    k_stored=tuple(c.k_stored for c in layers),
    v_stored=tuple(c.v_stored for c in layers),
    summaries=tuple(c.summaries for c in layers),
  )


def _pool_arrays(pool: PagePool):
  """The pool's arrays, flat (keys, values, summaries per layer), with their logical axes."""
  arrays = pool.k_stored + pool.v_stored + pool.summaries
  L = len(pool.k_stored)
  return arrays, (POOL_AXES,) * (2 * L) + (SUMMARY_AXES,) * L


def _from_arrays(pool: PagePool, arrays) -> PagePool:
  L = len(pool.k_stored)
  return pool.replace(
    k_stored=tuple(arrays[:L]), v_stored=tuple(arrays[L : 2 * L]), summaries=tuple(arrays[2 * L :])
  )


def write_pages(pool: PagePool, cache: paged_cache.PagedKVCache, dest_BP) -> PagePool:
  """Copies every row of a prefilled per-row cache ([L, B, K, P * Z, E], its rows split over the
  devices like the pool's shards) into its shard's pool pages dest_BP (physical ids;
  TRASH_PAGE for pages not to keep): keys, values and summaries."""
  Z, L = pool.page_size, len(pool.k_stored)
  arrays, axes = _pool_arrays(pool)

  def local(k_LBKSE, v_LBKSE, s_LBKPRE, dest_BP, *pools):
    as_pages = lambda x: x.reshape(*x.shape[:3], -1, Z, x.shape[-1])  # [L, B, K, P, Z, E]
    B, K = dest_BP.shape[0], k_LBKSE.shape[2]
    dest = jnp.broadcast_to(dest_BP[:, None], (B, K, dest_BP.shape[1]))
    head = jnp.broadcast_to(jnp.arange(K)[None, :, None], dest.shape)
    new = [as_pages(k_LBKSE), as_pages(v_LBKSE), s_LBKPRE]
    return tuple(p.at[0, head, dest].set(new[i // L][i % L]) for i, p in enumerate(pools))

  cache_axes = tuple(sharding.CACHE_AXES[n] for n in ("k_stored", "v_stored", "summaries"))
  out = per_device(
    local,
    (cache.k_stored, cache.v_stored, cache.summaries, dest_BP) + arrays,
    cache_axes + (("batch", "pages"),) + axes,
    tuple(zip(axes, (x.shape for x in arrays))),
  )
  return _from_arrays(pool, out)


def copy_pages(pool: PagePool, src_YN, dst_YN) -> PagePool:
  """Copies physical pages src_YN[y] onto dst_YN[y] in every shard y (pairs with dst TRASH_PAGE do
  nothing useful)."""
  arrays, axes = _pool_arrays(pool)

  def local(src_N, dst_N, *pools):
    return tuple(p.at[0, :, dst_N[0]].set(p[0, :, src_N[0]]) for p in pools)

  out = per_device(
    local,
    (src_YN, dst_YN) + arrays,
    (("batch", "pages"),) * 2 + axes,
    tuple(zip(axes, (x.shape for x in arrays))),
  )
  return _from_arrays(pool, out)
