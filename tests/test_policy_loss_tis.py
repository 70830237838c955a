"""The dense policy loss's TIS weight, through `train_step.policy_loss` (what the step's update
differentiates), against the formula worked by hand: a stale sampler whose log-probs differ from
the old dense policy's must weigh each token's clipped surrogate by min(p_old / q, C). The logged
`tis/weight_*` metrics are computed apart from the loss, so they cannot show which weight the
gradient got."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparrow_jax as sj
from sparrow_jax.rl import step_schema
from sparrow_jax.rl import train_step as ts
from tests.helpers import tiny_config

CFG = tiny_config()
SC = step_schema.StepConfig(
  rl=step_schema.RLConfig(tis_cap=2.0, eps_low=0.2, eps_high=0.28, dual_clip=3.0),
  distill=step_schema.DistillConfig(enabled=False),
  stats=step_schema.StatsConfig(bin_size=16, num_bins=4),
  rollout=step_schema.RolloutConfig(group_size=2, page_size=4),
)
S = 9
PROMPT_LEN = np.asarray([3, 4])
END = np.asarray([9, 7])  # one past each row's last completion token
# Per completion token (row 0: 6 tokens, row 1: 3), chosen by hand:
#   RATIO: the new over the old policy's probability, across the clip's regimes (0.9, 1.1 inside
#     1 +- eps; 0.5, 1.6 outside; 4.0 past the dual clip's 3 for the negative advantage);
#   P_OLD_OVER_Q: the stale sampler's mismatch, on both sides of 1 and past the cap C = 2.
RATIO = [[0.9, 1.1, 0.5, 1.6, 1.0, 1.2], [0.7, 1.6, 4.0]]
P_OLD_OVER_Q = [[0.5, 1.5, 3.0, 0.25, 1.8, 0.7], [0.4, 2.5, 1.25]]
ADV = np.asarray([1.0, -1.0])


def hand_loss(ratio_t, adv, w_t, eps_low=0.2, eps_high=0.28, dual=3.0):
  """token-mean of max(-A r, -A clip(r)) (bounded by -A c where A < 0) times w, in numpy; and
  d loss / d log pi per token: -A r w where the unclipped branch is the one taken, else 0."""
  loss_t, dlogp_t = [], []
  for r, a, w in zip(ratio_t, adv, w_t):
    unclipped, clipped = -a * r, -a * np.clip(r, 1 - eps_low, 1 + eps_high)
    value, slope = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
    if a < 0 and value > -a * dual:
      value, slope = -a * dual, 0.0
    loss_t.append(value * w)
    dlogp_t.append(slope * w)
  n = len(loss_t)
  return float(np.sum(loss_t)) / n, np.asarray(dlogp_t) / n


def reference_logp(params, tokens_BS):
  """log pi(token s | tokens < s) from the plain dense forward, token-aligned."""
  logp_BSV = jax.nn.log_softmax(sj.forward(params, tokens_BS, CFG), axis=-1)
  picked = jnp.take_along_axis(logp_BSV[:, :-1], tokens_BS[:, 1:, None], axis=2)[..., 0]
  return jnp.pad(picked, ((0, 0), (1, 0)))


@pytest.mark.slow
def test_the_policy_loss_weighs_tokens_by_min_of_p_old_over_the_stale_sampler_s_q_and_the_cap():
  params = sj.init_params(CFG, jax.random.PRNGKey(0), std=0.3)
  rng = np.random.RandomState(0)
  tokens = jnp.asarray(rng.randint(1, CFG.vocab_size, (2, S)), jnp.int32)
  pos = np.arange(S)[None]
  gen_mask = (pos >= PROMPT_LEN[:, None]) & (pos < END[:, None])
  logp = np.asarray(reference_logp(params, tokens))
  # The old policy and the sampler put where the hand-chosen ratios say.
  logp_old = np.zeros((2, S), np.float32)
  logp_q = np.zeros((2, S), np.float32)
  ratio_t, w_raw_t, adv_t, at = [], [], [], []
  for b in range(2):
    for j, s in enumerate(range(PROMPT_LEN[b], END[b])):
      logp_old[b, s] = logp[b, s] - np.log(RATIO[b][j])
      logp_q[b, s] = logp_old[b, s] - np.log(P_OLD_OVER_Q[b][j])
      ratio_t.append(RATIO[b][j])
      w_raw_t.append(P_OLD_OVER_Q[b][j])
      adv_t.append(ADV[b])
      at.append((b, s))
  batch = step_schema.Batch(
    tokens=tokens,
    gen_mask=jnp.asarray(gen_mask),
    prompt_len=jnp.asarray(PROMPT_LEN, jnp.int32),
    logp_rollout=jnp.asarray(logp_q),
    rewards=jnp.zeros(2, jnp.float32),
  )
  (loss, _), grads = jax.value_and_grad(ts.policy_loss, has_aux=True)(
    params, batch, jnp.asarray(ADV, jnp.float32), CFG, SC, jnp.asarray(logp_old)
  )

  w_t = np.minimum(w_raw_t, SC.rl.tis_cap)
  want, dlogp_t = hand_loss(ratio_t, adv_t, w_t)
  # The batch tells the rule from its usual breakages: the weight inverted (q / p_old) or the
  # sampler ignored (w = 1) give losses far from the rule's.
  for wrong_w in (np.minimum(1 / np.asarray(w_raw_t), SC.rl.tis_cap), np.ones(len(w_t))):
    assert abs(hand_loss(ratio_t, adv_t, wrong_w)[0] - want) > 0.1
  np.testing.assert_allclose(
    float(loss), want, rtol=1e-4, err_msg="policy loss != token-mean of clipped surrogate x TIS"
  )

  # The gradient: d loss / d log pi(token) is the hand slope, carried to the params by the plain
  # forward's log-probs (a sum of slope x log pi, whose gradient is the loss's).
  slope = np.zeros((2, S), np.float32)
  for (b, s), d in zip(at, dlogp_t):
    slope[b, s] = d
  want_grads = jax.grad(lambda p: jnp.sum(jnp.asarray(slope) * reference_logp(p, tokens)))(params)
  jax.tree_util.tree_map(
    lambda g, w: np.testing.assert_allclose(g, w, atol=2e-6, rtol=2e-3), grads, want_grads
  )
  assert float(optax.tree.norm(want_grads)) > 1e-3  # the check is not of zeros
