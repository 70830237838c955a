"""Block-sparse paged decode attention (Pallas; Mosaic lowering on TPU).

Same contract as sparrow_jax.attention.reference.paged_decode_attention (its jnp twin): one
decode query per (sequence b, KV head k) with G query heads, attending to the n_valid_BK[b, k]
pages listed first in page_idx_BKN[b, k] (physical ids into a flat [X, Z, E] page array, a page
pool; padding slots hold a valid page id and are masked), each page's positions given by its
logical id in the row, tokens at positions >= lengths_B[b] masked. An empty selection gives zeros.
`sparse_decode_attention` reads per-row caches through it (a free reshape).

Grid (2, ceil(B * K / 2)): the (row, KV head) pairs in order, split into two contiguous halves,
one per TensorCore on chips with two (v4, v5p: the "parallel" axis; on one-core chips the halves
run one after the other). Each program walks its pair's selected pages a block of
pages_per_block at a time in an in-kernel loop with an online softmax (float32) and writes its
[G, E] output. The page list, its logical ids, n_valid and lengths are scalar-prefetch operands
(SMEM): page ids are scalars the kernel turns into DMA addresses. SMEM is small (1 MiB), so a
batch whose lists need more than SMEM_PREFETCH_BYTES runs as a `lax.map` of calls over row
chunks. The caches stay in HBM; each block's pages are DMA'd (one copy per page: pages are
scattered over the pool, so a block of many pages is what puts many bytes in flight) into one
slot of a two-slot VMEM buffer while the other slot's block is computed on (double buffering).
Only the listed pages are ever copied (slots past n_valid are skipped, and their V rows zeroed,
since p = 0 times a stale NaN is NaN), so a budget below the static N costs only what it reads.
Both dots take the common dtype of q and the cache (bf16 stays bf16 on the MXU) and accumulate in
float32; float32 dots ask for full precision.

Prefetch across grid steps (as JAX's own paged_attention does): a core runs its half of the
pairs in order (the "arbitrary" axis), and the step that computes a pair's last block starts the
DMA of the next pair's first block, so only a core's first program waits for a cold copy. An
empty pair passes its buffer slot on to the next pair's first block; a one-word SMEM scratch
carries the slot across grid steps. The block loop stays inside the program (the block count is
dynamic: n_valid).

Padding: nothing requires it (a block equal to the full array dims is legal for any G), but G is
zero-padded to the sublane tile of q's dtype (8 rows for 32-bit, 16 for bf16) and sliced off
after: it costs nothing (a vreg holds that many rows and the MXU pads M to it anyway) and keeps q
and out off the sub-tile second-minor layouts for which JAX's paged_attention needs a reshape
workaround. Each page is Z contiguous rows of the [X, Z, E] page array, so one DMA per page; with
page_size a multiple of the sublane tile (Qwen3: 16 rows of bf16) each copy is whole (tile, 128)
tiles. Page ids are clipped to [0, X) like the reference's gather, so no DMA leaves the pages.

jax 0.10.2: `interpret=pltpu.InterpretParams()` runs the kernel on CPU with TPU semantics: a DMA
lands only when it is waited on and scratch starts as NaN, so a missing wait shows up as NaN and a
copy into the slot being computed on as wrong values (or a semaphore hang, as on a TPU). The
generic `interpret=True` also runs the kernel, but completes each copy when it starts, so it
passes a kernel that forgets to wait.
"""

import dataclasses
import functools
from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from sparrow_jax.attention import reference

_BLOCK_TOKENS = 512  # default tokens per block: 32 pages of 16 in flight per cache and slot
_CORES = 2  # TensorCores a chip may split a call over (v4, v5p; one on v5e, v6e: a no-op there)
_SUBLANES = 8  # 32-bit sublane tile; packed dtypes hold 32 // bits rows per sublane
# Scalar-prefetch bytes one pallas_call may take: half of the 1 MiB of SMEM that v4, v5e, v5p, v6e
# and TPU7x have (the compiler keeps its own scalars there too). A batch whose page lists need more
# runs as several calls over row chunks (docs/results/tpu_compile_check.md).
SMEM_PREFETCH_BYTES = 512 * 1024


def _sublane_tile(dtype) -> int:
  return _SUBLANES * 4 // jnp.dtype(dtype).itemsize


def _block_mask(logical_idx_ref, first, end, length, *, page_size, pages_per_block):
  """[1, T] validity of the tokens of the block at flat slot `first`: slot < end (the row's
  n_valid) and position < length. Each page's count of valid rows is a scalar (scalar core), so
  the vector work is one compare pair per page."""
  tok_1T = jax.lax.broadcasted_iota(jnp.int32, (1, pages_per_block * page_size), 1)
  valid_1T = jnp.zeros(tok_1T.shape, jnp.bool_)
  for i in range(pages_per_block):
    rows = length - logical_idx_ref[first + i] * page_size
    rows = jnp.where(first + i < end, jnp.clip(rows, 0, page_size), 0)
    valid_1T |= (tok_1T >= i * page_size) & (tok_1T < i * page_size + rows)
  return valid_1T


def _softmax_step(carry, q_GE, k_TE, v_TE, valid_1T, scale):
  """One online-softmax update of (m, l, acc) with a block's keys and values."""
  m_G1, l_G1, acc_GE = carry
  # float32 operands: ask for full-precision passes rather than Mosaic's default.
  precision = jax.lax.Precision.HIGHEST if q_GE.dtype == jnp.float32 else None
  s_GT = (
    jax.lax.dot_general(
      q_GE, k_TE, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
    )
    * scale
  )
  s_GT = jnp.where(valid_1T, s_GT, -jnp.inf)
  m_new_G1 = jnp.maximum(m_G1, jnp.max(s_GT, axis=1, keepdims=True))
  # All-masked so far: keep exp() at 0 instead of exp(-inf - -inf) = NaN.
  m_safe_G1 = jnp.where(m_new_G1 == -jnp.inf, 0.0, m_new_G1)
  corr_G1 = jnp.exp(m_G1 - m_safe_G1)
  p_GT = jnp.exp(s_GT - m_safe_G1)
  l_G1 = l_G1 * corr_G1 + jnp.sum(p_GT, axis=1, keepdims=True)
  pv_GE = jnp.dot(
    p_GT.astype(q_GE.dtype), v_TE, precision=precision, preferred_element_type=jnp.float32
  )
  return m_new_G1, l_G1, acc_GE * corr_G1 + pv_GE


@dataclasses.dataclass(frozen=True)
class _Pages:
  """The page DMAs of one call: block j of (row, KV head) pair p into buffer slot `slot`, one copy
  per listed page of K and of V. Pages at slots >= the pair's n_valid are neither copied nor
  waited for, so the tail of a last block reads nothing."""

  page_idx_ref: Any
  n_valid_ref: Any
  lengths_ref: Any
  hbm_refs: tuple  # (K, V) page arrays in HBM
  buf_refs: tuple  # (K, V) two-slot VMEM buffers
  sem_refs: tuple  # (K, V) one DMA semaphore per slot
  kv_heads: int
  slots_per_row: int
  page_size: int
  pages_per_block: int

  def blocks(self, p):
    """Blocks pair p copies: none for a row with nothing cached (its n_valid alone would fetch)."""
    n = self.n_valid_ref[p]
    count = jax.lax.div(n + self.pages_per_block - 1, self.pages_per_block)
    return jnp.where(self.lengths_ref[jax.lax.div(p, self.kv_heads)] > 0, count, 0)

  def _each_page(self, p, j, act, listed=True):
    """act(i) for each page i of block j at a listed slot (or, listed=False, at a slot past
    n_valid)."""
    first = j * self.pages_per_block
    for i in range(self.pages_per_block):
      is_listed = first + i < self.n_valid_ref[p]
      pl.when(is_listed if listed else ~is_listed)(functools.partial(act, i))

  def _copies(self, p, j, slot, i):
    page = self.page_idx_ref[p * self.slots_per_row + j * self.pages_per_block + i]
    rows = pl.ds(i * self.page_size, self.page_size)
    return [
      pltpu.make_async_copy(hbm.at[page], buf.at[slot, rows], sem.at[slot])
      for hbm, buf, sem in zip(self.hbm_refs, self.buf_refs, self.sem_refs)
    ]

  def start(self, p, j, slot):
    def act(i):
      for copy in self._copies(p, j, slot, i):
        copy.start()

    self._each_page(p, j, act)

  def wait(self, p, j, slot):
    def act(i):
      for copy in self._copies(p, j, slot, i):
        copy.wait()

    self._each_page(p, j, act)

  def zero_unlisted_values(self, p, j, slot):
    """V rows of the pages not copied hold whatever the slot held (NaN at first, or stale rows):
    zero them, since p = 0 times NaN is NaN. K needs nothing: masked scores are replaced."""
    v_buf = self.buf_refs[1]

    def act(i):
      rows = pl.ds(i * self.page_size, self.page_size)
      v_buf[slot, rows] = jnp.zeros((self.page_size, v_buf.shape[2]), v_buf.dtype)

    self._each_page(p, j, act, listed=False)


def _kernel(
  page_idx_ref,
  logical_idx_ref,
  n_valid_ref,
  lengths_ref,
  q_ref,
  k_hbm_ref,
  v_hbm_ref,
  o_ref,
  k_buf_ref,
  v_buf_ref,
  k_sem_ref,
  v_sem_ref,
  slot_ref,
  *,
  scale,
  page_size,
  pages_per_block,
  slots_per_row,
  kv_heads,
  pairs,
):
  """Program (core, i) computes the (row, KV head) pair core * num_programs(1) + i. Its blocks
  are double-buffered; its first block was started by the program before it on this core (the
  first program of a core starts its own), and its last block's step starts the next program's
  first, so no program waits cold. slot_ref carries across grid steps the buffer slot in which
  the next program's first block lands."""
  core, i = pl.program_id(0), pl.program_id(1)
  per_core = pl.num_programs(1)
  pair = core * per_core + i
  pages = _Pages(
    page_idx_ref,
    n_valid_ref,
    lengths_ref,
    (k_hbm_ref, v_hbm_ref),
    (k_buf_ref, v_buf_ref),
    (k_sem_ref, v_sem_ref),
    kv_heads=kv_heads,
    slots_per_row=slots_per_row,
    page_size=page_size,
    pages_per_block=pages_per_block,
  )
  # Pairs past the call's (the last core's padding) have nothing; reads stay in bounds.
  last = pairs - 1
  n_blocks = jnp.where(pair < pairs, pages.blocks(jnp.minimum(pair, last)), 0)
  following = pair + 1
  next_blocks = jnp.where(
    (i + 1 < per_core) & (following < pairs), pages.blocks(jnp.minimum(following, last)), 0
  )

  @pl.when(i == 0)
  def _():
    slot_ref[0] = 0  # a core's first program: nothing in flight

  first_slot = slot_ref[0]

  @pl.when((i == 0) & (n_blocks > 0))
  def _():
    pages.start(pair, 0, first_slot)

  # An empty program hands its slot straight to the next program's first block.
  @pl.when((n_blocks == 0) & (next_blocks > 0))
  def _():
    pages.start(following, 0, first_slot)

  # Dots in the common type of q and the cache: bf16 with bf16 stays bf16 on the MXU.
  dot_dtype = jnp.promote_types(q_ref.dtype, k_buf_ref.dtype)
  q_GE = q_ref[...].astype(dot_dtype)
  G, E = q_GE.shape
  length = lengths_ref[jax.lax.div(jnp.minimum(pair, last), kv_heads)]
  row = pair * slots_per_row

  def body(j, carry):
    slot = (first_slot + j) & 1

    # The other slot's block was consumed last step: refill it (this pair's next block, or after
    # the last one the next program's first) while this one computes.
    @pl.when(j + 1 < n_blocks)
    def _():
      pages.start(pair, j + 1, 1 - slot)

    @pl.when((j + 1 == n_blocks) & (next_blocks > 0))
    def _():
      pages.start(following, 0, 1 - slot)

    valid_1T = _block_mask(
      logical_idx_ref,
      row + j * pages_per_block,
      row + n_valid_ref[jnp.minimum(pair, last)],
      length,
      page_size=page_size,
      pages_per_block=pages_per_block,
    )
    pages.wait(pair, j, slot)
    pages.zero_unlisted_values(pair, j, slot)
    return _softmax_step(
      carry,
      q_GE,
      k_buf_ref[slot].astype(dot_dtype),
      v_buf_ref[slot].astype(dot_dtype),
      valid_1T,
      scale,
    )

  init = (
    jnp.full((G, 1), -jnp.inf, jnp.float32),
    jnp.zeros((G, 1), jnp.float32),
    jnp.zeros((G, E), jnp.float32),
  )
  _, l_G1, acc_GE = jax.lax.fori_loop(0, n_blocks, body, init)
  slot_ref[0] = (first_slot + n_blocks) & 1
  o_ref[...] = (acc_GE / jnp.where(l_G1 == 0.0, 1.0, l_G1)).astype(o_ref.dtype)


def default_pages_per_block(N: int, page_size: int) -> int:
  """Pages per DMA / compute block unless the caller says: 512 tokens, at most the N listed."""
  return max(1, min(N, _BLOCK_TOKENS // page_size))


def rows_per_call(B: int, K: int, slots_per_row: int, smem_bytes: int) -> int:
  """Rows one pallas_call takes so that its scalar-prefetch operands (page ids and logical ids,
  K x slots_per_row each, n_valid and the length, int32) fit in smem_bytes."""
  per_row = 4 * (K * (2 * slots_per_row + 1) + 1)
  if per_row > smem_bytes:
    raise ValueError(
      f"one row's page lists ({K} KV heads x {slots_per_row} pages, {per_row} bytes "
      f"of scalar prefetch) exceed the {smem_bytes} bytes of SMEM a call may take"
    )
  return min(B, smem_bytes // per_row)


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
  pages_per_block=None,
  interpret=None,
  smem_bytes=SMEM_PREFETCH_BYTES,
):
  """Pallas TPU twin of reference.paged_decode_attention (same arguments, same result).

  Kernel-only knobs: pages_per_block (pages per DMA/compute block; default fills 512 tokens, at
  most N), interpret (pallas_call's; default: TPU interpret mode, pltpu.InterpretParams(),
  unless the backend is a TPU) and smem_bytes (the scalar prefetch one call may take; a batch
  that needs more runs as a loop of calls over row chunks, `rows_per_call`).
  """
  reference.check_paged_args(
    q_BKGE, k_pages_XZE, v_pages_XZE, page_idx_BKN, logical_idx_BKN, n_valid_BK, lengths_B
  )
  B, K, G, E = q_BKGE.shape
  X, page_size, _ = k_pages_XZE.shape
  N = page_idx_BKN.shape[2]
  # A Python float: the kernel bakes it in (a traced scale cannot be closed over by pallas_call).
  scale = reference.default_scale(E) if scale is None else float(scale)
  if pages_per_block is None:
    pages_per_block = default_pages_per_block(N, page_size)
  if not isinstance(pages_per_block, int) or pages_per_block < 1:
    raise ValueError(f"pages_per_block must be a positive int, got {pages_per_block!r}")
  if interpret is None:
    interpret = pltpu.InterpretParams() if jax.default_backend() != "tpu" else False

  slots_per_row = -(-N // pages_per_block) * pages_per_block
  rows = rows_per_call(B, K, slots_per_row, smem_bytes)
  # Rows past B (a last partial chunk) select nothing: zeros, sliced off.
  chunks = -(-B // rows)
  by_chunk = lambda x: jnp.pad(x, ((0, chunks * rows - B),) + ((0, 0),) * (x.ndim - 1)).reshape(
    chunks, rows, *x.shape[1:]
  )
  # Slots >= N sit past every n_valid, so the kernel masks them like the caller's padding; page 0
  # keeps their copies in bounds, as the clip does for the caller's ids.
  flat = lambda idx_BKN: jnp.pad(
    idx_BKN.astype(jnp.int32), ((0, 0), (0, 0), (0, slots_per_row - N))
  ).reshape(-1)
  Gp = -(-G // _sublane_tile(q_BKGE.dtype)) * _sublane_tile(q_BKGE.dtype)
  q_BKGE_padded = jnp.pad(q_BKGE, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
  T = pages_per_block * page_size

  pairs = rows * K
  per_core = -(-pairs // _CORES)
  kernel = functools.partial(
    _kernel,
    scale=scale,
    page_size=page_size,
    pages_per_block=pages_per_block,
    slots_per_row=slots_per_row,
    kv_heads=K,
    pairs=pairs,
  )
  qo_spec = pl.BlockSpec((None, Gp, E), lambda core, i, *_: (core * per_core + i, 0, 0))
  hbm_spec = pl.BlockSpec(memory_space=pl.ANY)
  buf = pltpu.VMEM((2, T, E), k_pages_XZE.dtype)  # two slots: one DMA'd into, one computed on
  dma = pltpu.SemaphoreType.DMA((2,))
  call = pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=4,
      grid=(_CORES, per_core),
      in_specs=[qo_spec, hbm_spec, hbm_spec],
      out_specs=qo_spec,
      scratch_shapes=[buf, buf, dma, dma, pltpu.SMEM((1,), jnp.int32)],
    ),
    out_shape=jax.ShapeDtypeStruct((_CORES * per_core, Gp, E), q_BKGE.dtype),
    # A core walks its pairs in order (the prefetch crosses its grid steps); the cores are apart.
    compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    interpret=interpret,
    name="sparse_decode_tpu",
  )
  # The pairs of a call in grid order, the last core's tail padded with empty pairs.
  to_pairs = lambda q_chunk_BKGE: jnp.pad(
    q_chunk_BKGE.reshape(pairs, Gp, E), ((0, _CORES * per_core - pairs), (0, 0), (0, 0))
  )

  def one_chunk(args):
    page_idx, logical_idx, n_valid, lengths, q = args
    return call(
      flat(jnp.clip(page_idx, 0, X - 1)),
      flat(logical_idx),
      n_valid.astype(jnp.int32).reshape(-1),
      lengths.astype(jnp.int32),
      to_pairs(q),
      k_pages_XZE,
      v_pages_XZE,
    )[:pairs].reshape(rows, K, Gp, E)

  args = (page_idx_BKN, logical_idx_BKN, n_valid_BK, lengths_B, q_BKGE_padded)
  if chunks == 1:
    out_BKGE = one_chunk(args)
  else:
    out_BKGE = jax.lax.map(one_chunk, tuple(map(by_chunk, args))).reshape(chunks * rows, K, Gp, E)[
      :B
    ]
  return out_BKGE[:, :, :G]


# Pallas twin of reference.sparse_decode_attention (per-row caches; the same keywords as above).
sparse_decode_attention = reference.per_row(paged_decode_attention)
