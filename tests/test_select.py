"""Page selection: the decode path (lax.top_k) keeps exactly the pages of the shared rule
`keep_pages` used by teacher forcing, ties and tiny caches included; the page scores (mean key,
Quest's bound) against numpy, and the cache's page summaries against the ones the trainer computes
from the keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.attention import paged_cache, select
from sparrow_jax.attention.select import SparseConfig
from tests.helpers import tiny_config


@pytest.mark.slow
@pytest.mark.parametrize("sink, local", [(1, 2), (2, 1), (0, 2)])
def test_decode_pages_equal_keep_pages(sink, local):
  sparse = SparseConfig(page_size=4, sink_pages=sink, local_pages=local)
  rng = np.random.RandomState(0)
  B, K, G, E, P = 6, 2, 2, 8, 12
  # few distinct key values so that page scores tie often
  keys = rng.randint(-1, 2, (B, K, P, E)).astype(np.float32)
  centroids = jnp.asarray(keys)
  summaries = centroids[..., None, :]  # "mean" summaries: one row per page
  lengths = jnp.asarray([1, 4, 9, 13, 30, 48])
  budget = jnp.asarray([3, 3, 4, 5, 7, 12])  # within max_selected, as budget tables guarantee
  q = jnp.asarray(rng.randint(-1, 2, (B, K, G, E)).astype(np.float32))
  idx, n_valid = select.decode_pages(q, summaries, lengths, budget, sparse, max_selected=16)
  got = np.zeros((B, K, P), bool)
  for b in range(B):
    for k in range(K):
      chosen = np.asarray(idx[b, k, : int(n_valid[b, k])])
      assert (np.diff(chosen) > 0).all(), chosen  # distinct and ascending
      assert (np.asarray(idx[b, k]) >= 0).all() and (np.asarray(idx[b, k]) < P).all()
      got[b, k, chosen] = True
  scores = jnp.einsum("bkge,bkpe->bkp", q, centroids) / G
  want = select.keep_pages(scores, (lengths - 1)[:, None], budget[:, None], sparse)
  np.testing.assert_array_equal(got, np.asarray(want))
  # the full budget keeps every page holding tokens
  n_pages = (np.asarray(lengths) - 1) // 4 + 1
  assert (np.asarray(want).sum(-1)[-1] == np.minimum(budget[-1], n_pages[-1])).all()


def test_zero_local_pages_rejected():
  # With no local page the partial current page would be scored, and its teacher-forced centroid
  # would include keys written after the query: sampler and trainer would disagree.
  with pytest.raises(ValueError, match="local_pages"):
    SparseConfig(local_pages=0)


def test_page_scores_match_numpy_and_quest_bounds_every_key():
  rng = np.random.RandomState(1)
  B, K, X, S, E, Z = 2, 2, 3, 22, 8, 4  # S not whole pages: the partial last page is zero-padded
  k = rng.randn(B, K, S, E).astype(np.float32)
  q = rng.randn(B, K, X, E).astype(np.float32)
  k_pages = np.pad(k, ((0, 0), (0, 0), (0, -S % Z), (0, 0))).reshape(B, K, -1, Z, E)
  score = lambda name: np.asarray(
    paged_cache.page_scores(
      jnp.asarray(q), paged_cache.page_summaries(jnp.asarray(k), Z, name), name
    )
  )
  np.testing.assert_allclose(
    score("mean"), np.einsum("bkxe,bkpe->bkxp", q, k_pages.mean(3)), rtol=1e-5, atol=1e-5
  )
  hi, lo = k_pages.max(3)[:, :, None], k_pages.min(3)[:, :, None]  # [B, K, 1, P, E]
  bound = np.maximum(q[:, :, :, None] * hi, q[:, :, :, None] * lo).sum(-1)
  quest = score("quest")
  np.testing.assert_allclose(quest, bound, rtol=1e-5, atol=1e-5)
  best_key = np.einsum("bkxe,bkpze->bkxpz", q, k_pages).max(-1)
  assert np.all(quest >= best_key - 1e-5)
  assert np.mean(quest > best_key + 1e-3) > 0.5  # a bound, not the maximum itself


@pytest.mark.parametrize("page_score", ["mean", "quest"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cache_summaries_after_prefill_and_appends_are_the_keys_summaries(page_score, dtype):
  """Prefill writes partial pages (unwritten slots zero), appends complete them: every page's
  summary is then the one `page_summaries` computes from the cached keys, so no zero of a once
  partial page is left in a complete page's mean or bounds."""
  cfg, Z = tiny_config(), 4
  B, K, E, L = 2, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
  rng = np.random.RandomState(2)
  kv = lambda *shape: jnp.asarray(rng.randn(*shape) + 0.5, dtype)  # shifted: zero is no bound
  cache = paged_cache.init_cache(cfg, B, 32, page_size=Z, dtype=dtype, page_score=page_score)
  prompt_len = jnp.asarray([9, 6])
  valid = jnp.arange(12)[None] < prompt_len[:, None]
  for layer in range(L):
    cache = paged_cache.write_chunk(cache, layer, 0, kv(B, 12, K, E), kv(B, 12, K, E), valid)
  append = jax.jit(paged_cache.append)
  for t in range(11):
    for layer in range(L):
      cache = append(cache, layer, kv(B, K, E), kv(B, K, E), prompt_len + t)
  for layer in range(L):
    want = paged_cache.page_summaries(cache.keys(layer), Z, page_score)
    np.testing.assert_array_equal(
      np.asarray(cache.summaries[layer], np.float32), np.asarray(want, np.float32)
    )
