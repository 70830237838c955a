"""KVSchedule: published tables, budget semantics, jit/vmap, JSON, validation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax.sparsity import schedule as schedule_lib
from sparrow_jax.sparsity.schedule import KVSchedule

# The tau-0.86 tables (and 1.7B at 0.80) as printed in the project brief.
BRIEF_TABLES = {
  ("qwen3-1.7b", 0.86): [29, 61, 93, 93, 125, 157, 189, 221, 221] + [253] * 11,
  ("qwen3-4b", 0.86): [
    29,
    45,
    61,
    77,
    93,
    125,
    157,
    221,
    253,
    253,
    317,
    317,
    317,
    317,
    381,
    381,
    381,
    381,
    509,
    509,
  ],
  ("qwen3-8b", 0.86): [
    29,
    45,
    61,
    77,
    125,
    157,
    189,
    253,
    253,
    253,
    253,
    317,
    317,
    317,
    317,
    317,
    317,
    385,
    445,
    445,
  ],
  ("qwen3-14b", 0.86): [
    29,
    45,
    77,
    125,
    253,
    381,
    381,
    381,
    381,
    381,
    381,
    381,
    381,
    381,
    381,
    509,
    637,
    637,
    893,
    893,
  ],
  ("qwen3-1.7b", 0.80): [29, 45, 61, 77, 93, 93, 125, 125, 125] + [157] * 11,
}
TAUS = {
  "qwen3-1.7b": [0.75, 0.80, 0.83, 0.86, 0.88, 0.90, 0.92, 0.94],
  "qwen3-4b": [0.75, 0.80, 0.86, 0.88, 0.90, 0.92],
  "qwen3-8b": [0.75, 0.80, 0.86, 0.87, 0.92],
  "qwen3-14b": [0.86],
}


def _budget(schedule, cached_len):
  return np.asarray(schedule.budget_pages(np.asarray(cached_len, np.int32)))


def test_paper_1p7b_tau086_examples():
  s = KVSchedule.paper("qwen3-1.7b", tau=0.86)
  assert (s.page_size, s.always_kept, s.bin_size, s.max_pages) == (16, 3, 2000, 256)
  # 29 top-k + 3 always-kept = 32 pages in the first bin, capped at the cached pages.
  np.testing.assert_array_equal(
    _budget(s, [1, 16, 17, 80, 496, 497, 512, 1000, 1984]), [1, 1, 2, 5, 31, 32, 32, 32, 32]
  )
  # Bins are whole pages, as in the reference planner: 125 pages = 2000 tokens per bin.
  np.testing.assert_array_equal(_budget(s, [1985, 2000, 2047, 4000]), [64, 64, 64, 96])
  np.testing.assert_array_equal(
    _budget(s, [17984, 17985, 18000, 18432, 32768, 40000, 10**6]),
    [224, 256, 256, 256, 256, 256, 256],
  )


@pytest.mark.parametrize("key", sorted(BRIEF_TABLES))
def test_paper_tables_match_the_brief(key):
  s = KVSchedule.paper(*key)
  assert list(s.values) == BRIEF_TABLES[key]
  bin_starts = np.arange(20) * 2000
  budgets = _budget(s, bin_starts[1:])  # from bin 1 on, the cache is long enough to not cap
  np.testing.assert_array_equal(budgets, np.array(BRIEF_TABLES[key][1:]) + 3)


@pytest.mark.parametrize("model", sorted(TAUS))
def test_all_published_taus_load_and_grow_with_tau(model):
  tables = [KVSchedule.paper(model, tau).values for tau in TAUS[model]]
  assert all(len(t) == 20 for t in tables)
  for low, high in zip(tables, tables[1:]):  # a stricter threshold never needs fewer pages
    assert all(a <= b for a, b in zip(low, high))


KINDS = [
  KVSchedule.paper("qwen3-4b", 0.86),
  KVSchedule.fixed(40),
  KVSchedule.fixed(3),
  KVSchedule.linear(0.1, 200),
  KVSchedule.table([0, 5, 9], page_size=32, always_kept=0, bin_size=256),
]


@pytest.mark.parametrize("schedule", KINDS, ids=lambda s: s.kind)
def test_budget_is_capped_monotone_and_within_max_pages(schedule):
  lens = np.arange(0, 45000, 7)
  budgets = _budget(schedule, lens)
  assert np.all(budgets <= -(-lens // schedule.page_size))
  assert np.all(np.diff(budgets) >= 0)
  assert budgets.max() == schedule.max_pages


def test_fixed_and_linear_values():
  np.testing.assert_array_equal(_budget(KVSchedule.fixed(40), [16 * 39, 10**5]), [39, 40])
  s = KVSchedule.linear(0.25, 10, always_kept=3)
  # floor(0.25 * pages) + 3, capped at 10 + 3 and at the cached pages.
  np.testing.assert_array_equal(_budget(s, [16, 16 * 8, 16 * 20, 16 * 100]), [1, 5, 8, 13])


def test_budget_under_jit_and_vmap_compiles_once():
  s = KVSchedule.paper("qwen3-8b", 0.86)
  lens = jnp.arange(1, 40000, 97, dtype=jnp.int32)
  expected = _budget(s, lens)
  traces = []

  @jax.jit
  def f(cached_len):
    traces.append(1)
    return s.budget_pages(cached_len)

  np.testing.assert_array_equal(jax.vmap(f)(lens), expected)
  np.testing.assert_array_equal([int(f(n)) for n in lens[:5]], expected[:5])
  assert len(traces) == 1  # the vmapped and the scalar calls share one trace: lengths are data

  g = jax.jit(lambda sched, n: sched.budget_pages(n), static_argnums=0)
  np.testing.assert_array_equal(g(KVSchedule.paper("qwen3-8b", 0.86), lens), expected)
  np.testing.assert_array_equal(g(KVSchedule.fixed(5), lens), np.minimum(5, -(-lens // 16)))


@pytest.mark.parametrize("schedule", KINDS, ids=lambda s: s.kind)
def test_json_round_trip(schedule):
  back = KVSchedule.from_json(schedule.to_json())
  assert back == schedule and hash(back) == hash(schedule)


@pytest.mark.parametrize(
  "make, field",
  [
    (lambda: KVSchedule.table([5, 4]), "values"),
    (lambda: KVSchedule.table([-1, 4]), "values"),
    (lambda: KVSchedule.table([]), "values"),
    (lambda: KVSchedule.table([1, 2], page_size=24), "page_size"),
    (lambda: KVSchedule.table([1, 2], bin_size=100), "bin_size"),
    (lambda: KVSchedule.fixed(2), "always_kept"),
    (lambda: KVSchedule.fixed(-1, always_kept=0), "always_kept"),
    (lambda: KVSchedule.linear(-0.5, 10), "linear"),
    (lambda: KVSchedule("dynamic", (1,)), "kind"),
    (lambda: KVSchedule.fixed(4, always_kept=-1), "always_kept"),
    (lambda: KVSchedule.from_json('{"kind": "fixed", "values": [4]}'), "page_size"),
  ],
)
def test_validation_names_the_field(make, field):
  with pytest.raises(ValueError, match=field):
    make()


def test_unknown_paper_schedule_lists_known_ones():
  with pytest.raises(ValueError, match=r"qwen3-1\.7b@0\.86.*qwen3-8b@0\.87"):
    KVSchedule.paper("qwen3-8b", 0.88)
  with pytest.raises(ValueError, match="known"):
    KVSchedule.paper("llama-8b", 0.86)


def test_parse_specs_and_errors_name_the_field(tmp_path):
  assert KVSchedule.parse("fixed:9", 16) == KVSchedule.fixed(9)
  assert KVSchedule.parse("paper:qwen3-4b:0.86", 16) == KVSchedule.paper("qwen3-4b", 0.86)
  path = tmp_path / "s.json"
  path.write_text(KVSchedule.table((1, 2), page_size=4, bin_size=8).to_json())
  assert KVSchedule.parse(str(path), 4).values == (1, 2)
  for spec, match in [
    ("fixed:abc", "fixed:abc"),
    ("paper:qwen3-1.7b", "paper:MODEL:TAU"),
    ("nope.json", "KVSchedule JSON"),
    (str(path), "page_size 4"),
  ]:
    with pytest.raises(ValueError, match="rollout.schedule") as e:
      KVSchedule.parse(spec, 16)
    assert match in str(e.value)


def test_stages_switch_at_their_steps():
  stages = schedule_lib.parse_stages("0:paper:qwen3-1.7b:0.86,200:paper:qwen3-1.7b:0.80", 16)
  assert [start for start, _ in stages] == [0, 200]
  assert stages[schedule_lib.stage_index(stages, 199)][1] == KVSchedule.paper("qwen3-1.7b", 0.86)
  assert stages[schedule_lib.stage_index(stages, 200)][1] == KVSchedule.paper("qwen3-1.7b", 0.80)
  assert schedule_lib.parse_stages("fixed:8", 16) == ((0, KVSchedule.fixed(8)),)
  for spec in ("5:fixed:8", "0:fixed:8,0:fixed:9", "0:fixed:8,x"):
    with pytest.raises(ValueError, match="rollout.schedule"):
      schedule_lib.parse_stages(spec, 16)


def test_position_bin_is_the_table_schedules_bin():
  # cached lengths 0..40 at page 4, bins of 8 tokens: bin = ceil(len / 4) // 2
  lens = np.arange(41)
  np.testing.assert_array_equal(schedule_lib.position_bin(lens, 4, 8), -(-lens // 4) // 2)
  table = KVSchedule.table((0, 1, 2, 3, 4, 5), page_size=4, always_kept=0, bin_size=8)
  pages = -(-lens // 4)
  want = np.minimum(np.minimum(schedule_lib.position_bin(lens, 4, 8), 5), pages)
  np.testing.assert_array_equal(table.budget_pages(lens), want)
  with pytest.raises(ValueError, match="bin_size"):
    schedule_lib.position_bin(lens, 16, 24)


RULE = dict(
  tau=0.86,
  max_topk=40,
  raise_factor=1.5,
  lower_factor=0.95,
  window=4,
  lower_share=0.04,
  min_tokens=200,
)


def loop_step(state, share, count=1000, p10=0.99):
  """adapt_topk on one bin, `share` of its `count` tokens under tau, judged on 3 steps."""
  return schedule_lib.adapt_topk(
    state, [count], [round(share * count)], [p10], schedule_lib.LoopRule(**{**RULE, "window": 3})
  )


def test_adaptive_rule_pools_a_window_before_judging():
  start = schedule_lib.LoopState.start((20,))
  one = loop_step(start, share=0.2)  # one bad step under the window: holds, pooled
  assert one.topk == (20,) and (one.tokens, one.below, one.steps) == ((1000,), (200,), (1,))
  two = loop_step(one, share=0.0, count=199)  # too few tokens: pools nothing
  assert two == one
  state = start
  for _ in range(3):  # 3 steps at 3%: the pool passes (<= 4%) at the window, lowered x0.95
    state = loop_step(state, share=0.03)
  assert state.topk == (19,) and state.before == (20,) and state.steps == (0,)  # a new pool
  for share, topk in [(0.07, 19), (0.07, 19), (0.07, 20)]:  # the probe fails on its pool: undone
    state = loop_step(state, share)
    assert state.topk == (topk,)
  assert state.floor == (20,) and state.before == (19,)
  held = state
  for _ in range(3):  # 4.5%: neither passes nor fails; the pool grows
    held = loop_step(held, 0.045)
  assert held.topk == (20,) and held.steps == (3,)
  for _ in range(3):  # 3% at the floor: passes, but the floor keeps it at 20
    state = loop_step(state, 0.03)
  assert state.topk == (20,)
  for _ in range(3):  # a failure (pooled with the 3%: 6.5%) after coming up: at the edge, +1 page
    state = loop_step(state, 0.1)
  assert (state.topk, state.floor, state.before) == ((21,), (21,), (20,))
  assert loop_step(state, 0.3, p10=0.5).topk == (32,)  # off a cliff after coming up: x1.5


def test_adaptive_rule_fails_a_cliff_at_once_within_floor_and_cap():
  state = schedule_lib.LoopState.start((0, 4, 30, 36, 40))
  # every bin's step p10 under tau: raised at once (x1.5, >= +1 page, <= the cap 40)
  state = schedule_lib.adapt_topk(
    state, [500] * 5, [300] * 5, [0.1] * 5, schedule_lib.LoopRule(**RULE)
  )
  assert state.topk == (1, 6, 40, 40, 40) and state.floor == (1, 5, 31, 37, 40)
  # a NaN p10 (an empty bin) holds; a later bin is lifted to an earlier one (tables grow with
  # position), and the lift starts its pool anew
  lifted = schedule_lib.adapt_topk(
    schedule_lib.LoopState.start((10, 10)),
    [500, 500],
    [0, 0],
    [0.1, np.nan],
    schedule_lib.LoopRule(**RULE),
  )
  assert lifted.topk == (15, 15) and lifted.steps == (0, 0) and lifted.before == (10, 10)


def noisy_cliff_run(start, cliff, window, steps=80):
  """A bin whose step share under tau is noisy (Beta, mean 3% from `cliff` pages up: a step's
  share tops 5% in ~10% of steps at budgets that hold) with a cliff below `cliff` (mean 60%, step
  p10 ~0) -> (top-k after each step, final state)."""
  rs = np.random.RandomState(0)
  state, history = schedule_lib.LoopState.start((start,)), []
  for _ in range(steps):
    mean_share = 0.03 if state.topk[0] >= cliff else 0.6
    p10 = 0.99 if state.topk[0] >= cliff else 0.0
    state = schedule_lib.adapt_topk(
      state,
      [1000],
      [round(1000 * rs.beta(4, 4 / mean_share - 4))],
      [p10],
      schedule_lib.LoopRule(**{**RULE, "window": window}),
    )
    history.append(state.topk[0])
  return history, state


@pytest.mark.parametrize(
  "start, cliff, probes",
  [
    (22, 19, [18]),  # lowers a page at a time: one probe over the cliff
    (40, 36, [34, 35]),  # lowers 2 pages at a time: the undo, then a 1-page probe
  ],
)
def test_adaptive_rule_settles_at_the_cliff_edge_on_noisy_steps(start, cliff, probes):
  """Pooled, the loop walks down to the cliff, probes over it once per budget (each fails at
  once), returns and stays at the cheapest budget that holds."""
  history, state = noisy_cliff_run(start, cliff, RULE["window"])
  assert [k for k in history if k < cliff] == probes
  assert state.floor == (cliff,) and history[-20:] == [cliff] * 20


def test_adaptive_rule_judged_per_step_locks_itself_out_of_budgets_that_hold():
  """The same noisy bin judged on each step alone (window 1): a step over 5% at a budget that
  holds fails it, and its floor then keeps it there or above: it ends above the cliff edge."""
  history, state = noisy_cliff_run(22, 19, window=1)
  assert state.floor[0] > 19 and min(history[-20:]) > 19


def test_parse_adaptive_and_errors_name_the_field():
  assert schedule_lib.parse_adaptive("adaptive:0.86:paper:qwen3-1.7b:0.86", 16) == (
    0.86,
    KVSchedule.paper("qwen3-1.7b", 0.86),
  )
  assert schedule_lib.parse_adaptive("paper:qwen3-1.7b:0.86", 16) is None
  for spec, match in [
    ("adaptive:1.2:paper:qwen3-1.7b:0.86", "TAU '1.2'"),
    ("adaptive:x:fixed:8", "TAU 'x'"),
    ("adaptive:0.86:fixed:8", "'fixed'"),
    ("adaptive:0.86:nope", "KVSchedule JSON"),
  ]:
    with pytest.raises(ValueError, match="rollout.schedule") as e:
      schedule_lib.parse_adaptive(spec, 16)
    assert match in str(e.value)
  with pytest.raises(ValueError, match="combined with stages"):
    schedule_lib.parse_stages("0:adaptive:0.86:fixed:8,5:fixed:4", 16)
