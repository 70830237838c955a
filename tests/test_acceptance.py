"""Acceptance rates and tail statistics against independent numpy computations."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.mismatch import acceptance


def _logits(seed, shape, scale=3.0):
  return np.random.RandomState(seed).randn(*shape).astype(np.float32) * scale


def _softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def _pair(seed=0, shape=(2, 5, 300), noise=1.0):
  p = _logits(seed, shape)
  return p, p + noise * _logits(seed + 1, shape, 1.0)


def test_alpha_is_one_minus_total_variation_and_in_unit_interval():
  p, q = _pair()
  alpha = np.asarray(acceptance.acceptance_rate(p, q, chunk_size=64))
  tv = 0.5 * np.abs(_softmax(p) - _softmax(q)).sum(-1)
  np.testing.assert_allclose(alpha, 1.0 - tv, atol=2e-6)
  assert alpha.min() >= 0.0 and alpha.max() <= 1.0 + 1e-6
  assert alpha.min() < 0.9  # the noise is large enough to test something


def test_alpha_is_one_iff_distributions_equal():
  p, q = _pair(noise=0.05)
  np.testing.assert_allclose(acceptance.acceptance_rate(p, p), 1.0, atol=1e-5)
  np.testing.assert_allclose(acceptance.acceptance_rate(p, p + 7.0), 1.0, atol=1e-5)  # same dist
  assert np.all(np.asarray(acceptance.acceptance_rate(p, q)) < 1.0 - 1e-3)


def test_alpha_is_symmetric():
  p, q = _pair(seed=3)
  np.testing.assert_allclose(
    acceptance.acceptance_rate(p, q), acceptance.acceptance_rate(q, p), atol=1e-6
  )


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 299, 300, 4096])
def test_chunked_equals_unchunked(chunk_size):
  p, q = _pair(seed=5)  # V = 300: not a multiple of most chunk sizes
  whole = acceptance.acceptance_rate(p, q, chunk_size=300)
  np.testing.assert_allclose(
    acceptance.acceptance_rate(p, q, chunk_size=chunk_size), whole, atol=1e-6
  )


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_scales_logits(temperature):
  p, q = _pair(seed=7)
  alpha = acceptance.acceptance_rate(p, q, temperature=temperature, chunk_size=128)
  expected = np.minimum(_softmax(p / temperature), _softmax(q / temperature)).sum(-1)
  np.testing.assert_allclose(alpha, expected, atol=2e-6)


def test_bad_inputs_raise():
  p, q = _pair()
  with pytest.raises(ValueError, match="temperature"):
    acceptance.acceptance_rate(p, q, temperature=0.0)
  with pytest.raises(ValueError, match="logits_q_BTV"):
    acceptance.acceptance_rate(p, q[..., :-1])


def test_jit_and_bf16_inputs():
  p, q = _pair(seed=9)
  eager = acceptance.acceptance_rate(p, q, chunk_size=64)
  jitted = jax.jit(acceptance.acceptance_rate, static_argnames="chunk_size")(
    p, q, 1.0, chunk_size=64
  )
  np.testing.assert_allclose(jitted, eager, atol=1e-6)
  p16, q16 = jnp.asarray(p, jnp.bfloat16), jnp.asarray(q, jnp.bfloat16)
  expected = np.minimum(
    _softmax(np.asarray(p16, np.float32)), _softmax(np.asarray(q16, np.float32))
  ).sum(-1)
  np.testing.assert_allclose(acceptance.acceptance_rate(p16, q16), expected, atol=2e-6)


def _topk(logits, k):
  logp = jax.nn.log_softmax(jnp.asarray(logits), axis=-1)
  return jax.lax.top_k(logp, k)


@pytest.mark.slow
def test_topk_bound_is_below_exact_and_tight_at_full_vocab():
  p, q = _pair(seed=11, shape=(3, 4, 100))
  exact = np.asarray(acceptance.acceptance_rate(p, q))
  bound = np.asarray(acceptance.topk_acceptance_bound(*_topk(p, 20), *_topk(q, 20)))
  assert np.all(bound <= exact + 1e-6) and np.all(bound > 0)
  assert np.any(bound < exact - 1e-3)
  full = acceptance.topk_acceptance_bound(*_topk(p, 100), *_topk(q, 100))
  np.testing.assert_allclose(full, exact, atol=1e-5)


def test_topk_bound_of_disjoint_sets_is_zero():
  logp = jnp.log(jnp.full((1, 1, 2), 0.5))
  ids_p, ids_q = jnp.array([[[0, 1]]]), jnp.array([[[2, 3]]])
  assert float(acceptance.topk_acceptance_bound(logp, ids_p, logp, ids_q)[0, 0]) == 0.0


def test_sampled_estimator_is_unbiased():
  p, q = _logits(13, (12,), 1.5), _logits(14, (12,), 1.5)
  pp, qq = _softmax(p), _softmax(q)
  draws = np.random.RandomState(0).choice(12, size=200_000, p=qq)
  est = acceptance.sampled_acceptance(jnp.log(pp[draws]), jnp.log(qq[draws]))
  exact = float(acceptance.acceptance_rate(p[None, None], q[None, None])[0, 0])
  assert 0.1 < exact < 0.95
  assert abs(float(est.mean()) - exact) < 4 * float(est.std()) / np.sqrt(draws.size)
  assert float(est.max()) <= 1.0


def _tail_inputs(seed=0):
  rs = np.random.RandomState(seed)
  alpha = (1.0 - rs.beta(0.3, 6.0, size=(4, 700))).astype(np.float32)
  mask = rs.rand(4, 700) < 0.8
  prompt_len = np.array([0, 37, 100, 250])[:, None]
  positions = prompt_len + np.arange(700)[None]  # prompt + generated, as documented
  return alpha, mask, positions


def _np_summary(values, tau=0.86):
  if values.size == 0:
    return {
      k: np.nan for k in ("p1", "p5", "p10", "p50", "mean", "frac_above_0999", "frac_below_tau")
    } | {"count": 0}
  out = {f"p{p}": np.percentile(values, p) for p in (1, 5, 10, 50)}
  return out | {
    "mean": values.mean(),
    "frac_above_0999": (values > 0.999).mean(),
    "frac_below_tau": (values < tau).mean(),
    "count": values.size,
  }


@pytest.mark.slow
def test_tail_stats_match_numpy_overall_and_per_bin_under_jit():
  alpha, mask, positions = _tail_inputs()
  num_bins, bin_size = 12, 64  # positions reach 949: bins 0..11 cover 768, the rest is overall only
  stats = jax.jit(acceptance.tail_stats, static_argnames=("bin_size", "num_bins"))(
    alpha, mask, positions, bin_size=bin_size, num_bins=num_bins, tau=0.86
  )
  for key, value in _np_summary(alpha[mask].astype(np.float64)).items():
    np.testing.assert_allclose(stats[key], value, rtol=1e-5, atol=1e-6, err_msg=key)
  for b in range(num_bins):
    in_bin = mask & (positions // bin_size == b)
    for key, value in _np_summary(alpha[in_bin].astype(np.float64)).items():
      np.testing.assert_allclose(
        stats[f"{key}_bin"][b], value, rtol=1e-5, atol=1e-6, err_msg=f"{key}_bin[{b}]"
      )
  assert stats["p5_bin"].shape == (num_bins,)
  assert 0 < float(stats["frac_below_tau"]) < 1  # the threshold cuts the sample, not above it
  assert "frac_below_tau" not in acceptance.tail_stats(alpha, mask, positions)  # only with tau
  assert int(stats["count_bin"].sum()) == int((mask & (positions < num_bins * bin_size)).sum())


def test_turn_stats_match_numpy_per_turn():
  alpha, mask, positions = _tail_inputs()
  turns = positions // 300  # turns 0..3; turn 3 is past num_turns: overall only, not a turn
  stats = jax.jit(acceptance.turn_stats, static_argnums=3)(alpha, mask, turns, 3, 0.86)
  for t in range(3):
    for key, value in _np_summary(alpha[mask & (turns == t)].astype(np.float64)).items():
      np.testing.assert_allclose(
        stats[f"{key}_turn"][t], value, rtol=1e-5, atol=1e-6, err_msg=f"{key}_turn[{t}]"
      )
  assert stats["count_turn"].shape == (3,) and int(stats["count_turn"].sum()) < int(mask.sum())


def test_tail_stats_empty_bins_and_empty_mask_are_nan():
  alpha, mask, positions = _tail_inputs(1)
  stats = acceptance.tail_stats(alpha, mask, positions, bin_size=2048, num_bins=3)
  assert int(stats["count_bin"][0]) == int(mask.sum())
  assert np.isnan(stats["p5_bin"][1]) and np.isnan(stats["mean_bin"][2])
  assert int(stats["count_bin"][1]) == 0
  empty = acceptance.tail_stats(alpha, np.zeros_like(mask), positions)
  assert np.isnan(empty["p5"]) and np.isnan(empty["mean"]) and int(empty["count"]) == 0


def test_histogram_matches_numpy():
  alpha, mask, _ = _tail_inputs(2)
  counts = acceptance.alpha_histogram(alpha, mask, num_buckets=10)
  expected, _ = np.histogram(alpha[mask], bins=np.linspace(0.0, 1.0, 11))
  np.testing.assert_array_equal(counts, expected)
  ones = acceptance.alpha_histogram(jnp.ones((1, 3)), jnp.ones((1, 3)), num_buckets=4)
  np.testing.assert_array_equal(ones, [0, 0, 0, 3])


def test_sampled_estimator_p5_is_biased_low_where_exact_is_not():
  """Every position has p = [.5, .49, .01], q = [.5, .4, .1]: exact alpha 0.91 everywhere. Tokens
  sampled from q hit the third (p/q = 0.1) 10% of the time, so the estimator min(1, p(x)/q(x)) is
  unbiased for the mean (0.91) but its 5th percentile is 0.1."""
  n = 20000
  logits_p = jnp.log(jnp.broadcast_to(jnp.asarray([0.5, 0.49, 0.01]), (1, n, 3)))
  logits_q = jnp.log(jnp.broadcast_to(jnp.asarray([0.5, 0.4, 0.1]), (1, n, 3)))
  x = jax.random.categorical(jax.random.PRNGKey(0), logits_q)
  logp = lambda logits: jnp.take_along_axis(jax.nn.log_softmax(logits), x[..., None], -1)[..., 0]
  mask, pos = jnp.ones((1, n), bool), jnp.zeros((1, n), jnp.int32)
  exact = acceptance.tail_stats(acceptance.acceptance_rate(logits_p, logits_q), mask, pos)
  sampled = acceptance.tail_stats(
    acceptance.sampled_acceptance(logp(logits_p), logp(logits_q)), mask, pos
  )
  np.testing.assert_allclose(exact["p5"], 0.91, atol=1e-5)
  np.testing.assert_allclose(sampled["mean"], 0.91, atol=0.01)
  np.testing.assert_allclose(sampled["p5"], 0.1, atol=1e-5)
