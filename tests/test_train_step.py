"""The fused train step: equivalence with separate updates, gradient isolation, no recompiles,
guards. (DistillSparse raising the acceptance tail: tests/test_distill_sparse.py.)"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sparrow_jax as sj
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.mismatch import acceptance
from sparrow_jax.model import lora as lora_lib
from sparrow_jax.rl import accumulation, advantages, step_schema
from sparrow_jax.rl import train_step as ts
from sparrow_jax.rollout import sampler
from sparrow_jax.sparsity.schedule import BudgetTable, KVSchedule
from tests.helpers import tiny_config

CFG = tiny_config(num_hidden_layers=3)
SPARSE = SparseConfig(page_size=4, dense_layers=1)
SCHEDULE = KVSchedule.fixed(4, page_size=4)
SC = step_schema.StepConfig(
  stats=step_schema.StatsConfig(bin_size=16, num_bins=4),
  rollout=step_schema.RolloutConfig(group_size=4, page_size=4),
)
BUDGET = BudgetTable(jnp.asarray(sampler.budget_table(SCHEDULE, 12 + 24, SPARSE)))  # prompt + new


def make_batch(params, lora, seed, rewards=None, n_prompts=2, top=False):
  return step_schema.batch_from_rollout(*make_rollout(params, lora, seed, rewards, n_prompts, top))


def make_rollout(params, lora, seed, rewards=None, n_prompts=2, top=False):
  """(prompt, prompt_len, Rollout, rewards) of a sparse rollout of the tiny policy."""
  rng = np.random.RandomState(seed)
  prompt_len = jnp.asarray(np.repeat(rng.randint(6, 12, n_prompts), SC.rollout.group_size))
  prompt = jnp.asarray(
    np.repeat(rng.randint(1, CFG.vocab_size, (n_prompts, 12)), SC.rollout.group_size, 0)
  )
  prompt = prompt * (jnp.arange(12)[None] < prompt_len[:, None])
  out = sj.generate(
    params,
    CFG,
    prompt,
    prompt_len,
    jax.random.PRNGKey(seed),
    max_new_tokens=24,
    sparse=SPARSE,
    schedule=SCHEDULE,
    lora=lora,
    sampling=sj.Sampling(num_top_logprobs=20 if top else 0),
  )
  if rewards is None:
    rewards = rng.randint(0, 2, n_prompts * SC.rollout.group_size).astype(np.float32)
  return prompt, prompt_len, out, rewards


def state_of(params, opt, lora=None, lora_opt=None):
  """A train state on copies (the step donates its state's buffers)."""
  copy = lambda t: jax.tree_util.tree_map(jnp.copy, t)
  return step_schema.init_state(
    copy(params), opt, copy(lora) if lora is not None else None, lora_opt
  )


def setup(seed=0):
  params = sj.init_params(CFG, jax.random.PRNGKey(seed), std=0.3)
  lora = lora_lib.init_lora(params, jax.random.PRNGKey(seed + 1), rank=4, alpha=8.0)
  # B = 0 makes LoRA a no-op; perturb it so the equivalence test exercises the adapter path.
  lora = jax.tree_util.tree_map(lambda x: x + 0.01, lora)
  opt, lora_opt = optax.adamw(1e-3), optax.adam(1e-2)
  return params, lora, opt, lora_opt


@pytest.mark.slow
def test_fused_step_equals_separate_updates():
  params, lora, opt, lora_opt = setup()
  batch = make_batch(params, lora, seed=1)
  step = ts.make_train_step(CFG, SC, opt, lora_opt, SPARSE)
  fused, metrics = step(state_of(params, opt, lora, lora_opt), batch, BUDGET)
  assert not bool(metrics["skipped"])

  adv = advantages.advantages(batch.rewards, SC.rollout.group_size)
  (_, aux), g = jax.value_and_grad(ts.policy_loss, has_aux=True)(params, batch, adv, CFG, SC)
  upd, _ = opt.update(g, opt.init(params), params)
  new_params = optax.apply_updates(params, upd)
  lg = jax.grad(
    lambda lo: ts.distill_loss(lo, params, batch, adv, aux["logp"], CFG, SC, SPARSE, SCHEDULE)[0]
  )(lora)
  lupd, _ = lora_opt.update(lg, lora_opt.init(lora), lora)
  new_lora = optax.apply_updates(lora, lupd)
  # Adam turns float noise in near-zero gradients into a few % of one step (measured 1.1e-5 once
  # with blockwise attention and chunked log-probs, whose sums run in another order; 2.9e-5 on
  # another VM's CPU, whose XLA codegen differs): atol = lr / 20, a wrong update is a whole lr.
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5), fused.params, new_params
  )  # lr 1e-3
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4), fused.lora, new_lora
  )  # lr 1e-2
  assert float(jnp.abs(fused.params["embed"] - params["embed"]).max()) > 5e-4  # it did move


@pytest.mark.slow
def test_gradient_isolation():
  params, lora, opt, lora_opt = setup()
  batch = make_batch(params, lora, seed=2)
  adv = advantages.advantages(batch.rewards, SC.rollout.group_size)
  logp_dense = ts.policy_loss(params, batch, adv, CFG, SC)[1]["logp"]
  g_base = jax.grad(
    lambda p: ts.distill_loss(lora, p, batch, adv, logp_dense, CFG, SC, SPARSE, SCHEDULE)[0]
  )(params)
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree_util.tree_leaves(g_base))
  g_lora = jax.grad(
    lambda lo: ts.distill_loss(lo, params, batch, adv, logp_dense, CFG, SC, SPARSE, SCHEDULE)[0]
  )(lora)
  assert any(float(jnp.abs(x).max()) > 0 for x in jax.tree_util.tree_leaves(g_lora))
  # The dense policy never sees the adapter: a different LoRA gives the same base update.
  step = ts.make_train_step(CFG, SC, opt, lora_opt, SPARSE)
  other = jax.tree_util.tree_map(lambda x: x * 3.0, lora)
  a, _ = step(state_of(params, opt, lora, lora_opt), batch, BUDGET)
  b, _ = step(state_of(params, opt, other, lora_opt), batch, BUDGET)
  jax.tree_util.tree_map(np.testing.assert_array_equal, a.params, b.params)


@pytest.mark.slow
def test_no_recompilation_and_metrics():
  params, lora, opt, lora_opt = setup()
  step = ts.make_train_step(CFG, SC, opt, lora_opt, SPARSE)
  state = state_of(params, opt, lora, lora_opt)
  for seed in range(3):
    state, metrics = step(
      state, make_batch(state.params, state.lora, seed=10 + seed, top=True), BUDGET
    )
  assert step._cache_size() == 1
  assert int(state.step) == 3
  assert metrics["acceptance/p5_bin"].shape == (4,)
  bound, mean = float(metrics["acceptance_topk20/mean"]), float(metrics["acceptance/mean"])
  assert 0.0 < bound <= 1.0 and 0.0 < mean <= 1.0


def test_nonfinite_loss_skips_update():
  params, lora, opt, lora_opt = setup()
  batch = make_batch(params, lora, seed=3)
  batch = batch.replace(logp_rollout=jnp.where(batch.gen_mask, jnp.nan, batch.logp_rollout))
  step = ts.make_train_step(CFG, SC, opt, lora_opt, SPARSE)
  before = jax.tree_util.tree_map(np.asarray, params)
  state, metrics = step(state_of(params, opt, lora, lora_opt), batch, BUDGET)
  assert bool(metrics["skipped"])
  jax.tree_util.tree_map(np.testing.assert_array_equal, state.params, before)


@pytest.mark.nightly
def test_ppo_minibatches_run():
  params, lora, opt, lora_opt = setup()
  sc = step_schema.StepConfig(
    rl=step_schema.RLConfig(ppo_epochs=2, num_minibatches=2),
    distill=step_schema.DistillConfig(enabled=False),
    stats=step_schema.StatsConfig(bin_size=16, num_bins=4),
    rollout=step_schema.RolloutConfig(group_size=4, page_size=4),
  )
  step = ts.make_train_step(CFG, sc, opt, sparse=SPARSE)
  state, metrics = step(state_of(params, opt), make_batch(params, None, seed=4), BUDGET)
  assert not bool(metrics["skipped"]) and int(state.step) == 1


@pytest.mark.slow
def test_micro_batches_accumulate_the_same_update(loss_agg="seq-mean-token-mean"):
  """Gradient accumulation over 4 slices of the rows gives the one-pass update (the losses'
  normalisers are the minibatch's: rows for the sequence-mean policy term, tokens for the entropy,
  reference-KL and distill-k3 terms, so both weightings are exercised)."""
  params, lora, opt, lora_opt = setup()
  batch = make_batch(params, lora, seed=5)
  out = {}
  for n in (1, 4):
    sc = dataclasses.replace(
      SC,
      rl=step_schema.RLConfig(micro_batches=n, loss_agg=loss_agg, entropy_coef=0.01, kl_coef=0.1),
    )
    step = ts.make_train_step(CFG, sc, opt, lora_opt, SPARSE)
    state = step_schema.init_state(
      jax.tree_util.tree_map(jnp.copy, params),
      opt,
      jax.tree_util.tree_map(jnp.copy, lora),
      lora_opt,
      keep_reference=True,
    )
    out[n] = step(state, batch, BUDGET)
  (one, m_one), (four, m_four) = out[1], out[4]
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), four.params, one.params
  )
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=2e-4), four.lora, one.lora
  )
  for key in ("loss/policy", "loss/distill", "ppo/clip_frac", "acceptance/p5", "entropy"):
    np.testing.assert_allclose(m_four[key], m_one[key], rtol=1e-4, atol=1e-6)


def reference_alpha(params, lora, batch):
  """Exact alpha per token (token alignment) between the pre-update dense policy and the rollout
  policy (sparse + LoRA), from sj.forward and acceptance_rate alone."""
  S = batch.tokens.shape[1]
  valid = jnp.arange(S)[None] < (batch.prompt_len + batch.gen_mask.sum(1))[:, None]
  dense = sj.forward(params, batch.tokens, CFG, mask_BT=valid)
  rollout = sj.forward(
    params,
    batch.tokens,
    CFG,
    mask_BT=valid,
    lora=lora,
    sparse=SPARSE,
    schedule=SCHEDULE,
    prompt_len_B=batch.prompt_len,
  )
  return jnp.pad(acceptance.acceptance_rate(dense, rollout)[:, :-1], ((0, 0), (1, 0)))


def reference_exact_stats(params, lora, batch, sc=SC):
  """reference_alpha's tail stats, binned like the step (token s was decoded with s cached)."""
  alpha = reference_alpha(params, lora, batch)
  pos = jnp.broadcast_to(jnp.arange(batch.tokens.shape[1]), alpha.shape)
  return acceptance.tail_stats(
    alpha, batch.gen_mask, pos, sc.stats.bin_size, sc.stats.num_bins, sc.rollout.page_size
  )


@pytest.mark.slow
@pytest.mark.parametrize(
  "distill, minibatches", [(True, 1), (False, 1), pytest.param(True, 2, marks=pytest.mark.nightly)]
)
def test_logged_p5_is_exact_acceptance(distill, minibatches):
  params, lora, opt, lora_opt = setup()
  batch = make_batch(params, lora if distill else None, seed=5, top=True)
  sc = dataclasses.replace(
    SC,
    distill=step_schema.DistillConfig(enabled=distill),
    rl=step_schema.RLConfig(num_minibatches=minibatches),
  )
  step = ts.make_train_step(CFG, sc, opt, lora_opt if distill else None, SPARSE)
  _, metrics = step(
    state_of(params, opt, lora if distill else None, lora_opt if distill else None), batch, BUDGET
  )
  want = reference_exact_stats(params, lora if distill else None, batch)
  for key in ("p1", "p5", "p50", "mean", "p5_bin", "count_bin"):
    np.testing.assert_allclose(metrics[f"acceptance/{key}"], want[key], atol=1e-5, err_msg=key)
  assert float(metrics["acceptance/p5"]) < 0.99  # the budget is small: q really differs from p
  # the top-20 bound and the exact rate: bound <= exact token by token, so also in the mean
  assert float(metrics["acceptance_topk20/mean"]) <= float(metrics["acceptance/mean"]) + 1e-6


DOCUMENTED = [
  "loss/policy",
  "grad_norm/policy",
  "ppo/clip_frac",
  "skipped",
  "skipped_updates",
  "entropy",
  "tis/weight_mean",
  "tis/weight_min",
  "tis/clipped_frac",
  "reward/mean",
  "reward/std",
  "response_length/mean",
  "response_length/max",
  "loss/distill",
  "distill/k3",
  "grad_norm/lora",
  "skipped_lora",
] + [
  f"{family}/{stat}"
  for family in ("acceptance", "acceptance_sampled", "acceptance_topk20")
  for stat in ("p1", "p5", "p10", "p50", "mean", "p5_bin", "frac_below_tau", "histogram")
]


@pytest.mark.nightly
def test_minibatches_log_every_metric_from_the_full_batch():
  params, lora, opt, lora_opt = setup()
  batch = make_batch(params, lora, seed=6, top=True)
  runs = {}
  for n in (1, 4):
    step = ts.make_train_step(
      CFG,
      dataclasses.replace(SC, rl=step_schema.RLConfig(num_minibatches=n)),
      opt,
      lora_opt,
      SPARSE,
    )
    runs[n] = step(state_of(params, opt, lora, lora_opt), batch, BUDGET)[1]
    assert set(DOCUMENTED) <= set(runs[n]), set(DOCUMENTED) - set(runs[n])
    assert not bool(runs[n]["skipped"]) and int(runs[n]["skipped_updates"]) == 0
  # Pre-update quantities do not depend on how the updates are split.
  for key in DOCUMENTED:
    if key.startswith(("tis/", "acceptance", "entropy", "reward", "response")):
      np.testing.assert_allclose(runs[4][key], runs[1][key], atol=1e-5, err_msg=key)
  assert 0.0 <= float(runs[4]["ppo/clip_frac"]) <= 1.0
  assert float(runs[4]["grad_norm/policy"]) > 0 and float(runs[4]["grad_norm/lora"]) > 0


@pytest.mark.nightly
def test_a_skipped_minibatch_is_reported():
  params, lora, opt, lora_opt = setup()
  batch = make_batch(params, lora, seed=7)
  # NaN behaviour log-probs in the first of 2 minibatches (rows 0-3) only
  batch = batch.replace(logp_rollout=batch.logp_rollout.at[:4].set(jnp.nan))
  step = ts.make_train_step(
    CFG, dataclasses.replace(SC, rl=step_schema.RLConfig(num_minibatches=2)), opt, lora_opt, SPARSE
  )
  state, metrics = step(state_of(params, opt, lora, lora_opt), batch, BUDGET)
  assert bool(metrics["skipped"]) and int(metrics["skipped_updates"]) == 1
  assert float(jnp.abs(state.params["embed"] - params["embed"]).max()) > 0  # the others applied


@pytest.mark.slow
def test_a_new_budget_table_does_not_recompile():
  params, lora, opt, lora_opt = setup()
  step = ts.make_train_step(CFG, SC, opt, lora_opt, SPARSE)
  state = state_of(params, opt, lora, lora_opt)
  other = BudgetTable(
    jnp.asarray(sampler.budget_table(KVSchedule.fixed(6, page_size=4), 36, SPARSE))
  )
  for seed, budget in ((20, BUDGET), (21, other)):
    state, _ = step(state, make_batch(state.params, state.lora, seed=seed), budget)
  assert step._cache_size() == 1


@pytest.mark.slow
def test_dense_update_is_one_optimizer_step_of_the_policy_loss():
  params, lora, opt, _ = setup()
  batch = make_batch(params, lora, seed=1)
  adv = advantages.advantages(batch.rewards, SC.rollout.group_size)
  rows = (batch, adv, None)
  new, _, aux, row, finite = ts.dense_update(params, opt.init(params), opt, rows, CFG, SC)
  (loss, ref_aux), g = jax.value_and_grad(ts.policy_loss, has_aux=True)(params, batch, adv, CFG, SC)
  upd, _ = opt.update(g, opt.init(params), params)
  expected = optax.apply_updates(params, upd)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), new, expected)
  assert bool(finite) and set(row) == {"loss/policy", "grad_norm/policy", "ppo/clip_frac"}
  np.testing.assert_allclose(row["loss/policy"], loss, rtol=1e-6)
  np.testing.assert_allclose(aux["logp"], ref_aux["logp"], atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("base", ["pre_update", "updated"])
def test_distill_base_is_where_the_adapter_gradient_is_taken(base):
  """The fused step's LoRA update is distill_update's on the base `distill.base` names (the
  pre-update params, or those after the minibatch's base update: the reference's order), with the
  pre-update dense log-probs as teacher; SGD(1): the LoRA moves by minus its gradient."""
  params, lora, opt, _ = setup()
  lora_opt = optax.sgd(1.0)
  batch = make_batch(params, lora, seed=1)
  sc = dataclasses.replace(SC, distill=dataclasses.replace(SC.distill, base=base))
  fused, _ = ts.make_train_step(CFG, sc, opt, lora_opt, SPARSE)(
    state_of(params, opt, lora, lora_opt), batch, BUDGET
  )
  adv = advantages.advantages(batch.rewards, SC.rollout.group_size)
  teacher = ts.policy_loss(params, batch, adv, CFG, SC)[1]["logp"]
  fit = jax.jit(
    lambda at: ts.distill_update(
      lora, lora_opt.init(lora), lora_opt, at, (batch, adv, teacher), CFG, SC, SPARSE, BUDGET
    )[0]
  )
  right, wrong = (params, fused.params) if base == "pre_update" else (fused.params, params)
  err = lambda other: max(
    float(jnp.abs(a - b).max())
    for a, b in zip(*map(jax.tree_util.tree_leaves, (fused.lora, other)))
  )
  assert err(fit(right)) < 0.1 * err(fit(wrong)), (err(fit(right)), err(fit(wrong)))
  with pytest.raises(ValueError, match="DistillConfig.base = 'after'"):
    step_schema.DistillConfig(base="after")


def test_update_metrics_weigh_the_minibatches_by_tokens():
  rows = [({"loss/policy": jnp.float32(1.0)}, 3), ({"loss/policy": jnp.float32(4.0)}, 1)]
  m = ts.update_metrics(rows, [], [jnp.bool_(False), jnp.bool_(True)], [])
  np.testing.assert_allclose(m["loss/policy"], 1.75, rtol=1e-6)
  assert int(m["skipped_updates"]) == 1 and bool(m["skipped"]) and "skipped_lora" not in m
  lora_rows = [({"loss/distill": jnp.float32(2.0)}, 1), ({"loss/distill": jnp.float32(6.0)}, 1)]
  m = ts.update_metrics(rows, lora_rows, [jnp.bool_(False)] * 2, [jnp.bool_(False)] * 2)
  np.testing.assert_allclose(m["loss/distill"], 4.0, rtol=1e-6)
  assert not bool(m["skipped"]) and not bool(m["skipped_lora"])


def test_rollout_metrics_of_the_dense_policy():
  params, lora, *_ = setup()
  batch = make_batch(params, lora, seed=3)
  adv = advantages.advantages(batch.rewards, SC.rollout.group_size)
  dense = ts.policy_loss(params, batch, adv, CFG, SC)[1]
  m = ts.rollout_metrics(batch, dense, SC)
  mask = np.asarray(batch.gen_mask)
  w = np.minimum(np.exp(np.where(mask, dense["logp"] - batch.logp_rollout, 0.0)), SC.rl.tis_cap)
  np.testing.assert_allclose(m["tis/weight_mean"], (w * mask).sum() / mask.sum(), rtol=1e-5)
  assert float(m["response_length/max"]) == mask.sum(1).max()
  np.testing.assert_allclose(m["reward/mean"], np.mean(batch.rewards), rtol=1e-6)
  np.testing.assert_allclose(m["entropy"], (dense["entropy_BS"] * mask).sum() / mask.sum(), 1e-5)


def masking(token_below=0.0, row_below=0.0):
  rl = dataclasses.replace(SC.rl, mask_alpha_below=token_below, mask_row_alpha_below=row_below)
  return dataclasses.replace(SC, rl=rl)


def run_step(sc, params, lora, batch):
  opt, lora_opt = optax.adamw(1e-3), optax.adam(1e-2)
  step = ts.make_train_step(CFG, sc, opt, lora_opt, SPARSE)
  return step(state_of(params, opt, lora, lora_opt), batch, BUDGET)


def clean_thresholds(values, avoid=()):
  """Midpoints between sorted `values` 2e-4 or more apart, and 1e-4 or more from every `avoid`
  value: thresholds the step's chunked alpha and reference_alpha (equal to the last digits) put
  the same tokens under."""
  v = np.sort(values)
  t = (v[1:] + v[:-1]) / 2
  far = np.abs(t[:, None] - np.append(np.asarray(avoid, float), np.inf)[None]) > 1e-4
  return t[(np.diff(v) > 2e-4) & far.all(1)]


@pytest.mark.nightly
def test_masking_off_or_under_every_alpha_is_the_unmasked_step():
  """Thresholds 0: the unmasked step (no mask/* metrics). Thresholds under every token's alpha:
  the masked path (alpha before the update, p from a no-grad pass) gives the same update."""
  params, lora, *_ = setup()
  batch = make_batch(params, lora, seed=8)
  plain, m_plain = run_step(SC, params, lora, batch)
  off, m_off = run_step(masking(0.0, 0.0), params, lora, batch)
  assert not [k for k in m_off if k.startswith("mask/")]
  jax.tree_util.tree_map(np.testing.assert_array_equal, (off, m_off), (plain, m_plain))
  low = float(jnp.min(jnp.where(batch.gen_mask, reference_alpha(params, lora, batch), 1.0))) / 2
  under, m_under = run_step(masking(low, low), params, lora, batch)
  assert float(m_under["mask/token_frac"]) == 0.0 and float(m_under["mask/row_frac"]) == 0.0
  assert set(m_under) - set(m_plain) == {"mask/token_frac", "mask/row_frac"}
  for key in m_plain:
    np.testing.assert_allclose(m_under[key], m_plain[key], rtol=1e-5, atol=1e-6, err_msg=key)
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5),
    (under.params, under.lora),
    (plain.params, plain.lora),
  )


@pytest.mark.slow
def test_token_masking_is_the_loss_without_those_tokens():
  """Tokens whose exact alpha is under rl.mask_alpha_below leave the dense loss exactly as if
  they were not in gen_mask; they are counted; DistillSparse still fits them."""
  params, lora, *_ = setup()
  batch = make_batch(params, lora, seed=8)
  gen = np.asarray(batch.gen_mask)
  alpha = np.asarray(reference_alpha(params, lora, batch))
  below = next(t for t in clean_thresholds(alpha[gen]) if (alpha[gen] < t).sum() >= 0.1 * gen.sum())
  out = gen & (alpha < below)
  assert 0 < out.sum() < gen.sum() and (out.sum(1) < gen.sum(1)).all()  # holes, not whole rows
  state, m = run_step(masking(token_below=below), params, lora, batch)
  without = batch.replace(gen_mask=jnp.asarray(gen & ~out))
  adv = advantages.advantages(batch.rewards, SC.rollout.group_size)
  want, hole = ts.policy_loss(params, without, adv, CFG, SC)
  np.testing.assert_allclose(m["loss/policy"], want, rtol=1e-5)
  # a token out of the loss still conditions the tokens after it
  full = ts.policy_loss(params, batch, adv, CFG, SC)[1]
  kept = gen & ~out
  np.testing.assert_allclose(np.asarray(hole["logp"])[kept], np.asarray(full["logp"])[kept], 1e-5)
  assert round(float(m["mask/token_frac"]) * gen.sum()) == out.sum()
  np.testing.assert_allclose(m["mask/token_frac"], out.sum() / gen.sum(), rtol=1e-6)
  assert float(m["mask/row_frac"]) == 0.0
  plain, m_plain = run_step(SC, params, lora, batch)
  assert abs(float(m_plain["loss/policy"]) - float(want)) > 1e-3  # the masked tokens counted
  ref, _ = run_step(SC, params, lora, without)
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5), state.params, ref.params
  )
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, atol=1e-4), state.lora, plain.lora
  )
  np.testing.assert_allclose(m["acceptance/mean"], m_plain["acceptance/mean"], rtol=1e-5)


@pytest.mark.slow
def test_row_masking_drops_the_rows_whose_p1_alpha_is_under_it():
  """A threshold between the rows' p1 alpha (and none of their min alpha, which would drop other
  rows): exactly the rows under it in p1 leave the loss, and are counted."""
  params, lora, *_ = setup()
  batch = make_batch(params, lora, seed=8)
  gen = np.asarray(batch.gen_mask)
  alpha = np.asarray(reference_alpha(params, lora, batch))
  p1 = np.array([np.percentile(a[g], 1) for a, g in zip(alpha, gen)])
  low = np.array([a[g].min() for a, g in zip(alpha, gen)])
  below = next(
    t
    for t in clean_thresholds(p1, avoid=low)
    if 0 < (p1 < t).sum() < len(p1) and ((p1 < t) != (low < t)).any()
  )
  rows = p1 < below
  state, m = run_step(masking(row_below=below), params, lora, batch)
  adv = advantages.advantages(batch.rewards, SC.rollout.group_size)
  without = batch.replace(gen_mask=jnp.asarray(gen & ~rows[:, None]))
  np.testing.assert_allclose(
    m["loss/policy"], ts.policy_loss(params, without, adv, CFG, SC)[0], 1e-5
  )
  np.testing.assert_allclose(m["mask/row_frac"], rows.mean(), rtol=1e-6)
  assert float(m["mask/token_frac"]) == 0.0


def with_ends(batch, ends):
  """`batch` with row b's completion ended before position ends[b] (as a row that stopped early)."""
  keep_BS = jnp.arange(batch.tokens.shape[1])[None] < jnp.asarray(ends)[:, None]
  return batch.replace(gen_mask=batch.gen_mask & keep_BS)


def test_a_pass_runs_at_the_smallest_bucket_holding_its_longest_row():
  S, lengths = 36, accumulation.bucket_lengths((16, 24, 40), 36)
  assert lengths == (16, 24, 36)
  tokens = jnp.ones((2, S), jnp.int32)

  def fn(batch):  # the length it ran at, and a per-row array of it
    return batch.tokens.shape[1], batch.tokens.astype(jnp.float32)

  for end, ran_at in ((10, 16), (16, 16), (17, 24), (30, 36)):
    batch = step_schema.Batch(
      tokens=tokens,
      gen_mask=jnp.arange(S)[None] == end - 1,
      prompt_len=jnp.full((2,), 4),
      logp_rollout=jnp.zeros((2, S)),
      rewards=jnp.zeros(2),
    )
    n, per_row = accumulation.in_length_bucket(
      lambda b: (jnp.int32(fn(b)[0]), fn(b)[1]), batch, lengths
    )
    assert int(n) == ran_at
    np.testing.assert_array_equal(per_row, jnp.arange(S)[None].repeat(2, 0) < ran_at)


@pytest.mark.nightly
@pytest.mark.parametrize(
  "rl",
  [
    step_schema.RLConfig(micro_batches=2, loss_agg="seq-mean-token-sum-norm", entropy_coef=0.01),
    step_schema.RLConfig(num_minibatches=2, micro_batches=2, mask_alpha_below=0.05),
  ],
  ids=["one_update", "minibatches_masked"],
)
def test_length_buckets_give_the_unbucketed_step(rl, monkeypatch):
  """Rows that stopped early, run through buckets (16, 24; rows are 36 tokens) with their
  micro-batches sorted by length: the same update and metrics as every pass at the full length,
  one executable over batches of different lengths, whose passes were traced at exactly the
  bucket lengths."""
  params, lora, _, _ = setup()
  opt = lora_opt = optax.sgd(0.1)  # an update linear in the gradient (Adam's scales up rounding)
  batches = [
    with_ends(make_batch(params, lora, seed=20 + i), ends)
    for i, ends in enumerate(([14, 36, 16, 12, 22, 36, 15, 24], [13, 15, 16, 14, 12, 16, 11, 10]))
  ]
  traced = []
  hidden_states = ts.hidden_states
  monkeypatch.setattr(
    ts,
    "hidden_states",
    lambda p, b, *a, **k: traced.append(b.tokens.shape[1]) or hidden_states(p, b, *a, **k),
  )
  out = {}
  for buckets in ((), (16, 24)):
    sc = dataclasses.replace(SC, rl=dataclasses.replace(rl, length_buckets=buckets))
    step = ts.make_train_step(CFG, sc, opt, lora_opt, SPARSE)
    traced.clear()
    out[buckets] = [step(state_of(params, opt, lora, lora_opt), b, BUDGET) for b in batches]
    assert step._cache_size() == 1
    assert set(traced) == set(accumulation.bucket_lengths(buckets, 36))
  for (full, m_full), (cut, m_cut) in zip(out[()], out[(16, 24)]):
    jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5), cut.params, full.params
    )
    jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, atol=2e-4), cut.lora, full.lora
    )
    assert m_cut.keys() == m_full.keys()
    for key in m_full:
      np.testing.assert_allclose(m_cut[key], m_full[key], rtol=1e-4, atol=1e-5, err_msg=key)


def test_length_buckets_are_checked():
  for buckets, why in (((24, 16), "increasing"), ((16, 18), "page_size")):
    with pytest.raises(ValueError, match=f"length_buckets.*{why}"):
      step_schema.StepConfig(rl=step_schema.RLConfig(length_buckets=buckets), rollout=SC.rollout)


@pytest.mark.slow
def test_observation_tokens_never_enter_the_loss_tis_or_the_tails():
  """A multi-turn row's tool observations (Rollout.observed) are context, not actions: they are
  holes in gen_mask (still in the sequence the later tokens condition on), the step's update and
  every metric (loss, TIS, tails) are the same whatever log-prob the rollout holds there, and the
  generated-token counts and the tails count the sampled tokens only. The sparse pass reads them
  (and the turn end before each) as dense context, `Batch.context`, as the engine prefilled them:
  without it the tails move."""
  params, lora, opt, lora_opt = setup()
  prompt, prompt_len, out, rewards = make_rollout(params, lora, seed=8)
  lengths = np.asarray(out.lengths)
  pos = np.arange(out.tokens.shape[1])[None]
  observed = (pos >= 3) & (pos < 3 + lengths[:, None] // 3)  # a span inside every row
  assert observed.sum() > 0
  step = ts.make_train_step(CFG, SC, opt, lora_opt, SPARSE)

  def run(logprob_there):
    marked = out.replace(
      observed=jnp.asarray(observed), logprobs=jnp.where(observed, logprob_there, out.logprobs)
    )
    batch = step_schema.batch_from_rollout(prompt, prompt_len, marked, rewards)
    return batch, step(state_of(params, opt, lora, lora_opt), batch, BUDGET)

  batch, (state, m) = run(0.0)
  _, (other, m_other) = run(-7.0)
  # the sparse pass reads the observations (and the turn end before each) as dense context
  assert np.asarray(batch.context).sum() > observed.sum()
  _, m_sparse_context = step(
    state_of(params, opt, lora, lora_opt), batch.replace(context=None), BUDGET
  )
  assert float(m_sparse_context["acceptance/mean"]) != float(m["acceptance/mean"])
  for key in m:
    np.testing.assert_array_equal(m[key], m_other[key], err_msg=key)
  jax.tree_util.tree_map(np.testing.assert_array_equal, state.params, other.params)
  sampled = lengths - observed.sum(1)
  np.testing.assert_allclose(m["response_length/mean"], sampled.mean(), rtol=1e-6)
  assert int(np.sum(m["acceptance/count_bin"])) == int(sampled.sum())
  plain = make_batch(params, lora, seed=8)  # the same rows, every completion token sampled
  np.testing.assert_array_equal(batch.tokens, plain.tokens)  # observations stay in the context
  at = np.arange(plain.tokens.shape[1])[None] - np.asarray(prompt_len)[:, None]
  observed_S = (at >= 3) & (at < 3 + lengths[:, None] // 3)
  np.testing.assert_array_equal(batch.gen_mask, np.asarray(plain.gen_mask) & ~observed_S)


def test_a_token_s_turn_counts_the_tool_observations_before_it():
  """The turn end before an observation is sampled and stays in its turn; a turn starts after each
  observation."""
  gen = np.array([[0, 0, 1, 1, 1, 0, 0, 1, 1, 0, 1, 1]], bool)  # prompt, turn, obs, turn, obs, turn
  observed = np.array([[0, 0, 0, 0, 0, 1, 1, 0, 0, 1, 0, 0]], bool)
  context = observed | np.pad(observed[:, 1:], ((0, 0), (0, 1)))
  batch = step_schema.Batch(
    tokens=jnp.zeros(gen.shape, jnp.int32),
    gen_mask=jnp.asarray(gen),
    prompt_len=jnp.asarray([2]),
    logp_rollout=jnp.zeros(gen.shape),
    rewards=jnp.zeros(1),
    context=jnp.asarray(context),
  )
  turn = np.asarray(step_schema.turn_index(batch))
  np.testing.assert_array_equal(turn[gen], [0, 0, 0, 1, 1, 2, 2])


@pytest.mark.slow
def test_a_multi_turn_batch_s_tails_are_also_per_turn(monkeypatch):
  """acceptance/*_turn: each turn's sampled tokens (the observations' holes in gen_mask split a
  row into turns) summarized as the overall tails are: their counts are each turn's, and they add
  up to the overall count and mean. A single-turn batch's step never computes them (its program
  is the one it was before multi-turn rows)."""
  params, lora, opt, lora_opt = setup()
  prompt, prompt_len, out, rewards = make_rollout(params, lora, seed=8)
  pos = np.arange(out.tokens.shape[1])[None]
  observed = ((pos >= 3) & (pos < 6)) | ((pos >= 10) & (pos < 12))  # two observations a row
  marked = out.replace(observed=jnp.asarray(observed & (pos < np.asarray(out.lengths)[:, None])))
  batch = step_schema.batch_from_rollout(prompt, prompt_len, marked, rewards)
  sc = dataclasses.replace(SC, stats=dataclasses.replace(SC.stats, turns=3))
  _, m = ts.make_train_step(CFG, sc, opt, lora_opt, SPARSE)(
    state_of(params, opt, lora, lora_opt), batch, BUDGET
  )
  gen = np.asarray(batch.gen_mask)
  at = np.arange(gen.shape[1])[None] - np.asarray(prompt_len)[:, None]  # completion position
  turn = (at >= 6).astype(int) + (at >= 12)
  expected = [int((gen & (turn == t)).sum()) for t in range(3)]
  assert min(expected) > 0
  for family in ("acceptance", "acceptance_sampled"):
    count, mean = m[f"{family}/count_turn"], m[f"{family}/mean_turn"]
    np.testing.assert_array_equal(count, expected, err_msg=family)
    np.testing.assert_allclose(
      np.sum(count * mean), m[f"{family}/count"] * m[f"{family}/mean"], rtol=1e-5, err_msg=family
    )
    assert m[f"{family}/p5_turn"].shape == (3,)
  monkeypatch.setattr(acceptance, "turn_stats", lambda *a, **k: pytest.fail("turn stats ran"))
  _, m_plain = ts.make_train_step(CFG, sc, opt, lora_opt, SPARSE)(
    state_of(params, opt, lora, lora_opt), make_batch(params, lora, seed=8), BUDGET
  )
  assert not [key for key in m_plain if key.endswith("_turn")]
