"""Decode attention dispatch (sparsity/policy.py): the length-aware dense baseline equals the
whole-cache reference and never reads past the longest row; "auto" picks each platform's kernel when
lowered for that platform, whatever machine traces it."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.attention import reference
from sparrow_jax.sparsity import policy
from tests.test_sparse_decode_kernel import BF16_ATOL, BF16_RTOL, _inputs, _jit

TRITON, MOSAIC = "@__gpu$xla.gpu.triton", "tpu_custom_call"


def _dense_inputs(seed, dtype, S=1024, poison_from=None):
  """q, caches of S slots and ragged lengths (<= 600); slots >= poison_from hold NaN."""
  q, kc, vc, *_ = _inputs(seed, B=3, K=2, G=2, E=128, Z=16, P=S // 16, N=1, dtype=dtype)
  lengths = jnp.asarray([600, 17, 1], jnp.int32)
  if poison_from is not None:
    kc, vc = (x.at[:, :, poison_from:].set(jnp.nan) for x in (kc, vc))
  return q, kc, vc, lengths


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas", "pallas_tpu"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_decode_equals_the_whole_cache_reference(impl, dtype):
  q, kc, vc, lengths = _dense_inputs(0, dtype)
  want = _jit(reference.dense_decode_attention)(q, kc, vc, lengths)
  got = _jit(policy.dense_decode_attention, page_size=16, impl=impl)(q, kc, vc, lengths)
  assert got.dtype == q.dtype
  if dtype == "float32":
    np.testing.assert_allclose(got, want, atol=1e-5)
  else:
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=BF16_RTOL, atol=BF16_ATOL
    )


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas", "pallas_tpu"])
def test_dense_decode_reads_nothing_past_the_longest_row(impl):
  """NaN in every slot from 1024 on (the longest row holds 600 tokens; no kernel or XLA block
  reaches past 1024): a read of one of them would make the output NaN, as it does for the
  whole-cache reference."""
  q, kc, vc, lengths = _dense_inputs(1, "float32", S=4096, poison_from=1024)
  clean = _dense_inputs(1, "float32", S=4096)
  got = _jit(policy.dense_decode_attention, page_size=16, impl=impl)(q, kc, vc, lengths)
  assert np.all(np.isnan(_jit(reference.dense_decode_attention)(q, kc, vc, lengths)))
  np.testing.assert_allclose(got, _jit(reference.dense_decode_attention)(*clean), atol=1e-5)


def _module(fn, platform, dtype, *shapes):
  args = [jax.ShapeDtypeStruct(s, jnp.int32 if len(s) < 4 else dtype) for s in shapes]
  checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON[1:])]
  return jax.export.export(jax.jit(fn), platforms=[platform], disabled_checks=checks)(
    *args
  ).mlir_module()


@pytest.mark.slow
@pytest.mark.parametrize(
  "platform,has,lacks",
  [("cuda", TRITON, MOSAIC), ("tpu", MOSAIC, TRITON), ("cpu", None, (TRITON, MOSAIC))],
)
def test_auto_picks_the_kernel_of_the_platform_it_is_lowered_for(platform, has, lacks):
  """Traced here on a CPU, exported for each platform: CUDA gets the Triton kernel, TPU the Mosaic
  kernel, CPU the XLA path; for sparse and dense decode alike."""
  B, K, G, E, Z, P, N = 2, 8, 2, 128, 16, 64, 16
  q, cache, idx, n, lengths = (B, K, G, E), (B, K, P * Z, E), (B, K, N), (B, K), (B,)
  sparse = functools.partial(policy.decode_attention, page_size=Z, impl="auto")
  dense = functools.partial(policy.dense_decode_attention, page_size=Z, impl="auto")
  for module in (
    _module(sparse, platform, jnp.bfloat16, q, cache, cache, idx, n, lengths),
    _module(dense, platform, jnp.bfloat16, q, cache, cache, lengths),
  ):
    if has:
      assert has in module
    for name in lacks if isinstance(lacks, tuple) else (lacks,):
      assert name not in module
