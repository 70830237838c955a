"""The Pallas TPU sparse decode kernel (TPU interpret mode on CPU) == the jnp reference, and it
lowers to a Mosaic kernel for TPU with the designed structure (grid, scalar prefetch, page DMAs)."""

import base64
import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import sparse_decode_tpu
from sparrow_jax.attention import reference
from tests.test_sparse_decode_kernel import BF16_ATOL, BF16_RTOL, _inputs, _jit

# (G, E, Z, P, N, pages_per_block): G 1/2/4 (all padded to 8 sublanes), head_dim 128 and 64, pages
# of 8 and 16, one block (default), one page per block, N not a multiple of the block.
FLOAT32_CASES = [
  (1, 128, 8, 12, 5, None),
  (2, 64, 16, 6, 4, 1),
  (4, 128, 8, 24, 20, 3),
  (2, 128, 16, 12, 9, 2),
  (4, 64, 8, 20, 17, 4),
]


@pytest.mark.slow
@pytest.mark.parametrize("G,E,Z,P,N,pages_per_block", FLOAT32_CASES)
def test_kernel_matches_reference_float32(G, E, Z, P, N, pages_per_block):
  args = _inputs(30 + G + E + N, B=2, K=2, G=G, E=E, Z=Z, P=P, N=N)
  want = _jit(reference.sparse_decode_attention, page_size=Z)(*args)
  got = _jit(
    sparse_decode_tpu.sparse_decode_attention, page_size=Z, pages_per_block=pages_per_block
  )(*args)
  assert got.shape == want.shape and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, atol=1e-5)


# bf16 pages of 16 rows: whole (16, 128) bf16 tiles, the Qwen3 layout.
@pytest.mark.slow
@pytest.mark.parametrize(
  "G,E,Z,P,N,pages_per_block", [(2, 128, 16, 12, 9, 2), (4, 64, 16, 8, 6, None)]
)
def test_kernel_matches_reference_bfloat16(G, E, Z, P, N, pages_per_block):
  args = _inputs(40 + G, B=2, K=2, G=G, E=E, Z=Z, P=P, N=N, dtype=jnp.bfloat16)
  want = _jit(reference.sparse_decode_attention, page_size=Z)(*args)
  got = _jit(
    sparse_decode_tpu.sparse_decode_attention, page_size=Z, pages_per_block=pages_per_block
  )(*args)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(
    np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=BF16_RTOL, atol=BF16_ATOL
  )


def test_empty_selection_gives_zeros_not_nan():
  q, kc, vc, page_idx, _, _ = _inputs(2, B=2, K=2, G=2, E=128, Z=8, P=4, N=3)
  n_valid = jnp.asarray([[0, 2], [0, 0]], jnp.int32)
  lengths = jnp.asarray([20, 0], jnp.int32)  # row 1 has nothing cached at all
  out = np.asarray(
    _jit(sparse_decode_tpu.sparse_decode_attention, page_size=8)(
      q, kc, vc, page_idx, n_valid, lengths
    )
  )
  assert np.all(np.isfinite(out))
  np.testing.assert_array_equal(out[0, 0], 0.0)
  np.testing.assert_array_equal(out[1], 0.0)
  assert np.any(out[0, 1] != 0)


@pytest.mark.slow
def test_blocks_past_n_valid_are_skipped():
  """Page 5 is listed only in padding slots of blocks wholly past n_valid, and holds NaN: computing
  on such a block would make the output NaN (p = 0 times v = NaN), while the padding slot that
  shares a block with a valid one lists a clean page."""
  q, kc, vc, _, _, lengths = _inputs(5, B=1, K=2, G=2, E=128, Z=8, P=6, N=6)
  page_idx = jnp.asarray([[[0, 1, 5, 5, 5, 5], [2, 3, 0, 1, 5, 5]]], jnp.int32)
  n_valid = jnp.asarray([[1, 3]], jnp.int32)  # pages_per_block 2: blocks 0 and 0..1
  want = _jit(reference.sparse_decode_attention, page_size=8)(q, kc, vc, page_idx, n_valid, lengths)
  kc_nan, vc_nan = (c.at[:, :, 40:48].set(jnp.nan) for c in (kc, vc))
  got = _jit(sparse_decode_tpu.sparse_decode_attention, page_size=8, pages_per_block=2)(
    q, kc_nan, vc_nan, page_idx, n_valid, lengths
  )
  np.testing.assert_allclose(got, want, atol=1e-5)


def test_bad_pages_per_block_raises():
  args = _inputs(6, B=1, K=1, G=2, E=128, Z=8, P=3, N=2)
  with pytest.raises(ValueError, match="pages_per_block must be a positive int"):
    sparse_decode_tpu.sparse_decode_attention(*args, page_size=8, pages_per_block=0)


def _mosaic_text(stablehlo_text):
  """The Mosaic kernel embedded in the module's tpu_custom_call, as MLIR text. The body is
  serialized Mosaic bytecode; reading it back uses jax-internal MLIR bindings (jax 0.10.2)."""
  from jax._src.interpreters import mlir
  from jax._src.lib import tpu
  from jax._src.lib.mlir import ir, passmanager

  config = re.search(r'backend_config = "(.*?)"', stablehlo_text).group(1).replace("\\22", '"')
  body = base64.b64decode(json.loads(config)["custom_call_config"]["body"])
  ctx = mlir.make_ir_context()
  tpu.register_dialect(ctx)
  with ctx, ir.Location.unknown():
    ctx.allow_unregistered_dialects = True
    module = ir.Module.parse(body)
    passmanager.PassManager.parse("builtin.module(mosaic-serde{serialize=false})").run(
      module.operation
    )
    return str(module)


def test_kernel_lowers_to_mosaic_for_tpu():
  """Lowering to the Mosaic custom call needs no TPU, and jax.export accepts "tpu_custom_call"
  with no disabled safety check (it is on jax.export's list of stable targets). Mosaic's own
  passes (layouts, tiling) run only when a TPU compiles the module, so this cannot catch errors
  raised there; it does check the kernel JAX builds: grid, scalar prefetch, page DMAs, dots."""
  B, K, G, E, Z, P, N = 4, 8, 2, 128, 16, 64, 16  # Qwen3-1.7B heads, a 256-token budget
  f = jax.jit(
    functools.partial(sparse_decode_tpu.sparse_decode_attention, page_size=Z, interpret=False)
  )
  shapes = [
    ((B, K, G, E), jnp.bfloat16),
    ((B, K, P * Z, E), jnp.bfloat16),
    ((B, K, P * Z, E), jnp.bfloat16),
    ((B, K, N), jnp.int32),
    ((B, K), jnp.int32),
    ((B,), jnp.int32),
  ]
  exported = jax.export.export(f, platforms=["tpu"])(
    *[jax.ShapeDtypeStruct(s, d) for s, d in shapes]
  )
  assert exported.platforms == ("tpu",)
  module = exported.mlir_module()
  assert module.count("@tpu_custom_call(") == 1
  kernel = _mosaic_text(module)
  # grid (cores, B * K / cores): the pair axis in order, for the prefetch across programs
  assert "iteration_bounds = array<i64: 2, 16>" in kernel
  assert "#tpu.dimension_semantics<parallel>, #tpu.dimension_semantics<arbitrary>" in kernel
  assert "scalar_prefetch = 4" in kernel  # page ids, their logical ids, n_valid, lengths
  assert "memref<1xi32, #tpu.memory_space<smem>>" in kernel  # the slot carried across programs
  # the caches as one flat page array (B * K * P pages), in HBM
  assert kernel.count("memref<2048x16x128xbf16, #tpu.memory_space<any>>, ") >= 2
  assert "memref<2x256x128xbf16, #tpu.memory_space<vmem>>" in kernel  # 2 slots x 16 pages x 16
  page_dma = r"tpu.enqueue_dma source\(%\w+ : memref<16x128xbf16, #tpu.memory_space<any>>\)"
  assert re.search(page_dma, kernel)
  assert "tpu.wait_dma2" in kernel
  # Both dots: bf16 operands, float32 accumulation; G padded to 16 rows (one bf16 sublane tile).
  scores = "vector<16x128xbf16>, vector<256x128xbf16>, vector<16x256xf32> -> vector<16x256xf32>"
  weighted = "vector<16x256xbf16>, vector<256x128xbf16>, vector<16x128xf32> -> vector<16x128xf32>"
  assert scores in kernel and weighted in kernel
