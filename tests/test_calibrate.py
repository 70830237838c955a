"""Schedule calibration: the choice rule on planted surfaces, the p5 surface against a per-candidate
computation, one compilation across candidates, and the CLI end to end."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparrow_jax as sj
from experiments import calibrate_schedule
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.mismatch import calibrate as cal
from sparrow_jax.mismatch.acceptance import acceptance_rate, tail_stats
from sparrow_jax.mismatch.schedule import KVSchedule
from tests.helpers import tiny_config

CFG = tiny_config(num_hidden_layers=3)
PARAMS = sj.init_params(CFG, jax.random.PRNGKey(0), std=0.3)
SPARSE = SparseConfig(page_size=4, dense_layers=1)
PROMPT_LEN = np.asarray([9, 21, 14])
PROMPT = np.random.RandomState(0).randint(1, CFG.vocab_size, (3, 21)) * (
    np.arange(21)[None] < PROMPT_LEN[:, None])
BIN = 16


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
  p5_CB[:, [6, 7]] = np.nan                      # empty bins inherit the previous choice
  p5_CB[:, 19] = 0.5                             # nothing meets tau: the largest
  tau = 0.86
  sched = cal.choose_schedule(p5_CB, cands, tau, bin_size=2000)
  expected = brute_force_choice(p5_CB, cands, tau)
  assert sched.values == expected
  assert sched.kind == "table" and sched.bin_size == 2000 and sched.always_kept == 3
  assert list(sched.values) == sorted(sched.values)
  assert sched.values[6] == sched.values[7] == sched.values[5]
  assert sched.values[19] == cands[-1]
  for b in range(20):                             # cheapest: one candidate less would fail tau
    if not np.isnan(p5_CB[0, b]) and b < 19:
      i = cands.index(sched.values[b])
      assert p5_CB[i, b] >= tau
      assert i == 0 or p5_CB[i - 1, b] < tau or sched.values[b] == sched.values[b - 1]


def test_choose_schedule_monotone_and_leading_empty_bins():
  cands = (1, 2, 4, 8)
  nan = np.nan
  p5_CB = np.array([[nan, 0.5, 0.95, 0.5],
                    [nan, 0.7, 0.97, 0.9],
                    [nan, 0.9, 0.99, 0.95],
                    [nan, 1.0, 1.00, 1.0]])
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
  whole by the caller: eager would take long)."""
  S = tokens_BS.shape[1]
  valid_BS = (jnp.arange(S)[None] < PROMPT_LEN[:, None]) | gen_mask_BS
  dense = sj.forward(PARAMS, tokens_BS, CFG, mask_BT=valid_BS)
  cached_len_S = np.arange(1, S)     # token j was sampled at a step with j cached tokens
  pos_BS = np.broadcast_to(-(-cached_len_S // 4) * 4, (3, S - 1))
  rows = []
  for c in cands:
    sparse = sj.forward(PARAMS, tokens_BS, CFG, mask_BT=valid_BS, sparse=SPARSE,
                        schedule=KVSchedule.table((c,), page_size=4, bin_size=BIN),
                        prompt_len_B=jnp.asarray(PROMPT_LEN))
    alpha_BS = acceptance_rate(dense, sparse)[:, :-1]
    rows.append(tail_stats(alpha_BS, gen_mask_BS[:, 1:], pos_BS, BIN, num_bins)["p5_bin"])
  return jnp.stack(rows)


def test_p5_surface_matches_per_candidate_computation(rows):
  tokens_BS, gen_mask_BS = rows
  cands = (0, 1, 3, 16)                        # 16 top-k + 3 covers all 16 pages of 61 tokens
  num_bins = 5
  # 3 rows in batches of 2 and 4 candidates in groups of 3: both get topped up.
  p5 = cal.p5_surface(PARAMS, CFG, tokens_BS, gen_mask_BS, PROMPT_LEN, cands, SPARSE, BIN,
                      num_bins, batch_size=2, candidates_per_pass=3, verbose=False)
  assert p5.shape == (4, num_bins)
  reference = jax.jit(reference_surface, static_argnums=(2, 3))
  np.testing.assert_allclose(p5, reference(tokens_BS, gen_mask_BS, cands, num_bins), atol=1e-5)
  count = cal.bin_counts(gen_mask_BS, 4, BIN, num_bins)
  assert count.sum() == gen_mask_BS[:, 1:].sum() and (count[:4] > 0).all() and count[4] == 0
  np.testing.assert_allclose(p5[-1, :4], 1.0, atol=1e-5)   # whole context: sparse == dense
  assert np.isnan(p5[:, 4]).all()                           # no token reaches the last bin
  mean_C = np.nanmean(p5, axis=1)
  assert (np.diff(mean_C) >= -1e-6).all(), mean_C
  assert mean_C[0] < 0.999                                  # the small budgets do bind


def test_sparse_pass_compiles_once_across_candidates(rows):
  before = cal._sparse_alpha._cache_size()
  # batch 3 x 1 candidate per pass: a shape no other test compiles
  cal.p5_surface(PARAMS, CFG, *rows, PROMPT_LEN, (0, 1, 2, 5, 12), SPARSE, BIN, 4, batch_size=3,
                 verbose=False)
  assert cal._sparse_alpha._cache_size() == before + 1


def test_default_candidates():
  assert cal.default_candidates(40960) == cal.PAPER_CANDIDATES
  small = cal.default_candidates(340)
  assert len(small) == 18 and small[0] == 1 and small[-1] == 22 - 3
  assert list(small) == sorted(set(small))


def test_cli_writes_schedule_surface_and_plot(tmp_path, capsys):
  rng = np.random.RandomState(3)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("\n".join(json.dumps(rng.randint(1, 256, n).tolist()) for n in (12, 20)))
  out = tmp_path / "out"
  calibrate_schedule.main([
      "--preset", "tiny-untied", "--prompts", str(prompts), "--num_prompts", "2", "--repeats", "2",
      "--max_new_tokens", "24", "--page_size", "4", "--bin_size", "16", "--dense_layers", "1",
      "--candidates", "1,2,8", "--tau", "0.9", "--out_dir", str(out)])
  assert "ETA" in capsys.readouterr().out
  sched = KVSchedule.from_json((out / "schedule.json").read_text())
  surface = json.loads((out / "surface.json").read_text())
  assert sched.kind == "table" and sched.page_size == 4 and sched.bin_size == 16
  assert surface["candidates"] == [1, 2, 8]
  assert list(sched.values) == surface["chosen_topk"]
  assert len(surface["count_bin"]) == len(sched.values) == len(surface["p5"]["8"])
  assert sum(surface["count_bin"]) > 0
  assert (out / "calibration.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_prompt_row(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text("[1, 2, 3]\n{\"text\": \"hi\"}\n")
  with pytest.raises(ValueError, match="row 2"):
    calibrate_schedule.read_prompts(str(bad), 10)
