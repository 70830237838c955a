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

from kernels import sparse_decode
from sparrow_jax.attention import blockwise, reference, select
from sparrow_jax.model import qwen3, sharding


def teacher_forced_attention_fn(sparse: select.SparseConfig, schedule, prompt_len_B):
  """An `attention_fn` for qwen3.forward that restricts each query to the pages the sparse sampler
  read at that step, blockwise (the pages are chosen per query block by the same `keep_pages` rule
  the sampler's `decode_pages` follows). Prompt positions were prefilled densely, and layers below
  `dense_layers` stay dense: their budget is every page."""
  select_fn = functools.partial(select.keep_pages, sparse=sparse)

  def attention(layer, q_BTKGE, k_BTKE, v_BTKE, mask_BT):
    T = q_BTKGE.shape[1]
    pos_T = jnp.arange(T)
    every_page = -(-T // sparse.page_size)
    dense_BT = (layer < sparse.dense_layers) | (pos_T[None] < prompt_len_B[:, None])
    budget_BT = jnp.where(dense_BT, every_page, schedule.budget_pages(pos_T + 1)[None])
    return blockwise.attention(q_BTKGE, k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3),
                               mask_BT, budget_BT=budget_BT, select_fn=select_fn,
                               page_size=sparse.page_size)
  return attention


def forward(params, tokens_BT, cfg, *, sparse=None, schedule=None, prompt_len_B=None, **kwargs):
  """Teacher-forced logits_BTV (float32), dense or sparse (`sj.forward`).

  With `sparse` (a SparseConfig) and `schedule` (anything with `budget_pages(cached_len)`: a
  KVSchedule, or a schedule.BudgetTable under jit), each query position attends to exactly the pages
  the sparse sampler read at that step (dense before `prompt_len_B`: prefill is dense). Sparse
  teacher forcing needs right-padded rows (cache slot == position), as the sampler makes. Other
  keyword arguments go to `qwen3.forward` (mask_BT, positions_BT, lora, ...).
  """
  if sparse is not None:
    if schedule is None or prompt_len_B is None:
      raise ValueError("forward(sparse=...) needs `schedule` and `prompt_len_B` (where decoding "
                       "began)")
    kwargs["attention_fn"] = teacher_forced_attention_fn(sparse, schedule, prompt_len_B)
  return qwen3.forward(params, tokens_BT, cfg, **kwargs)


def decode_attention(q_BKGE, k_cache_BKSE, v_cache_BKSE, page_idx_BKN, n_valid_BK, lengths_B, *,
                     page_size, scale=None, impl="auto"):
  """Sparse decode attention by `impl`: "xla" (the jnp reference), "pallas" (kernels/), or "auto"
  (Pallas on a GPU backend, XLA elsewhere)."""
  if impl not in reference.IMPLS:
    raise ValueError(f"impl must be one of {reference.IMPLS}, got {impl!r}")
  if impl == "auto":
    impl = "pallas" if jax.default_backend() == "gpu" else "xla"
  fn = functools.partial(reference.sparse_decode_attention if impl == "xla"
                         else sparse_decode.sparse_decode_attention, page_size=page_size,
                         scale=scale)
  return _per_shard(fn, q_BKGE, k_cache_BKSE, v_cache_BKSE, page_idx_BKN, n_valid_BK, lengths_B)


def _per_shard(fn, q_BKGE, k_cache_BKSE, v_cache_BKSE, page_idx_BKN, n_valid_BK, lengths_B):
  """fn under `shard_map` on the enclosing mesh: each device attends over its own rows and KV heads
  (rows and heads are independent), so neither the Pallas custom call, which XLA cannot
  partition, nor the XLA path's map over rows gathers the cache. Plain call without a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  args = (q_BKGE, k_cache_BKSE, v_cache_BKSE, page_idx_BKN, n_valid_BK, lengths_B)
  if mesh.empty:
    return fn(*args)
  bk = sharding.spec(("batch", "kv_heads"), q_BKGE.shape[:2], mesh)
  specs = (P(*bk, None, None), P(*bk, None, None), P(*bk, None, None), P(*bk, None), P(*bk),
           P(bk[0]))
  return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(*args)


def decode_attention_fn(sparse: select.SparseConfig, budget, max_selected: int):
  """An `attention_fn` for qwen3.decode_step: layers below `dense_layers` read the whole cache, the
  others the pages `select.decode_pages` picks under `budget.budget_pages(cached_len)` (a
  schedule.BudgetTable: traced, so a new schedule does not recompile), at most `max_selected`
  (static) pages."""
  def sparse_attention(layer, q_BKGE, cache, lengths_B):
    page_idx_BKN, n_valid_BK = select.decode_pages(
        q_BKGE, cache.centroid_sum[layer], lengths_B, budget.budget_pages(lengths_B), sparse,
        min(max_selected, cache.num_pages))
    return decode_attention(q_BKGE, cache.keys(layer), cache.values(layer), page_idx_BKN, n_valid_BK,
                            lengths_B, page_size=sparse.page_size, impl=sparse.attention_impl)

  def attention(layer, q_BKGE, cache, lengths_B):  # layer: traced (the model scans its layers)
    return jax.lax.cond(layer < sparse.dense_layers, qwen3.dense_decode_fn, sparse_attention,
                        layer, q_BKGE, cache, lengths_B)
  return attention
