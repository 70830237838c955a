"""The tail percentile held at tau is a parameter (stats.quantile, 5 the paper's): it reaches the
logged tail stats, calibration's choice, the closed loop's pooled test, and a table calibrated for
one percentile is refused under another."""

import jax.numpy as jnp
import numpy as np
import pytest

from configs import default
from sparrow_jax.mismatch import acceptance, calibrate
from sparrow_jax.rl import run_config, step_schema, train_step
from sparrow_jax.sparsity import schedule as schedule_lib
from sparrow_jax.sparsity.schedule import KVSchedule

# 100 tokens of one bin: 3 at alpha 0.5, the rest at 0.99. p1 (0.5) is under tau 0.86, p5 (0.99)
# is over it: p1 and p5 disagree on this bin.
ALPHA_BT = np.where(np.arange(100) < 3, 0.5, 0.99)[None].astype(np.float32)


@pytest.mark.slow
def test_logged_stats_hold_the_quantile():
  stats = acceptance.tail_stats(
    ALPHA_BT,
    np.ones_like(ALPHA_BT, bool),
    np.arange(100)[None],
    bin_size=128,
    num_bins=1,
    tau=0.86,
    percentiles=acceptance.tail_percentiles(2.5),
  )
  assert float(stats["p1"]) == pytest.approx(0.5) and float(stats["p5"]) == pytest.approx(0.99)
  assert float(stats["p2.5_bin"][0]) == pytest.approx(np.percentile(ALPHA_BT, 2.5))
  assert float(stats["frac_below_tau_bin"][0]) == pytest.approx(0.03)
  step = step_schema.StepConfig(
    stats=step_schema.StatsConfig(quantile=2.5, bin_size=128, num_bins=1)
  )
  batch = step_schema.Batch(
    tokens=jnp.zeros((1, 100), jnp.int32),
    gen_mask=jnp.ones((1, 100), bool),
    prompt_len=jnp.ones((1,), jnp.int32),
    logp_rollout=jnp.zeros((1, 100)),
    rewards=jnp.zeros((1,)),
  )
  metrics = train_step._acceptance_metrics(batch, jnp.zeros((1, 100)), None, ALPHA_BT, None, step)
  assert float(metrics["acceptance/p2.5_bin"][0]) == pytest.approx(float(stats["p2.5_bin"][0]))
  with pytest.raises(ValueError, match="StatsConfig.quantile = 50"):
    step_schema.StatsConfig(quantile=50)


def test_p1_and_p5_choose_different_tables():
  """Candidate 1 has the tails of ALPHA_BT; candidate 2 is exact. p5 >= 0.86 takes top-k 1, p1
  needs top-k 2; each table records its percentile."""
  tail = {1: np.array([[0.5], [1.0]]), 5: np.array([[0.99], [1.0]])}
  p5 = calibrate.choose_schedule(tail[5], (1, 2), 0.86, page_size=4, bin_size=8)
  p1 = calibrate.choose_schedule(tail[1], (1, 2), 0.86, page_size=4, bin_size=8, quantile=1)
  assert (p5.values, p5.quantile) == ((1,), 5) and (p1.values, p1.quantile) == ((2,), 1)
  surface = {
    "candidates": [1, 2],
    "tail": {f"{q}": {str(c): list(t[i]) for i, c in enumerate((1, 2))} for q, t in tail.items()},
  }
  np.testing.assert_array_equal(calibrate.surface_tail(surface, 1)[1], tail[1])
  with pytest.raises(ValueError, match=r"percentiles \['1', '5'\] of alpha, not 10"):
    calibrate.surface_tail(surface, 10)
  assert KVSchedule.from_json(p1.to_json()) == p1


def test_closed_loop_pools_against_the_quantile():
  """3% of a bin's tokens under tau: a p5 loop lowers the budget, a p1 loop raises it."""
  rule = dict(
    tau=0.86,
    max_topk=40,
    raise_factor=1.5,
    lower_factor=0.9,
    window=1,
    lower_share=0.005,
    min_tokens=10,
  )
  start = schedule_lib.LoopState.start((20,))
  held = schedule_lib.adapt_topk(
    start, [1000], [30], [0.99], schedule_lib.LoopRule(**rule, quantile=5)
  )
  raised = schedule_lib.adapt_topk(
    start, [1000], [30], [0.99], schedule_lib.LoopRule(**rule, quantile=1)
  )
  assert held.topk == (20,) and held.steps == (1,)
  assert raised.topk == (21,) and raised.floor == (21,)


def test_a_table_calibrated_for_another_quantile_is_refused(tmp_path):
  path = tmp_path / "p1.json"
  path.write_text(KVSchedule.table((1, 2), page_size=16, bin_size=128, quantile=1).to_json())
  c = default.get_config()
  c.workdir = str(tmp_path / "run")
  c.rollout.schedule = str(path)
  with pytest.raises(
    ValueError,
    match=r"calibrated to hold p1 >= tau, but config.stats.quantile "
    r"is 5",
  ):
    run_config.validate(c)
  c.stats.quantile = 1
  run_config.validate(c)
  c.rollout.schedule = f"adaptive:0.86:{path}"
  c.rollout.adaptive_lower_share = 0.02
  with pytest.raises(
    ValueError,
    match="adaptive_lower_share = 0.02 is invalid: must be in "
    r"\[0, 0.01\)",
  ):
    run_config.validate(c)
  c.stats.quantile = 0
  with pytest.raises(ValueError, match="config.stats.quantile = 0.0 is invalid"):
    run_config.validate(c)


def _sweep(dense_scores, tables):
  """A sweep.json-shaped dict: dense over seeds, and quest tables (quantile, tau, kv, held-out)."""
  stat = lambda m, s=0.0: {"mean": m, "std": s}
  settings = {
    "dense": dict(
      kind="dense",
      heldout_score=stat(float(np.mean(dense_scores)), float(np.std(dense_scores, ddof=1))),
      kv_read=stat(1.0),
    )
  }
  for q, tau, kv, score in tables:
    settings[f"quest{tau:g}_p{q:g}"] = dict(
      kind="quest", quantile=q, tau=tau, kv_read=stat(kv), heldout_score=stat(score, 0.05)
    )
  return {"settings": settings}


@pytest.mark.parametrize(
  "tables, verdict",
  [
    ([(5, 0.86, 0.75, 0.50), (1, 0.86, 0.90, 0.78)], "confirmed"),
    ([(5, 0.86, 0.75, 0.50), (1, 0.86, 0.90, 0.60)], "refuted"),  # p1 does not recover dense
    ([(5, 0.86, 0.75, 0.79), (1, 0.86, 0.90, 0.78)], "refuted"),  # p5 is enough
    ([(5, 0.86, 0.75, 0.50), (1, 0.86, 0.97, 0.80)], "inconclusive"),  # no p1 saving
    ([(5, 0.86, 0.75, 0.50), (1, 0.86, 0.97, 0.80), (1, 0.94, 0.93, 0.77)], "confirmed"),
  ],
)
def test_quantile_verdict_follows_the_preregistered_rule(tables, verdict):
  """Dense 0.70 / 0.80 / 0.90: mean 0.80, std 0.10, so the line is 0.70."""
  from experiments import tau_sweep

  v = tau_sweep.quantile_verdict(_sweep([0.7, 0.8, 0.9], tables))
  assert v["line"] == pytest.approx(0.7) and v["verdict"] == verdict


def test_quantile_plot_is_written(tmp_path):
  from experiments import tau_sweep

  sweep = _sweep(
    [0.7, 0.8, 0.9], [(5, 0.86, 0.75, 0.5), (1, 0.86, 0.9, 0.78), (1, 0.94, 0.93, 0.8)]
  )
  tau_sweep.plot_quantiles(sweep, str(tmp_path / "quantiles.png"))
  assert (tmp_path / "quantiles.png").stat().st_size > 1000
