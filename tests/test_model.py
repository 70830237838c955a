"""Parity of the JAX Qwen3 with transformers, and incremental decoding against forward."""

import dataclasses

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
  "gqa4_theta": tiny_config(
    num_attention_heads=8, num_key_value_heads=2, rope_theta=5000.0, num_hidden_layers=3
  ),
  "linear_rope": tiny_config(rope_scaling=(("factor", 2.0), ("rope_type", "linear"))),
  "yarn_rope": tiny_config(
    rope_scaling=(("factor", 4.0), ("original_max_position_embeddings", 64), ("rope_type", "yarn"))
  ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_match_transformers(name):
  cfg = CONFIGS[name]
  params = sj.init_params(cfg, jax.random.PRNGKey(1), std=0.2)
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 40))
  ref = hf_logits(hf_model(cfg, params), tokens)
  ours = np.asarray(sj.forward(params, jnp.asarray(tokens), cfg))
  assert np.abs(ours - ref).max() <= 1e-4


@pytest.mark.slow
def test_rope_theta_changes_logits():
  """A peer library silently ignored rope_theta: make sure ours does not."""
  cfg = tiny_config()
  params = sj.init_params(cfg, jax.random.PRNGKey(1), std=0.2)
  tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (1, 40)))
  a = sj.forward(params, tokens, cfg)
  b = sj.forward(params, tokens, tiny_config(rope_theta=100.0))
  assert float(jnp.abs(a - b).max()) > 1e-3


@pytest.mark.slow
def test_padded_ragged_batch_matches_transformers():
  cfg = tiny_config()
  params = sj.init_params(cfg, jax.random.PRNGKey(2), std=0.2)
  rng = np.random.RandomState(1)
  tokens = rng.randint(0, cfg.vocab_size, (3, 24))
  mask = np.ones((3, 24), bool)
  mask[0, :7] = False  # left padding
  mask[1, 15:] = False  # right padding
  positions = np.asarray(qwen3.default_positions(jnp.asarray(mask)))
  ref = hf_logits(hf_model(cfg, params), tokens, mask, positions)
  ours = np.asarray(sj.forward(params, jnp.asarray(tokens), cfg, mask_BT=jnp.asarray(mask)))
  assert np.abs(ours - ref)[mask].max() <= 1e-4
  # A row's real tokens do not depend on its padding.
  alone = np.asarray(sj.forward(params, jnp.asarray(tokens[1:2, :15]), cfg))
  assert np.abs(alone[0] - ours[1, :15]).max() <= 1e-5


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [False, True])
def test_decode_loop_reads_weights_and_cache_in_place(sparse):
  """The sampler's decode loop (weights split before it, per-layer float32 caches) holds no copy
  of a layer's cache or weights inside the loop: XLA CPU had copied every layer's whole K/V cache
  (a stacked slice, a uint32 -> float32 read) and weights (a stacked slice) at every step."""
  from sparrow_jax.rollout import sampler
  from sparrow_jax.sparsity import policy
  from sparrow_jax.sparsity.schedule import BudgetTable, KVSchedule

  cfg = dataclasses.replace(tiny_config(), num_hidden_layers=3, max_position_embeddings=512)
  params = sj.init_params(cfg, jax.random.PRNGKey(0))
  B, S = 4, 512
  caches = paged_cache.split_layers(paged_cache.init_cache(cfg, B, S, page_size=16))
  cfg_sparse = sj.SparseConfig(page_size=16, dense_layers=1)
  table = sampler.budget_table(KVSchedule.fixed(8), S, cfg_sparse)
  attention_fn = (
    policy.decode_attention_fn(cfg_sparse, BudgetTable(jnp.asarray(table)), 8)
    if sparse
    else policy.dense_decode_fn()
  )

  def loop(params, caches):
    params, _ = qwen3.unstack_layers(params)

    def step(i, carry):
      logits_BV, caches = qwen3.decode_step(
        params, carry[0], cfg, carry[1], attention_fn=attention_fn
      )
      return jnp.argmax(logits_BV, -1).astype(jnp.int32), caches

    return jax.lax.fori_loop(0, 8, step, (jnp.zeros((B,), jnp.int32), caches))

  hlo = jax.jit(loop).lower(params, caches).compile().as_text()
  cache_shape = f"[{B},{cfg.num_key_value_heads},{S},{cfg.head_dim}]"
  weight_shape = f"[{cfg.hidden_size},{cfg.intermediate_size}]"
  loop_bodies = [c for c in hlo.split("\n\n") if "region" in c.split("\n")[0]]
  made = [
    line.strip()[:120]
    for c in loop_bodies
    for line in c.split("\n")
    if "fusion(" in line
    and any(shape in line.split("=")[1].split(" ")[1] for shape in (cache_shape, weight_shape))
  ]
  assert not made, made
