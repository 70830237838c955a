"""Exact mode (rollout/speculative.py): the acceptance rule samples the dense chain's distribution
(and a broken rule is caught), greedy speculative rollouts are dense greedy token for token, rows
do not depend on their placement, a round leaves the cache dense decoding leaves, and the verify
pass's page-table attention equals its dense twin."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats as scipy_stats

import sparrow_jax as sj
from sparrow_jax.attention import page_pool, reference
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.model import qwen3
from sparrow_jax.rollout import engine, programs, sampler, speculative
from sparrow_jax.sparsity import policy
from sparrow_jax.sparsity.schedule import DraftPlan, KVSchedule
from tests.helpers import assert_dashboard_has_data, tiny_config

# A Markov chain on V tokens: the dense p(x | previous) and a draft q far from it.
V, K_DRAFT, N_SAMPLES = 4, 3, 20000
P_VV = np.asarray(
  [[0.5, 0.3, 0.1, 0.1], [0.1, 0.1, 0.2, 0.6], [0.25, 0.25, 0.25, 0.25], [0.05, 0.05, 0.8, 0.1]]
)
Q_VV = np.asarray(
  [[0.1, 0.1, 0.4, 0.4], [0.4, 0.3, 0.2, 0.1], [0.7, 0.1, 0.1, 0.1], [0.3, 0.3, 0.1, 0.3]]
)


@functools.partial(jax.jit, static_argnames=("rounds",))
def chain_samples(keys_N, rounds: int = 2):
  """Each key's first two tokens after token 0 by speculative rounds of K_DRAFT drafts (each
  token's keys from its index, as the engine's), drafts from Q_VV, verified against P_VV."""
  logp, logq = jnp.log(jnp.asarray(P_VV)), jnp.log(jnp.asarray(Q_VV))

  def one(key):
    out, last, n = jnp.zeros(rounds * (K_DRAFT + 1), jnp.int32), jnp.int32(0), jnp.int32(0)
    for _ in range(rounds):
      token_keys = jax.vmap(lambda c: jax.random.fold_in(key, n + c))(jnp.arange(K_DRAFT + 1))
      drafts, prev = [], last
      for i in range(K_DRAFT):
        d = jax.random.categorical(speculative.draw_keys(token_keys[i])[0], logq[prev])
        drafts.append(d.astype(jnp.int32))
        prev = drafts[-1]
      draft_k = jnp.stack(drafts)
      context_C = jnp.concatenate([last[None], draft_k])
      tokens_C, n_acc, _, _ = speculative.accept_round(
        logp[context_C], logq[context_C[:K_DRAFT]], draft_k, token_keys
      )
      cols = jnp.where(jnp.arange(K_DRAFT + 1) <= n_acc, n + jnp.arange(K_DRAFT + 1), out.size)
      out = out.at[cols].set(tokens_C, mode="drop")
      last, n = tokens_C[n_acc], n + n_acc + 1
    return out[:2]

  return jax.vmap(one)(keys_N)


def chi_square_pairs(samples_N2):
  """Pearson's statistic of the (x1, x2) counts against the chain's p(x1 | 0) p(x2 | x1), and the
  threshold a correct sampler exceeds with probability 1e-6 at this sample size (df = V^2 - 1)."""
  expected = (P_VV[0][:, None] * P_VV) * len(samples_N2)
  counts = np.zeros((V, V))
  np.add.at(counts, (samples_N2[:, 0], samples_N2[:, 1]), 1)
  return float(np.sum((counts - expected) ** 2 / expected)), scipy_stats.chi2.ppf(
    1 - 1e-6, V * V - 1
  )


@pytest.mark.slow
def test_rounds_sample_the_dense_chain_and_a_broken_rule_is_caught(monkeypatch):
  keys = jax.random.split(jax.random.PRNGKey(0), N_SAMPLES)
  stat, threshold = chi_square_pairs(np.asarray(chain_samples(keys)))
  assert stat < threshold
  # The classic bug: at a rejection draw from p instead of the residual max(p - q, 0).
  monkeypatch.setattr(speculative, "residual_logits", lambda logp_p_V, logq_V: logp_p_V)
  chain_samples.clear_cache()
  stat, threshold = chi_square_pairs(np.asarray(chain_samples(keys)))
  assert stat > threshold
  chain_samples.clear_cache()


@pytest.mark.slow
def test_greedy_rule_keeps_drafts_while_they_are_the_argmax():
  logp_p = jnp.log(jax.nn.one_hot(jnp.asarray([2, 1, 3, 0]), V) + 1e-30)
  logp_p = jnp.where(logp_p > -1, 0.0, -jnp.inf)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  for draft, n_want in (([2, 1, 3], 3), ([2, 0, 3], 1), ([1, 1, 3], 0)):
    logq = jnp.where(jax.nn.one_hot(jnp.asarray(draft), V) > 0, 0.0, -jnp.inf)
    tokens, n, logp, alpha = speculative.accept_round(logp_p, logq, jnp.asarray(draft), keys)
    assert int(n) == n_want
    np.testing.assert_array_equal(tokens[: n_want + 1], [2, 1, 3, 0][: n_want + 1])
    np.testing.assert_array_equal(logp[: n_want + 1], 0.0)
    np.testing.assert_array_equal(alpha, np.asarray(draft) == np.asarray([2, 1, 3]))


def test_the_bonus_token_is_drawn_from_the_last_dense_distribution():
  """Every draft kept (p = q on the drafts' positions), so each round ends with the bonus token:
  its distribution must be p_k, not the residual against q_{k-1}."""
  logq_dV = jnp.log(jnp.asarray(Q_VV[:K_DRAFT]))
  p_k = P_VV[0]  # far from q_{k-1} = Q_VV[2]: the residual max(p_k - q_{k-1}, 0) has 2 tokens
  logp_CV = jnp.concatenate([logq_dV, jnp.log(jnp.asarray(p_k))[None]])
  draft_k = jnp.asarray([2, 0, 1], jnp.int32)

  def one(key):
    token_keys = jax.vmap(lambda c: jax.random.fold_in(key, c))(jnp.arange(K_DRAFT + 1))
    tokens_C, n, _, _ = speculative.accept_round(logp_CV, logq_dV, draft_k, token_keys)
    return tokens_C[K_DRAFT], n

  bonus_N, n_N = jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(5), N_SAMPLES))
  assert np.all(np.asarray(n_N) == K_DRAFT)
  counts = np.bincount(np.asarray(bonus_N), minlength=V)
  expected = p_k * N_SAMPLES
  stat = float(np.sum((counts - expected) ** 2 / expected))
  assert stat < scipy_stats.chi2.ppf(1 - 1e-6, V - 1), (counts, expected)


def test_a_draft_the_dense_policy_gives_no_mass_is_never_kept():
  """The accept rule at its boundary: u < p / q is strict, so p(d) = 0 rejects even at u = 0."""
  log0 = -jnp.inf
  for u in (0.0, 0.3, 0.999):
    u_k = jnp.full(3, u, jnp.float32)
    assert int(speculative.n_accepted(u_k, jnp.asarray([log0, 0.0, 0.0]), jnp.zeros(3))) == 0
    assert int(speculative.n_accepted(u_k, jnp.asarray([0.0, log0, 0.0]), jnp.zeros(3))) == 1
  # p = q keeps every draft, whatever u in [0, 1).
  assert (
    int(speculative.n_accepted(jnp.asarray([0.0, 0.5, 0.999]), jnp.zeros(3), jnp.zeros(3))) == 3
  )


@pytest.mark.slow
def test_verify_attention_is_dense_causal_attention_over_the_row():
  """reference.paged_verify_attention (pages through a page table + C new keys) against the
  dense attention of the same row laid out contiguously."""
  rng = np.random.RandomState(0)
  B, K, G, E, Z, C, N = 3, 2, 2, 8, 4, 3, 5
  lengths = np.asarray([5, 0, 17])
  X = B * K * N + 1
  k_pages = jnp.asarray(rng.randn(X, Z, E), jnp.float32)
  v_pages = jnp.asarray(rng.randn(X, Z, E), jnp.float32)
  table_BKN = jnp.asarray(rng.permutation(X - 1)[: B * K * N].reshape(B, K, N) % (X - 1) + 1)
  q = jnp.asarray(rng.randn(B, K, C, G, E), jnp.float32)
  k_new = jnp.asarray(rng.randn(B, K, C, E), jnp.float32)
  v_new = jnp.asarray(rng.randn(B, K, C, E), jnp.float32)
  out = reference.paged_verify_attention(
    q, k_pages, v_pages, table_BKN, jnp.asarray(lengths), k_new, v_new
  )
  for b in range(B):
    n = lengths[b]
    rows_k = k_pages[table_BKN[b]].reshape(K, N * Z, E)[:, :n]
    rows_v = v_pages[table_BKN[b]].reshape(K, N * Z, E)[:, :n]
    keys = jnp.concatenate([rows_k, k_new[b]], axis=1).transpose(1, 0, 2)[None]
    values = jnp.concatenate([rows_v, v_new[b]], axis=1).transpose(1, 0, 2)[None]
    allowed = (jnp.arange(n + C)[None] <= n + jnp.arange(C)[:, None])[None]
    want = reference.dense_attention(q[b].transpose(1, 0, 2, 3)[None], keys, values, allowed)
    np.testing.assert_allclose(out[b], want[0].transpose(1, 0, 2, 3), atol=1e-5)
  # One query is the decode attention's page-table path with the new token written in the cache.
  at = (
    table_BKN[jnp.arange(B)[:, None], jnp.arange(K)[None], lengths[:, None] // Z],
    lengths[:, None] % Z,
  )
  k_written = k_pages.at[at].set(k_new[:, :, 0])
  v_written = v_pages.at[at].set(v_new[:, :, 0])
  logical = jnp.broadcast_to(jnp.arange(N, dtype=jnp.int32), (B, K, N))
  n_valid = jnp.broadcast_to(jnp.asarray(-(-(lengths + 1) // Z), jnp.int32)[:, None], (B, K))
  decode = reference.paged_decode_attention(
    q[:, :, 0], k_written, v_written, table_BKN, logical, n_valid, jnp.asarray(lengths + 1)
  )
  np.testing.assert_allclose(out[:, :, 0], decode, atol=1e-5)


CFG = tiny_config(num_hidden_layers=3)
PARAMS = sj.init_params(CFG, jax.random.PRNGKey(0), std=0.3)
SPARSE = SparseConfig(page_size=4, dense_layers=1)
SCHEDULE = KVSchedule.fixed(4, page_size=4)  # binding: rows reach 15+ pages
GROUP_LEN = np.asarray([9, 20, 13])
PROMPT_LEN = np.repeat(GROUP_LEN, 2)
PROMPT = np.repeat(np.random.RandomState(0).randint(1, CFG.vocab_size, (3, 21)), 2, axis=0) * (
  np.arange(21)[None] < PROMPT_LEN[:, None]
)
MAX_NEW = np.asarray([40, 7, 33, 40, 1, 25])
EOS = (3, 5)


def run(
  speculate=3,
  slots=6,
  chunk=16,
  pages=200,
  params=PARAMS,
  cfg=CFG,
  rows=slice(None),
  schedule=SCHEDULE,
  max_new=MAX_NEW,
  sparse=SPARSE,
  **sampling,
):
  config = engine.EngineConfig(
    num_slots=slots, num_pages=pages, chunk_steps=chunk, speculate=speculate
  )
  prompt, prompt_len = PROMPT[rows], PROMPT_LEN[rows]
  return engine.run(
    params,
    cfg,
    engine.Requests(prompt, prompt_len, np.broadcast_to(max_new, (6,))[rows], group_size=2),
    jax.random.PRNGKey(1),
    engine=config,
    sampling=sj.Sampling(**{"eos_ids": EOS, "temperature": 0.0, **sampling}),
    sparse=sparse,
    schedule=schedule,
  )


def assert_same_rows(a, b, atol=1e-5):
  np.testing.assert_array_equal(a.lengths, b.lengths)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny", pytest.param("kv_heads", marks=pytest.mark.nightly)])
def test_greedy_speculative_rows_are_dense_greedy_rows(model):
  params, cfg = PARAMS, CFG
  if model == "kv_heads":  # several KV heads, two sparse layers past the dense one
    cfg = tiny_config(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4)
    params = sj.init_params(cfg, jax.random.PRNGKey(3), std=0.3)
  dense, _ = run(0, params=params, cfg=cfg, sparse=None, schedule=None)
  for k in (1, 4):
    spec, stats = run(k, params=params, cfg=cfg)
    assert_same_rows(spec, dense)
    assert stats.drafted == k * stats.rounds > 0 and 0 < stats.draft_acceptance <= 1
    assert 1 < stats.accepted_per_round <= k + 1
    assert 0 < stats.rows_in_flight <= 6  # 6 slots, however many tokens a round emits


TIGHT = KVSchedule.fixed(3, page_size=4)  # 3 pages: a 48-token prompt's drafts read a quarter
PREEMPT_PAGES = 24  # 3 slots' rows outgrow it: the least advanced row is preempted


def head(rollout, n: int):
  return jax.tree_util.tree_map(lambda x: np.asarray(x)[:n], rollout)


@pytest.mark.nightly
def test_sampled_rows_do_not_depend_on_placement():
  ref, _ = run(3, temperature=1.0)
  preempted, stats = run(3, temperature=1.0, slots=3, chunk=9, pages=PREEMPT_PAGES)
  assert stats.preemptions > 0
  # Placements that share a compiled chunk (slots, rounds per chunk, pool) with another run here.
  variants = [
    run(3, temperature=1.0, slots=2, chunk=5)[0],  # 1 round a chunk
    preempted,  # rows wait and are preempted
    run(3, temperature=1.0, slots=4, chunk=4)[0],
  ]
  four, _ = run(3, temperature=1.0, rows=slice(0, 4), slots=4, chunk=4)
  two, _ = run(3, temperature=1.0, rows=slice(0, 2), slots=2, chunk=5)
  for got, want in [(v, ref) for v in variants] + [(four, head(ref, 4)), (two, head(four, 2))]:
    assert_same_rows(got, want)
    # alpha sums a row's probabilities: its rounding follows the batch's width
    np.testing.assert_allclose(np.asarray(got.alpha), np.asarray(want.alpha), atol=1e-5)


@pytest.mark.slow
def test_logprobs_are_the_dense_policy_s_and_alpha_its_acceptance():
  out, stats = run(3, temperature=1.0, top_k=20)
  tokens = np.asarray(out.tokens)
  for b in range(6):
    n, p = int(out.lengths[b]), PROMPT_LEN[b]
    rows = np.concatenate([PROMPT[b, :p], tokens[b, :n]])
    logits = qwen3.forward(PARAMS, jnp.asarray(rows)[None], CFG)[0, p - 1 : p - 1 + n]
    logp = sampler.sampled_logp(logits, 1.0, 1.0, 20)
    want = np.take_along_axis(np.asarray(logp), tokens[b, :n, None], axis=1)[:, 0]
    np.testing.assert_allclose(np.asarray(out.logprobs)[b, :n], want, atol=2e-4)
  alpha = np.asarray(out.alpha)
  assert np.all(np.isnan(alpha[:, 0]))  # the first token is the prefill's: no draft
  drafted = ~np.isnan(alpha)
  assert drafted.any() and np.all((alpha[drafted] >= 0) & (alpha[drafted] <= 1 + 1e-6))
  assert stats.rounds > 0 and stats.drafted == 3 * stats.rounds


@pytest.mark.slow
@pytest.mark.parametrize(  # 48: past what TIGHT keeps, drafts rejected
  "prompt_len, page_score",
  [(10, "mean"), pytest.param(10, "quest", marks=pytest.mark.nightly), (48, "mean"), (48, "quest")],
)
def test_a_round_leaves_the_cache_dense_decoding_of_its_tokens_leaves(page_score, prompt_len):
  sparse = SparseConfig(page_size=4, dense_layers=1, page_score=page_score)
  Z, S, PR, rounds = 4, 4, 16, 2
  pool = page_pool.init_pool(CFG, S * PR + 1, Z, page_score=page_score)
  table = jnp.asarray(np.arange(1, S * PR + 1).reshape(S, PR), jnp.int32)
  prompt = np.random.RandomState(1).randint(1, CFG.vocab_size, (S, prompt_len))
  dense_fn = policy.pool_decode_attention_fn(None, None, None)
  active = jnp.ones(S, bool)
  step = jax.jit(
    lambda pool, token, length, active: qwen3.decode_step(
      PARAMS, token, CFG, page_pool.layer_views(pool, table, length, active), attention_fn=dense_fn
    )
  )
  for t in range(prompt.shape[1] - 1):
    _, layers = step(pool, jnp.asarray(prompt[:, t]), jnp.full(S, t, jnp.int32), active)
    pool = page_pool.from_layers(pool, layers)
  length = jnp.full(S, prompt.shape[1] - 1, jnp.int32)
  budget = engine._budget(TIGHT, sparse, PR * Z)
  slots = dict(
    token=jnp.asarray(prompt[:, -1], jnp.int32),
    length=length,
    n_gen=jnp.ones(S, jnp.int32),
    max_new=jnp.full(S, 100, jnp.int32),
    row=jnp.arange(S, dtype=jnp.int32),
    active=active,
    page_table=table,
  )
  copy = jax.tree_util.tree_map(jnp.copy, pool)
  spec_pool, after, out, _, count = programs.speculative_chunk(
    PARAMS,
    None,
    copy,
    budget,
    jax.random.PRNGKey(2),
    slots,
    cfg=CFG,
    rounds=rounds,
    draft=3,
    sparse=sparse,
    sampling=sj.Sampling(temperature=1.0),
  )
  n_emit = np.asarray(after["n_gen"]) - 1
  assert np.all(np.asarray(after["length"]) == np.asarray(length) + n_emit)
  if prompt_len > int(TIGHT.budget_pages(prompt_len)) * Z:  # the budget binds
    assert np.any(np.asarray(count["accepted"]) < rounds * 3), "no draft was rejected"
  # Dense decoding appends the round's cached tokens: the pending one and the accepted drafts.
  for b in range(S):
    kept = [prompt[b, -1]] + np.asarray(out["tokens"])[b, : n_emit[b] - 1].tolist()
    for j, token in enumerate(kept):
      one = jnp.asarray(prompt[:, -1]).at[b].set(token)
      _, layers = step(pool, one, length + j, jnp.arange(S) == b)
      pool = page_pool.from_layers(pool, layers)
  for name in ("k_stored", "v_stored", "summaries"):
    for got, want in zip(getattr(spec_pool, name), getattr(pool, name)):
      np.testing.assert_allclose(np.asarray(got)[:, :, 1:], np.asarray(want)[:, :, 1:], atol=1e-5)
  assert int(np.sum(count["rounds"])) == S * rounds


@pytest.mark.slow
def test_counters_count_only_what_rows_emit():
  """accepted_per_round: tokens emitted over rounds, every emitted token counted once (a row's
  first token is the prefill's); draft_acceptance: accepted over judged drafts, which at
  temperature 0 is the emitted drafted tokens' mean alpha (each 0 or 1)."""
  out, stats = run(3)
  lengths, alpha = np.asarray(out.lengths), np.asarray(out.alpha)
  assert stats.preemptions == 0 and stats.emitted == int(np.sum(lengths - 1))
  assert stats.accepted_per_round == stats.emitted / stats.rounds
  assert stats.rounds > stats.emitted - stats.accepted  # some round was cut by EOS or max_new
  drafted = ~np.isnan(alpha)
  assert stats.judged == int(np.sum(drafted)) and 0 < stats.accepted < stats.judged
  assert stats.draft_acceptance == pytest.approx(float(np.mean(alpha[drafted])), abs=1e-6)


@pytest.mark.slow
def test_generate_speculates_exactly_and_refuses_it_without_a_sparse_actor():
  prompt, prompt_len = PROMPT[:4], PROMPT_LEN[:4]
  args = (PARAMS, CFG, prompt, prompt_len, jax.random.PRNGKey(0))
  kw = dict(max_new_tokens=24, sampling=sj.Sampling(temperature=0.0), prefill_group=2)
  dense = sj.generate(*args, **kw)
  exact = sj.generate(*args, **kw, sparse=SPARSE, schedule=TIGHT, speculate=3)
  assert_same_rows(exact, dense)
  assert np.any(~np.isnan(np.asarray(exact.alpha))) and dense.alpha is None
  with pytest.raises(ValueError, match=r"speculate=3\) drafts with the sparse actor.*sparse="):
    sj.generate(*args, **kw, speculate=3)


def run_plan(plan, temperature=0.0, slots=6, chunk=16, pages=200):
  """`run` with exact mode's regime switch: each row-round drafts the plan's k at its length."""
  config = engine.EngineConfig(
    num_slots=slots, num_pages=pages, chunk_steps=chunk, speculate=3, draft_switch=True
  )
  return engine.run(
    PARAMS,
    CFG,
    engine.Requests(PROMPT, PROMPT_LEN, MAX_NEW, group_size=2),
    jax.random.PRNGKey(1),
    engine=config,
    sampling=sj.Sampling(eos_ids=EOS, temperature=temperature),
    sparse=SPARSE,
    schedule=SCHEDULE,
    draft_plan=plan,
  )


MIXED = DraftPlan((0, 3, 0, 2, 3), page_size=4, bin_size=8)  # dense, 3, dense, 2, then 3 drafts


@pytest.mark.nightly
def test_a_draft_plan_switches_per_bin_and_rows_stay_the_dense_policy_s():
  dense, _ = run(0, sparse=None, schedule=None)
  stats = {}
  for plan in (MIXED, DraftPlan((0,), 4, 8), DraftPlan((3,), 4, 8)):
    rows, stats[plan.k_bin] = run_plan(plan)
    assert_same_rows(rows, dense)  # greedy: dense greedy, whatever the plan
  assert stats[(0,)].drafted == 0 and stats[(0,)].emitted == stats[(0,)].rounds  # dense rounds
  assert stats[(3,)].drafted == 3 * stats[(3,)].rounds
  assert 0 < stats[MIXED.k_bin].drafted < 3 * stats[MIXED.k_bin].rounds
  # A plan of k everywhere is the fixed-k engine, bit for bit.
  fixed, fixed_stats = run(3, temperature=1.0)
  planned, planned_stats = run_plan(DraftPlan((3,), 4, 8), temperature=1.0)
  assert_same_rows(planned, fixed, atol=0)
  np.testing.assert_array_equal(np.asarray(planned.alpha), np.asarray(fixed.alpha))
  assert planned_stats == fixed_stats
  # Sampled rows do not depend on their placement, which decides the chunks' programs (a chunk
  # with no row drafting runs dense rounds only).
  ref, _ = run_plan(MIXED, temperature=1.0)
  for slots, chunk, pages in ((3, 9, 60), (2, 5, 200)):
    assert_same_rows(run_plan(MIXED, 1.0, slots, chunk, pages)[0], ref)


@pytest.mark.slow
def test_a_plan_that_drafts_nowhere_is_dense_decoding():
  """The switch's dense regime is the dense engine's decoding, sampled rows included (a round of
  no drafts draws with the token's own key, as a decode step does): so it costs what dense
  decoding costs, and its counters say one token a round, nothing drafted."""
  dense, _ = run(0, sparse=None, schedule=None, temperature=1.0)
  rows, stats = run_plan(DraftPlan((0,), 4, 8), temperature=1.0)
  assert_same_rows(rows, dense)
  assert np.all(np.isnan(np.asarray(rows.alpha)))
  assert stats.emitted == stats.rounds == int(np.sum(np.asarray(rows.lengths) - 1))
  assert stats.drafted == stats.judged == 0 and stats.kv_pages_read > 0


def test_a_draft_plan_by_cached_length():
  plan = DraftPlan((0, 3, 2), page_size=4, bin_size=8)
  # position_bin: whole pages cached // 2 pages a bin; past the last bin the last value holds
  np.testing.assert_array_equal(plan.k_by_len(20), [0] * 5 + [3] * 8 + [2] * 8)
  with pytest.raises(ValueError, match="DraftPlan.k_bin must be ints >= 0"):
    DraftPlan((1, -1), 4, 8)
  with pytest.raises(ValueError, match="draft_switch needs speculate > 0"):
    engine.EngineConfig(draft_switch=True)


def test_engine_config_checks_speculate():
  with pytest.raises(ValueError, match="EngineConfig.speculate must be an int >= 0"):
    engine.EngineConfig(speculate=-1)
  config = engine.EngineConfig(chunk_steps=16, speculate=4)
  assert (config.chunk_rounds, config.chunk_tokens) == (3, 15)
  assert engine.EngineConfig(chunk_steps=2, speculate=4).chunk_rounds == 1


@pytest.mark.slow
def test_no_recompilation_across_rounds_lengths_and_budgets():
  run(3, slots=3, chunk=8)
  before = programs.speculative_chunk._cache_size()
  run(3, slots=3, chunk=8, max_new=MAX_NEW[::-1])
  run(3, slots=3, chunk=8, schedule=KVSchedule.fixed(3, page_size=4))
  assert programs.speculative_chunk._cache_size() == before


@pytest.mark.slow
def test_a_speculative_training_step_logs_dense_rollouts(tmp_path):
  """rollout.speculate through the trainer: the rollouts' log-probs are the dense policy's, so the
  TIS weights are 1 up to the re-score's rounding; the exact mode's metrics are logged, and so is
  every tag of its dashboard."""
  from sparrow_jax.rl import trainer
  from tests.test_trainer import small

  c = small(tmp_path / "run", total_steps=2, rollout__speculate=2)
  rows = trainer.train(c)
  assert_dashboard_has_data(c, rows)
  for row in rows:
    assert abs(row["tis/weight_mean"] - 1) < 1e-3 and row["tis/weight_min"] > 1 - 1e-2
    assert 1 <= row["rollout/accepted_per_round"] <= 3
    assert 0 <= row["rollout/draft_acceptance"] <= 1
    assert 0 < row["kv/read_fraction"]


@pytest.mark.slow
def test_auto_speculation_starts_dense_and_stays_exact(tmp_path):
  """rollout.speculate = "auto" through the trainer: the first step decodes densely (nothing
  measured), every step logs the drafts per bin it ran (a later step's follow the hooks' pricing,
  tests/test_hooks.py; on this CPU the tiny model's measured pass overhead keeps them dense), and
  every step's rollouts stay the dense policy's (TIS weights 1)."""
  from sparrow_jax.rl import trainer
  from tests.test_trainer import small

  rows = trainer.train(small(tmp_path / "run", total_steps=3, rollout__speculate="auto"))
  assert not np.any(rows[0]["rollout/draft_k_bin"])
  for row in rows:
    assert len(row["rollout/draft_k_bin"]) == len(rows[0]["rollout/draft_k_bin"])
    assert abs(row["tis/weight_mean"] - 1) < 1e-3 and row["tis/weight_min"] > 1 - 1e-2


def test_a_row_drafting_fewer_than_the_chunk_s_k_draws_its_last_token_from_its_dense_p():
  """Exact mode's regime switch: a chunk runs the program of its most drafts k, and a row whose own
  draft count k_row is below it (`accept_round`'s drafts) ends its round, once its k_row drafts
  are kept, with the bonus token at offset k_row drawn from p_{k_row}, the dense distribution
  after its own last draft; the residual against the draft distribution the program computed
  there, q_{k_row}, would break the dense law. Rows of every k_row in one vmapped call, as the
  chunk makes it; p = q on a row's own drafts' positions keeps each of them."""
  logq_dV = jnp.log(jnp.asarray(Q_VV[:K_DRAFT]))
  # p_{k_row} = P_VV[0], against q_0, q_1, q_2 a residual on 2, 1 and 1 tokens; k_row = k: bonus.
  k_rows = np.arange(K_DRAFT + 1)
  logp_RCV = jnp.stack(
    [
      jnp.concatenate([logq_dV[:k], jnp.log(jnp.asarray(np.tile(P_VV[0], (K_DRAFT + 1 - k, 1))))])
      for k in k_rows
    ]
  )
  R = len(k_rows)
  draft_d = jnp.asarray([2, 0, 1], jnp.int32)

  def one(key):
    keys_RC = jax.vmap(
      lambda r: jax.vmap(lambda c: jax.random.fold_in(jax.random.fold_in(key, r), c))(
        jnp.arange(K_DRAFT + 1)
      )
    )(jnp.arange(R))
    tokens_RC, n_R, _, _ = jax.vmap(speculative.accept_round)(
      logp_RCV,
      jnp.broadcast_to(logq_dV, (R,) + logq_dV.shape),
      jnp.broadcast_to(draft_d, (R, K_DRAFT)),
      keys_RC,
      jnp.asarray(k_rows, jnp.int32),
    )
    return tokens_RC, n_R

  tokens_NRC, n_NR = jax.jit(jax.vmap(one))(jax.random.split(jax.random.PRNGKey(7), N_SAMPLES))
  tokens_NRC, n_NR = np.asarray(tokens_NRC), np.asarray(n_NR)
  threshold = scipy_stats.chi2.ppf(1 - 1e-6, V - 1)
  expected = P_VV[0] * N_SAMPLES
  wrong = {}
  for r, k in enumerate(k_rows):
    assert np.all(n_NR[:, r] == k), f"k_row {k}: its own drafts are not all kept"
    np.testing.assert_array_equal(
      tokens_NRC[:, r, :k], np.broadcast_to(draft_d[:k], (N_SAMPLES, k))
    )
    counts = np.bincount(tokens_NRC[:, r, k], minlength=V)
    if float(np.sum((counts - expected) ** 2 / expected)) >= threshold:
      wrong[int(k)] = counts.tolist()
  assert not wrong, f"last-token counts by k_row (of k {K_DRAFT}) {wrong}, want {expected}"


def test_a_chunk_is_filed_under_the_drafts_its_rounds_ran():
  """A chunk runs the program of the most drafts its rows' rounds may take (the look-ahead), and
  each round the most drafts a running row asks for: a chunk of k rounds is one whose every round
  drafted k. A chunk with rounds that drafted fewer is filed under no k (filed under the program's
  k it would price that k below its rounds' cost); its clock's length is its row-rounds' mean."""
  count = lambda rounds, drafts, cached: dict(
    rounds=np.asarray(rounds), round_drafts=np.asarray(drafts), cached=np.asarray(cached)
  )
  slots = dict(length=np.asarray([10, 30, 0]), n_gen=np.asarray([1, 4, 0]))
  full = count([2, 3, 0], [4, 6, 0], [21, 93, 0])
  assert engine._chunk_ran(2, slots, None, full) == (2, pytest.approx(114 / 5))
  short = count([2, 3, 0], [2, 6, 0], [21, 93, 0])  # a round with one row running drafted 0
  assert engine._chunk_ran(2, slots, None, short) == (None, pytest.approx(114 / 5))
  dense = engine._dense_round_counts(slots["length"], np.asarray([3, 1, 0]), CFG, 4)
  assert engine._chunk_ran(0, slots, None, dense) == (0, pytest.approx((10 + 11 + 12 + 30) / 4))
  # the dense engine's chunk (no exact-mode counters): rows step one token a step
  assert engine._chunk_ran(0, slots, np.asarray([4, 5, 0]), None) == (0, pytest.approx(63 / 4))


@pytest.mark.slow
def test_the_engine_files_a_look_ahead_chunk_under_no_draft_count():
  """Through the engine: rows short of the bin the look-ahead sees run the 2-draft program but
  draft nowhere, and no chunk is filed under 2; rows inside that bin are filed under 2, at the
  cached lengths their rounds ran at."""
  plan = DraftPlan((0, 0, 2), page_size=4, bin_size=8)  # 2 drafts from 13 cached tokens on
  assert plan.k_by_len(14)[12:].tolist() == [0, 2, 2]

  def rollout(prompt_len, max_new):
    prompt = np.repeat(np.random.RandomState(0).randint(1, CFG.vocab_size, (2, 16)), 2, axis=0)
    config = engine.EngineConfig(
      num_slots=4, num_pages=40, chunk_steps=16, speculate=2, draft_switch=True
    )
    return engine.run(
      PARAMS,
      CFG,
      engine.Requests(prompt * (np.arange(16) < prompt_len), [prompt_len] * 4, max_new, 2),
      jax.random.PRNGKey(1),
      engine=config,
      sampling=sj.Sampling(temperature=1.0),
      sparse=SPARSE,
      schedule=SCHEDULE,
      draft_plan=plan,
    )[1]

  short = rollout(6, 4)  # cached 6 .. 9: the window of 16 lengths reaches the 2-draft bin
  assert short.rounds > 0 and short.drafted == 0
  assert short.chunk_rounds == {}
  inside = rollout(14, 8)
  assert inside.drafted == 2 * inside.rounds and set(inside.chunk_rounds) == {2}
  assert all(14 <= cached <= 21 for _, cached, _ in inside.chunk_rounds[2])
