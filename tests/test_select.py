"""Page selection: the decode path (lax.top_k) keeps exactly the pages of the shared rule
`keep_pages` used by teacher forcing, ties and tiny caches included."""
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.attention import select
from sparrow_jax.attention.select import SparseConfig


@pytest.mark.parametrize("sink, local", [(1, 2), (2, 1), (0, 2)])
def test_decode_pages_equal_keep_pages(sink, local):
  sparse = SparseConfig(page_size=4, sink_pages=sink, local_pages=local)
  rng = np.random.RandomState(0)
  B, K, G, E, P = 6, 2, 2, 8, 12
  # few distinct key values so that page scores tie often
  keys = rng.randint(-1, 2, (B, K, P, E)).astype(np.float32)
  centroids = jnp.asarray(keys)
  lengths = jnp.asarray([1, 4, 9, 13, 30, 48])
  budget = jnp.asarray([3, 3, 4, 5, 7, 12])  # within max_selected, as budget tables guarantee
  q = jnp.asarray(rng.randint(-1, 2, (B, K, G, E)).astype(np.float32))
  idx, n_valid = select.decode_pages(q, centroids, lengths, budget, sparse, max_selected=16)
  got = np.zeros((B, K, P), bool)
  for b in range(B):
    for k in range(K):
      chosen = np.asarray(idx[b, k, :int(n_valid[b, k])])
      assert len(set(chosen.tolist())) == len(chosen)  # distinct
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
