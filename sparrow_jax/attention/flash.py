"""Dense causal attention for teacher forcing (the policy's forward in training and calibration)
and the prefill's first chunk, by backend: cuDNN flash attention on GPU, splash attention on TPU,
the blockwise jnp path (attention/blockwise.py) elsewhere. Sparse teacher forcing stays blockwise
whatever the backend: it must keep the sampler's page choice, which neither fused kernel can take.

Rows hold one run of valid tokens each (right padding, as the trainer's rows; or left padding, as an
HF attention_mask). Splash takes the mask as segment ids (valid 1, padding 0), so any mask works;
cuDNN takes sequence lengths, so each row is rolled to start at its first valid token and rolled
back after. A query's output at a padded position is unspecified (the blockwise path and the kernels
differ there); callers mask those positions out.

`impl="auto"` picks cuDNN when tracing for a GPU (JAX traces its cuDNN call only where cuDNN is
installed) and otherwise lets `lax.platform_dependent` pick splash or blockwise when the function is
lowered, so a module exported for "tpu" from a CPU host holds the splash kernel.
"""

import functools
import math

import jax
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparrow_jax import sharding
from sparrow_jax.attention import blockwise

IMPLS = ("auto", "blockwise", "cudnn", "splash")
SPLASH_BLOCK = 512  # query and key tile of the splash kernels (rows are padded to a multiple)


def causal_attention(q_BTKGE, k_BTKE, v_BTKE, mask_BT, *, impl: str = "auto", interpret=False):
  """softmax(q k^T / sqrt(E)) v over the causal, valid keys; q's shape and dtype. `interpret` runs
  the splash kernel in the Pallas interpreter (tests on CPU)."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  E = q_BTKGE.shape[-1]
  if impl == "auto":
    if sharding.platform() in ("gpu", "cuda") and cudnn_supports(q_BTKGE.dtype, E):
      impl = "cudnn"
    elif splash_supports(E):
      tpu = functools.partial(_per_shard, _splash)
      return jax.lax.platform_dependent(
        q_BTKGE, k_BTKE, v_BTKE, mask_BT, tpu=tpu, default=_blockwise
      )
    else:
      impl = "blockwise"
  if impl == "cudnn":
    return _per_shard(_cudnn, q_BTKGE, k_BTKE, v_BTKE, mask_BT)
  if impl == "splash":
    fn = functools.partial(_splash, interpret=interpret)
    return _per_shard(fn, q_BTKGE, k_BTKE, v_BTKE, mask_BT)
  return _blockwise(q_BTKGE, k_BTKE, v_BTKE, mask_BT)


def cudnn_supports(dtype, head_dim: int) -> bool:
  """cuDNN's flash attention takes 16-bit operands and head sizes that are multiples of 8 up to 128
  (256 on Hopper; 128 is what every Qwen3 uses)."""
  return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and head_dim % 8 == 0 and head_dim <= 128


def splash_supports(head_dim: int) -> bool:
  """Splash tiles the head dimension by the TPU's 128 lanes."""
  return head_dim % 128 == 0


def _blockwise(q_BTKGE, k_BTKE, v_BTKE, mask_BT):
  return blockwise.attention(
    q_BTKGE, k_BTKE.transpose(0, 2, 1, 3), v_BTKE.transpose(0, 2, 1, 3), mask_BT
  )


def _cudnn(q_BTKGE, k_BTKE, v_BTKE, mask_BT, implementation="cudnn"):
  """jax.nn.dot_product_attention with sequence lengths; `implementation="xla"` runs the same call
  on any backend (the CPU tests)."""
  B, T, K, G, E = q_BTKGE.shape
  start_B = jnp.argmax(mask_BT, axis=1)  # the first valid token (0 for a row without one)
  len_B = jnp.sum(mask_BT, axis=1, dtype=jnp.int32)
  t_T = jnp.arange(T)

  def roll(x, index_BT):
    return jnp.take_along_axis(x, index_BT.reshape(B, T, *[1] * (x.ndim - 2)), axis=1)

  to_front_BT = (t_T[None] + start_B[:, None]) % T
  out_BTHE = jax.nn.dot_product_attention(
    roll(q_BTKGE, to_front_BT).reshape(B, T, K * G, E),
    roll(k_BTKE, to_front_BT),
    roll(v_BTKE, to_front_BT),
    is_causal=True,
    query_seq_lengths=len_B,
    key_value_seq_lengths=len_B,
    implementation=implementation,
  )
  return roll(out_BTHE, (t_T[None] - start_B[:, None]) % T).reshape(B, T, K, G, E)


def _splash(q_BTKGE, k_BTKE, v_BTKE, mask_BT, interpret=False):
  """The splash kernel per row (vmapped): heads-major operands, the query pre-scaled (splash does
  not scale), rows padded to whole tiles as padding (segment 0)."""
  B, T, K, G, E = q_BTKGE.shape
  block = min(SPLASH_BLOCK, -(-T // 128) * 128)
  Tp = -(-T // block) * block
  pad = lambda x: jnp.pad(x, [(0, 0), (0, Tp - T)] + [(0, 0)] * (x.ndim - 2))
  q_BHTE = (pad(q_BTKGE) * (1.0 / math.sqrt(E))).astype(q_BTKGE.dtype)
  q_BHTE = q_BHTE.reshape(B, Tp, K * G, E).transpose(0, 2, 1, 3)
  k_BKTE, v_BKTE = pad(k_BTKE).transpose(0, 2, 1, 3), pad(v_BTKE).transpose(0, 2, 1, 3)
  segment_BT = pad(mask_BT.astype(jnp.int32))
  causal = splash_mask.MultiHeadMask([splash_mask.CausalMask((Tp, Tp))] * (K * G))
  sizes = splash.BlockSizes(
    block_q=block,
    block_kv=block,
    block_kv_compute=block,
    block_q_dkv=block,
    block_kv_dkv=block,
    block_kv_dkv_compute=block,
    block_q_dq=block,
    block_kv_dq=block,
  )
  kernel = splash.make_splash_mha(
    causal, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
  )
  segments = splash.SegmentIds(q=segment_BT, kv=segment_BT)
  out_BHTE = jax.vmap(kernel)(q_BHTE, k_BKTE, v_BKTE, segment_ids=segments)
  return out_BHTE.transpose(0, 2, 1, 3)[:, :T].reshape(B, T, K, G, E)


def _per_shard(fn, q_BTKGE, k_BTKE, v_BTKE, mask_BT):
  """fn under `shard_map` on the enclosing mesh, each device on its own rows and KV heads (neither
  kernel is partitioned by XLA); a plain call without a mesh."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn(q_BTKGE, k_BTKE, v_BTKE, mask_BT)
  b, _, k = sharding.spec(("batch", "length", "kv_heads"), k_BTKE.shape[:3], mesh)
  specs = (P(b, None, k, None, None), P(b, None, k, None), P(b, None, k, None), P(b, None))
  return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(
    q_BTKGE, k_BTKE, v_BTKE, mask_BT
  )
