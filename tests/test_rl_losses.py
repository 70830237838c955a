"""Advantages and losses against hand-worked cases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.rl import advantages, losses


def test_grpo_drgrpo_rloo_by_hand():
  r = jnp.asarray([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
  np.testing.assert_allclose(
    advantages.advantages(r, 4, "grpo", std_ddof=0), [1, -1, -1, 1, 0, 0, 0, 0], atol=1e-5
  )
  # the default, as the reference's torch.std: the unbiased std sqrt(1/3) of [1, 0, 0, 1]
  np.testing.assert_allclose(
    advantages.advantages(r, 4, "grpo"),
    np.asarray([1, -1, -1, 1, 0, 0, 0, 0]) * 0.5 / np.sqrt(1 / 3),
    atol=1e-5,
  )
  np.testing.assert_allclose(
    advantages.advantages(r, 4, "dr_grpo"), [0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0], atol=1e-6
  )
  # rloo: r_i - mean of the other three, e.g. 1 - (0 + 0 + 1) / 3 = 2/3
  np.testing.assert_allclose(
    advantages.advantages(r, 4, "rloo")[:4], [2 / 3, -2 / 3, -2 / 3, 2 / 3], atol=1e-6
  )
  np.testing.assert_array_equal(advantages.informative_groups(r, 4), [True, False])
  with pytest.raises(ValueError, match="group_size"):
    advantages.advantages(r, 3)
  with pytest.raises(ValueError, match="grpo"):
    advantages.advantages(r, 4, "ppo")


@pytest.mark.slow
def test_ppo_clip_and_dual_clip_gradients():
  logp_old = jnp.zeros((1, 4))
  # ratios 0.5, 1.1, 1.5, 10 with advantages +1 (first row) / -1 (second row)
  logp = jnp.log(jnp.asarray([[0.5, 1.1, 1.5, 10.0]]))

  def loss(lp, adv, dual):
    return losses.ppo_token_loss(lp, logp_old, jnp.asarray([adv]), 0.2, 0.28, dual)[0].sum()

  g_pos = jax.grad(loss)(logp, 1.0, 0.0)
  # A > 0: gradient -ratio where unclipped (0.5 below 1-eps gives min(...) = unclipped, 1.1 inside),
  # zero where the ratio is above 1 + eps_high (1.5, 10).
  np.testing.assert_allclose(g_pos, [[-0.5, -1.1, 0, 0]], atol=1e-6)
  g_neg = jax.grad(loss)(logp, -1.0, 0.0)
  # A < 0: ratio 0.5 is clipped at 0.8 (zero grad); above, the unclipped -A * ratio dominates.
  np.testing.assert_allclose(g_neg, [[0, 1.1, 1.5, 10.0]], atol=1e-5)
  g_dual = jax.grad(loss)(logp, -1.0, 3.0)
  # dual clip at c = 3 bounds the ratio-10 token's loss by 3 * |A|: no gradient there.
  np.testing.assert_allclose(g_dual, [[0, 1.1, 1.5, 0]], atol=1e-5)
  value = losses.ppo_token_loss(logp, logp_old, jnp.asarray([-1.0]), 0.2, 0.28, 3.0)[0]
  np.testing.assert_allclose(value, [[0.8, 1.1, 1.5, 3.0]], atol=1e-5)


def test_tis_weight_token_and_sequence():
  old = jnp.log(jnp.asarray([[0.5, 0.9, 0.2]]))
  rollout = jnp.log(jnp.asarray([[0.25, 0.9, 0.8]]))
  mask = jnp.asarray([[True, True, True]])
  np.testing.assert_allclose(
    losses.tis_weight(old, rollout, mask, 1.5, "token"), [[1.5, 1, 0.25]], rtol=1e-5
  )
  np.testing.assert_allclose(
    losses.tis_weight(old, rollout, mask, 5.0, "sequence"), [[0.5, 0.5, 0.5]], rtol=1e-5
  )  # 2 * 1 * 0.25
  grad = jax.grad(lambda o: losses.tis_weight(o, rollout, mask, 5.0).sum())(old)
  np.testing.assert_array_equal(grad, 0)
  with pytest.raises(ValueError, match="TIS level"):
    losses.tis_weight(old, rollout, mask, 2.0, "batch")


def test_aggregation_modes():
  loss = jnp.asarray([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
  mask = jnp.asarray([[1, 1, 1], [1, 0, 0]], bool)
  assert float(losses.aggregate(loss, mask, "token-mean")) == pytest.approx(10 / 4)
  assert float(losses.aggregate(loss, mask, "seq-mean-token-mean")) == pytest.approx((2 + 4) / 2)
  assert float(losses.aggregate(loss, mask, "seq-mean-token-sum-norm", 3)) == pytest.approx(
    (6 / 3 + 4 / 3) / 2
  )
  with pytest.raises(ValueError, match="token-mean"):
    losses.aggregate(loss, mask, "sum")


def test_kl_estimators_and_entropy():
  lp, ref = jnp.log(jnp.asarray([0.5])), jnp.log(jnp.asarray([0.25]))
  np.testing.assert_allclose(losses.kl_penalty(lp, ref, "k1"), [np.log(2)], rtol=1e-6)
  np.testing.assert_allclose(losses.kl_penalty(lp, ref, "k3"), [0.5 + np.log(2) - 1], rtol=1e-5)
  assert float(losses.kl_penalty(lp, lp, "k3")[0]) == 0.0
  np.testing.assert_allclose(losses.entropy(jnp.zeros((1, 4))), [np.log(4)], rtol=1e-6)


def test_k3_is_capped_like_verl_low_var_kl():
  lp = jnp.log(jnp.asarray([1e-30, 0.5, 0.9]))
  ref = jnp.log(jnp.asarray([0.9, 0.5, 0.9 * np.exp(-5.0)]))
  k3 = losses.kl_penalty(lp, ref, "k3")
  # d = log ref - log pi = +69 (clamped to 20: e^20 - 21, capped at 10), 0, -5 (e^-5 + 5 - 1)
  np.testing.assert_allclose(k3, [10.0, 0.0, np.exp(-5.0) + 4], rtol=1e-5)
  assert float(jnp.max(k3)) <= losses.K3_CAP


def test_ppo_ratio_overflow_gives_finite_gradients():
  logp_old = jnp.asarray([[-200.0, 0.0]])  # a token the old policy all but ruled out
  logp = jnp.asarray([[-1.0, 0.0]])  # exp(199) overflows float32 without the clamp
  loss = lambda lp: losses.ppo_token_loss(lp, logp_old, jnp.asarray([-1.0]), 0.2, 0.28)[0].sum()
  value, grad = jax.value_and_grad(loss)(logp)
  assert np.isfinite(float(value)) and np.isfinite(np.asarray(grad)).all()
