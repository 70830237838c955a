"""Multi-turn rows in the rollout engine (`engine.run(turns=...)`): a row whose turn ends waits on
its tool without holding up the others, its observation is prefilled into its own pages, and what
it samples afterwards is the policy's sample given the whole conversation (the teacher-forced
forward over prompt, turns and observations gives its log-probs), whatever the slots or the pool."""

import contextlib
import json
import sys
import textwrap
import threading
import time

import jax
import numpy as np
import pytest

import sparrow_jax as sj
from sparrow_jax import sharding
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.rl import step_schema
from sparrow_jax.rollout import engine
from sparrow_jax.sparsity.schedule import KVSchedule
from tests import helpers
from tests.helpers import tiny_config

CFG = tiny_config(num_hidden_layers=3)
PARAMS = sj.init_params(CFG, jax.random.PRNGKey(0), std=0.3)
GROUP_LEN = np.asarray([9, 20, 13])
PROMPT_LEN = np.repeat(GROUP_LEN, 2)
PROMPT = np.repeat(np.random.RandomState(0).randint(1, CFG.vocab_size, (3, 21)), 2, axis=0) * (
  np.arange(21)[None] < PROMPT_LEN[:, None]
)
MAX_NEW = 200
EOS = tuple(range(0, CFG.vocab_size, 8))  # a turn every ~8 tokens of the random model
TURNS = 3  # tool calls a row makes before its next turn end finishes it


def observation(row: int, turn: int) -> list:
  """The tool's answer to a row's turn: a length of its own (one longer than a prefill pass)."""
  n = (5, 70, 23)[(row + turn) % 3]
  return [int(t) for t in (row * 131 + turn * 17 + np.arange(n)) % CFG.vocab_size]


class FakeTools:
  """Turns whose tools answer `observation(row, turn)`: at the next poll, or for `slow` rows after
  `delay_s` of wall time (the engine decodes the other rows meanwhile). A row makes `calls[row]`
  calls (default TURNS), then its next turn end finishes it. Records what happened."""

  def __init__(self, slow=(), delay_s=0.0, calls=None):
    self.slow, self.delay_s, self.calls = set(slow), delay_s, calls or {}
    self.turn, self.pending, self.log = {}, {}, []
    self.lock = threading.Lock()

  def turn_ended(self, row, turn):
    t = self.turn.get(row, 0)
    self.turn[row] = t + 1
    if t >= self.calls.get(row, TURNS):
      self.log.append(("done", row, time.perf_counter()))
      return False
    due = time.perf_counter() + (self.delay_s if row in self.slow else 0.0)
    self.pending[row] = (due, observation(row, t))
    return True

  def observations(self, wait):
    while True:
      now = time.perf_counter()
      ready = {r: ids for r, (due, ids) in self.pending.items() if due <= now}
      if ready or not wait:
        break
      time.sleep(0.01)
    for r in ready:
      del self.pending[r]
      self.log.append(("observed", r, now))
    return ready

  def restart(self, row):
    self.turn.pop(row, None)
    self.pending.pop(row, None)


def run(turns, slots=6, pages=400, chunk=16, sparse=None, speculate=0, max_new=MAX_NEW, **kw):
  config = engine.EngineConfig(
    num_slots=slots, num_pages=pages, chunk_steps=chunk, speculate=speculate
  )
  extra = {} if sparse is None else dict(sparse=sparse, schedule=KVSchedule.fixed(4, page_size=4))
  return engine.run(
    PARAMS,
    CFG,
    engine.Requests(PROMPT, PROMPT_LEN, max_new, group_size=2),
    jax.random.PRNGKey(1),
    engine=config,
    sampling=sj.Sampling(eos_ids=EOS),
    turns=turns,
    **extra,
    **kw,
  )


def conversation_spans(out, row):
  """The observed spans of a row as [start, end) pairs, from the Rollout's mask."""
  mask = np.asarray(out.observed[row, : out.lengths[row]], np.int8)
  edges = np.flatnonzero(np.diff(np.concatenate([[0], mask, [0]])))
  return [tuple(map(int, p)) for p in edges.reshape(-1, 2)]


def assert_turns_are_the_tools(out):
  """Every observation follows a turn's EOS and is the tool's answer to that turn, and a row's
  model tokens end turns only where an observation follows or the row ends."""
  for b in range(len(PROMPT)):
    tokens, n = np.asarray(out.tokens[b]), int(out.lengths[b])
    spans = conversation_spans(out, b)
    assert len(spans) <= TURNS
    for t, (start, end) in enumerate(spans):
      assert tokens[start - 1] in EOS, (b, t)
      assert tokens[start:end].tolist() == observation(b, t)[: end - start]
    model = np.ones(n, bool)
    for start, end in spans:
      model[start:end] = False
    ends = [j for j in range(n) if model[j] and tokens[j] in EOS]
    assert ends == [start - 1 for start, _ in spans] + ([n - 1] if tokens[n - 1] in EOS else [])


@pytest.fixture(scope="module")
def reference():
  return run(FakeTools())


@pytest.mark.slow
def test_a_multi_turn_row_s_logprobs_are_the_teacher_forced_forward_over_its_conversation(
  reference,
):
  """Dense rows: every token a row sampled, the first after each observation included, has the
  log-prob the teacher-forced forward over prompt + turns + observations gives it; observations
  (prefilled in passes of OBSERVATION_CHUNK, some longer than one) carry log-prob 0."""
  out, _ = reference
  assert_turns_are_the_tools(out)
  spans = [conversation_spans(out, b) for b in range(len(PROMPT))]
  assert sum(len(s) for s in spans) >= 8  # most rows make several tool calls
  assert any(end - start > engine.OBSERVATION_CHUNK for s in spans for start, end in s)
  ref, valid = helpers.rescored_logprobs(PARAMS, CFG, PROMPT, PROMPT_LEN, out)
  sampled = np.asarray(valid) & ~out.observed
  np.testing.assert_allclose(
    np.where(sampled, out.logprobs, 0), np.where(sampled, ref, 0), atol=1e-4
  )
  assert np.all(out.logprobs[out.observed] == 0)


@pytest.mark.slow
def test_exact_mode_rows_across_turns_are_the_dense_policy_s_samples():
  """Exact mode (sparse drafts, dense verification): a multi-turn row's sampled tokens carry the
  dense teacher-forced log-probs over the whole conversation, and drafts never cross a turn's end
  (acceptance counts sampled tokens only: its alphas are NaN at observations)."""
  out, stats = run(FakeTools(), sparse=SparseConfig(page_size=4, dense_layers=1), speculate=2)
  assert_turns_are_the_tools(out)
  assert stats.rounds > 0 and stats.drafted > 0
  ref, valid = helpers.rescored_logprobs(PARAMS, CFG, PROMPT, PROMPT_LEN, out)
  sampled = np.asarray(valid) & ~out.observed
  np.testing.assert_allclose(
    np.where(sampled, out.logprobs, 0), np.where(sampled, ref, 0), atol=1e-4
  )
  assert np.all(np.isnan(out.alpha[out.observed]))


@pytest.mark.slow
def test_rows_are_the_same_whatever_the_slots_pool_or_chunk(reference):
  """Four slots, chunks of 5 and a pool that preempts rows (a preempted row's episode starts over,
  its tool calls made again): the same rows token for token."""
  out, stats = run(FakeTools(), slots=4, chunk=5, pages=18)
  assert stats.preemptions > 0
  np.testing.assert_array_equal(out.lengths, reference[0].lengths)
  np.testing.assert_array_equal(out.tokens, reference[0].tokens)
  np.testing.assert_array_equal(out.observed, reference[0].observed)
  np.testing.assert_allclose(out.logprobs, reference[0].logprobs, atol=1e-5)


@pytest.mark.slow
def test_a_row_waiting_on_a_slow_tool_does_not_hold_up_the_others():
  """Row 0 calls a tool that answers 2 s later, three times; the other rows call none: they decode
  to their ends while row 0 waits, before its first answer comes. Its rows are those of a fast
  tool."""
  calls = {row: 0 for row in range(1, len(PROMPT))}
  tools = FakeTools(slow={0}, delay_s=2.0, calls=calls)
  out, _ = run(tools)
  first_slow = min(t for what, row, t in tools.log if what == "observed" and row == 0)
  others_done = [t for what, row, t in tools.log if what == "done" and row != 0]
  assert len(others_done) >= 3 and max(others_done) < first_slow
  fast, _ = run(FakeTools(calls=calls))
  assert len(conversation_spans(out, 0)) == TURNS
  np.testing.assert_array_equal(out.tokens, fast.tokens)


@pytest.mark.slow
def test_observations_count_toward_max_new_and_are_cut_to_leave_a_sampled_token():
  """Rows of at most 60 tokens: an observation that does not fit is cut so that the row samples
  one token after it, and no row runs past its max_new tokens."""
  out, _ = run(FakeTools(), max_new=60)
  assert (out.lengths <= 60).all()
  cut = 0
  for b in range(len(PROMPT)):
    for t, (start, end) in enumerate(conversation_spans(out, b)):
      if end - start < len(observation(b, t)):
        cut += 1
        assert end == 59 and out.lengths[b] == 60 and not out.observed[b, 59]
  assert cut >= 1


@pytest.mark.slow
def test_lossy_sparse_rows_across_turns_are_the_sparse_teacher_forced_forward():
  """Lossy sparse rows: each sampled token's log-prob is the sparse teacher-forced forward's over
  the whole conversation, with each observation and the turn end before it read as dense context
  like the prompt (`context_BT`: programs.observe prefills them in one dense pass;
  step_schema.batch_from_rollout's `context`). Read as sampled tokens instead (sparse), the later
  layers' keys there differ, and so do the log-probs after them."""
  sparse = SparseConfig(page_size=4, dense_layers=1)
  out, _ = run(FakeTools(), sparse=sparse)
  assert_turns_are_the_tools(out)
  context = step_schema.batch_from_rollout(PROMPT, PROMPT_LEN, out, np.zeros(len(PROMPT))).context
  kw = dict(sparse=sparse, schedule=KVSchedule.fixed(4, page_size=4), prompt_len_B=PROMPT_LEN)
  ref, valid = helpers.rescored_logprobs(
    PARAMS, CFG, PROMPT, PROMPT_LEN, out, context_BT=context, **kw
  )
  sampled = np.asarray(valid) & ~out.observed
  np.testing.assert_allclose(
    np.where(sampled, out.logprobs, 0), np.where(sampled, ref, 0), atol=1e-4
  )
  as_sampled, _ = helpers.rescored_logprobs(PARAMS, CFG, PROMPT, PROMPT_LEN, out, **kw)
  assert np.max(np.abs(np.where(sampled, as_sampled - ref, 0))) > 1e-3


GROUPS_LEN = np.asarray([9, 20, 13, 6])  # 4 groups of 2 rows: 2 groups a process
ROWS_LEN = np.repeat(GROUPS_LEN, 2)
ROWS = np.repeat(np.random.RandomState(1).randint(1, CFG.vocab_size, (4, 21)), 2, axis=0) * (
  np.arange(21)[None] < ROWS_LEN[:, None]
)


def run_rows(lo: int, hi: int, mesh=None):
  """Rows [lo, hi) of ROWS, lossy sparse, row 1's tools 0.3 s slow, on `mesh` (None: no mesh)."""
  params = PARAMS
  if mesh is not None:
    shardings = sharding.param_shardings(PARAMS, mesh, sharding.ROLLOUT_RULES)
    params = sharding.place(PARAMS, shardings)
  sparse = dict(sparse=SparseConfig(page_size=4, dense_layers=1))
  with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
    out, _ = engine.run(
      params,
      CFG,
      engine.Requests(ROWS[lo:hi], ROWS_LEN[lo:hi], 120, group_size=2, first_row=lo),
      jax.random.PRNGKey(1),
      engine=engine.EngineConfig(num_slots=2, num_pages=100, chunk_steps=6),
      sampling=sj.Sampling(eos_ids=EOS),
      turns=FakeTools(slow={1}, delay_s=0.3),
      schedule=KVSchedule.fixed(4, page_size=4),
      **sparse,
    )
  return out


PROCESS = textwrap.dedent("""
    import sys, jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{sys.argv[2]}", 2, int(sys.argv[3]))
    import numpy as np
    from sparrow_jax import sharding
    from tests import test_multiturn_engine as t

    mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2)
    lo, hi = sharding.process_rows(sharding.rows(mesh), len(t.ROWS))
    out = t.run_rows(lo, hi, mesh)
    np.savez(sys.argv[1], lo=lo, tokens=out.tokens, logprobs=out.logprobs, observed=out.observed)
""")


@pytest.mark.slow
def test_a_process_runs_the_observe_pass_another_process_runs(monkeypatch):
  """With several processes each observe pass is agreed on (`engine._any_process`): a process
  whose rows have nothing left to write runs the pass beside one that has, which leaves its rows
  as they were. One process here, with a stand-in for another that has 3 more passes to run. (The
  two-process test below cannot catch a process skipping them: on its mesh the observe program
  has no collective across processes, so processes running different programs do not hang.)"""
  empty = []  # per pass: whether it wrote nothing (no slot of this process active)
  observe = engine.programs.observe
  monkeypatch.setattr(
    engine.programs,
    "observe",
    lambda *a, **k: empty.append(not np.asarray(a[4]["active"]).any()) or observe(*a, **k),
  )
  want = run_rows(0, len(ROWS))
  assert empty and not any(empty)  # alone, a process runs a pass only with tokens to write
  empty.clear()
  others = iter([True] * 3)
  asked = engine._any_process

  def any_process(flag):  # the other process: 3 passes after this one's have run out
    if flag or sys._getframe(1).f_code.co_name != "observe":
      return asked(flag)
    return next(others, False)

  monkeypatch.setattr(engine, "_any_process", any_process)
  got = run_rows(0, len(ROWS))
  assert sum(empty) == 3
  for name in ("tokens", "observed", "lengths"):
    np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
  np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)  # as the two-process test


@pytest.mark.nightly
def test_multi_turn_rows_on_two_processes_are_those_of_one_device(tmp_path):
  """2 processes x 2 devices (CPU collectives, a local coordinator), each playing its own rows'
  turns (process 0's row 1 waits on a slow tool while process 1's rows decode on or end): the
  rows are one device's, token for token. (The agreement on observe passes: the test above.)"""
  want = run_rows(0, len(ROWS))
  assert np.any(want.observed)
  parts = helpers.run_two_processes(PROCESS, tmp_path, timeout=300)
  assert [int(p["lo"]) for p in parts] == [0, 4]  # each process had its own rows
  for name in ("tokens", "observed"):
    np.testing.assert_array_equal(np.concatenate([p[name] for p in parts]), getattr(want, name))
  got = np.concatenate([p["logprobs"] for p in parts])
  np.testing.assert_allclose(got, want.logprobs, atol=1e-5)


@pytest.mark.slow
def test_partial_rollouts_carry_multi_turn_rows_through_a_saved_state(reference):
  """The three groups through engine.Partial in three calls that take one ended group each, the
  same turns throughout: rows cut mid-episode, waiting on a tool (the last two groups' tools
  answer 0.5 s late), are carried with their slots and pages. The state after the first call,
  through JSON, restored into a new Partial (its turns' progress copied), gives the other two
  calls: every row is the uncut rollout's, token for token, its observations where they were."""
  sampling = sj.Sampling(eos_ids=EOS)
  config = engine.EngineConfig(num_slots=6, num_pages=400, chunk_steps=16)
  first = engine.Partial(CFG, jax.random.PRNGKey(1), engine=config, sampling=sampling)
  tools = FakeTools(slow={2, 3, 4, 5}, delay_s=0.5)
  requests = engine.Requests(PROMPT, PROMPT_LEN, MAX_NEW, group_size=2)
  taken = [first.run(PARAMS, requests, groups=1, version=1, turns=tools)]
  meta, arrays, pool = first.state()
  meta = json.loads(json.dumps(meta))
  assert any(r["waiting"] for r in meta["rows"])  # a row cut while its tool runs
  resumed = engine.Partial(CFG, jax.random.PRNGKey(1), engine=config, sampling=sampling)
  resumed.restore((meta, arrays, pool))
  tools_again = FakeTools()
  tools_again.turn, tools_again.pending = dict(tools.turn), dict(tools.pending)
  for version in (2, 3):
    taken.append(resumed.run(PARAMS, None, groups=1, version=version, turns=tools_again))
  want = reference[0]
  keys = np.concatenate([k for _, _, k in taken])
  assert sorted(keys.tolist()) == list(range(len(PROMPT)))
  for rollout, _, k in taken:
    np.testing.assert_array_equal(rollout.lengths, want.lengths[k])
    np.testing.assert_array_equal(rollout.tokens, want.tokens[k])
    np.testing.assert_array_equal(rollout.observed, want.observed[k])
    np.testing.assert_allclose(rollout.logprobs, want.logprobs[k], atol=1e-5)
