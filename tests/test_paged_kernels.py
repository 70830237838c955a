"""Both Pallas kernels read a page pool through page tables (physical page ids, logical ids for
the positions) exactly as their jnp twin does: rows whose pages are scattered over a shared pool,
shared prompt pages, a partial last page, padding and empty rows."""

import functools

import jax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import sparse_decode, sparse_decode_tpu
from sparrow_jax.attention import reference
from sparrow_jax.sparsity import policy


def _pool_inputs(seed, B, K, G, E, Z, X, N, dtype=jnp.float32):
  """A pool of X pages per KV head; each row's logical pages map to distinct physical pages (rows
  0 and 1 share their first two, as a GRPO group shares its prompt); each (row, head) selects
  n_valid of its pages in a random order, the rest padding."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(Z * 2 + 1, Z * (X // B) + 1, size=B)
  lengths[-1] = 0  # a slot that runs no row
  physical = rng.permutation(np.arange(1, X))  # page 0 is the trash page
  tables, at = [], 0
  for b in range(B):
    n = -(-lengths[b] // Z)
    table = physical[at : at + n].copy()
    at += n
    if b == 1:
      table[:2] = tables[0][:2]
    tables.append(table)
  page_idx = np.zeros((B, K, N), np.int32)
  logical = np.zeros((B, K, N), np.int32)
  n_valid = np.zeros((B, K), np.int32)
  for b in range(B):
    for k in range(K):
      n_pages = len(tables[b])
      n = min(N, n_pages) if (b + k) % 2 else rng.integers(0, min(N, n_pages) + 1)
      pick = rng.permutation(n_pages)[:n]
      logical[b, k, :n], n_valid[b, k] = pick, n
      page_idx[b, k, :n] = k * X + tables[b][pick]
      page_idx[b, k, n:] = rng.integers(0, K * X, N - n)  # padding: any valid id
  q = rng.standard_normal((B, K, G, E))
  k_pages, v_pages = rng.standard_normal((2, K * X, Z, E))
  return (
    jnp.asarray(q, dtype),
    jnp.asarray(k_pages, dtype),
    jnp.asarray(v_pages, dtype),
    jnp.asarray(page_idx),
    jnp.asarray(logical),
    jnp.asarray(n_valid),
    jnp.asarray(lengths, jnp.int32),
  )


def _naive(q, k_pages, v_pages, page_idx, logical, n_valid, lengths):
  q, k_pages, v_pages = (np.asarray(x, np.float64) for x in (q, k_pages, v_pages))
  B, K, G, E = q.shape
  Z = k_pages.shape[1]
  out = np.zeros((B, K, G, E))
  for b in range(B):
    for k in range(K):
      keys, values = [], []
      for i in range(int(n_valid[b, k])):
        for z in range(Z):
          if int(logical[b, k, i]) * Z + z < int(lengths[b]):
            keys.append(k_pages[int(page_idx[b, k, i]), z])
            values.append(v_pages[int(page_idx[b, k, i]), z])
      if keys:
        s = q[b, k] @ np.asarray(keys).T / np.sqrt(E)
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        out[b, k] = (w / w.sum(axis=-1, keepdims=True)) @ np.asarray(values)
  return out


KERNELS = {
  "pallas": functools.partial(sparse_decode.paged_decode_attention, interpret=True),
  "pallas_tpu": sparse_decode_tpu.paged_decode_attention,
}


@pytest.mark.parametrize("G,E,Z,X,N", [(2, 16, 8, 40, 5), (4, 32, 16, 30, 7)])
def test_reference_reads_the_pool_through_page_tables(G, E, Z, X, N):
  args = _pool_inputs(G + E, B=3, K=2, G=G, E=E, Z=Z, X=X, N=N)
  got = jax.jit(reference.paged_decode_attention)(*args)
  np.testing.assert_allclose(got, _naive(*args), atol=1e-5)
  assert np.all(np.asarray(got)[-1] == 0)  # the empty slot reads nothing


@pytest.mark.slow
@pytest.mark.parametrize("impl", list(KERNELS))
@pytest.mark.parametrize("G,E,Z,X,N", [(2, 16, 8, 40, 5), (4, 32, 16, 30, 7)])
def test_kernels_equal_their_twin_with_page_tables(impl, G, E, Z, X, N):
  args = _pool_inputs(G + E + 1, B=3, K=2, G=G, E=E, Z=Z, X=X, N=N)
  want = jax.jit(reference.paged_decode_attention)(*args)
  np.testing.assert_allclose(jax.jit(KERNELS[impl])(*args), want, atol=1e-5)
  dispatched = jax.jit(functools.partial(policy.paged_decode_attention, impl=impl))(*args)
  np.testing.assert_allclose(dispatched, want, atol=1e-5)


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_the_engine_decode_attention_lowers_for_accelerators(platform):
  """policy.paged_decode_attention with impl auto exports for CUDA and TPU from this CPU: the
  Pallas kernel of each platform in the module (Qwen3 head shapes, a pool of 4K pages)."""
  B, K, G, E, Z, X, N = 4, 8, 2, 128, 16, 4096, 64
  shapes = [
    ((B, K, G, E), jnp.bfloat16),
    ((K * X, Z, E), jnp.bfloat16),
    ((K * X, Z, E), jnp.bfloat16),
    ((B, K, N), jnp.int32),
    ((B, K, N), jnp.int32),
    ((B, K), jnp.int32),
    ((B,), jnp.int32),
  ]
  # Triton IR has no cross-version guarantee, so jax.export asks to accept it by name
  disabled = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  exported = jax.export.export(
    jax.jit(policy.paged_decode_attention),
    platforms=[platform],
    disabled_checks=disabled if platform == "cuda" else (),
  )(*[jax.ShapeDtypeStruct(s, d) for s, d in shapes])
  module = exported.mlir_module()
  assert ("tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton") in module


@pytest.mark.slow
def test_tpu_kernel_splits_a_batch_whose_page_lists_overflow_smem():
  """A batch whose scalar prefetch needs more than smem_bytes runs as calls over row chunks (here
  2 rows a call for 5 rows: 3 calls, the last one padded) and equals the twin; the chunking follows
  the budget of the 1 MiB SMEM for Qwen3-1.7B's dense 32K lists."""
  B, K, N = 5, 2, 7
  args = _pool_inputs(11, B=B, K=K, G=2, E=16, Z=8, X=60, N=N)
  per_row = 4 * (K * (2 * N + 1) + 1)
  assert sparse_decode_tpu.rows_per_call(B, K, N, 2 * per_row + 3) == 2
  got = jax.jit(
    functools.partial(
      sparse_decode_tpu.paged_decode_attention, smem_bytes=2 * per_row + 3, pages_per_block=1
    )
  )(*args)
  np.testing.assert_allclose(got, jax.jit(reference.paged_decode_attention)(*args), atol=1e-5)
  # 8 KV heads x 2048 pages (dense at 32K): 131 KB a row, 3 rows a call in 512 KiB
  assert sparse_decode_tpu.rows_per_call(64, 8, 2048, sparse_decode_tpu.SMEM_PREFETCH_BYTES) == 3
  with pytest.raises(ValueError, match="exceed the 1000 bytes of SMEM"):
    sparse_decode_tpu.rows_per_call(4, 8, 2048, 1000)


def _tpu_edge_inputs(n_valid_P, lengths_B, K, seed=3, G=2, E=16, Z=8, X=24, N=7):
  """Random pool and page lists (any ids and logical ids: the twin masks exactly what the kernel
  must) with the given n_valid per (row, KV head) pair in grid order and row lengths."""
  rng = np.random.default_rng(seed)
  B = len(lengths_B)
  q = rng.standard_normal((B, K, G, E))
  k_pages, v_pages = rng.standard_normal((2, X, Z, E))
  return (
    jnp.asarray(q, jnp.float32),
    jnp.asarray(k_pages, jnp.float32),
    jnp.asarray(v_pages, jnp.float32),
    jnp.asarray(rng.integers(0, X, (B, K, N)), jnp.int32),
    jnp.asarray(rng.integers(0, X // 2, (B, K, N)), jnp.int32),
    jnp.asarray(n_valid_P, jnp.int32).reshape(B, K),
    jnp.asarray(lengths_B, jnp.int32),
  )


# n_valid per pair in grid order, blocks of 3 pages, 9 pairs = 2 cores x 5 (the last one padding):
# core 0 starts empty, then 1 page, a whole block, an empty pair between two with pages, and ends
# short of a block; core 1 starts with a row that lists pages but caches nothing, then an empty
# pair, one page past a block, and all 7 (3 blocks, the last with 1 page).
EDGE_N_VALID = [0, 1, 3, 0, 2, 5, 0, 4, 7]
EDGE_LENGTHS = [90, 17, 60, 1, 96, 0, 40, 96, 70]


@pytest.mark.slow
@pytest.mark.parametrize("cores", [1, 2])
def test_tpu_kernel_prefetch_crosses_programs_at_every_edge(cores):
  """Each program's first block is started by the program before it on its core (a core's first
  program starts its own; an empty program passes its slot on): equal to the twin with the grid's
  two halves on one simulated core or on two, DMAs landing only when waited for."""
  args = _tpu_edge_inputs(EDGE_N_VALID, EDGE_LENGTHS, K=1)
  want = jax.jit(reference.paged_decode_attention)(*args)
  kernel = functools.partial(
    sparse_decode_tpu.paged_decode_attention,
    pages_per_block=3,
    interpret=pltpu.InterpretParams(num_cores_or_threads=cores),
  )
  got = np.asarray(jax.jit(kernel)(*args))
  np.testing.assert_allclose(got, want, atol=1e-5)
  np.testing.assert_array_equal(got[[0, 3, 5, 6]], 0.0)  # empty pairs give zeros
  # The same pairs as 3 rows of 3 KV heads: pairs of one row on both cores.
  args3 = _tpu_edge_inputs(EDGE_N_VALID, EDGE_LENGTHS[::3], K=3)
  got3 = jax.jit(kernel)(*args3)
  np.testing.assert_allclose(got3, jax.jit(reference.paged_decode_attention)(*args3), atol=1e-5)


@pytest.mark.slow
def test_tpu_kernel_copies_no_page_past_n_valid_inside_a_block():
  """Page 5 holds NaN and sits only in slots past n_valid inside the last block (3 pages a block):
  it is not copied, and the V rows it would fill are zeroed, so the output stays the twin's."""
  args = list(_tpu_edge_inputs([2, 4], [96, 96], K=1, X=8))
  args[3] = jnp.asarray([[[0, 1, 5, 5, 5, 5, 5]], [[2, 3, 4, 6, 5, 5, 5]]], jnp.int32)
  want = jax.jit(reference.paged_decode_attention)(*args)
  args[1], args[2] = (pages.at[5].set(jnp.nan) for pages in args[1:3])
  got = jax.jit(functools.partial(sparse_decode_tpu.paged_decode_attention, pages_per_block=3))(
    *args
  )
  np.testing.assert_allclose(got, want, atol=1e-5)
