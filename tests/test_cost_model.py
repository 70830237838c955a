"""eFLOPs cost model: hand-computed cases, the paper's closed form, monotonicity, speedups."""

import dataclasses

import numpy as np
import pytest

from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.mismatch import cost_model
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.sparsity.schedule import KVSchedule

# I = 10 / 5 = 2 FLOPs per byte, 2-byte elements: small enough to check by hand.
TOY_HW = cost_model.Hardware("toy", peak_flops=10.0, mem_bandwidth=5.0, dtype_bytes=2)
TOY_SPARSE = SparseConfig(page_size=2, dense_layers=1)  # the toy cases: pages of 2, 1 dense layer


def test_param_count_by_hand_and_against_model_cards():
  # tiny: D=64, F=128, 2 layers, 4 query heads, 2 KV heads, head_dim 16, vocab 256, tied.
  attention = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 2 * 16  # q, k, v, o, q/k norms
  layer = attention + 3 * 64 * 128 + 2 * 64  # + MLP + 2 RMSNorms
  assert cost_model.param_count("tiny") == 256 * 64 + 2 * layer + 64
  untied = Qwen3Config.preset("tiny-untied")
  assert cost_model.param_count(untied) > cost_model.param_count(
    Qwen3Config(**{**untied.__dict__, "tie_word_embeddings": True})
  )
  # Qwen3 model cards: non-embedding parameters 0.44B, 1.4B, 3.6B, 6.95B, 13.2B.
  for name, non_embedding in [
    ("qwen3-0.6b", 0.44e9),
    ("qwen3-1.7b", 1.4e9),
    ("qwen3-4b", 3.6e9),
    ("qwen3-8b", 6.95e9),
    ("qwen3-14b", 13.2e9),
  ]:
    cfg = Qwen3Config.preset(name)
    embeddings = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    assert cost_model.param_count(name) - embeddings == pytest.approx(non_embedding, rel=0.02)


def test_dense_cost_by_hand():
  # tiny: P = 90496, r = 2, D = 2 (K and V) * 32 * 2 layers = 128. Prompt 3, 2 steps, 2 samples:
  # step t attends to S = 4, 5 tokens.
  p, r, d, n = 90496, 2, 128, 2
  compute = n * (2 * p + 2 * r * d * 4) + n * (2 * p + 2 * r * d * 5)
  memory = 2 * d * (3 + n * 1) + 2 * d * (3 + n * 2)  # bytes: shared prompt KV + own KV
  expected = compute + 2 * memory
  assert cost_model.dense_rollout_cost("tiny", 3, 2, n_samples=2, hardware=TOY_HW) == expected


def test_sparse_cost_by_hand():
  # 1 dense layer (D = 64) + 1 sparse layer (D = 64); pages of 2 tokens; 2 pages kept (1 always).
  # S = 4, 5 -> cached pages 2, 3 -> budget 2 pages = 4 tokens; 1 complete prompt page is shared.
  schedule = KVSchedule.fixed(2, page_size=2, always_kept=1)
  p, r, n = 90496, 2, 2
  compute = n * (2 * p + 2 * r * (64 * 4 + 64 * 4) + 64 * 2) + n * (
    2 * p + 2 * r * (64 * 5 + 64 * 4) + 64 * 3
  )
  elems = (
    64 * (3 + n * 1)
    + n * 64 * 4
    + 32 * (1 + n * (2 - 1))
    + 64 * (3 + n * 2)
    + n * 64 * 4
    + 32 * (1 + n * (3 - 1))
  )
  expected = compute + 2 * (2 * elems)
  got = cost_model.sparse_rollout_cost(
    "tiny", schedule, 3, 2, n_samples=2, hardware=TOY_HW, sparse=TOY_SPARSE
  )
  assert got == expected


def test_dense_sum_matches_paper_closed_form():
  cfg = Qwen3Config.preset("qwen3-1.7b")
  p, n, l_in, l_out = cost_model.param_count(cfg), 8, 1024, 32768
  d, r, i = 2 * cfg.kv_width * cfg.num_hidden_layers, cfg.group_size, TOY_HW.intensity
  c_comp = 2 * p * n * l_out + r * (2 * l_in + l_out) * l_out * n * d
  c_mem = 2 * l_in * l_out * d + n * l_out**2 * d
  got = cost_model.dense_rollout_cost(cfg, l_in, l_out, n, TOY_HW)
  assert got == pytest.approx(c_comp + i * c_mem, rel=1e-3)


def test_more_budget_never_costs_less():
  costs = [
    cost_model.sparse_rollout_cost("qwen3-1.7b", KVSchedule.fixed(pages), 512, 4096)
    for pages in (3, 8, 32, 128, 288, 400)
  ]
  assert all(a < b for a, b in zip(costs[:-1], costs[1:-1]))
  assert costs[-2] == costs[-1]  # 4608 tokens = 288 pages: any larger budget is already capped
  taus = [0.75, 0.80, 0.83, 0.86, 0.88, 0.90, 0.92, 0.94]
  paper = [
    cost_model.sparse_rollout_cost("qwen3-1.7b", KVSchedule.paper("qwen3-1.7b", tau), 1024, 32768)
    for tau in taus
  ]
  assert all(a < b for a, b in zip(paper, paper[1:]))


@pytest.mark.parametrize("n_samples, dense_layers", [(1, 0), (8, 0), (8, 2)])
def test_budget_covering_context_costs_at_least_dense(n_samples, dense_layers):
  everything = KVSchedule.fixed(10**6)
  for hardware in ("h200", "tpu_v5e", TOY_HW):
    dense = cost_model.dense_rollout_cost("qwen3-4b", 700, 3000, n_samples, hardware)
    sparse = cost_model.sparse_rollout_cost(
      "qwen3-4b",
      everything,
      700,
      3000,
      n_samples,
      hardware,
      SparseConfig(dense_layers=dense_layers),
    )
    assert sparse >= dense


def test_all_dense_layers_is_no_speedup():
  cfg = Qwen3Config.preset("qwen3-1.7b")
  speedup = cost_model.rollout_speedup(
    cfg, KVSchedule.fixed(4), 100, 500, sparse=SparseConfig(dense_layers=cfg.num_hidden_layers)
  )
  assert speedup == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("model", ["qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b"])
def test_paper_schedules_speed_up_long_rollouts(model):
  schedule = KVSchedule.paper(model, 0.86)
  for hardware in cost_model.HARDWARE:
    assert cost_model.rollout_speedup(model, schedule, 1024, 32768, hardware=hardware) > 1.0
  # Short rollouts barely reach the budget: less to gain than at 32K.
  assert cost_model.rollout_speedup(model, schedule, 1024, 4096) < cost_model.rollout_speedup(
    model, schedule, 1024, 32768
  )


def test_page_size_comparison_only_moves_scoring():
  schedule = KVSchedule.paper("qwen3-1.7b", 0.86)
  by_size = cost_model.page_size_comparison("qwen3-1.7b", schedule, 1024, 32768)
  assert list(by_size) == [16, 32, 64, 128]
  assert by_size[16] == cost_model.rollout_speedup("qwen3-1.7b", schedule, 1024, 32768)
  values = [by_size[z] for z in (16, 32, 64, 128)]
  assert all(a < b for a, b in zip(values, values[1:]))  # fewer centroids to read
  assert values[-1] / values[0] < 1.2  # scoring is a small share


def test_hardware_table_and_errors():
  assert cost_model.HARDWARE["h200"].intensity == pytest.approx(989e12 / 4.8e12)
  assert cost_model.get_hardware(TOY_HW) is TOY_HW
  with pytest.raises(ValueError, match="h200"):
    cost_model.get_hardware("h300")
  with pytest.raises(ValueError, match="SparseConfig.dense_layers must be in \\[0, 2\\], got 3"):
    cost_model.sparse_rollout_cost(
      "tiny", KVSchedule.fixed(4), 10, 10, sparse=SparseConfig(dense_layers=3)
    )
  with pytest.raises(ValueError, match="gen_len"):
    cost_model.dense_rollout_cost("tiny", 10, 0)
  with pytest.raises(ValueError, match="preset"):
    cost_model.dense_rollout_cost("qwen3-9b", 10, 10)


def test_measure_this_machine_returns_positive_rates():
  hw = cost_model.measure_this_machine(seconds=0.2, matmul_size=128, copy_mib=4)
  assert hw.name.startswith(cost_model.THIS_MACHINE)
  assert hw.peak_flops > 0 and hw.mem_bandwidth > 0 and np.isfinite(hw.intensity)
  assert cost_model.rollout_speedup("tiny", KVSchedule.fixed(4), 32, 256, hardware=hw) > 0


# --- roofline time model -------------------------------------------------------------------------

PAPER_MODELS = ["qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b"]


def test_running_fraction_mean_cut_and_errors():
  for mean in (0.3, 0.5, 0.9):
    alive = cost_model.running_fraction(32768, mean)
    assert alive.shape == (32768,) and alive[0] == 1.0
    assert np.all(np.diff(alive) < 0)  # rows only ever stop
    assert alive.sum() / 32768 == pytest.approx(mean, rel=1e-9)  # mean length as stated
    assert 0 < alive[-1] < 1  # some rows reach the cutoff
  assert cost_model.running_fraction(32768, 0.5)[-1] == pytest.approx(0.203, abs=1e-3)
  np.testing.assert_array_equal(cost_model.running_fraction(100, 1.0), np.ones(100))
  for bad in (0.0, 0.5 / 100, 1.5):
    with pytest.raises(ValueError, match="mean_len_frac"):
      cost_model.running_fraction(100, bad)


def test_roofline_dense_time_by_hand():
  # tiny: P = 90496, r = 2, D = 128 KV elements per token. Prompt 3, 2 steps (S = 4, 5), every row
  # to the cutoff, 2-byte elements, 10 FLOP/s, 5 bytes/s.
  p, r, d = 90496, 2, 128
  prefill = max((2 * p * 3 + 2 * r * d * 3 * 4 / 2) / 10, 2 * (p + d * 3) / 5)  # compute-bound

  def time(rows):  # `rows` samples of one prompt
    return prefill + sum(
      max(rows * (2 * p + 2 * r * d * s) / 10, (2 * p + rows * 2 * d * s) / 5) for s in (4, 5)
    )

  one, three = time(1), time(3)
  assert one == pytest.approx((4 * p + 2 * d * 9) / 5 + prefill)  # memory-bound: 1 row, weights
  assert three == pytest.approx(3 * (4 * p + 2 * r * d * 9) / 10 + prefill)  # compute-bound
  for rows, want in ((1, one), (3, three)):
    got = cost_model.roofline_rollout_time(
      "tiny", None, 3, 2, batch_per_device=rows, mean_len_frac=1.0, n_samples=rows, hardware=TOY_HW
    )
    assert got == pytest.approx(want, rel=1e-12)


def test_quest_scores_two_summaries_a_page():
  # The same schedule as above: quest adds one more centroid's reads and FLOPs per scored page.
  schedule = KVSchedule.fixed(2, page_size=2, always_kept=1)
  n = 2
  cost = lambda score: cost_model.sparse_rollout_cost(
    "tiny",
    schedule,
    3,
    2,
    n_samples=2,
    hardware=TOY_HW,
    sparse=dataclasses.replace(TOY_SPARSE, page_score=score),
  )
  scoring = n * 64 * 2 + n * 64 * 3 + 2 * 2 * (32 * (1 + n * 1) + 32 * (1 + n * 2))
  assert cost("quest") - cost("mean") == scoring
  roofline = lambda score: cost_model.roofline_speedup(
    "qwen3-8b",
    KVSchedule.paper("qwen3-8b", 0.86),
    1024,
    32768,
    batch_per_device=60,
    mean_len_frac=0.5,
    sparse=SparseConfig(page_score=score),
  )
  assert roofline("quest") < roofline("mean")
  with pytest.raises(ValueError, match="page_score must be one of"):
    cost("max")


def test_roofline_sparse_row_by_hand():
  # 1 dense + 1 sparse layer (64 KV elements per token each), pages of 2, budget 2 pages = 4 tokens
  # at S = 4 and 5; 2 complete pages scored per KV head (2 heads, head_dim 16) in the sparse layer.
  schedule = KVSchedule.fixed(2, page_size=2, always_kept=1)
  p, r = 90496, 2
  steps = 0.0
  for s in (4, 5):
    kv = 64 * s + 64 * 4
    flops = 2 * p + 2 * r * kv + 2 * 16 * (2 * 2)
    memory = 2 * p + 2 * kv + (2 * 16 + 8) * (2 * 2)  # bf16 centroids + fp32 score write/read
    steps += max(flops / 10, memory / 5)
  prefill = cost_model.prefill_time("tiny", 3, 1, TOY_HW)
  got = cost_model.roofline_rollout_time(
    "tiny",
    schedule,
    3,
    2,
    batch_per_device=1,
    mean_len_frac=1.0,
    n_samples=1,
    hardware=TOY_HW,
    sparse=TOY_SPARSE,
  )
  assert got == pytest.approx(steps + prefill, rel=1e-12)


@pytest.mark.parametrize("model", PAPER_MODELS)
def test_roofline_reduces_to_eflops_model(model):
  # Every row to the cutoff, weights amortised over an unbounded batch, no prompt to share, and
  # compute made free so that eFLOPs is I x memory and the roofline step is its memory time. What
  # is left is the top-k's fp32 scores (8 of the 264 selection bytes per scored page, selection
  # being < 20% of the sparse bytes, so < 0.6%) and scoring complete pages rather than all pages
  # (< 1 page in ~2000); measured 0.2-0.3%.
  free_compute = cost_model.Hardware("free", peak_flops=1e30, mem_bandwidth=4.8e12)
  schedule = KVSchedule.paper(model, 0.86)
  eflops = cost_model.rollout_speedup(model, schedule, 0, 32768, hardware=free_compute)
  roofline = cost_model.roofline_speedup(
    model, schedule, 0, 32768, batch_per_device=1e15, mean_len_frac=1.0, hardware=free_compute
  )
  assert roofline == pytest.approx(eflops, rel=0.006)


def _paper_speedup(model, **kw):
  kw = {"batch_per_device": 60, "mean_len_frac": 0.5, **kw}
  return cost_model.roofline_speedup(model, KVSchedule.paper(model, 0.86), 1024, 32768, **kw)


@pytest.mark.parametrize("model", ["qwen3-1.7b", "qwen3-14b"])
def test_roofline_speedup_moves_the_right_way(model):
  # Shorter responses spend more steps where the budget is close to the whole cache.
  by_mean = [_paper_speedup(model, mean_len_frac=m) for m in (1.0, 0.7, 0.5, 0.3)]
  assert all(a > b for a, b in zip(by_mean, by_mean[1:]))
  # A larger batch spreads the weight read, which sparse attention does not shrink, over more rows.
  by_batch = [_paper_speedup(model, batch_per_device=b) for b in (1, 8, 60, 240)]
  assert all(a < b for a, b in zip(by_batch, by_batch[1:]))
  # Reading centroids and running the top-k costs time that dense attention does not spend.
  assert _paper_speedup(model, page_selection=False) > _paper_speedup(model)
  assert (
    1.0
    < _paper_speedup(model)
    < cost_model.rollout_speedup(model, KVSchedule.paper(model, 0.86), 1024, 32768)
  )


def test_roofline_without_sparsity_is_no_speedup():
  cfg = Qwen3Config.preset("qwen3-1.7b")
  kw = dict(batch_per_device=60, mean_len_frac=0.5)
  all_dense = cost_model.roofline_speedup(
    cfg,
    KVSchedule.fixed(4),
    100,
    500,
    sparse=SparseConfig(dense_layers=cfg.num_hidden_layers),
    **kw,
  )
  assert all_dense == pytest.approx(1.0, rel=1e-12)
  everything = KVSchedule.fixed(10**6)
  assert cost_model.roofline_speedup(
    cfg, everything, 100, 500, page_selection=False, **kw
  ) == pytest.approx(1.0, rel=1e-12)
  assert cost_model.roofline_speedup(cfg, everything, 100, 500, **kw) < 1.0


def test_peak_memory_by_hand():
  # Every row to the cutoff: the last step holds all rows at prompt + gen_len tokens.
  cfg = Qwen3Config.preset("qwen3-8b")
  kv_per_token = 2 * cfg.kv_width * cfg.num_hidden_layers * 2
  got = cost_model.peak_memory_bytes(cfg, 1024, 4096, batch_per_device=60, mean_len_frac=1.0)
  assert got == 2 * cost_model.param_count(cfg) + 60 * 5120 * kv_per_token
  assert cost_model.peak_memory_bytes(cfg, 1024, 4096, batch_per_device=60, mean_len_frac=0.5) < got


def test_engine_and_static_rooflines_agree_where_the_batches_are_the_same():
  """Every row to the cutoff and as many slots as the static batch holds rows: the engine's steady
  state runs the same rows at the same mean position, so both rates agree; with long-tailed
  lengths and free slots the engine holds more rows and is faster, dense and sparse."""
  model, prompt, cutoff = "qwen3-1.7b", 1024, 8192
  pool = 40 * (prompt + cutoff)
  schedule = KVSchedule.paper(model, 0.86)
  for sched in (None, schedule):
    static, static_rows = cost_model.roofline_static_rate(
      model, sched, prompt, cutoff, pool_tokens=pool, mean_len_frac=1.0
    )
    engine, engine_rows = cost_model.roofline_engine_rate(
      model, sched, prompt, cutoff, slots=40, pool_tokens=pool, mean_len_frac=1.0
    )
    assert static_rows == engine_rows == 40
    assert abs(engine / static - 1) < 0.02, (engine, static)
    tail = dict(pool_tokens=pool, mean_len_frac=0.3)
    static_tail, static_rows = cost_model.roofline_static_rate(model, sched, prompt, cutoff, **tail)
    engine_tail, engine_rows = cost_model.roofline_engine_rate(
      model, sched, prompt, cutoff, slots=1000, **tail
    )
    assert engine_rows > 2 * static_rows and engine_tail > static_tail
  held = 1024 / 8 + np.sum(np.arange(1, cutoff + 1)) / cutoff  # uniform positions
  assert (
    cost_model.roofline_engine_rate(
      model, None, prompt, cutoff, slots=10**6, pool_tokens=pool, mean_len_frac=1.0
    )[1]
    == pool / held
  )


# --- lossless (speculative) rollouts -------------------------------------------------------------


def _tokens_per_round_moments(alpha, k):
  """Exact mean and variance of the tokens of a round under i.i.d. acceptance: j + 1 tokens with
  probability alpha^j (1 - alpha) for j < k, k + 1 with probability alpha^k."""
  j = np.arange(k + 1)
  prob = alpha**j * np.where(j < k, 1 - alpha, 1.0)
  mean = np.sum(prob * (j + 1))
  return mean, np.sum(prob * (j + 1) ** 2) - mean**2


@pytest.mark.parametrize("alpha", [0.3, 0.8, 0.97])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_expected_tokens_per_round_matches_monte_carlo(alpha, k):
  """Rounds simulated with the speculative acceptance rule itself: each draft x ~ q accepted with
  probability min(1, p(x) / q(x)), every token's (p, q) drawn i.i.d. from a fixed set of pairs whose
  exact mean acceptance sum_x min(p, q) is the alpha the formula is given. The tolerance is 5
  standard errors of the mean of n rounds, from the exact variance."""
  rng = np.random.default_rng(k * 100 + int(alpha * 100))
  pairs, vocab, n = 64, 8, 40_000
  p_NV = rng.dirichlet(np.ones(vocab), pairs)
  # q_i = p_i mixed with noise so that the pairs' acceptances spread around `alpha`.
  mix = np.clip(rng.normal(1 - alpha, 0.1, (pairs, 1)), 0, 1)
  q_NV = (1 - mix) * p_NV + mix * rng.dirichlet(np.ones(vocab), pairs)
  mean_alpha = np.minimum(p_NV, q_NV).sum(1).mean()
  pair_RK = rng.integers(0, pairs, (n, k))
  cdf_RKV = np.cumsum(q_NV, 1)[pair_RK]
  x_RK = np.minimum((cdf_RKV < rng.random((n, k, 1))).sum(-1), vocab - 1)
  ratio_RK = p_NV[pair_RK, x_RK] / q_NV[pair_RK, x_RK]
  accepted_RK = rng.random((n, k)) < np.minimum(1.0, ratio_RK)
  tokens_R = np.cumprod(accepted_RK, 1).sum(1) + 1  # the accepted prefix + the token after it
  assert np.mean(accepted_RK) == pytest.approx(mean_alpha, abs=5 * np.sqrt(0.25 / (n * k)))
  mean, var = _tokens_per_round_moments(mean_alpha, k)
  assert cost_model.expected_tokens_per_round(mean_alpha, k) == pytest.approx(mean, rel=1e-12)
  assert abs(tokens_R.mean() - mean) < 5 * np.sqrt(var / n)


def test_expected_tokens_per_round_limits_and_errors():
  for k in (0, 1, 4, 8):
    assert cost_model.expected_tokens_per_round(1.0, k) == k + 1
    assert cost_model.expected_tokens_per_round(0.0, k) == 1
  alpha = np.array([0.2, 0.5, 0.9])
  np.testing.assert_allclose(
    cost_model.expected_tokens_per_round(alpha, 3), (1 - alpha**4) / (1 - alpha), rtol=1e-12
  )
  assert cost_model.expected_tokens_per_round(0.9, 0) == 1
  with pytest.raises(ValueError, match="k \\(draft tokens per round\\) must be >= 0, got -1"):
    cost_model.expected_tokens_per_round(0.5, -1)
  with pytest.raises(ValueError, match="alpha .* must be in \\[0, 1\\]"):
    cost_model.expected_tokens_per_round(1.2, 2)


def test_speculative_round_by_hand():
  # tiny on TOY_HW, one row at 4 cached tokens, k = 1: a draft step as in the sparse row by hand
  # above (1 dense + 1 sparse layer, budget 4 tokens, 4 centroids scored), then the dense
  # verification of 2 queries attending to 4 and 5 tokens, reading the 5 tokens' KV once.
  schedule = KVSchedule.fixed(2, page_size=2, always_kept=1)
  p, r, d = 90496, 2, 128
  kv = 64 * 4 + 64 * 4
  draft = max((2 * p + 2 * r * kv + 2 * 16 * 4) / 10, (2 * p + 2 * kv + (2 * 16 + 8) * 4) / 5)
  verify = max((2 * 2 * p + 2 * r * d * (4 + 5)) / 10, (2 * p + 2 * d * 5) / 5)
  for alpha in (0.0, 0.6, 1.0):
    got = cost_model.roofline_round_rate(
      "tiny", schedule, 4, k=1, alpha=alpha, rows=1, hardware=TOY_HW, sparse=TOY_SPARSE
    )
    assert got == pytest.approx((1 + alpha) / (draft + verify), rel=1e-12)
  dense = max((2 * p + 2 * r * d * 4) / 10, (2 * p + 2 * d * 4) / 5)
  got = cost_model.roofline_round_rate("tiny", None, 4, k=0, alpha=0.5, rows=1, hardware=TOY_HW)
  assert got == pytest.approx(1 / dense, rel=1e-12)


ENGINE = dict(slots=256, mean_len_frac=0.5)


def _pool(model):
  return 100e9 / cost_model.kv_bytes_per_token(model)


def _speculative(model, k, alpha, schedule=None, **kw):
  schedule = schedule or KVSchedule.paper(model, 0.86)
  return cost_model.roofline_speculative_rate(
    model,
    schedule,
    1024,
    32768,
    drafts=cost_model.Drafts(k, alpha),
    pool_tokens=_pool(model),
    **ENGINE,
    **kw,
  )


def _engine(model, schedule):
  return cost_model.roofline_engine_rate(
    model, schedule, 1024, 32768, pool_tokens=_pool(model), **ENGINE
  )


@pytest.mark.parametrize("model", ["qwen3-1.7b", "qwen3-14b"])
def test_speculation_without_drafts_is_the_dense_engine(model):
  rate, rows, per_round = _speculative(model, 0, 0.9)
  dense_rate, dense_rows = _engine(model, None)
  assert rate == pytest.approx(dense_rate, rel=1e-12) and rows == dense_rows and per_round == 1


@pytest.mark.parametrize("model", ["qwen3-1.7b", "qwen3-14b"])
def test_speculative_rate_moves_the_way_the_algebra_says(model):
  dense, _ = _engine(model, None)
  lossy, _ = _engine(model, KVSchedule.paper(model, 0.86))
  # More acceptance, more tokens a round for the same rounds.
  by_alpha = [_speculative(model, 4, a)[0] for a in (0.0, 0.5, 0.8, 0.95, 1.0)]
  assert all(a < b for a, b in zip(by_alpha, by_alpha[1:]))
  # All drafts accepted: k + 1 tokens a round, more drafts amortise the verification pass, yet
  # the pass keeps the lossless mode below the lossy sparse engine.
  perfect = [_speculative(model, k, 1.0) for k in (1, 2, 4, 8)]
  np.testing.assert_allclose([r[2] for r in perfect], [2, 3, 5, 9], rtol=1e-12)
  assert all(a[0] < b[0] for a, b in zip(perfect, perfect[1:])) and perfect[-1][0] < lossy
  # Nothing accepted: every round is one token at the cost of k drafts and a dense pass.
  rejected = [_speculative(model, k, 0.0)[0] for k in (1, 2, 4)]
  assert all(a > b for a, b in zip(rejected, rejected[1:])) and rejected[0] < dense
  # At a fixed acceptance a smaller draft budget is cheaper.
  small, large = KVSchedule.fixed(64), KVSchedule.fixed(512)
  assert _speculative(model, 4, 0.9, small)[0] > _speculative(model, 4, 0.9, large)[0]
  # Raising one bin's acceptance raises the rate; per-bin values equal to a scalar give its rate.
  bins = np.full(20, 0.9)
  assert _speculative(model, 4, bins)[0] == pytest.approx(_speculative(model, 4, 0.9)[0])
  bins[5] = 0.99
  assert _speculative(model, 4, bins)[0] > _speculative(model, 4, 0.9)[0]


def test_best_draft_count_grows_with_acceptance():
  """rate(k) = E(alpha, k) / T(k) with T independent of alpha, and E(k + 1) / E(k) grows with alpha,
  so the k that maximises the rate cannot fall as alpha rises."""
  model, ks = "qwen3-4b", range(1, 17)
  best = []
  for alpha in (0.5, 0.7, 0.8, 0.9, 0.95, 0.98, 0.995):
    rates = [
      cost_model.roofline_round_rate(
        model, KVSchedule.paper(model, 0.86), 16384, k=k, alpha=alpha, rows=64
      )
      for k in ks
    ]
    best.append(ks[int(np.argmax(rates))])
  assert all(a <= b for a, b in zip(best, best[1:])) and best[0] < best[-1], best


def test_a_draft_count_replaces_dense_only_beyond_the_margin():
  """A k priced 5% faster than dense decoding is taken with no margin and left with a margin of
  10%; one priced 20% faster is taken with either."""
  model, schedule = "qwen3-4b", KVSchedule.paper("qwen3-4b", 0.86)
  kw = dict(ks=(4,), rows=64, hardware="h200")
  k, rate, dense = cost_model.best_draft(model, schedule, 16384, 0.9, **kw)
  assert k == 4
  for gain, margin, want in ((1.05, 0.0, 4), (1.05, 0.1, 0), (1.2, 0.1, 4)):
    scale = {4: rate / (dense * gain)}  # k's rounds charged so that its rate is gain x dense
    got = cost_model.best_draft(model, schedule, 16384, 0.9, scale=scale, margin=margin, **kw)
    assert got[0] == want, (gain, margin)
    assert got[2] == pytest.approx(dense)
    assert got[1] == pytest.approx(dense * gain if want else dense)


def test_alpha_by_length_follows_the_schedule_bins():
  # Pages of 16, bins of 2 pages: cached pages 1, 1, 2, 2, 3, 4, 13 -> bins 0, 0, 1, 1, 1, 2, 6,
  # the last past the table (its last value).
  lengths = np.array([1, 16, 17, 32, 48, 49, 200])
  np.testing.assert_array_equal(
    cost_model.alpha_by_length([0.1, 0.2, 0.3], lengths, 16, 32),
    [0.1, 0.1, 0.2, 0.2, 0.2, 0.3, 0.3],
  )
  np.testing.assert_array_equal(cost_model.alpha_by_length(0.7, lengths, 16, 32), np.full(7, 0.7))
