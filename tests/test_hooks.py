"""The RL loop's hooks (rl/hooks.py), each on its own: what it adds to a step's metrics, what it
does after the step, and its checkpoint meta."""

import dataclasses
import json
import types

import numpy as np
import pytest

from configs import default
from sparrow_jax import schema, sharding
from sparrow_jax.mismatch import cost_model
from sparrow_jax.rl import build, hooks
from sparrow_jax.rollout import engine, sampler
from sparrow_jax.sparsity import schedule as schedule_lib

TABLE = "assets/pointer_chase_tiny/calibration_quest/schedule.json"
MESH = sharding.make_mesh(1, 1, 1)
CACHE_LEN = 1024


def config(schedule: str):
  c = default.get_config()
  c.rollout.schedule = schedule
  return c


def budgets(c):
  cfg = build.model_config(c)
  return build.budgets(c, cfg, build.sparse_config(c), MESH, CACHE_LEN), cfg


def output(step, budget, lengths=(300, 420, 17, 400)):
  return hooks.StepOutput(
    step=step,
    budget=budget,
    prompt_len_B=np.full(len(lengths), 460),
    lengths_B=np.asarray(lengths),
    engine_stats=engine.EngineStats(decode_steps=10, useful_row_steps=30, computed_row_steps=40),
    rollout_s=2.0,
    train_s=0.5,
  )


def test_budgets_follow_the_stages_under_one_static_cap():
  hook, _ = budgets(config("0:fixed:8,3:" + TABLE))
  first, later = hook.for_step(2), hook.for_step(3)
  assert (first.stage, later.stage) == (0, 1)
  assert first.schedule.kind == "fixed" and later.schedule.kind == "table"
  np.testing.assert_array_equal(np.asarray(later.table.pages_by_len), later.pages_by_len)
  cap = sampler.max_selected_pages([first.pages_by_len, later.pages_by_len])
  assert first.table.max_selected == later.table.max_selected == cap  # one compiled decode
  assert hook.for_step(7).table is later.table  # built and placed once
  assert hook.metrics(output(3, later)) == {"kv/schedule_stage": 1}
  assert hook.meta() == {}


def test_closed_loop_moves_the_table_and_resumes_from_its_meta():
  c = config(f"adaptive:0.86:{TABLE}")
  hook, cfg = budgets(c)
  before = hook.for_step(0)
  bins = len(before.schedule.values)
  metrics = hook.metrics(output(0, before))
  np.testing.assert_array_equal(metrics["kv/topk_bin"], before.schedule.values)
  assert metrics["kv/read_fraction_start"] == pytest.approx(
    cost_model.kv_read_fraction(
      before.pages_by_len,
      np.full(4, 460),
      np.asarray((300, 420, 17, 400)),
      cfg,
      build.sparse_config(c),
    )
  )
  # every measured bin fell off a cliff (p10 under tau): each is raised by adapt_topk's rule
  n = c.stats.num_bins
  tail = {
    "acceptance/count_bin": [1000] * n,
    "acceptance/frac_below_tau_bin": [0.5] * n,
    "acceptance/p10_bin": [0.1] * n,
  }
  hook.end_step(output(0, before), tail)
  after = hook.for_step(1)
  assert all(a > b for a, b in zip(after.schedule.values[:n], before.schedule.values))
  assert after.table.max_selected == before.table.max_selected
  resumed, _ = budgets(c)
  resumed.restore(hook.meta())
  assert resumed.for_step(1).schedule.values == after.schedule.values
  assert len(hook.meta()["adaptive"]["topk"]) == bins


def mean_cached(out) -> float:
  return float(np.mean(out.prompt_len_B + out.lengths_B / 2))


def timed(out, cached=None, beside=(), **round_s):
  """out with its engine's chunks timed: round_s k0=..., k2=...: seconds per round of each, three
  chunks each (the first, which may compile, ten times slower), at `cached` cached tokens (default:
  the rows' mean); the counts in `beside` timed beside the loop's step."""
  stats = dataclasses.replace(out.engine_stats, chunk_rounds={})
  for k, s in round_s.items():
    for seconds in (10 * s, s, s):
      started = -1.0 if k in beside else 1.0
      stats.time_chunk(
        int(k[1:]), seconds * 4, 4, mean_cached(out) if cached is None else cached, started
      )
  if beside:
    stats.beside_until = 0.0
  return dataclasses.replace(out, engine_stats=stats)


@pytest.fixture(autouse=True)
def no_margin(monkeypatch):
  """The switch's pricing apart from its margin: the tiny model's drafts price narrow gains, all
  within the margin (whose own test puts it back)."""
  monkeypatch.setattr(hooks, "MARGIN", 0.0)


def test_the_draft_switch_keeps_dense_decoding_where_a_k_wins_by_less_than_its_margin(
  monkeypatch,
):
  """Bins where a k prices a few percent faster than dense decoding stay dense under the margin;
  a bin where it prices beyond the margin drafts."""
  c = config(TABLE)
  c.rollout.speculate, c.rollout.speculate_hardware = "auto", "tpu_v5e"
  hook, cfg = budgets(c)
  first = hook.for_step(0)
  n = c.stats.num_bins
  mean = [0.2, 0.5, np.nan, 0.9, 0.99, 0.999, 0.95][:n]
  step = {"acceptance/mean_bin": mean, "acceptance/count_bin": [10] * n}
  hook.end_step(output(0, first), step)
  narrow = hook.for_step(1).drafts.k_bin
  assert max(narrow) > 0  # without the margin, the narrow wins draft
  monkeypatch.setattr(hooks, "MARGIN", 0.05)  # above the bins' gains but the largest
  priced = dict(ks=(1, 2, 4), rows=1, hardware="tpu_v5e", sparse=build.sparse_config(c))

  def gain(b, alpha):  # the best k's priced rate over dense decoding's in bin b
    _, rate, dense = cost_model.best_draft(
      cfg, first.schedule, (b + 0.5) * c.stats.bin_size, alpha, **priced
    )
    return rate / dense

  gains = [np.nan if np.isnan(a) else gain(b, a) for b, a in enumerate(mean)]
  kept = hook.for_step(1).drafts.k_bin
  for b, gain in enumerate(gains):
    assert (kept[b] > 0) == (gain > 1.05), (b, gain, kept)
  assert 0 < sum(k > 0 for k in kept) < sum(k > 0 for k in narrow)


def test_the_draft_switch_prices_each_bin_at_its_measured_acceptance_and_resumes():
  c = config(TABLE)
  c.rollout.speculate, c.rollout.speculate_hardware = "auto", "tpu_v5e"
  hook, cfg = budgets(c)
  first = hook.for_step(0)
  n = c.stats.num_bins
  assert first.drafts.k_bin == (0,) * n  # nothing measured yet: dense decoding
  np.testing.assert_array_equal(hook.metrics(output(0, first))["rollout/draft_k_bin"], [0] * n)
  mean = [0.2, 0.5, np.nan, 0.9, 0.99, 0.999, 0.95][:n]
  count = [10, 10, 0, 10, 10, 10, 10][:n]
  step = {"acceptance/mean_bin": mean, "acceptance/count_bin": count}
  hook.end_step(output(0, first), step)  # no chunk timed: the roofline alone prices
  plan = hook.for_step(1).drafts
  kw = dict(bin_size=c.stats.bin_size, ks=(1, 2, 4), rows=1, hardware="tpu_v5e")
  sparse = build.sparse_config(c)
  assert plan == cost_model.draft_plan(cfg, first.schedule, sparse, mean, **kw)
  assert plan.k_bin[2] == 0 and max(plan.k_bin) > 0  # an empty bin stays dense
  # a bin with no tokens keeps its last acceptance
  empty = {"acceptance/mean_bin": [0.0] * n, "acceptance/count_bin": [0] * n}
  hook.end_step(output(1, hook.for_step(1)), empty)
  assert hook.for_step(2).drafts == plan
  resumed, _ = budgets(c)
  resumed.restore(json.loads(json.dumps(hook.meta(), allow_nan=False)))
  assert resumed.for_step(2).drafts == plan
  # A dense step of 0.2 s a decode step prices every pass with the 0.2 s the roofline leaves
  # unexplained: a round of k + 1 passes no longer pays anywhere.
  slow, _ = budgets(c)
  slow.end_step(timed(output(0, first), k0=0.2), step)
  assert slow.meta()["drafts"]["pass_overhead_s"] == pytest.approx(0.2, rel=1e-3)
  assert slow.for_step(1).drafts.k_bin == (0,) * n


def test_the_draft_switch_drops_a_draft_count_whose_measured_rounds_do_not_pay():
  """The roofline proposes a k; the engine's clock decides: a k whose measured rounds cost more
  than the tokens they emit would densely is dropped where it ran, and its factor is logged and
  kept across a resume. A k measured as cheap as the roofline keeps its bins."""
  c = config(TABLE)
  c.rollout.speculate, c.rollout.speculate_hardware = "auto", "tpu_v5e"
  c.rollout.speculate_ks = (2,)
  n = c.stats.num_bins
  step = {"acceptance/mean_bin": [0.99] * n, "acceptance/count_bin": [10] * n}
  hook, cfg = budgets(c)
  first = hook.for_step(0)
  hook.end_step(output(0, first), step)
  proposed = hook.for_step(1)
  assert max(proposed.drafts.k_bin) == 2  # at alpha 0.99 the roofline drafts past bin 0
  sparse, rows = build.sparse_config(c), hook.switch.rows
  cached = mean_cached(output(0, first))
  priced = dict(rows=rows, hardware=hook.switch.hardware, sparse=sparse)
  dense_s = cost_model.round_seconds(cfg, None, cached, k=0, **priced)
  round_s = cost_model.round_seconds(cfg, proposed.schedule, cached, k=2, **priced)
  # measured: dense steps as the roofline prices them, rounds of 2 drafts 5x their price (the
  # 2.97 tokens a round emits at alpha 0.99 then cost more than 2.97 dense steps)
  hook.end_step(timed(output(1, proposed), k0=dense_s, k2=5 * round_s), step)
  assert hook.switch.scale[2] == pytest.approx(5.0, rel=1e-3)
  assert hook.for_step(2).drafts.k_bin == (0,) * n
  logged = hook.metrics(output(2, hook.for_step(2)))["rollout/round_scale/k2"]
  assert logged == pytest.approx(5.0, rel=1e-3)
  resumed, _ = budgets(c)
  resumed.restore(json.loads(json.dumps(hook.meta(), allow_nan=False)))
  assert resumed.for_step(2).drafts.k_bin == (0,) * n
  cheap, _ = budgets(c)
  cheap.end_step(output(0, first), step)
  cheap.end_step(timed(output(1, proposed), k0=dense_s, k2=round_s), step)
  assert cheap.switch.scale[2] == pytest.approx(1.0, rel=1e-3)
  assert cheap.for_step(2).drafts == proposed.drafts
  # Dense steps measured 3x faster than the roofline prices them (a pass overhead cannot be
  # negative): dense decoding is priced on that clock too, so rounds at their roofline price no
  # longer pay; a k not yet run is priced on the same clock as dense, so it still does.
  fast, _ = budgets(c)
  fast.end_step(output(0, first), step)
  fast.end_step(timed(output(1, proposed), k0=dense_s / 3, k2=round_s), step)
  assert fast.switch.scale[0] == pytest.approx(1 / 3, rel=1e-3)
  assert fast.for_step(2).drafts.k_bin == (0,) * n
  unrun, _ = budgets(c)
  unrun.end_step(output(0, first), step)
  unrun.end_step(timed(output(1, proposed), k0=dense_s / 3), step)
  assert unrun.for_step(2).drafts == proposed.drafts


def test_engine_stats_time_rounds_leaving_each_programs_first_chunk_out():
  """Each chunk is filed with its seconds per round and the cached length it ran at, under the
  count its rounds ran (None: not filed); the clock round-trips through a checkpoint's JSON."""
  stats = engine.EngineStats()
  chunks = ((0, 9.0, 8, 10), (0, 0.8, 8, 20), (0, 1.6, 8, 40), (0, 0.0, 0, 50), (2, 5.0, 2, 60))
  for draft, seconds, rounds, cached in chunks + ((None, 1.0, 4, 70),):
    stats.time_chunk(draft, seconds, rounds, cached, started=float(cached))
  assert stats.round_timings() == {0: [(pytest.approx(0.1), 20), (pytest.approx(0.2), 40)]}
  assert stats.round_timings(beside=True) == {} and stats.timed_beside() == 0.0
  stats.beside_until = 30.0  # the chunk that started at 20 shared the machine with the loop's step
  assert stats.round_timings() == {0: [(pytest.approx(0.2), 40)]}
  assert stats.round_timings(beside=True) == {0: [(pytest.approx(0.1), 20)]}
  assert stats.timed_beside() == 0.5
  state = json.loads(json.dumps(stats.state(), allow_nan=False))
  back = engine.EngineStats.from_state(state)
  assert back.state() == stats.state() and back == stats
  assert (back.chunk_rounds, back.beside_until) == (stats.chunk_rounds, stats.beside_until)


def test_kv_metrics_price_the_steps_rollouts():
  c = config(TABLE)
  hook_budgets, cfg = budgets(c)
  sparse = build.sparse_config(c)
  engine_cfg = build.engine_config(c, cfg, rows_per_device=16)
  kv = build.kv_metrics(c, cfg, sparse, engine_cfg, "h200")
  budget = hook_budgets.for_step(0)
  out = output(0, budget)
  metrics = kv.metrics(out)
  assert metrics["kv/read_fraction"] == cost_model.kv_read_fraction(
    budget.pages_by_len, out.prompt_len_B, out.lengths_B, cfg, sparse
  )
  assert 0 < metrics["kv/read_fraction"] < 1
  assert metrics["kv/predicted_speedup"] == hooks.predicted_speedup(
    cfg,
    sparse,
    budget.schedule,
    engine_cfg,
    "h200",
    out.prompt_len_B,
    out.lengths_B,
    c.rollout.max_new_tokens,
    c.rollout.group_size,
  )
  dense = build.kv_metrics(c, cfg, None, engine_cfg, None).metrics(output(0, None))
  assert dense == {"kv/read_fraction": 1.0}


def test_perf_metrics_are_the_steps_rates():
  perf = hooks.PerfMetrics(lambda step: 1e-5 * step).metrics(output(3, None))
  assert perf["perf/rollout_tokens_per_s"] == (300 + 420 + 17 + 400) / 2.0
  assert perf["perf/engine_occupancy"] == 30 / 40 and perf["perf/engine_rows_in_flight"] == 3.0
  assert perf["perf/train_step_s"] == 0.5 and perf["lr"] == pytest.approx(3e-5)


def test_hooks_default_to_nothing():
  hook = hooks.Hook()
  assert hook.metrics(output(0, None)) == {} and hook.meta() == {}
  assert hook.end_step(output(0, None), {}) is None and hook.restore({}) is None


class _Counter(hooks.Hook):
  every = 3

  def __init__(self):
    self.steps = []

  def end_step(self, out, metrics):
    self.steps.append(out.step)

  def meta(self):
    return {"counted": list(self.steps)}


def test_a_hook_runs_every_n_steps_and_the_checkpoint_also_at_the_end(monkeypatch):
  counter = _Counter()
  saved = []
  monkeypatch.setattr(hooks.checkpoint, "save", lambda *a: saved.append(a))
  saver = hooks.Checkpoint("mgr", 4, total_steps=10, data_position=lambda s: 5 * s, hooks=[counter])
  for step in range(10):
    out = dataclasses.replace(output(step, None), state=f"state{step}")
    for hook in (counter, saver):  # as the trainer's loop runs them
      if hook.due(step):
        hook.end_step(out, {})
  assert counter.steps == [2, 5, 8]
  assert [(s[1], s[2]) for s in saved] == [(4, "state3"), (8, "state7"), (10, "state9")]
  assert saved[1][3] == {"step": 8, "data_position": 40, "counted": [2, 5]}


def test_the_loop_rule_is_a_config_component():
  """rollout.adaptive_* and stats.quantile build LoopConfig by name; its checks name the field."""
  c = default.get_config()
  c.rollout.adaptive_window, c.rollout.adaptive_lower_share, c.stats.quantile = 6, 0.005, 1
  loop = schema.from_group(schedule_lib.LoopConfig, c, "rollout", "stats")
  rule = loop.rule(0.86, loop.ceiling((3, 5)))
  assert (rule.window, rule.quantile, rule.max_topk, rule.tau) == (6, 1, 10, 0.86)
  c.rollout.adaptive_lower_share = 0.02  # above quantile 1 %
  with pytest.raises(ValueError, match=r"config.rollout.adaptive_lower_share = 0.02 is invalid"):
    schema.from_group(schedule_lib.LoopConfig, c, "rollout", "stats")


def test_evaluation_scores_dense_and_under_the_steps_own_budget(tmp_path):
  """A scripted generate answers right only under the sparse budget the step ran under (stage 1's
  table at step 3): the sparse score is that budget's, the dense one the dense policy's. The
  completions shown are each problem's first sample; the history resumes from the meta."""
  c = config("0:fixed:8,3:" + TABLE)
  c.task.min_hops, c.task.max_hops = 4, 8
  c.eval.every, c.eval.problems, c.eval.samples, c.eval.completions = 2, 3, 2, 2
  hook_budgets, cfg = budgets(c)
  sparse = build.sparse_config(c)
  task = build.make_task(c, c.eval.seed)
  budget = hook_budgets.for_step(3)
  by_prompt = {p.prompt_ids: p for p in task.sample(3, 0)}
  calls = []

  def scripted_generate(params, cfg, prompt_BT, prompt_len_B, key, **kwargs):
    calls.append((params, kwargs))
    right = kwargs.get("schedule") is budget.table
    ids = [
      by_prompt[tuple(row[:n].tolist())].reference_ids if right else ()
      for row, n in zip(np.asarray(prompt_BT), np.asarray(prompt_len_B))
    ]
    tokens = np.zeros((len(ids), kwargs["max_new_tokens"]), np.int32)
    for i, row in enumerate(ids):
      tokens[i, : len(row)] = row
    return sampler.Rollout(tokens, np.zeros(tokens.shape), np.asarray([len(r) for r in ids]))

  samples = tmp_path / "eval_samples.jsonl"
  weights = lambda params, lora: (params + "-gathered", lora)
  hook = build.evaluation(c, cfg, sparse, task, task.own_tokenizer, weights, str(samples))
  out = dataclasses.replace(output(3, budget), state=types.SimpleNamespace(params="P", lora="L"))
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(hooks.engine, "generate", scripted_generate)
    metrics = hook.metrics(out)
  assert [kw.get("schedule") is budget.table for _, kw in calls] == [False, True]  # 6 rows each
  assert calls[1][1]["sparse"] == sparse and calls[1][1]["lora"] == "L"
  assert "lora" not in calls[0][1] and {p for p, _ in calls} == {"P-gathered"}
  assert metrics["eval/sparse/pass@1"] == metrics["eval/sparse/mean@2"] == 1.0
  assert metrics["eval/dense/pass@1"] == metrics["eval/dense/pass@2"] == 0.0
  assert "**1234:0**, reward 1" in metrics["eval/sparse/samples"]  # TensorBoard text
  rows = [json.loads(line) for line in samples.read_text().splitlines()]
  assert [(r["step"], r["mode"], r["problem"]) for r in rows] == [
    (4, mode, f"1234:{i}") for mode in ("dense", "sparse") for i in (0, 1)
  ]
  answer = task.sample(1, 0)[0].answer
  assert rows[2]["reward"] == 1.0 and f"answer {answer}" in rows[2]["completion"]
  assert hook.history == [
    {"step": 4, **{k: v for k, v in metrics.items() if not k.endswith("/samples")}}
  ]
  resumed = build.evaluation(c, cfg, sparse, task, task.own_tokenizer, weights, None)
  resumed.restore(json.loads(json.dumps(hook.meta())))
  assert resumed.history == hook.history


def switch_of(ks=(2,)):
  c = config(TABLE)
  c.rollout.speculate, c.rollout.speculate_hardware = "auto", "tpu_v5e"
  c.rollout.speculate_ks = ks
  hook, cfg = budgets(c)
  step = {
    "acceptance/mean_bin": [0.99] * c.stats.num_bins,
    "acceptance/count_bin": [10] * c.stats.num_bins,
  }
  return hook, cfg, build.sparse_config(c), step


def on_the_roofline(cfg, sparse, schedule, hardware, rows, overhead, chunks):
  """chunks: {k: cached lengths} -> {k: [seconds per round]}: what `hardware` with `overhead`
  seconds a pass prices a round of k at each length, exactly."""
  hw = dataclasses.replace(hardware, pass_overhead_s=overhead)
  price = lambda k, n: cost_model.round_seconds(
    cfg, schedule if k else None, n, k=k, rows=rows, hardware=hw, sparse=sparse
  )
  return {k: [price(k, n) for n in lengths] for k, lengths in chunks.items()}


def file_chunks(out, seconds, lengths, beside=()):
  """out with its engine's chunks: seconds[k][i] a round at lengths[k][i] cached tokens, each k's
  first chunk (which may compile) ten times slower; the counts in `beside` timed beside the loop's
  step."""
  stats = dataclasses.replace(out.engine_stats, chunk_rounds={})
  for k in seconds:
    started = -1.0 if k in beside else 1.0
    first = (10 * seconds[k][0], lengths[k][0])
    for s, n in [first] + list(zip(seconds[k], lengths[k])):
      stats.time_chunk(k, s * 4, 4, n, started)
  stats.beside_until = 0.0 if beside else None
  return dataclasses.replace(out, engine_stats=stats)


# Dense rounds ran in the short bins, rounds of 2 drafts in the long ones: far from the rows' mean
# cached length either way, where the roofline prices both differently.
LENGTHS = {0: [100, 150, 200], 2: [6000, 8000, 10000]}
OVERHEAD = 2e-8  # seconds a pass beyond the roofline, well under it: drafting can pay


def test_the_switch_prices_each_draft_count_where_its_rounds_ran():
  """Rounds timed exactly at what the roofline (with a pass overhead) prices them at the cached
  lengths where they ran: the fitted overhead is that overhead and every factor is 1, however far
  each k's lengths are from the rollout's mean."""
  hook, cfg, sparse, step = switch_of()
  first = hook.for_step(0)
  hook.end_step(output(0, first), step)
  proposed = hook.for_step(1)
  switch = hook.switch
  seconds = on_the_roofline(
    cfg, sparse, proposed.schedule, switch.hardware, switch.rows, OVERHEAD, LENGTHS
  )
  hook.end_step(file_chunks(output(1, proposed), seconds, LENGTHS), step)
  assert switch.hardware.pass_overhead_s == pytest.approx(OVERHEAD, rel=1e-6)
  assert switch.scale == {0: pytest.approx(1.0, rel=1e-6), 2: pytest.approx(1.0, rel=1e-6)}


def test_rounds_timed_beside_the_update_do_not_move_the_price():
  """One step off, the rollout's chunks share the machine with the loop's step and run slower,
  dense rounds and drafting rounds alike. Those timings neither set the pass overhead nor the
  factors timed alone; a k timed only beside a step is charged its factor relative to the dense
  rounds timed beside one, on the quiet dense clock: the plan is the one quiet timings give."""
  hook, cfg, sparse, step = switch_of()
  switch = hook.switch
  first = hook.for_step(0)
  roofline = lambda chunks, s=switch: on_the_roofline(
    cfg, sparse, first.schedule, s.hardware, s.rows, OVERHEAD, chunks
  )
  quiet = roofline(LENGTHS)
  # Step 0 samples alone (nothing to update yet) and decodes densely: its dense rounds.
  hook.end_step(file_chunks(output(0, first), {0: quiet[0]}, LENGTHS), step)
  assert switch.hardware.pass_overhead_s == pytest.approx(OVERHEAD, rel=1e-6)
  # The next rollouts run beside the updates, every round 4x slower than alone.
  slow = {k: [4 * s for s in v] for k, v in quiet.items()}
  out = file_chunks(output(1, hook.for_step(1)), slow, LENGTHS, beside=(0, 2))
  hook.end_step(out, step)
  assert switch.hardware.pass_overhead_s == pytest.approx(OVERHEAD, rel=1e-6)
  assert switch.scale == {0: pytest.approx(1.0, rel=1e-6)}
  assert switch.scale_beside == {0: pytest.approx(4.0, rel=1e-6), 2: pytest.approx(4.0, rel=1e-6)}
  assert switch.priced() == {0: pytest.approx(1.0, rel=1e-6), 2: pytest.approx(1.0, rel=1e-6)}
  # the plan of the same rounds timed alone
  alone, _, _, _ = switch_of()
  alone.end_step(file_chunks(output(0, first), quiet, LENGTHS), step)
  assert hook.for_step(2).drafts == alone.for_step(2).drafts
  assert max(hook.for_step(2).drafts.k_bin) == 2
  assert hook.metrics(out)["rollout/round_timing_beside_update"] == 1.0
  resumed, _, _, _ = switch_of()
  resumed.restore(json.loads(json.dumps(hook.meta(), allow_nan=False)))
  assert resumed.switch.priced() == switch.priced()


def test_decode_seconds_add_up_every_timed_chunk():
  """A rollout's decode clocks (whole chunks, and their programs) hold every chunk's seconds,
  those of chunks no draft count prices (None) included, and stay out of the stats' equality."""
  stats = engine.EngineStats()
  stats.time_chunk(0, 0.5, 4, 100.0, 1.0, 0.25)
  stats.time_chunk(None, 0.25, 2, 100.0, 2.0, 0.125)
  stats.time_chunk(4, 1.0, 0, 100.0, 3.0, 0.5)
  assert stats.decode_seconds == 1.75 and stats.program_seconds == 0.875
  assert stats == engine.EngineStats(decode_seconds=0.0, program_seconds=0.0, chunk_rounds={})
  assert engine.EngineStats.from_state(stats.state()).program_seconds == 0.875
