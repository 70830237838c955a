"""Llama-architecture models (Qwen3Config.qk_norm=False): logits equal transformers'
LlamaForCausalLM, save_hf / load_hf round trips, unsupported config keys named, and both sparse
decode kernels equal their jnp twins at SmolLM2's head shape (head dim 64, G = 3)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernels import sparse_decode, sparse_decode_tpu
import sparrow_jax as sj
from sparrow_jax.attention import reference
from tests.helpers import hf_logits, hf_model, tiny_config
from tests.test_sparse_decode_kernel import _inputs, _jit


def _llama_hf_config(**overrides):
  import transformers

  base = dict(
    vocab_size=97,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,  # G = 3, as SmolLM2 (9 / 3)
    head_dim=8,
    rope_theta=1e5,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    tie_word_embeddings=True,
  )
  base.update(overrides)
  return transformers.LlamaConfig(**base)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_logits_match_transformers_llama(tmp_path, tied):
  """A random transformers LlamaForCausalLM, saved by transformers, loads here as a Llama config
  and gives its logits (ragged rows: padding mask and positions)."""
  import torch
  import transformers

  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(_llama_hf_config(tie_word_embeddings=tied)).eval()
  with torch.no_grad():  # non-unit norms so that a missing or extra norm shows
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.3 * torch.randn_like(p))
  model.save_pretrained(tmp_path)
  cfg, params = sj.load_hf(str(tmp_path))
  assert not cfg.qk_norm and cfg.model_type == "llama"
  assert cfg.tie_word_embeddings == tied and cfg.rope_theta == 1e5
  assert "q_norm" not in params["layers"] and ("lm_head" in params) != tied
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 24))
  mask = np.ones((2, 24), bool)
  mask[1, 17:] = False
  got = sj.forward(params, jnp.asarray(tokens), cfg, mask_BT=jnp.asarray(mask))
  want = hf_logits(model, tokens, mask_BT=mask)
  np.testing.assert_allclose(np.asarray(got)[mask], want[mask], atol=1e-4)


@pytest.mark.slow
def test_save_hf_round_trip_is_a_llama_for_transformers(tmp_path):
  cfg = tiny_config(
    qk_norm=False,
    hidden_size=48,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=8,
    rope_theta=1e5,
  )
  params = sj.init_params(cfg, jax.random.PRNGKey(0), std=0.2)
  assert "q_norm" not in params["layers"]
  model = hf_model(cfg, params)  # our save_hf -> transformers
  assert type(model).__name__ == "LlamaForCausalLM"
  tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 20))
  np.testing.assert_allclose(
    hf_logits(model, tokens), sj.forward(params, jnp.asarray(tokens), cfg), atol=1e-4
  )
  sj.save_hf(str(tmp_path), cfg, params)
  cfg2, params2 = sj.load_hf(str(tmp_path))
  assert cfg2 == cfg
  jax.tree_util.tree_map(np.testing.assert_array_equal, params2, params)


@pytest.mark.slow
def test_qk_norm_changes_the_model():
  """The flag is read: the same weights (norms at non-unit values) give other logits with it off."""
  qwen = tiny_config()
  params = sj.init_params(qwen, jax.random.PRNGKey(2), std=0.2)
  params["layers"]["q_norm"] = params["layers"]["q_norm"] * 3.0
  llama = tiny_config(qk_norm=False)
  layers = {k: v for k, v in params["layers"].items() if k not in ("q_norm", "k_norm")}
  llama_params = {**params, "layers": layers}
  tokens = jnp.asarray(np.random.RandomState(2).randint(0, qwen.vocab_size, (1, 12)))
  a = sj.forward(params, tokens, qwen)
  b = sj.forward(llama_params, tokens, llama)
  assert float(jnp.max(jnp.abs(a - b))) > 1e-3


@pytest.mark.parametrize(
  "key,value",
  [
    ("attention_bias", True),
    ("mlp_bias", True),
    ("hidden_act", "gelu"),
    ("pretraining_tp", 2),
    ("num_local_experts", 8),
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0}),
  ],
)
def test_unsupported_llama_keys_are_named(key, value):
  d = {**tiny_config(qk_norm=False).to_hf_dict(), key: value}
  if key == "rope_scaling":
    d.pop("rope_parameters")
  match = "rope_type" if key == "rope_scaling" else key
  with pytest.raises(ValueError, match=match):
    sj.Qwen3Config.from_hf_dict(d)


def test_config_dict_round_trip_both_flavours():
  for qk_norm in (True, False):
    cfg = tiny_config(qk_norm=qk_norm, rope_theta=1e5)
    d = cfg.to_hf_dict()
    assert d["model_type"] == ("qwen3" if qk_norm else "llama")
    assert sj.Qwen3Config.from_hf_dict(d) == cfg


# SmolLM2-135M's attention: head dim 64, 3 query heads per KV head (9 / 3), pages of 16.
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_kernels_match_twins_at_head_dim_64_group_3(dtype):
  args = _inputs(64, B=2, K=3, G=3, E=64, Z=16, P=10, N=7, dtype=dtype)
  want = np.asarray(_jit(reference.sparse_decode_attention, page_size=16)(*args), np.float32)
  tol = dict(atol=1e-5) if dtype == jnp.float32 else dict(rtol=2.0**-7, atol=2.0**-9)
  for kernel in (sparse_decode.sparse_decode_attention, sparse_decode_tpu.sparse_decode_attention):
    got = _jit(kernel, page_size=16)(*args)
    assert got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), want, **tol)
