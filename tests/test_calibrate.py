"""Schedule calibration: the choice rule on planted surfaces, the p5 surface against a per-candidate
computation, one compilation across candidates, the top-20 bound against exact alpha, on-policy
calibration, and the CLI end to end."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import calibrate_schedule
import sparrow_jax as sj
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.mismatch import calibrate as cal
from sparrow_jax.mismatch import cost_model
from sparrow_jax.mismatch.acceptance import acceptance_rate, tail_stats, topk_bound_from_logits
from sparrow_jax.rollout import sampler
from sparrow_jax.sparsity.schedule import KVSchedule
from tests.helpers import tiny_config

CFG = tiny_config(num_hidden_layers=3)
PARAMS = sj.init_params(CFG, jax.random.PRNGKey(0), std=0.3)
SPARSE = SparseConfig(page_size=4, dense_layers=1)
PROMPT_LEN = np.asarray([9, 21, 14])
PROMPT = np.random.RandomState(0).randint(1, CFG.vocab_size, (3, 21)) * (
  np.arange(21)[None] < PROMPT_LEN[:, None]
)
BIN = 16
QUIET = cal.CalibrationConfig(bin_size=BIN, verbose=False)  # the tests' bins, no progress lines


def brute_force_choice(p5_CB, cands, tau):
  """The rule spelled out bin by bin."""
  out, prev = [], cands[0]
  for b in range(p5_CB.shape[1]):
    col = p5_CB[:, b]
    if np.isnan(col).all():
      pick = prev
    else:
      ok = [c for c, v in zip(cands, col) if v >= tau]
      pick = max(prev, ok[0] if ok else cands[-1])
    out.append(pick)
    prev = pick
  return tuple(out)


def test_choose_schedule_recovers_planted_surface():
  cands = (29, 45, 61, 77, 93, 125, 157, 189, 221, 253)
  bins = np.arange(20)
  # p5 rises with budget and falls with position, so the cheapest budget meeting tau grows.
  p5_CB = 1 - 0.4 * (bins[None] + 1) / (np.asarray(cands)[:, None] / 5 + bins[None] + 1)
  p5_CB[:, [6, 7]] = np.nan  # empty bins inherit the previous choice
  p5_CB[:, 19] = 0.5  # nothing meets tau: the largest
  tau = 0.86
  sched = cal.choose_schedule(p5_CB, cands, tau, bin_size=2000)
  expected = brute_force_choice(p5_CB, cands, tau)
  assert sched.values == expected
  assert sched.kind == "table" and sched.bin_size == 2000 and sched.always_kept == 3
  assert list(sched.values) == sorted(sched.values)
  assert sched.values[6] == sched.values[7] == sched.values[5]
  assert sched.values[19] == cands[-1]
  for b in range(20):  # cheapest: one candidate less would fail tau
    if not np.isnan(p5_CB[0, b]) and b < 19:
      i = cands.index(sched.values[b])
      assert p5_CB[i, b] >= tau
      assert i == 0 or p5_CB[i - 1, b] < tau or sched.values[b] == sched.values[b - 1]


def test_choose_schedule_monotone_and_leading_empty_bins():
  cands = (1, 2, 4, 8)
  nan = np.nan
  p5_CB = np.array(
    [[nan, 0.5, 0.95, 0.5], [nan, 0.7, 0.97, 0.9], [nan, 0.9, 0.99, 0.95], [nan, 1.0, 1.00, 1.0]]
  )
  # raw per-bin choice: -, 4, 1, 2 -> leading empty bin takes the smallest, then running maximum
  assert cal.choose_schedule(p5_CB, cands, 0.88, page_size=4, bin_size=16).values == (1, 4, 4, 4)
  assert cal.choose_schedule(p5_CB, cands, 0.6, page_size=4, bin_size=16).values == (1, 2, 2, 2)
  with pytest.raises(ValueError, match="strictly increasing"):
    cal.choose_schedule(p5_CB, (1, 4, 2, 8), 0.8)
  with pytest.raises(ValueError, match="num_candidates=3"):
    cal.choose_schedule(p5_CB, (1, 2, 4), 0.8)


@pytest.fixture(scope="module")
def rows():
  """Right-padded prompt + completion rows [3, 61] and their completion mask. The completions are
  random tokens of lengths 40, 25, 33: the surface scores any rows (the CLI test samples them)."""
  rng = np.random.RandomState(1)
  gen_len = np.asarray([40, 25, 33])
  idx_S = np.arange(61)[None]
  gen_mask_BS = (idx_S >= PROMPT_LEN[:, None]) & (idx_S < (PROMPT_LEN + gen_len)[:, None])
  tokens_BS = np.pad(PROMPT, ((0, 0), (0, 40)))
  tokens_BS = np.where(gen_mask_BS, rng.randint(1, CFG.vocab_size, (3, 61)), tokens_BS)
  return tokens_BS, gen_mask_BS


def reference_surface(tokens_BS, gen_mask_BS, cands, num_bins):
  """One sj.forward per candidate, then acceptance_rate and tail_stats, nothing shared (jitted
  whole by the caller: eager would take long) -> (p5, mean) per candidate per bin."""
  S = tokens_BS.shape[1]
  valid_BS = (jnp.arange(S)[None] < PROMPT_LEN[:, None]) | gen_mask_BS
  dense = sj.forward(PARAMS, tokens_BS, CFG, mask_BT=valid_BS)
  cached_len_S = np.arange(1, S)  # token j was sampled at a step with j cached tokens
  pos_BS = np.broadcast_to(-(-cached_len_S // 4) * 4, (3, S - 1))
  rows = []
  for c in cands:
    sparse = sj.forward(
      PARAMS,
      tokens_BS,
      CFG,
      mask_BT=valid_BS,
      sparse=SPARSE,
      schedule=KVSchedule.table((c,), page_size=4, bin_size=BIN),
      prompt_len_B=jnp.asarray(PROMPT_LEN),
    )
    alpha_BS = acceptance_rate(dense, sparse)[:, :-1]
    rows.append(tail_stats(alpha_BS, gen_mask_BS[:, 1:], pos_BS, BIN, num_bins))
  return tuple(jnp.stack([r[name] for r in rows]) for name in ("p5_bin", "mean_bin"))


@pytest.mark.slow
def test_tail_surface_matches_per_candidate_computation(rows):
  tokens_BS, gen_mask_BS = rows
  cands = (0, 1, 3, 16)  # 16 top-k + 3 covers all 16 pages of 61 tokens
  num_bins = 5
  # 3 rows in batches of 2 and 4 candidates in groups of 3: both get topped up.
  tails, mean = cal.tail_surface(
    PARAMS,
    CFG,
    tokens_BS,
    gen_mask_BS,
    PROMPT_LEN,
    cands,
    SPARSE,
    num_bins=num_bins,
    calibration=dataclasses.replace(QUIET, batch_size=2, candidates_per_pass=3),
    with_mean=True,
  )
  p5 = tails[5]
  assert (tails[1] <= p5 + 1e-6)[~np.isnan(p5)].all()
  assert p5.shape == (4, num_bins)
  reference = jax.jit(reference_surface, static_argnums=(2, 3))
  p5_ref, mean_ref = reference(tokens_BS, gen_mask_BS, cands, num_bins)
  np.testing.assert_allclose(p5, p5_ref, atol=1e-5)
  np.testing.assert_allclose(mean, mean_ref, atol=1e-5)
  assert (mean >= p5 - 1e-6)[~np.isnan(p5)].all()
  count = cal.bin_counts(gen_mask_BS, 4, BIN, num_bins)
  assert count.sum() == gen_mask_BS[:, 1:].sum() and (count[:4] > 0).all() and count[4] == 0
  np.testing.assert_allclose(p5[-1, :4], 1.0, atol=1e-5)  # whole context: sparse == dense
  assert np.isnan(p5[:, 4]).all()  # no token reaches the last bin
  mean_C = np.nanmean(p5, axis=1)
  assert (np.diff(mean_C) >= -1e-6).all(), mean_C
  assert mean_C[0] < 0.999  # the small budgets do bind


def test_sparse_pass_compiles_once_across_candidates(rows):
  before = cal._sparse_alpha._cache_size()
  # batch 3 x 1 candidate per pass: a shape no other test compiles
  cal.tail_surface(
    PARAMS,
    CFG,
    *rows,
    PROMPT_LEN,
    (0, 1, 2, 5, 12),
    SPARSE,
    num_bins=4,
    calibration=dataclasses.replace(QUIET, batch_size=3),
  )
  assert cal._sparse_alpha._cache_size() == before + 1


def test_topk_bound_from_logits_matches_numpy():
  rng = np.random.RandomState(5)
  p = rng.randn(2, 3, 30) * 2
  q = p + rng.randn(2, 3, 30)  # related, so the top-5 sets overlap, but not fully
  temperature, k = 0.7, 5

  def logp_top(x):
    logp = x / temperature - np.log(np.exp(x / temperature).sum(-1, keepdims=True))
    return logp, np.argsort(-logp, -1)[..., :k]

  (lp, ip), (lq, iq) = logp_top(p), logp_top(q)
  expected = np.zeros((2, 3))
  for b, t in np.ndindex(2, 3):
    for x in set(ip[b, t]) & set(iq[b, t]):
      expected[b, t] += np.exp(min(lp[b, t, x], lq[b, t, x]))
  assert (expected > 0).all()
  got = topk_bound_from_logits(
    jnp.asarray(p), jnp.asarray(q), k=k, temperature=temperature, chunk_size=8
  )  # several vocabulary chunks, the last one shifted
  np.testing.assert_allclose(got, expected, atol=1e-6)
  np.testing.assert_allclose(
    topk_bound_from_logits(p, q, k=30, temperature=temperature),
    acceptance_rate(p, q, temperature),
    atol=1e-6,
  )  # whole vocabulary
  with pytest.raises(ValueError, match="k must be in \\[1, 30\\].*got 31"):
    topk_bound_from_logits(p, q, k=31)


@pytest.mark.slow
def test_topk20_surface_is_below_exact_and_picks_larger_budgets(rows):
  cands = (0, 1, 3, 16)
  exact, topk20 = (
    cal.tail_surface(
      PARAMS,
      CFG,
      *rows,
      PROMPT_LEN,
      cands,
      SPARSE,
      num_bins=4,
      calibration=dataclasses.replace(QUIET, candidates_per_pass=4, alpha=a),
    )[5]
    for a in ("exact", "topk20")
  )
  np.testing.assert_array_equal(np.isnan(topk20), np.isnan(exact))
  seen = ~np.isnan(exact)
  assert (topk20[seen] <= exact[seen] + 1e-6).all()
  assert (topk20[seen] < exact[seen] - 1e-3).any()  # vocab 97 > 20: the bound drops mass
  for tau in (0.3, 0.5, 0.7, 0.9):
    pick = [
      cal.choose_schedule(p5, cands, tau, page_size=4, bin_size=BIN).values
      for p5 in (exact, topk20)
    ]
    assert all(t >= e for e, t in zip(*pick)), (tau, pick)


def test_unknown_alpha_is_rejected_by_name():
  message = r"CalibrationConfig.alpha must be one of \['exact', 'topk20'\], got 'top20'"
  with pytest.raises(ValueError, match=message):
    cal.CalibrationConfig(alpha="top20")


@pytest.mark.nightly
def test_on_policy_scores_each_candidate_on_its_own_rollouts(capsys):
  prompts = [PROMPT[0, : PROMPT_LEN[0]].tolist(), PROMPT[1, : PROMPT_LEN[1]].tolist()]
  key, cands = jax.random.PRNGKey(7), (1, 3, 12)  # 12 + 3 pages cover 21 + 30 tokens: dense
  result = cal.calibrate(
    PARAMS,
    CFG,
    prompts,
    key,
    max_new_tokens=30,
    calibration=cal.CalibrationConfig(
      tau=0.9, candidates=cands, repeats=2, bin_size=BIN, on_policy=True
    ),
    sparse=SPARSE,
    sampling=sj.Sampling(eos_ids=(5, 6, 7)),
  )
  assert "ETA" in capsys.readouterr().out
  p5 = result.tail[5]
  num_bins = p5.shape[1]
  assert p5.shape == result.count.shape == (3, num_bins) and result.on_policy
  np.testing.assert_array_equal(np.isnan(p5), result.count == 0)
  np.testing.assert_allclose(p5[-1][result.count[-1] > 0], 1.0, atol=1e-5)
  # the middle row is tail_surface on top-k 3's own rollouts (same prompts, same keys)
  prompt_BT, prompt_len_B = cal.pad_prompts(prompts)
  prompt_BT, prompt_len_B = np.repeat(prompt_BT, 2, 0), np.repeat(prompt_len_B, 2)
  out = sj.generate(
    PARAMS,
    CFG,
    prompt_BT,
    prompt_len_B,
    jax.random.fold_in(key, 0),
    max_new_tokens=30,
    sampling=sj.Sampling(eos_ids=(5, 6, 7)),
    sparse=SPARSE,
    schedule=cal.candidate_schedule(3, SPARSE, BIN),
  )
  tokens_BS, gen_mask_BS = sampler.full_sequences(prompt_BT, prompt_len_B, out)
  np.testing.assert_array_equal(cal.bin_counts(gen_mask_BS, 4, BIN, num_bins), result.count[1])
  own = cal.tail_surface(
    PARAMS,
    CFG,
    tokens_BS,
    gen_mask_BS,
    prompt_len_B,
    (3,),
    SPARSE,
    num_bins=num_bins,
    calibration=QUIET,
  )
  np.testing.assert_allclose(p5[1], own[5][0], atol=1e-6)
  surface = cal.surface_dict(result)
  assert surface["on_policy"] and surface["alpha"] == "exact"
  assert surface["count_bin"] == result.count.max(0).tolist()
  assert surface["count_bin_by_candidate"]["3"] == result.count[1].tolist()
  with pytest.raises(ValueError, match="CalibrationConfig.on_policy .* sample_topk=5"):
    cal.CalibrationConfig(on_policy=True, sample_topk=5)


QWEN = sj.Qwen3Config.preset("qwen3-1.7b")  # the planner prices, nothing runs it
PLAN_CANDS = (29, 61, 125, 253)


def _plan(mean_Ub, ks=(1, 2, 4, 8, 16)):
  return cal.speculative_plan(mean_Ub, PLAN_CANDS, QWEN, SparseConfig(), bin_size=2048, ks=ks)


@pytest.mark.slow
def test_speculative_plan_moves_the_way_the_algebra_says():
  bins = 12
  # One budget's acceptance raised in every bin at once: the chosen k never falls, no acceptance
  # is dense decoding, full acceptance drafts the most tokens.
  by_alpha = {}
  for alpha in (0.0, 0.3, 0.6, 0.8, 0.9, 0.95, 0.99, 1.0):
    mean_Ub = np.full((len(PLAN_CANDS), bins), np.nan)
    mean_Ub[1] = alpha
    by_alpha[alpha] = _plan(mean_Ub)
  assert by_alpha[0.0]["k"] == [0] * bins and by_alpha[0.0]["topk"] == [None] * bins
  assert by_alpha[0.0]["speedup"] == [1.0] * bins
  assert by_alpha[1.0]["k"][1:] == [16] * (bins - 1)  # bin 0 (1K cached) is all dense
  assert by_alpha[1.0]["tokens_per_round"][-1] == 17
  plans = list(by_alpha.values())
  for b in range(bins):
    ks = [p["k"][b] for p in plans]
    speedups = [p["speedup"][b] for p in plans]
    assert all(x <= y for x, y in zip(ks, ks[1:])), (b, ks)
    assert all(x <= y for x, y in zip(speedups, speedups[1:])), (b, speedups)
  # Equal acceptance: the smallest budget, which reads least.
  same = _plan(np.full((len(PLAN_CANDS), bins), 0.95))
  assert same["topk"][1:] == [29] * (bins - 1)
  # A larger budget that accepts far more wins where its cost is small against the context.
  mean_Ub = np.full((len(PLAN_CANDS), bins), 0.5)
  mean_Ub[2] = 0.99
  assert _plan(mean_Ub)["topk"][-1] == 125
  # Longer contexts gain more from the same drafts.
  assert all(x < y for x, y in zip(same["speedup"][1:], same["speedup"][2:]))
  # Each bin's pick is the best of every (budget, k) pair priced alone.
  plan = _plan(mean_Ub, ks=(2, 4))
  b = bins - 1
  rates = {
    (c, k): cost_model.roofline_round_rate(
      QWEN,
      cal.candidate_schedule(c, SparseConfig(), 2048),
      plan["cached_len"][b],
      k=k,
      alpha=mean_Ub[i, b],
      rows=64,
    )
    for i, c in enumerate(PLAN_CANDS)
    for k in (2, 4)
  }
  assert max(rates, key=rates.get) == (plan["topk"][b], plan["k"][b])


def test_speculative_plan_empty_bins_and_errors():
  mean_Ub = np.full((len(PLAN_CANDS), 3), 0.9)
  mean_Ub[:, 1] = np.nan
  plan = _plan(mean_Ub)
  assert plan["topk"][1] is None and plan["k"][1] is None and plan["speedup"][1] is None
  assert plan["cached_len"] == [1024.0, 3072.0, 5120.0] and plan["candidates"] == list(PLAN_CANDS)
  with pytest.raises(ValueError, match="mean_Ub must be \\[num_candidates=4, num_bins\\]"):
    _plan(mean_Ub[:2])
  with pytest.raises(ValueError, match="ks .* must be integers >= 1, got \\[0, 2\\]"):
    _plan(mean_Ub, ks=(0, 2))


def test_default_candidates():
  assert cal.default_candidates(40960) == cal.PAPER_CANDIDATES
  small = cal.default_candidates(340)
  assert len(small) == 18 and small[0] == 1 and small[-1] == 22 - 3
  assert list(small) == sorted(set(small))


@pytest.mark.nightly
def test_cli_writes_schedule_surface_and_plot(tmp_path, run_experiment):
  rng = np.random.RandomState(3)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("\n".join(json.dumps(rng.randint(1, 256, n).tolist()) for n in (12, 20)))
  out = tmp_path / "out"
  stdout = run_experiment(
    "calibrate_schedule",
    "calibrate",
    {
      "model.hf_dir": "",
      "model.preset": "tiny-untied",
      "prompts": prompts,
      "num_prompts": 2,
      "calibration.repeats": 2,
      "rollout.max_new_tokens": 24,
      "rollout.page_size": 4,
      "stats.bin_size": 16,
      "rollout.dense_layers": 1,
      "calibration.candidates": "(1,2,8)",
      "stats.tau": 0.9,
      "calibration.alpha": "topk20",
      "out_dir": out,
      "record": tmp_path / "record.json",
      "speculative.report": True,
    },
  )
  assert "ETA" in stdout and "lossless (speculative) rollouts on h200" in stdout
  sched = KVSchedule.from_json((out / "schedule.json").read_text())
  surface = json.loads((out / "surface.json").read_text())
  assert sched.kind == "table" and sched.page_size == 4 and sched.bin_size == 16
  assert surface["candidates"] == [1, 2, 8]
  assert surface["alpha"] == "topk20" and surface["on_policy"] is False
  assert list(sched.values) == surface["chosen_topk"]
  assert len(surface["count_bin"]) == len(sched.values) == len(surface["tail"]["5"]["8"])
  assert sched.quantile == surface["quantile"] == 5 and set(surface["tail"]) == {
    "1",
    "5",
    "10",
    "50",
  }
  assert sum(surface["count_bin"]) > 0
  assert (out / "calibration.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  record = json.loads((tmp_path / "record.json").read_text())
  assert record["command"].startswith("python experiments/calibrate_schedule.py")
  assert record["results"]["chosen_topk"] == surface["chosen_topk"]
  assert record["results"]["count_bin"] == surface["count_bin"] and record["results"]["seconds"] > 0
  # The mean acceptance per bin sits above the p5; the plan has an entry a bin, None where empty.
  for c in ("1", "2", "8"):
    for mean, p5, n in zip(surface["mean"][c], surface["tail"]["5"][c], surface["count_bin"]):
      assert (mean is None) == (p5 is None) == (n == 0) and (mean is None or mean >= p5)
  plan = json.loads((out / "speculative.json").read_text())
  assert record["results"]["speculative"] == plan and plan["ks"] == [1, 2, 4, 8]
  assert len(plan["k"]) == len(surface["count_bin"])
  assert [k is None for k in plan["k"]] == [n == 0 for n in surface["count_bin"]]
  assert all(s is None or s >= 1 for s in plan["speedup"])  # dense decoding is always there


def test_cli_rejects_bad_prompt_row(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text("[1, 2, 3]\n{\"text\": \"hi\"}\n")
  with pytest.raises(ValueError, match="row 2"):
    calibrate_schedule.read_prompts(str(bad), 10)
