"""Parity of the JAX Qwen3 with transformers, and incremental decoding against forward."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparrow_jax as sj
from sparrow_jax.attention import paged_cache
from sparrow_jax.model import qwen3
from tests.helpers import hf_logits, hf_model, tiny_config

CONFIGS = {
    "tied_gqa2": tiny_config(),
    "untied_gqa1": tiny_config(tie_word_embeddings=False, num_key_value_heads=4),
    "gqa4_theta": tiny_config(num_attention_heads=8, num_key_value_heads=2, rope_theta=5000.0,
                              num_hidden_layers=3),
    "linear_rope": tiny_config(rope_scaling=(("factor", 2.0), ("rope_type", "linear"))),
    "yarn_rope": tiny_config(rope_scaling=(("factor", 4.0), ("original_max_position_embeddings", 64),
                                           ("rope_type", "yarn"))),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name):
  cfg = CONFIGS[name]
  params = sj.init_params(cfg, jax.random.PRNGKey(1), std=0.2)
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 40))
  ref = hf_logits(hf_model(cfg, params), tokens)
  ours = np.asarray(sj.forward(params, jnp.asarray(tokens), cfg))
  assert np.abs(ours - ref).max() <= 1e-4


def test_rope_theta_changes_logits():
  """A peer library silently ignored rope_theta: make sure ours does not."""
  cfg = tiny_config()
  params = sj.init_params(cfg, jax.random.PRNGKey(1), std=0.2)
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 40)))
  a = sj.forward(params, tokens, cfg)
  b = sj.forward(params, tokens, tiny_config(rope_theta=100.0))
  assert float(jnp.abs(a - b).max()) > 1e-3


def test_padded_ragged_batch_matches_transformers():
  cfg = tiny_config()
  params = sj.init_params(cfg, jax.random.PRNGKey(2), std=0.2)
  rng = np.random.RandomState(1)
  tokens = rng.randint(0, cfg.vocab_size, (3, 24))
  mask = np.ones((3, 24), bool)
  mask[0, :7] = False   # left padding
  mask[1, 15:] = False  # right padding
  positions = np.asarray(qwen3.default_positions(jnp.asarray(mask)))
  ref = hf_logits(hf_model(cfg, params), tokens, mask, positions)
  ours = np.asarray(sj.forward(params, jnp.asarray(tokens), cfg, mask_BT=jnp.asarray(mask)))
  assert np.abs(ours - ref)[mask].max() <= 1e-4
  # A row's real tokens do not depend on its padding.
  alone = np.asarray(sj.forward(params, jnp.asarray(tokens[1:2, :15]), cfg))
  assert np.abs(alone[0] - ours[1, :15]).max() <= 1e-5


def test_bfloat16_tolerance():
  """bf16 params and activations: logits within 0.1 of the float32 transformers model (documented
  tolerance; bf16 has ~3 significant digits and errors grow with depth)."""
  cfg = tiny_config()
  params = sj.init_params(cfg, jax.random.PRNGKey(3), std=0.2)
  tokens = np.random.RandomState(2).randint(0, cfg.vocab_size, (2, 32))
  ref = hf_logits(hf_model(cfg, params), tokens)
  params_bf16 = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  ours = np.asarray(sj.forward(params_bf16, jnp.asarray(tokens), cfg))
  assert ours.dtype == np.float32
  assert np.abs(ours - ref).max() <= 0.1


@pytest.mark.parametrize("name", ["tied_gqa2", "gqa4_theta"])
def test_incremental_decoding_matches_forward(name):
  cfg = CONFIGS[name]
  params = sj.init_params(cfg, jax.random.PRNGKey(4), std=0.2)
  B, T = 2, 37
  tokens = jnp.asarray(np.random.RandomState(3).randint(0, cfg.vocab_size, (B, T)))
  full = sj.forward(params, tokens, cfg)
  prompt_len = jnp.asarray([5, 9])
  cache = paged_cache.init_cache(cfg, B, T, page_size=8)
  prompt = jnp.where(jnp.arange(T)[None] < prompt_len[:, None], tokens, 0)
  logits, cache = jax.jit(qwen3.prefill, static_argnums=3)(params, prompt, prompt_len, cfg, cache)
  np.testing.assert_allclose(logits, full[jnp.arange(B), prompt_len - 1], atol=1e-5)
  cache = paged_cache.split_layers(cache)
  step = jax.jit(lambda p, tok, c: qwen3.decode_step(p, tok, cfg, c))
  for t in range(int(prompt_len.min()), T - 4):
    pos = jnp.minimum(prompt_len + (t - prompt_len.min()), T - 1)
    logits, cache = step(params, tokens[jnp.arange(B), pos], cache)
    np.testing.assert_allclose(logits, full[jnp.arange(B), pos], atol=1e-5)


def test_tokens_outside_vocab_rejected():
  cfg = tiny_config()
  params = sj.init_params(cfg, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match=r"\[0, 97\)"):
    sj.forward(params, jnp.asarray([[1, 97]]), cfg)
  with pytest.raises(ValueError, match="min -1"):
    sj.forward(params, jnp.asarray([[-1, 3]]), cfg)


def test_concrete_tokens_captured_under_jit():
  cfg = tiny_config()
  params = sj.init_params(cfg, jax.random.PRNGKey(0))
  tokens = jnp.asarray([[1, 2, 3]])
  out = jax.jit(lambda p: sj.forward(p, tokens, cfg))(params)
  np.testing.assert_allclose(out, sj.forward(params, tokens, cfg), atol=1e-6)
