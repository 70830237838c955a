"""Sparse decode attention: jnp reference == naive softmax == dense when every page is selected; the
Pallas kernel (interpret mode on CPU) == the reference; the kernel lowers to Triton for CUDA."""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import sparse_decode
from sparrow_jax.attention import reference
from sparrow_jax.sparsity import policy

# bf16 inputs: both sides accumulate in float32 but sum in different orders and round the output to
# bf16 (8 significant bits), so they may land one bf16 ulp apart: |diff| <= 2^-7 * |out| + 2^-9.
BF16_RTOL, BF16_ATOL = 2.0**-7, 2.0**-9


def _jit(fn, **kwargs):
  """Compiling the whole function once is ~2x faster here than running its ops eagerly."""
  return jax.jit(functools.partial(fn, **kwargs))


def _inputs(seed, B, K, G, E, Z, P, N, dtype=jnp.float32):
  """Random q/cache, ragged lengths (partial last pages), N <= P distinct pages per row of which the
  first n_valid are real (some rows empty, one full) and the rest random valid ids (padding)."""
  rng = np.random.default_rng(seed)
  S = P * Z
  lengths = rng.integers(1, S + 1, size=B)
  lengths[0] = S - Z // 2
  n_valid = rng.integers(0, N + 1, size=(B, K))
  n_valid[0, 0] = 0
  n_valid[-1, -1] = N
  page_idx = rng.integers(0, P, size=(B, K, N))
  for b in range(B):
    for k in range(K):
      page_idx[b, k, : n_valid[b, k]] = rng.permutation(P)[: n_valid[b, k]]
  q = rng.standard_normal((B, K, G, E))
  kc, vc = rng.standard_normal((2, B, K, S, E))
  return (
    jnp.asarray(q, dtype),
    jnp.asarray(kc, dtype),
    jnp.asarray(vc, dtype),
    jnp.asarray(page_idx, jnp.int32),
    jnp.asarray(n_valid, jnp.int32),
    jnp.asarray(lengths, jnp.int32),
  )


def _naive(q, kc, vc, page_idx, n_valid, lengths, page_size, scale):
  """Loop over rows: softmax over the listed tokens in float64; zeros when there are none."""
  q, kc, vc = (np.asarray(x, np.float64) for x in (q, kc, vc))
  B, K, G, E = q.shape
  out = np.zeros((B, K, G, E))
  for b in range(B):
    for k in range(K):
      pos = [
        p * page_size + z
        for p in np.asarray(page_idx)[b, k, : int(n_valid[b, k])]
        for z in range(page_size)
        if p * page_size + z < int(lengths[b])
      ]
      if pos:
        s = q[b, k] @ kc[b, k, pos].T * scale
        w = np.exp(s - s.max(axis=-1, keepdims=True))
        out[b, k] = (w / w.sum(axis=-1, keepdims=True)) @ vc[b, k, pos]
  return out


def test_reference_matches_naive_softmax():
  q, kc, vc, page_idx, n_valid, lengths = _inputs(0, B=2, K=2, G=2, E=8, Z=4, P=5, N=3)
  scale = 0.3
  want = _naive(q, kc, vc, page_idx, n_valid, lengths, 4, scale)
  got = _jit(reference.sparse_decode_attention, page_size=4, scale=scale)(
    q, kc, vc, page_idx, n_valid, lengths
  )
  np.testing.assert_allclose(got, want, atol=1e-5)
  all_idx = jnp.broadcast_to(jnp.arange(5, dtype=jnp.int32), (2, 2, 5))
  want_dense = _naive(q, kc, vc, all_idx, jnp.full((2, 2), 5), lengths, 4, 0.25)
  got_dense = _jit(reference.dense_decode_attention, scale=0.25)(q, kc, vc, lengths)
  np.testing.assert_allclose(got_dense, want_dense, atol=1e-5)
  assert np.any(np.asarray(got) != 0)


def test_sparse_reference_equals_dense_when_all_pages_selected():
  B, K, P, Z = 3, 2, 6, 8
  q, kc, vc, _, _, lengths = _inputs(1, B=B, K=K, G=4, E=16, Z=Z, P=P, N=P)
  rng = np.random.default_rng(1)
  page_idx = jnp.asarray(
    np.stack([[rng.permutation(P) for _ in range(K)] for _ in range(B)]), jnp.int32
  )
  sparse = _jit(reference.sparse_decode_attention, page_size=Z)(
    q, kc, vc, page_idx, jnp.full((B, K), P, jnp.int32), lengths
  )
  dense = _jit(reference.dense_decode_attention)(q, kc, vc, lengths)
  np.testing.assert_allclose(sparse, dense, atol=1e-6)


def test_empty_selection_gives_zeros_not_nan():
  q, kc, vc, page_idx, _, _ = _inputs(2, B=2, K=2, G=2, E=16, Z=8, P=4, N=3)
  n_valid = jnp.asarray([[0, 2], [0, 0]], jnp.int32)
  lengths = jnp.asarray([20, 0], jnp.int32)  # row 1 has nothing cached at all
  for fn in (reference.sparse_decode_attention, sparse_decode.sparse_decode_attention):
    out = np.asarray(_jit(fn, page_size=8)(q, kc, vc, page_idx, n_valid, lengths))
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[0, 0], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)
    assert np.any(out[0, 1] != 0)
  dense = np.asarray(_jit(reference.dense_decode_attention)(q, kc, vc, lengths))
  np.testing.assert_array_equal(dense[1], 0.0)


# (G, E, Z, P, N, num_splits): G below and at the 16-row pad, pages of 8 (several per block) and 16,
# one and several blocks per split, more splits than valid blocks.
KERNEL_CASES = [
  (1, 16, 8, 12, 5, None),
  (2, 32, 16, 6, 4, 1),
  (4, 64, 8, 24, 20, 2),
  (2, 128, 16, 12, 9, 3),
  (1, 64, 8, 20, 17, 4),
]


def _config(dtype, use_dot):
  """The tuning table's entry for dtype with the G-query-head path forced (both must be right)."""
  return dataclasses.replace(sparse_decode.TUNING[dtype], use_dot=use_dot)


@pytest.mark.parametrize("use_dot", [False, True], ids=["reduce", "dot"])
@pytest.mark.parametrize("G,E,Z,P,N,num_splits", KERNEL_CASES)
def test_kernel_matches_reference_float32(G, E, Z, P, N, num_splits, use_dot):
  args = _inputs(10 + G + E + N, B=2, K=2, G=G, E=E, Z=Z, P=P, N=N)
  want = _jit(reference.sparse_decode_attention, page_size=Z)(*args)
  got = _jit(
    sparse_decode.sparse_decode_attention,
    page_size=Z,
    num_splits=num_splits,
    config=_config("float32", use_dot),
  )(*args)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("use_dot", [True, False], ids=["dot", "reduce"])
@pytest.mark.parametrize("G,E,Z,P,N,num_splits", [(2, 128, 16, 12, 9, 2), (4, 32, 8, 24, 20, None)])
def test_kernel_matches_reference_bfloat16(G, E, Z, P, N, num_splits, use_dot):
  """The dot path rounds the softmax weights to bfloat16 before p @ v (the reference keeps them
  in float32): still within one bfloat16 ulp of the output."""
  args = _inputs(20 + G, B=2, K=2, G=G, E=E, Z=Z, P=P, N=N, dtype=jnp.bfloat16)
  want = _jit(reference.sparse_decode_attention, page_size=Z)(*args)
  got = _jit(
    sparse_decode.sparse_decode_attention,
    page_size=Z,
    num_splits=num_splits,
    config=_config("bfloat16", use_dot),
  )(*args)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=BF16_RTOL, atol=BF16_ATOL
  )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 2, 3])
def test_kernel_ragged_selections_with_one_and_several_splits(num_splits, dtype):
  """n_valid of 0, 1, one short of a block, a whole block, one past it and all N (blocks of 4
  pages of 8): one split (normalised in the kernel, no merge) and several (merged), whose last
  block's look-ahead id load stays in the split's own ids."""
  q, kc, vc, page_idx, _, lengths = _inputs(7, B=2, K=3, G=2, E=32, Z=8, P=12, N=10, dtype=dtype)
  n_valid = jnp.asarray([[0, 1, 3], [4, 5, 10]], jnp.int32)
  args = (q, kc, vc, page_idx, n_valid, jnp.asarray([96, 93], jnp.int32))
  want = _jit(reference.sparse_decode_attention, page_size=8)(*args)
  name = jnp.dtype(dtype).name
  got = _jit(
    sparse_decode.sparse_decode_attention,
    page_size=8,
    num_splits=num_splits,
    config=dataclasses.replace(sparse_decode.TUNING[name], block_tokens=32),
  )(*args)
  assert got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got)[0, 0], 0.0)
  tol = dict(atol=1e-5) if dtype == jnp.float32 else dict(rtol=BF16_RTOL, atol=BF16_ATOL)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)


def test_default_splits_aim_at_the_target_without_empty_splits():
  assert sparse_decode.default_splits(16 * 8, 32, 1056) == 8  # batch 16: 1024 programs
  assert sparse_decode.default_splits(64 * 8, 32, 1056) == 2
  assert sparse_decode.default_splits(128 * 8, 32, 1056) == 1  # one split: no merge
  assert sparse_decode.default_splits(4, 5, 1056) == 5  # at most one split per block
  # 7 wanted over 10 blocks: 2 blocks a split, so 5 splits cover them all (7 would leave 2 empty)
  assert sparse_decode.default_splits(150, 10, 1056) == 5


def test_dispatch_and_budget_change_does_not_recompile():
  q, kc, vc, page_idx, n_valid, lengths = _inputs(3, B=2, K=2, G=2, E=16, Z=8, P=6, N=4)
  xla = _jit(reference.sparse_decode_attention, page_size=8)(q, kc, vc, page_idx, n_valid, lengths)
  for impl in ("auto", "xla"):  # auto is XLA on this CPU backend
    got = _jit(policy.decode_attention, page_size=8, impl=impl)(
      q, kc, vc, page_idx, n_valid, lengths
    )
    np.testing.assert_array_equal(got, xla)
  step = _jit(policy.decode_attention, page_size=8, impl="pallas")
  np.testing.assert_allclose(step(q, kc, vc, page_idx, n_valid, lengths), xla, atol=1e-5)
  step(q, kc, vc, page_idx, jnp.minimum(n_valid, 1), lengths)
  assert step._cache_size() == 1
  impls = r"\('auto', 'xla', 'pallas', 'pallas_tpu'\)"
  with pytest.raises(ValueError, match=f"impl must be one of {impls}"):
    policy.decode_attention(q, kc, vc, page_idx, n_valid, lengths, page_size=8, impl="triton")


def test_bad_arguments_raise():
  q, kc, vc, page_idx, n_valid, lengths = _inputs(4, B=1, K=2, G=2, E=24, Z=8, P=3, N=2)
  with pytest.raises(ValueError, match="page_size must be a positive power of two"):
    reference.sparse_decode_attention(q, kc, vc, page_idx, n_valid, lengths, page_size=12)
  with pytest.raises(ValueError, match="n_valid_BK must be"):
    reference.sparse_decode_attention(q, kc, vc, page_idx, n_valid[0], lengths, page_size=8)
  with pytest.raises(ValueError, match="head_dim must be a power of two >= 16"):
    sparse_decode.sparse_decode_attention(q, kc, vc, page_idx, n_valid, lengths, page_size=8)


@pytest.mark.parametrize(
  "dtype,use_dot", [("bfloat16", True), ("float32", False), ("bfloat16", False), ("float32", True)]
)
def test_kernel_lowers_to_triton_for_cuda(dtype, use_dot):
  """Lowering to the Triton custom call needs no GPU. jax.export refuses to serialize it by default
  because "__gpu$xla.gpu.triton" has no cross-version compatibility guarantee (the Triton IR is
  embedded as-is), so that one safety check is disabled; Triton -> PTX compilation itself only
  happens when XLA compiles the module on a GPU, so this cannot catch errors raised there."""
  B, K, G, E, Z, P, N = 4, 8, 2, 128, 16, 64, 16  # Qwen3-1.7B heads
  config = dataclasses.replace(_config(dtype, use_dot), block_tokens=64)
  f = jax.jit(
    functools.partial(
      sparse_decode.sparse_decode_attention, page_size=Z, config=config, interpret=False
    )
  )
  shapes = [
    ((B, K, G, E), dtype),
    ((B, K, P * Z, E), dtype),
    ((B, K, P * Z, E), dtype),
    ((B, K, N), jnp.int32),
    ((B, K), jnp.int32),
    ((B,), jnp.int32),
  ]
  args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
  with pytest.raises(ValueError, match="custom calls whose targets have no compatibility"):
    jax.export.export(f, platforms=["cuda"])(*args)
  exported = jax.export.export(
    f,
    platforms=["cuda"],
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
  )(*args)
  assert exported.platforms == ("cuda",)
  module = exported.mlir_module()
  assert module.count("@__gpu$xla.gpu.triton") == 1
  assert "grid_x = 4 : i32, grid_y = 8 : i32, grid_z = 4 : i32" in module  # (B, K, splits)
  assert f"num_warps = {config.num_warps} : i32" in module
  assert "stablehlo.optimization_barrier" in module  # between the kernel and the split merge
  # One split: the kernel writes the normalised output in q's dtype, and nothing merges.
  one = jax.export.export(
    jax.jit(
      functools.partial(
        sparse_decode.sparse_decode_attention,
        page_size=Z,
        config=config,
        num_splits=1,
        interpret=False,
      )
    ),
    platforms=["cuda"],
    disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
  )(*args)
  module = one.mlir_module()
  assert "grid_x = 4 : i32, grid_y = 8 : i32, grid_z = 1 : i32" in module
  assert "stablehlo.optimization_barrier" not in module
  out_type = {"bfloat16": "bf16", "float32": "f32"}[dtype]
  assert re.search(rf"@__gpu\$xla\.gpu\.triton\(.*-> tensor<4x8x\d+x128x{out_type}>", module)
