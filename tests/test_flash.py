"""Dense teacher-forced attention by backend (attention/flash.py): the cuDNN path's glue (rolled
rows, sequence lengths; run here by jax.nn.dot_product_attention's XLA implementation) and the
splash kernel (Pallas interpreter) equal the blockwise path on every valid query, forward and
gradients, for right- and left-padded rows; on CPU the model's attention is the blockwise path, bit
for bit; lowered for TPU, the model's forward and backward hold the splash kernels."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax import sharding
from sparrow_jax.attention import blockwise, flash
from sparrow_jax.model import qwen3
from sparrow_jax.model.config import Qwen3Config

B, T, K, G, E = 2, 200, 2, 2, 128
MASKS = {
  "right": jnp.arange(T)[None] < jnp.array([[150], [T]]),
  "left": jnp.arange(T)[None] >= jnp.array([[30], [0]]),
}
IMPLS = {
  "cudnn_glue": lambda *a: flash._cudnn(*a, implementation="xla"),
  "splash": lambda *a: flash._splash(*a, interpret=True),
}


def _qkv():
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(0), 3)
  return (
    jax.random.normal(kq, (B, T, K, G, E)),
    jax.random.normal(kk, (B, T, K, E)),
    jax.random.normal(kv, (B, T, K, E)),
  )


def _masked_loss(fn, mask_BT):
  """A loss that reads every valid query's output (padded queries are unspecified)."""
  weight_E = jnp.cos(jnp.arange(E))
  keep = mask_BT[:, :, None, None, None]
  return lambda q, k, v: jnp.sum(jnp.where(keep, fn(q, k, v, mask_BT) * weight_E, 0.0))


@pytest.mark.slow
@pytest.mark.parametrize("padding", MASKS)
@pytest.mark.parametrize("impl", IMPLS)
def test_fused_paths_equal_blockwise_on_valid_queries(impl, padding):
  q, k, v = _qkv()
  mask_BT = MASKS[padding]
  keep = mask_BT[:, :, None, None, None]
  want = flash._blockwise(q, k, v, mask_BT)
  got = IMPLS[impl](q, k, v, mask_BT)
  np.testing.assert_allclose(np.where(keep, got, 0), np.where(keep, want, 0), atol=2e-5)
  grads = jax.grad(_masked_loss(IMPLS[impl], mask_BT), argnums=(0, 1, 2))(q, k, v)
  grads_want = jax.grad(_masked_loss(flash._blockwise, mask_BT), argnums=(0, 1, 2))(q, k, v)
  for g, w in zip(grads, grads_want):
    np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-4)


def test_cpu_auto_is_the_blockwise_path():
  q, k, v = _qkv()
  mask_BT = MASKS["right"]
  auto = jax.jit(lambda *a: flash.causal_attention(*a))(q, k, v, mask_BT)
  plain = jax.jit(
    lambda q, k, v, m: blockwise.attention(q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), m)
  )(q, k, v, mask_BT)
  np.testing.assert_array_equal(auto, plain)


def test_backend_choice():
  assert flash.cudnn_supports(jnp.bfloat16, 128) and not flash.cudnn_supports(jnp.float32, 128)
  assert not flash.cudnn_supports(jnp.bfloat16, 12)
  assert flash.splash_supports(128) and not flash.splash_supports(64)
  with pytest.raises(ValueError, match="impl must be one of .* got 'flash2'"):
    flash.causal_attention(*_qkv(), MASKS["right"], impl="flash2")


def _dot_operand_dtypes(closed_jaxpr) -> set:
  """The (lhs, rhs) dtypes of every dot_general in a jaxpr and the jaxprs inside it."""
  found = set()

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "dot_general":
        found.add(tuple(str(x.aval.dtype) for x in eqn.invars))
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          inner = getattr(sub, "jaxpr", sub)
          if hasattr(inner, "eqns"):
            walk(inner)

  walk(closed_jaxpr.jaxpr)
  return found


def test_blockwise_takes_16_bit_operands_off_cpu(monkeypatch):
  """On an accelerator the blockwise path's matmuls (sparse teacher forcing, prefill) take bf16
  operands and accumulate in float32; on CPU, which has no fast bf16 dots, float32 operands."""
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv())
  mask_BT = MASKS["right"]
  fn = lambda q, k, v: flash._blockwise(q, k, v, mask_BT)
  loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32))
  assert _dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss))(q, k, v)) == {("float32", "float32")}
  monkeypatch.setattr(sharding, "platform", lambda: "tpu")
  assert _dot_operand_dtypes(jax.make_jaxpr(jax.grad(loss))(q, k, v)) == {("bfloat16", "bfloat16")}
  want = flash._blockwise(*(x.astype(jnp.float32) for x in (q, k, v)), mask_BT)
  np.testing.assert_allclose(np.float32(fn(q, k, v)), want, atol=3e-2)


@pytest.mark.slow
def test_model_lowered_for_tpu_runs_splash_forward_and_backward():
  """jax.export for "tpu" (no TPU needed) of the policy's loss gradient at Qwen3 head size: the
  scanned layers' attention is the splash kernels (forward, dq and dkv); on CPU the same function
  has none."""
  cfg = Qwen3Config(
    vocab_size=64,
    hidden_size=256,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
  )
  params = jax.eval_shape(lambda: qwen3.init_params(cfg, jax.random.PRNGKey(0), jnp.bfloat16))
  tokens = jax.ShapeDtypeStruct((2, 256), jnp.int32)
  mask = jax.ShapeDtypeStruct((2, 256), jnp.bool_)

  def loss(params, tokens, mask):
    logits = qwen3.forward(params, tokens, cfg, mask_BT=mask)
    return jnp.mean(qwen3.token_logprobs(logits, tokens))

  grad = jax.jit(jax.grad(loss))
  tpu = jax.export.export(grad, platforms=["tpu"])(params, tokens, mask).mlir_module()
  assert tpu.count("@tpu_custom_call(") >= 3  # forward, dq, dkv (inside the layer scan)
  for kernel in ("splash_mha_fwd", "splash_mha_dq", "splash_mha_dkv"):
    assert kernel in tpu, kernel
  cpu = jax.export.export(grad, platforms=["cpu"])(params, tokens, mask).mlir_module()
  assert "tpu_custom_call" not in cpu and "splash_mha" not in cpu
