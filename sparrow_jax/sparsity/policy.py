"""The sparsity policy in one place: which layers stay dense, which pages the others read, and
which implementation reads them. The model (model/qwen3.py) knows Qwen3 only; this module builds
the attention functions it takes, for teacher forcing (`forward`: trainer, calibration) and for
decoding (`decode_attention_fn`: the sampler), from the same `select` rule, so both read the same
pages.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from kernels import sparse_decode, sparse_decode_tpu
from sparrow_jax import sharding
from sparrow_jax.attention import blockwise, page_pool, reference, select
from sparrow_jax.model import qwen3


def teacher_forced_attention_fn(
  sparse: select.SparseConfig, schedule, prompt_len_B, context_BT=None
):
  """An `attention_fn` for qwen3.forward that restricts each query to the pages the sparse sampler
  read at that step, blockwise (the pages are chosen per query block by the same `keep_pages` rule
  the sampler's `decode_pages` follows, on pages scored by `sparse.page_score`). Prompt positions
  were prefilled densely, and so were a multi-turn row's tool observations (`context_BT`, [B, T]
  bool; None: none); layers below `dense_layers` stay dense: their budget is every page."""
  select_fn = functools.partial(select.keep_pages, sparse=sparse)

  def attention(layer, q_BTKGE, k_BTKE, v_BTKE, mask_BT):
    T = q_BTKGE.shape[1]
    pos_T = jnp.arange(T)
    every_page = -(-T // sparse.page_size)
    dense_BT = (layer < sparse.dense_layers) | (pos_T[None] < prompt_len_B[:, None])
    if context_BT is not None:
      dense_BT = dense_BT | context_BT
    budget_BT = jnp.where(dense_BT, every_page, schedule.budget_pages(pos_T + 1)[None])
    return blockwise.attention(
      q_BTKGE,
      k_BTKE.transpose(0, 2, 1, 3),
      v_BTKE.transpose(0, 2, 1, 3),
      mask_BT,
      budget_BT=budget_BT,
      select_fn=select_fn,
      page_size=sparse.page_size,
      page_score=sparse.page_score,
    )

  return attention


def forward(
  params,
  tokens_BT,
  cfg,
  *,
  sparse=None,
  schedule=None,
  prompt_len_B=None,
  context_BT=None,
  **kwargs,
):
  """Teacher-forced logits_BTV (float32), dense or sparse (`sj.forward`).

  With `sparse` (a SparseConfig) and `schedule` (anything with `budget_pages(cached_len)`: a
  KVSchedule, or a schedule.BudgetTable under jit), each query position attends to exactly the pages
  the sparse sampler read at that step (dense before `prompt_len_B`, and at `context_BT`'s
  positions, a multi-turn row's observations: prefills are dense). Sparse teacher forcing needs
  right-padded rows (cache slot == position), as the sampler makes. Other keyword arguments go to
  `qwen3.forward` (mask_BT, positions_BT, lora, ...).
  """
  if sparse is not None:
    if schedule is None or prompt_len_B is None:
      raise ValueError(
        "forward(sparse=...) needs `schedule` and `prompt_len_B` (where decoding began)"
      )
    kwargs["attention_fn"] = teacher_forced_attention_fn(sparse, schedule, prompt_len_B, context_BT)
  return qwen3.forward(params, tokens_BT, cfg, **kwargs)


DENSE_PREFIXES = (
  1,
  2,
  3,
)  # eighths of the cache the XLA dense decode may read instead of all of it


def _sparse_fn(impl, page_size, scale, interpret=None):
  """One implementation's sparse decode attention, a function of its six arrays. interpret=None:
  the kernels decide by the tracing backend (interpret mode off their own hardware)."""
  if impl == "xla":
    return functools.partial(reference.sparse_decode_attention, page_size=page_size, scale=scale)
  kernel = sparse_decode if impl == "pallas" else sparse_decode_tpu
  return functools.partial(
    kernel.sparse_decode_attention, page_size=page_size, scale=scale, interpret=interpret
  )


def _dense_fn(impl, page_size, interpret=None):
  """One implementation's length-aware dense decode attention, a function of (q, k, v, lengths):
  the kernels with every valid page selected (blocks past a row's last page are never loaded), XLA
  over a static cache prefix that holds the longest row."""
  if impl == "xla":
    return _dense_xla
  sparse = _sparse_fn(impl, page_size, None, interpret)

  def every_valid_page(q_BKGE, k_cache_BKSE, v_cache_BKSE, lengths_B):
    B, K, S, _ = k_cache_BKSE.shape
    P = S // page_size
    page_idx_BKP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, K, P))
    n_valid_BK = jnp.broadcast_to((-(-lengths_B // page_size)).astype(jnp.int32)[:, None], (B, K))
    return sparse(q_BKGE, k_cache_BKSE, v_cache_BKSE, page_idx_BKP, n_valid_BK, lengths_B)

  return every_valid_page


def _dense_xla(q_BKGE, k_cache_BKSE, v_cache_BKSE, lengths_B):
  """The whole-cache einsum over the smallest static cache prefix (DENSE_PREFIXES eighths, or the
  whole cache) that holds the longest row (a lax.switch: one branch runs). A prefix is copied
  before its dot, so it pays only up to ~3/8 (on CPU a 1/2 prefix is as slow as the whole cache),
  and a blockwise walk over cache blocks is slower than the whole cache at full length (every block
  copied; docs/kernels.md has the measurements)."""
  S = k_cache_BKSE.shape[2]
  sizes = sorted({-(-S * i // 8) for i in DENSE_PREFIXES} | {S})
  prefix = lambda size: (
    lambda q, k, v, lengths: reference.dense_decode_attention(
      q, k[:, :, :size], v[:, :, :size], lengths
    )
  )
  bucket = jnp.searchsorted(jnp.asarray(sizes), jnp.max(lengths_B))  # first size >= longest row
  return jax.lax.switch(
    jnp.minimum(bucket, len(sizes) - 1),
    [prefix(s) for s in sizes],
    q_BKGE,
    k_cache_BKSE,
    v_cache_BKSE,
    lengths_B,
  )


def _dispatch(impl, make):
  """The function make(impl, interpret) builds for `impl`. "auto" is decided when the function
  is lowered, for the platform it is lowered for (`lax.platform_dependent`), not by the machine
  that traces it: a module exported for "cuda" or "tpu" from a CPU host has that platform's
  kernel."""
  if impl not in reference.IMPLS:
    raise ValueError(f"impl must be one of {reference.IMPLS}, got {impl!r}")
  if impl != "auto":
    return make(impl, None)

  def auto(q_BKGE, *args):
    # Every branch is traced wherever this runs: a head size the Triton dot cannot take (tiny
    # test models) goes to XLA on CUDA too.
    gpu = "pallas" if sparse_decode.supports(q_BKGE.shape[-1]) else "xla"
    cuda, tpu, default = (make(i, False) for i in (gpu, "pallas_tpu", "xla"))
    return jax.lax.platform_dependent(q_BKGE, *args, cuda=cuda, tpu=tpu, default=default)

  return auto


def decode_attention(
  q_BKGE,
  k_cache_BKSE,
  v_cache_BKSE,
  page_idx_BKN,
  n_valid_BK,
  lengths_B,
  *,
  page_size,
  scale=None,
  impl="auto",
):
  """Sparse decode attention by `impl`: "xla" (the jnp reference), "pallas" (kernels/sparse_decode,
  Triton), "pallas_tpu" (kernels/sparse_decode_tpu, Mosaic) or "auto" (the GPU kernel on CUDA, the
  TPU kernel on TPU, XLA elsewhere)."""
  fn = _dispatch(impl, lambda i, interpret: _sparse_fn(i, page_size, scale, interpret))
  return _per_shard(fn, q_BKGE, k_cache_BKSE, v_cache_BKSE, page_idx_BKN, n_valid_BK, lengths_B)


def dense_decode_attention(
  q_BKGE, k_cache_BKSE, v_cache_BKSE, lengths_B, *, page_size, impl="auto"
):
  """Dense decode attention over each row's cached tokens only, by `impl` as `decode_attention`:
  the fair baseline of the sparse path (a length-aware dense kernel, as the paper's FlashInfer
  baseline is), never the whole preallocated cache (prompt width + max_new_tokens) and never a
  float32 copy of it. The sampler's dense rollouts and dense layers use it."""
  fn = _dispatch(impl, lambda i, interpret: _dense_fn(i, page_size, interpret))
  return _per_shard(fn, q_BKGE, k_cache_BKSE, v_cache_BKSE, lengths_B)


def _per_shard(fn, *args_BK):
  """fn under `shard_map` on the enclosing mesh: each device attends over its own rows and KV heads
  (rows and heads are independent; every argument is [B, K, ...] or [B]), so neither the Pallas
  custom calls, which XLA cannot partition, nor the XLA paths gather the cache. Plain call without
  a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(*args_BK)
  bk = sharding.spec(("batch", "kv_heads"), args_BK[0].shape[:2], mesh)
  specs = tuple(P(*bk[: x.ndim], *[None] * (x.ndim - 2)) for x in args_BK)
  return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(*args_BK)


def dense_decode_fn(impl="auto"):
  """An `attention_fn` for qwen3.decode_step: every layer reads each row's cached tokens from its
  own one-layer cache."""

  def attention(layer, q_BKGE, cache, lengths_B):
    return dense_decode_attention(
      q_BKGE, cache.keys(0), cache.values(0), lengths_B, page_size=cache.page_size, impl=impl
    )

  return attention


def cache_pages(q_BKGE, cache, lengths_B, sparse: select.SparseConfig, budget, max_selected: int):
  """`select.decode_pages` on a single-layer cache: the pages a sparse layer reads, at most
  `max_selected`, under `budget.budget_pages(cached_len)`."""
  return select.decode_pages(
    q_BKGE,
    cache.summaries[0],
    lengths_B,
    budget.budget_pages(lengths_B),
    sparse,
    min(max_selected, cache.num_pages),
  )


def decode_attention_fn(sparse: select.SparseConfig, budget, max_selected: int):
  """An `attention_fn` for qwen3.decode_step: layers below `dense_layers` read every cached token,
  the others the pages `select.decode_pages` picks under `budget.budget_pages(cached_len)` (a
  schedule.BudgetTable: traced, so a new schedule does not recompile), at most `max_selected`
  (static) pages. The caches must keep the summaries `sparse.page_score` scores."""

  def attention(layer, q_BKGE, cache, lengths_B):  # layer: a Python int (decoding unrolls layers)
    if layer < sparse.dense_layers:
      return dense_decode_fn(sparse.attention_impl)(layer, q_BKGE, cache, lengths_B)
    if cache.page_score != sparse.page_score:
      raise ValueError(
        f"the cache keeps {cache.page_score!r} page summaries, SparseConfig."
        f"page_score is {sparse.page_score!r}"
      )
    page_idx_BKN, n_valid_BK = cache_pages(q_BKGE, cache, lengths_B, sparse, budget, max_selected)
    return decode_attention(
      q_BKGE,
      cache.keys(0),
      cache.values(0),
      page_idx_BKN,
      n_valid_BK,
      lengths_B,
      page_size=sparse.page_size,
      impl=sparse.attention_impl,
    )

  return attention


def _paged_fn(impl, interpret=None):
  """One implementation of reference.paged_decode_attention's contract (flat pages, page ids)."""
  if impl == "xla":
    return reference.paged_decode_attention
  kernel = sparse_decode if impl == "pallas" else sparse_decode_tpu
  return functools.partial(kernel.paged_decode_attention, interpret=interpret)


def paged_decode_attention(
  q_BKGE,
  k_pages_XZE,
  v_pages_XZE,
  page_idx_BKN,
  logical_idx_BKN,
  n_valid_BK,
  lengths_B,
  *,
  impl="auto",
):
  """reference.paged_decode_attention by `impl`, as `decode_attention` dispatches."""
  return _dispatch(impl, _paged_fn)(
    q_BKGE, k_pages_XZE, v_pages_XZE, page_idx_BKN, logical_idx_BKN, n_valid_BK, lengths_B
  )


def pool_decode_attention_fn(sparse, budget, max_selected: int, impl: str = "auto"):
  """An `attention_fn` for qwen3.decode_step over a page pool (`page_pool.layer_views`): dense
  (sparse=None, and layers below `sparse.dense_layers`) reads every page a slot has cached; sparse
  layers read the pages `select.decode_pages` picks from the slot's pages in logical order, the
  one rule the per-row sampler and the trainer use. Slots that run no row read nothing. Each
  device reads its own pool shard for its own slots (`page_pool.per_device`).

  Reads go through a prefix of the page tables that covers the device's longest running row (a
  lax.switch over DENSE_PREFIXES eighths of the table, or all of it), so a step scores and gathers
  about as many pages as that row holds, not the table's static width."""
  impl = sparse.attention_impl if sparse is not None else impl

  def attention(layer, q_BKGE, pool, lengths_B):  # pool: a page_pool.PoolLayer
    dense = sparse is None or layer < sparse.dense_layers
    if not dense and pool.page_score != sparse.page_score:
      raise ValueError(
        f"the pool keeps {pool.page_score!r} page summaries, SparseConfig."
        f"page_score is {sparse.page_score!r}"
      )
    Z, dtype = pool.page_size, pool.dtype

    def local(
      q_BKGE, k_stored, v_stored, summaries, page_table_BP, active_B, lengths_B, pages_by_len
    ):
      B, K = q_BKGE.shape[:2]
      X, PR = k_stored.shape[2], page_table_BP.shape[1]
      lengths_B = jnp.where(active_B, lengths_B, 0)
      n_pages_B = -(-lengths_B // Z)
      k_pages, v_pages = page_pool.local_pages(k_stored, v_stored, dtype)
      head_base_1K1 = (jnp.arange(K, dtype=jnp.int32) * X)[None, :, None]

      def read(size):
        def fn(q_BKGE):
          table_BKN = jnp.broadcast_to(page_table_BP[:, None, :size], (B, K, size))
          if dense:
            logical_BKN = jnp.broadcast_to(jnp.arange(size, dtype=jnp.int32), (B, K, size))
            n_valid_BK = jnp.broadcast_to(n_pages_B[:, None], (B, K)).astype(jnp.int32)
          else:
            with jax.named_scope("page_selection"):  # the summaries' gather: selection's read
              summary_BKNRE = summaries[0][:, page_table_BP[:, :size]].transpose(1, 0, 2, 3, 4)
            logical_BKN, n_valid_BK = select.decode_pages(
              q_BKGE,
              summary_BKNRE,
              lengths_B,
              pages_by_len[lengths_B],
              sparse,
              min(max_selected, size),
            )
            n_valid_BK = jnp.where(active_B[:, None], n_valid_BK, 0)
          page_BKN = jnp.take_along_axis(table_BKN, logical_BKN, axis=2) + head_base_1K1
          return paged_decode_attention(
            q_BKGE, k_pages, v_pages, page_BKN, logical_BKN, n_valid_BK, lengths_B, impl=impl
          )

        return fn

      sizes = sorted({-(-PR * i // 8) for i in DENSE_PREFIXES} | {PR})
      bucket = jnp.searchsorted(jnp.asarray(sizes), jnp.max(n_pages_B))
      return (
        jax.lax.switch(jnp.minimum(bucket, len(sizes) - 1), [read(s) for s in sizes], q_BKGE),
      )

    pages_by_len = budget.pages_by_len if budget is not None else jnp.zeros((1,), jnp.int32)
    q_axes = ("batch", "kv_heads", "q_group", "head_dim")
    return page_pool.per_device(
      local,
      (
        q_BKGE,
        pool.k_stored,
        pool.v_stored,
        pool.summaries,
        pool.page_table,
        pool.active,
        lengths_B,
        pages_by_len,
      ),
      (
        q_axes,
        page_pool.POOL_AXES,
        page_pool.POOL_AXES,
        page_pool.SUMMARY_AXES,
        page_pool.SLOT_AXES,
        page_pool.SLOT_AXES,
        page_pool.SLOT_AXES,
        ("length",),
      ),
      ((q_axes, q_BKGE.shape),),
    )[0]

  return attention


def pool_verify_attention_fn():
  """An attention_fn for qwen3.verify_step over a page pool (`page_pool.layer_views`): every layer
  dense, each slot's C queries over the tokens it has cached and causally over the C new ones
  (`reference.paged_verify_attention`, the jnp path on every platform). Reads go through a prefix
  of the page tables that covers the device's longest running row, as `pool_decode_attention_fn`'s
  do; slots that run no row read no page."""

  def attention(layer, q_BCKGE, k_BCKE, v_BCKE, pool, lengths_B):
    del layer
    Z, dtype = pool.page_size, pool.dtype

    def local(q_BKCGE, k_BKCE, v_BKCE, k_stored, v_stored, page_table_BP, active_B, lengths_B):
      B, K = q_BKCGE.shape[:2]
      X, PR = k_stored.shape[2], page_table_BP.shape[1]
      lengths_B = jnp.where(active_B, lengths_B, 0)
      k_pages, v_pages = page_pool.local_pages(k_stored, v_stored, dtype)
      head_base_1K1 = (jnp.arange(K, dtype=jnp.int32) * X)[None, :, None]

      def read(size):
        def fn(q_BKCGE, k_BKCE, v_BKCE):
          page_BKN = page_table_BP[:, None, :size] + head_base_1K1
          return reference.paged_verify_attention(
            q_BKCGE, k_pages, v_pages, page_BKN, lengths_B, k_BKCE, v_BKCE
          )

        return fn

      sizes = sorted({-(-PR * i // 8) for i in DENSE_PREFIXES} | {PR})
      bucket = jnp.searchsorted(jnp.asarray(sizes), jnp.max(-(-lengths_B // Z)))
      branches = [read(s) for s in sizes]
      return (
        jax.lax.switch(jnp.minimum(bucket, len(sizes) - 1), branches, q_BKCGE, k_BKCE, v_BKCE),
      )

    q_axes = ("batch", "kv_heads", "length", "q_group", "head_dim")
    kv_axes = ("batch", "kv_heads", "length", "head_dim")
    out = page_pool.per_device(
      local,
      (
        q_BCKGE.transpose(0, 2, 1, 3, 4),
        k_BCKE.transpose(0, 2, 1, 3),
        v_BCKE.transpose(0, 2, 1, 3),
        pool.k_stored,
        pool.v_stored,
        pool.page_table,
        pool.active,
        lengths_B,
      ),
      (
        q_axes,
        kv_axes,
        kv_axes,
        page_pool.POOL_AXES,
        page_pool.POOL_AXES,
        page_pool.SLOT_AXES,
        page_pool.SLOT_AXES,
        page_pool.SLOT_AXES,
      ),
      ((q_axes, q_BCKGE.transpose(0, 2, 1, 3, 4).shape),),
    )[0]
    return out.transpose(0, 2, 1, 3, 4)

  return attention
