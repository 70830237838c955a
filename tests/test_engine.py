"""The rollout engine: its rows agree with the teacher-forced forward (greedy tokens are its argmax,
sampled log-probs its log-probs; dense and sparse), whatever the slots, chunk length, admission
order or pool size."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparrow_jax as sj
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.rollout import engine, programs, sampler
from sparrow_jax.sparsity.schedule import KVSchedule
from tests import helpers
from tests.helpers import tiny_config

CFG = tiny_config(num_hidden_layers=3)
PARAMS = sj.init_params(CFG, jax.random.PRNGKey(0), std=0.3)
SPARSE = SparseConfig(page_size=4, dense_layers=1)
SCHEDULE = KVSchedule.fixed(4, page_size=4)  # binding: rows reach 15+ pages
# three GRPO groups of two rows; 20 is a whole number of pages (no partial prompt page to copy)
GROUP_LEN = np.asarray([9, 20, 13])
PROMPT_LEN = np.repeat(GROUP_LEN, 2)
PROMPT = np.repeat(np.random.RandomState(0).randint(1, CFG.vocab_size, (3, 21)), 2, axis=0) * (
  np.arange(21)[None] < PROMPT_LEN[:, None]
)
MAX_NEW = np.asarray([40, 7, 33, 40, 1, 25])  # per row; row 4 ends at its first token
EOS = (3, 5)


def run(
  slots=6,
  chunk=64,
  pages=200,
  order=None,
  sparse=True,
  static=False,
  drain=0,
  max_new_tokens=MAX_NEW,
  schedule=SCHEDULE,
  **sampling,
):
  config = engine.EngineConfig(
    num_slots=slots, num_pages=pages, chunk_steps=chunk, static=static, drain_slots=drain
  )
  return engine.run(
    PARAMS,
    CFG,
    engine.Requests(PROMPT, PROMPT_LEN, max_new_tokens, group_size=2),
    jax.random.PRNGKey(1),
    engine=config,
    sampling=sj.Sampling(**{"eos_ids": EOS, **sampling}),
    order=order,
    **(dict(sparse=SPARSE, schedule=schedule) if sparse else {}),
  )


def assert_same_rows(a, b):
  np.testing.assert_array_equal(a.lengths, b.lengths)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


@pytest.fixture(scope="module")
def reference_run():
  return run()


@pytest.mark.slow
@pytest.mark.parametrize(
  "placement",
  [
    dict(slots=2, chunk=1),
    pytest.param(dict(slots=5), marks=pytest.mark.nightly),
    pytest.param(dict(chunk=7), marks=pytest.mark.nightly),
    pytest.param(dict(order=[4, 5, 0, 1, 2, 3]), marks=pytest.mark.nightly),
    dict(order=[3, 2, 5, 4, 1, 0], slots=2),
    dict(slots=5, chunk=4, drain=2),
  ],
)
def test_rows_do_not_depend_on_placement(reference_run, placement):
  out, stats = run(**placement)
  assert_same_rows(out, reference_run[0])
  assert stats.useful_row_steps == reference_run[1].useful_row_steps


def test_rows_end_at_eos_or_their_own_max_new_tokens(reference_run):
  out, _ = reference_run
  tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
  assert lengths[4] == 1 and (lengths <= MAX_NEW).all()
  for row, n, cap in zip(tokens, lengths, MAX_NEW):
    assert not set(row[: n - 1].tolist()) & set(EOS)
    assert n == cap or row[n - 1] in EOS
    assert (row[n:] == 0).all()
  assert (lengths > 10).sum() >= 2  # the sampled rows are long enough to exercise paging


def test_rollouts_come_back_as_host_arrays(reference_run):
  """The scheduler gathers rows on the host; the caller places them once (the trainer's step)."""
  out, _ = reference_run
  for name, x in out.__dict__.items():
    assert x is None or type(x) is np.ndarray, (name, type(x))


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [False, True])
def test_logprobs_equal_the_teacher_forced_forward(reference_run, sparse):
  out = reference_run[0] if sparse else run(sparse=False)[0]
  kw = dict(sparse=SPARSE, schedule=SCHEDULE, prompt_len_B=PROMPT_LEN) if sparse else {}
  ref, valid = helpers.rescored_logprobs(PARAMS, CFG, PROMPT, PROMPT_LEN, out, **kw)
  np.testing.assert_allclose(np.where(valid, out.logprobs, 0), np.where(valid, ref, 0), atol=1e-4)
  if sparse:  # the budget binds: dense re-scoring differs
    dense, _ = helpers.rescored_logprobs(PARAMS, CFG, PROMPT, PROMPT_LEN, out)
    assert float(np.abs(np.where(valid, out.logprobs - dense, 0)).max()) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("sparse", [False, True])
def test_greedy_rows_are_the_teacher_forced_argmax(sparse):
  """Each greedy token is the argmax of the teacher-forced forward at its position (dense, or sparse
  over the pages the engine's selection reads)."""
  out, _ = run(slots=3, chunk=7, sparse=sparse, temperature=0.0, max_new_tokens=40, eos_ids=())
  seq_BS, _ = sampler.full_sequences(PROMPT, PROMPT_LEN, out)
  kw = (
    dict(sparse=SPARSE, schedule=SCHEDULE, prompt_len_B=jnp.asarray(PROMPT_LEN)) if sparse else {}
  )
  logits = sj.forward(PARAMS, seq_BS, CFG, mask_BT=seq_BS != -1, **kw)
  before_token = PROMPT_LEN[:, None] - 1 + np.arange(40)[None]  # the position predicting token j
  argmax = np.take_along_axis(np.asarray(jnp.argmax(logits, -1)), before_token, 1)
  np.testing.assert_array_equal(np.asarray(out.lengths), 40)
  np.testing.assert_array_equal(np.asarray(out.tokens), argmax)


@pytest.mark.slow
def test_a_pool_too_small_for_every_row_completes_them_unchanged(reference_run):
  """24 pages: at most two rows near the cap at once besides the prompts, so rows are preempted
  and decoded again; no row is lost or truncated and none changes."""
  out, stats = run(pages=24, chunk=4)
  assert stats.preemptions > 0
  assert stats.peak_pages <= 23
  assert_same_rows(out, reference_run[0])


@pytest.mark.slow
def test_static_batch_same_rows_more_pages_less_occupancy(reference_run):
  out, static = run(static=True, slots=4, chunk=4)
  assert_same_rows(out, reference_run[0])
  _, continuous = run(slots=4, chunk=4)
  assert static.useful_row_steps == continuous.useful_row_steps
  assert static.computed_row_steps > continuous.computed_row_steps  # waves wait for their longest
  assert static.peak_pages > continuous.peak_pages  # full-length pages up front


def test_drain_slots_decode_only_the_rows_left(reference_run):
  """Once two rows are left the chunks decode two slots: fewer computed row-steps, same rows."""
  out, drained = run(slots=5, chunk=4, drain=2)
  assert_same_rows(out, reference_run[0])
  _, full = run(slots=5, chunk=4)
  assert drained.decode_steps == full.decode_steps
  assert drained.computed_row_steps < full.computed_row_steps
  with pytest.raises(ValueError, match="drain_slots .5. must be below num_slots .5."):
    engine.EngineConfig(num_slots=5, drain_slots=5)


@pytest.mark.slow
def test_top_logprobs_and_no_recompilation_across_lengths():
  out, _ = run(num_top_logprobs=3, slots=3, chunk=8)
  valid = np.arange(out.tokens.shape[1])[None] < np.asarray(out.lengths)[:, None]
  assert out.top_logprobs.shape == (6, 40, 3)
  assert np.all(np.where(valid, out.top_logprobs[..., 0] >= out.logprobs - 1e-6, True))
  before = programs.decode_chunk._cache_size()
  # other per-row lengths under the same cap, another schedule under the same max_selected
  run(num_top_logprobs=3, slots=3, chunk=8, max_new_tokens=MAX_NEW[::-1])
  run(num_top_logprobs=3, slots=3, chunk=8, schedule=KVSchedule.fixed(3, page_size=4))
  assert programs.decode_chunk._cache_size() == before


def test_bad_requests_rejected():
  with pytest.raises(ValueError, match="num_pages = 8 cannot hold row 0"):
    run(pages=8)
  with pytest.raises(ValueError, match="EngineConfig.num_slots"):
    engine.EngineConfig(num_slots=0)
  with pytest.raises(ValueError, match="Requests.group_size = 3: the rows are not runs of 3"):
    engine.Requests(PROMPT, PROMPT_LEN, 3, group_size=3)
  with pytest.raises(ValueError, match=r"Requests.max_new_B \(max_new_tokens.*\) must be positive"):
    engine.Requests(PROMPT, PROMPT_LEN, 0)
  with pytest.raises(ValueError, match="Sampling.top_p must be in"):
    sj.Sampling(top_p=0.0)
  with pytest.raises(ValueError, match="permutation"):
    run(order=[0, 1, 2])


def partial_rows(params2=None):
  """Six groups through engine.Partial in three calls that take two ended groups each: groups
  0-3 queued first (row indices 0-7), 4-5 at the second call (row indices 20-23), nothing new at
  the third; the second and third calls sample with params2 (default: the same weights) as
  versions 2 and 3. Returns each call's (rollout, row indices) and the uncut rollout of the twelve
  rows by row index."""
  prompt, prompt_len, max_new = (
    np.tile(x, (2,) + (1,) * (x.ndim - 1)) for x in (PROMPT, PROMPT_LEN, MAX_NEW)
  )
  requests = lambda lo, hi, first: engine.Requests(
    prompt[lo:hi], prompt_len[lo:hi], max_new[lo:hi], group_size=2, first_row=first
  )
  config = engine.EngineConfig(num_slots=4, num_pages=200, chunk_steps=4)
  sampling = sj.Sampling(eos_ids=EOS)
  partial = engine.Partial(CFG, jax.random.PRNGKey(1), engine=config, sampling=sampling)
  calls = []
  for version, (params, new) in enumerate(
    [
      (PARAMS, requests(0, 8, 0)),
      (params2 or PARAMS, requests(8, 12, 20)),
      (params2 or PARAMS, None),
    ],
    1,
  ):
    rollout, _, keys = partial.run(params, new, groups=2, version=version)
    calls.append((rollout, keys))
  uncut = {}
  for lo, hi, first in ((0, 8, 0), (8, 12, 20)):
    rollout, _ = engine.run(
      PARAMS, CFG, requests(lo, hi, first), jax.random.PRNGKey(1), engine=config, sampling=sampling
    )
    uncut.update({first + i: jax.tree.map(lambda x: x[i], rollout) for i in range(hi - lo)})
  return calls, uncut


def carried_spans(max_carry: int) -> list:
  """The three groups through engine.Partial in three calls that take one ended group each
  (versions 1-3, the same weights): the versions each taken row's tokens span."""
  requests = engine.Requests(PROMPT, PROMPT_LEN, MAX_NEW, group_size=2)
  config = engine.EngineConfig(num_slots=4, num_pages=200, chunk_steps=4)
  partial = engine.Partial(
    CFG, jax.random.PRNGKey(1), engine=config, sampling=sj.Sampling(eos_ids=EOS)
  )
  spans = []
  for version in (1, 2, 3):
    new = requests if version == 1 else None
    rollout, _, _ = partial.run(PARAMS, new, groups=1, version=version, max_carry=max_carry)
    spans += [int(np.ptp(row[:n])) for row, n in zip(rollout.versions, rollout.lengths)]
  return spans


@pytest.mark.slow
def test_a_carry_bound_ends_a_row_before_it_spans_more_versions():
  """max_carry = 1: a row started by an earlier call ends in the call it was carried into (that
  call decodes on until it has), so no row's tokens span more than two versions; without the
  bound a long row spans three."""
  assert max(carried_spans(0)) == 2
  assert max(carried_spans(1)) == 1


@pytest.mark.slow
def test_partial_rollouts_carry_cut_rows_over_calls_with_every_token_once():
  """Rows cut when a call has its groups go on in the next call on the pages they hold: every row
  comes out once, whole groups at a time; with unchanged weights each row is the uncut rollout's
  row of its key, token for token; each token carries the version of the call that sampled it, and
  some row carries two. With new weights from the second call, what the first sampled is kept."""
  calls, uncut = partial_rows()
  keys = np.concatenate([k for _, k in calls])
  assert sorted(keys.tolist()) == sorted(uncut)
  assert all(np.all(k.reshape(-1, 2)[:, 0] // 2 == k.reshape(-1, 2)[:, 1] // 2) for _, k in calls)
  carried = 0
  for call, (rollout, k) in enumerate(calls, 1):
    assert_same_rows(rollout, jax.tree.map(lambda *x: np.stack(x), *[uncut[i] for i in k]))
    for row, n in zip(rollout.versions, rollout.lengths):
      assert (
        np.all(row[n:] == -1)
        and np.all(np.diff(row[:n]) >= 0)
        and 1 <= row[0] <= row[n - 1] <= call
      )
      carried += row[0] < call
  assert carried > 0, "no row was cut"

  other = jax.tree.map(lambda x: x * 1.5, PARAMS)
  changed, _ = partial_rows(other)
  versions = set()
  for rollout, k in changed:
    for i, (row, n) in enumerate(zip(rollout.versions, rollout.lengths)):
      first = int(np.sum(row[:n] == 1))  # what the first weights sampled is the uncut prefix
      np.testing.assert_array_equal(rollout.tokens[i, :first], uncut[k[i]].tokens[:first])
      versions.add(tuple(np.unique(row[:n])))
  assert (1, 2) in versions  # a row the new weights finished
