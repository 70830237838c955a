"""Block-sparse flash-decoding over the paged KV cache (Pallas; Triton lowering on GPU).

Same contract as sparrow_jax.attention.reference.paged_decode_attention (its jnp twin): one
decode query per (sequence b, KV head k) with G query heads, attending to the n_valid_BK[b, k]
pages listed first in page_idx_BKN[b, k] (physical ids into a flat [X, Z, E] page array, a page
pool; padding slots hold a valid page id and are masked), each page's positions given by its
logical id in the row, tokens at positions >= lengths_B[b] masked. An empty selection gives zeros.
`sparse_decode_attention` reads per-row caches through it (reference.sparse_decode_attention's
contract).

Grid (B, K, num_splits): program (b, k, s) walks the s-th contiguous range of page slots, a block
of pages at a time, with an online softmax, and writes partial (max, sum, acc) for its range; a
jnp epilogue merges the splits (flash-decoding: splits give the GPU enough programs when B * K is
small). With one split the kernel normalises and writes the output itself: no epilogue. Blocks
past n_valid are never loaded, so a budget below the static maximum N costs only what it reads.
Each block's page ids are loaded one block ahead (carried in the loop), so its K and V gathers
issue together at the top of the step without waiting on an id load. The outputs pass an
optimization_barrier before the merge (JAX's GPU decode ops found NaNs after jit without one: XLA
may otherwise fuse the merge into the custom call's consumers in an order that reads the outputs
before they are final).

Precision: both products read the cache in its own dtype and accumulate in float32. A bfloat16
cache runs bfloat16 x bfloat16 tensor-core dots (q and the softmax weights p rounded to bfloat16,
as JAX's Pallas GPU decode ops do); a float32 cache keeps IEEE float32 (HIGHEST; Triton's default
is TF32). How the G query heads meet the keys is per shape (`tuning`): a `tl.dot` needs M >= 16,
so G is zero-padded to 16 rows (on bfloat16 tensor cores the padded rows cost little: decode is
bound by reading the cache), or a CUDA-core broadcast-multiply-reduce over the G real rows (no
padding; chosen for float32, where a padded IEEE dot would do 16/G times the FMA work).

Triton constraints met by construction: every loaded or computed block has power-of-two sizes
(G padded to a power of two), the dot path's M, N, K >= 16, a block holds >= 16 tokens (several
pages when page_size < 16), and head_dim must be a power of two >= 16 (Qwen3: 128).

jax 0.10.2 Pallas on GPU: pallas_call lowers to Mosaic GPU unless its compiler params say
otherwise (config jax_pallas_use_mosaic_gpu defaults to True); passing
`compiler_params=jax.experimental.pallas.triton.CompilerParams(num_warps=.., num_stages=..)`
selects the Triton lowering (pallas_call has no `backend=` argument). The Triton lowering has no
scalar prefetch ("scalar prefetch not implemented in the Triton backend"), so the page list is an
ordinary input block and pages are fetched by indexing the cache ref with the loaded page ids (a
gather load). Its float32 dots default to TF32 (Precision.DEFAULT); HIGHEST makes them IEEE.
"""

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
import jax.numpy as jnp

from sparrow_jax.attention import reference

_MIN_DOT = 16  # tl.dot: M, N and K must be >= 16
_HIGHEST = jax.lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class Tuning:
  block_tokens: int  # tokens loaded per inner step (whole pages)
  use_dot: bool  # tl.dot with G padded to 16 rows, else a CUDA-core multiply-reduce
  num_warps: int
  num_stages: int
  target_programs: int  # default splits aim at about this many programs per call


# Per cache dtype. Not yet tuned on a GPU (none was at hand): values follow the shapes JAX's and
# axlearn's GPU decode ops use for head_dim 128, with no register spill when compiled for sm_90
# (docs/results/triton_sm90.md; at 2 stages the bfloat16 entry spilled); experiments/device_check.py
# times `tuning_alternatives()` so this table can be set from measurements. 1056 programs = 8 per SM
# of an H100/H200's 132: several waves of the few programs an SM holds at once, so the last wave's
# idle SMs cost little even at batch 16 (the split count stays at most one per block).
TUNING = {
  "bfloat16": Tuning(
    block_tokens=64, use_dot=True, num_warps=4, num_stages=3, target_programs=1056
  ),
  "float32": Tuning(
    block_tokens=32, use_dot=False, num_warps=4, num_stages=2, target_programs=1056
  ),
}


def tuning_alternatives() -> list:
  """The bfloat16 Tunings the device check times and experiments/triton_stats.py compiles for
  sm_90: block tokens, warps and stages around the table's entry, with the tensor-core dot, and
  the CUDA-core multiply-reduce at 32 tokens; none spills (docs/results/triton_sm90.md)."""
  base = TUNING["bfloat16"]
  shapes = [(32, True, 4, 2), (32, True, 4, 3), (64, True, 8, 2), (64, True, 8, 3)]
  shapes += [(128, True, 4, 2), (32, False, 4, 2)]
  return [
    dataclasses.replace(base, block_tokens=b, use_dot=d, num_warps=w, num_stages=s)
    for b, d, w, s in shapes
  ]


def tuning(dtype, G: int) -> Tuning:
  """The table's entry for a cache dtype (float16 as bfloat16); the dot path needs nothing else,
  but G >= 16 always takes it (nothing to pad)."""
  name = "float32" if jnp.dtype(dtype).itemsize == 4 else "bfloat16"
  entry = TUNING[name]
  return dataclasses.replace(entry, use_dot=True) if G >= _MIN_DOT else entry


def supports(head_dim: int) -> bool:
  """Whether the Triton dot can take this head size (a power of two >= 16)."""
  return head_dim >= _MIN_DOT and not head_dim & (head_dim - 1)


def default_splits(programs: int, n_blocks: int, target_programs: int) -> int:
  """Splits per (b, k) so that `programs` (b, k) pairs make about target_programs programs; at most
  one per block, and no split left without a block of the static list."""
  wanted = min(n_blocks, max(1, target_programs // programs))
  return -(-n_blocks // -(-n_blocks // wanted))


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _scores(q_GE, k_TE, use_dot):
  """q . k for each (query head, token), float32."""
  if use_dot:
    precision = _HIGHEST if k_TE.dtype == jnp.float32 else None
    return pltriton.dot(q_GE, k_TE, trans_b=True, precision=precision)
  return jnp.sum(q_GE[:, None, :].astype(jnp.float32) * k_TE[None].astype(jnp.float32), axis=2)


def _weighted_values(p_GT, v_TE, use_dot):
  """p @ v, float32; the dot rounds p to the cache dtype (a bfloat16 tensor-core product)."""
  if use_dot:
    precision = _HIGHEST if v_TE.dtype == jnp.float32 else None
    return pltriton.dot(p_GT.astype(v_TE.dtype), v_TE, precision=precision)
  return jnp.sum(p_GT[:, :, None] * v_TE[None].astype(jnp.float32), axis=1)


def _kernel(
  page_idx_ref,
  logical_idx_ref,
  n_valid_ref,
  length_ref,
  q_ref,
  k_ref,
  v_ref,
  *out_refs,
  scale,
  page_size,
  pages_per_block,
  blocks_per_split,
  use_dot,
):
  """One (b, k, split): online softmax over this split's blocks of selected pages. Writes the
  partial (max, sum, acc) for the merge, or with one output ref (a single split) the normalised
  output itself."""
  split = pl.program_id(2)
  n_valid = n_valid_ref[0]
  length = length_ref[0]
  q_GE = q_ref[...]
  G, E = q_GE.shape
  T = pages_per_block * page_size
  first_slot = split * (blocks_per_split * pages_per_block)
  remaining = jnp.maximum(n_valid - first_slot, 0)
  n_blocks = jnp.minimum(
    jax.lax.div(remaining + pages_per_block - 1, pages_per_block), blocks_per_split
  )

  def block_ids(j):
    """Block j's physical page ids; past the split's last block, its last block's (the read stays
    inside this program's id block, and the loop never uses them)."""
    first = jnp.minimum(j, blocks_per_split - 1) * pages_per_block
    return page_idx_ref[pl.ds(first, pages_per_block)]

  def body(j, carry):
    m_G, l_G, acc_GE, ids_N = carry
    # Block j's ids came with the carry, so its K and V gathers depend on no load of this step and
    # issue together (Triton's software pipeliner can stage them a step ahead); block j+1's ids
    # load while this block computes. The logical ids only feed the mask, after the score dot, so
    # they load here: carrying them too would hold registers for no earlier use.
    k_TE = k_ref[ids_N].reshape(T, E)
    v_TE = v_ref[ids_N].reshape(T, E)
    next_ids_N = block_ids(j + 1)
    s_GT = _scores(q_GE, k_TE, use_dot) * scale
    logical_N = logical_idx_ref[pl.ds(j * pages_per_block, pages_per_block)]
    slot_N = first_slot + j * pages_per_block + jnp.arange(pages_per_block)
    pos_NZ = logical_N[:, None] * page_size + jnp.arange(page_size)[None, :]
    valid_T = ((slot_N[:, None] < n_valid) & (pos_NZ < length)).reshape(T)
    s_GT = jnp.where(valid_T[None, :], s_GT, -jnp.inf)
    m_new_G = jnp.maximum(m_G, jnp.max(s_GT, axis=1))
    # All-masked so far: keep exp() at 0 instead of exp(-inf - -inf) = NaN.
    m_safe_G = jnp.where(m_new_G == -jnp.inf, 0.0, m_new_G)
    corr_G = jnp.exp(m_G - m_safe_G)
    p_GT = jnp.exp(s_GT - m_safe_G[:, None])
    l_G = l_G * corr_G + jnp.sum(p_GT, axis=1)
    acc_GE = acc_GE * corr_G[:, None] + _weighted_values(p_GT, v_TE, use_dot)
    return m_new_G, l_G, acc_GE, next_ids_N

  init = (
    jnp.full((G,), -jnp.inf, jnp.float32),
    jnp.zeros((G,), jnp.float32),
    jnp.zeros((G, E), jnp.float32),
    block_ids(0),
  )
  m_G, l_G, acc_GE, _ = jax.lax.fori_loop(0, n_blocks, body, init)
  if len(out_refs) == 1:
    [o_ref] = out_refs
    o_ref[...] = _normalise(acc_GE, l_G[:, None]).astype(o_ref.dtype)
    return
  m_ref, l_ref, acc_ref = out_refs
  m_ref[...] = m_G
  l_ref[...] = l_G
  acc_ref[...] = acc_GE


def _normalise(acc_aE, l_a1):
  """acc / l; nothing valid (l = 0, acc = 0) stays 0."""
  return acc_aE / jnp.where(l_a1 == 0.0, 1.0, l_a1)


def _merge_splits(m_BKWG, l_BKWG, acc_BKWGE):
  """Combine per-split partial softmaxes; splits (or rows) with nothing valid weigh 0."""
  m_BKWG, l_BKWG, acc_BKWGE = jax.lax.optimization_barrier((m_BKWG, l_BKWG, acc_BKWGE))
  m_BKG = jnp.max(m_BKWG, axis=2)
  m_BKG = jnp.where(jnp.isfinite(m_BKG), m_BKG, 0.0)
  w_BKWG = jnp.exp(m_BKWG - m_BKG[:, :, None])
  l_BKG = jnp.sum(l_BKWG * w_BKWG, axis=2)
  acc_BKGE = jnp.sum(acc_BKWGE * w_BKWG[..., None], axis=2)
  return _normalise(acc_BKGE, l_BKG[..., None])


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
  num_splits=None,
  config=None,
  interpret=None,
):
  """Pallas twin of reference.paged_decode_attention (same arguments, same result): page ids are
  physical ids into the flat page array (a page pool), logical ids give the positions to mask.

  Kernel-only knobs: num_splits (page ranges per (b, k); default aims at the tuning's
  target_programs), config (a Tuning; default `tuning(cache dtype, G)`) and interpret (default:
  True unless the backend is a GPU).
  """
  reference.check_paged_args(
    q_BKGE, k_pages_XZE, v_pages_XZE, page_idx_BKN, logical_idx_BKN, n_valid_BK, lengths_B
  )
  B, K, G, E = q_BKGE.shape
  X, page_size, _ = k_pages_XZE.shape
  N = page_idx_BKN.shape[2]
  if not supports(E):
    raise ValueError(f"head_dim must be a power of two >= {_MIN_DOT} for the Triton dot, got {E}")
  # A Python float: the kernel bakes it in (a traced scale cannot be closed over by pallas_call).
  scale = reference.default_scale(E) if scale is None else float(scale)
  if interpret is None:
    interpret = jax.default_backend() != "gpu"
  config = config or tuning(k_pages_XZE.dtype, G)

  pages_per_block = max(config.block_tokens, _MIN_DOT, page_size) // page_size
  n_blocks = -(-N // pages_per_block)
  if num_splits is None:
    num_splits = default_splits(B * K, n_blocks, config.target_programs)
  if not isinstance(num_splits, int) or num_splits < 1:
    raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
  blocks_per_split = -(-n_blocks // num_splits)
  per_split = blocks_per_split * pages_per_block
  # Padding slots sit at index >= N >= n_valid, so the kernel masks them like the caller's padding;
  # their page id 0 keeps the gather in bounds, as the clip does for the caller's ids.
  split = lambda idx_BKN: jnp.pad(
    idx_BKN.astype(jnp.int32), ((0, 0), (0, 0), (0, num_splits * per_split - N))
  ).reshape(B, K, num_splits, per_split)
  page_idx_BKWN = split(jnp.clip(page_idx_BKN, 0, X - 1))
  logical_idx_BKWN = split(logical_idx_BKN)
  Gp = max(_MIN_DOT, _next_pow2(G)) if config.use_dot else _next_pow2(G)
  # q meets the cache in the cache's dtype (the Triton dot takes one element type).
  q_BKGE_padded = jnp.pad(q_BKGE.astype(k_pages_XZE.dtype), ((0, 0), (0, 0), (0, Gp - G), (0, 0)))

  kernel = functools.partial(
    _kernel,
    scale=scale,
    page_size=page_size,
    pages_per_block=pages_per_block,
    blocks_per_split=blocks_per_split,
    use_dot=config.use_dot,
  )
  # Every program sees the whole page array and gathers its pages by id (no per-row block).
  pages_spec = pl.BlockSpec((X, page_size, E), lambda b, k, s: (0, 0, 0))
  ids_spec = pl.BlockSpec((None, None, None, per_split), lambda b, k, s: (b, k, s, 0))
  # One split is the whole answer: the kernel normalises and writes q's dtype, no merge.
  if num_splits == 1:
    out_specs = [pl.BlockSpec((None, None, Gp, E), lambda b, k, s: (b, k, 0, 0))]
    out_shape = [jax.ShapeDtypeStruct((B, K, Gp, E), q_BKGE.dtype)]
  else:
    out_specs = [
      pl.BlockSpec((None, None, None, Gp), lambda b, k, s: (b, k, s, 0)),
      pl.BlockSpec((None, None, None, Gp), lambda b, k, s: (b, k, s, 0)),
      pl.BlockSpec((None, None, None, Gp, E), lambda b, k, s: (b, k, s, 0, 0)),
    ]
    out_shape = [
      jax.ShapeDtypeStruct((B, K, num_splits, Gp), jnp.float32),
      jax.ShapeDtypeStruct((B, K, num_splits, Gp), jnp.float32),
      jax.ShapeDtypeStruct((B, K, num_splits, Gp, E), jnp.float32),
    ]
  outs = pl.pallas_call(
    kernel,
    grid=(B, K, num_splits),
    in_specs=[
      ids_spec,
      ids_spec,
      pl.BlockSpec((None, None, 1), lambda b, k, s: (b, k, 0)),
      pl.BlockSpec((None, 1), lambda b, k, s: (b, 0)),
      pl.BlockSpec((None, None, Gp, E), lambda b, k, s: (b, k, 0, 0)),
      pages_spec,
      pages_spec,
    ],
    out_specs=out_specs,
    out_shape=out_shape,
    # Selects the Triton lowering on GPU (default would be Mosaic GPU); ignored in interpret mode.
    compiler_params=pltriton.CompilerParams(
      num_warps=config.num_warps, num_stages=config.num_stages
    ),
    interpret=interpret,
    name="sparse_decode",
  )(
    page_idx_BKWN,
    logical_idx_BKWN,
    n_valid_BK.astype(jnp.int32)[..., None],
    lengths_B.astype(jnp.int32)[:, None],
    q_BKGE_padded,
    k_pages_XZE,
    v_pages_XZE,
  )
  out_BKGE = outs[0] if num_splits == 1 else _merge_splits(*outs)
  return out_BKGE[:, :, :G].astype(q_BKGE.dtype)


# Pallas twin of reference.sparse_decode_attention (per-row caches; the same keywords as above).
sparse_decode_attention = reference.per_row(paged_decode_attention)
