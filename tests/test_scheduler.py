"""The engine's host scheduler without JAX: seeded random request streams driven through the same
calls the engine makes, with a host stand-in for the compiled programs whose row tokens depend
only on (row, token index), as the engine's row keys make them. Checked at every step: pages are
never lost or shared, admission keeps the reserve, preemption takes the least advanced row, drain
moves the rows into the first slots, freed slots are refilled, and every row comes out as it
would alone."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from sparrow_jax.rollout import scheduler

EOS = (1,)
VOCAB = 40


def token(row: int, t: int) -> int:
  """Row `row`'s token t: a function of the row and the index only (the engine's row_key)."""
  return int(np.random.RandomState(1000 * row + t).randint(0, VOCAB))


def alone(max_new: int, row: int) -> list:
  """The row's tokens decoded by itself: up to its first EOS or max_new tokens."""
  out = []
  while len(out) < max_new:
    out.append(token(row, len(out)))
    if out[-1] in EOS:
      break
  return out


def fake_chunk(slots, steps: int):
  """The decode-chunk program on the host: (outputs, n_gen after, active after, steps run)."""
  n_gen, active = slots["n_gen"].copy(), slots["active"].copy()
  out = dict(tokens=np.zeros((len(n_gen), steps), np.int32), logprobs=np.zeros((len(n_gen), steps)))
  j = 0
  while j < steps and active.any():
    for i in np.flatnonzero(active):
      out["tokens"][i, j] = token(int(slots["row"][i]), int(n_gen[i]))
      out["logprobs"][i, j] = -n_gen[i]
      n_gen[i] += 1
      active[i] = out["tokens"][i, j] not in EOS and n_gen[i] < slots["max_new"][i]
    j += 1
  return out, n_gen, active, j


def owned_pages(sched) -> list:
  """Every page some row or group holds (with repeats, if any were handed out twice)."""
  pages = [p for r in sched.rows.values() for p in r.pages]
  for g in sched.groups.values():
    pages += g.shared + ([g.template] if g.template is not None else [])
  return pages


def check_pages(sched):
  held = owned_pages(sched)
  free = list(sched.shards[0].free_pages)
  assert len(held) == len(set(held)), "a page is held twice"
  assert sorted(held + free) == list(range(1, sched.engine.num_pages)), "a page is lost"
  for r in sched.running():
    table = sched.groups[r.group].shared + r.pages
    assert list(sched.shards[0].page_table[r.slot, : len(table)]) == table


def drive(engine, requests, order=None, refill=False):
  """The engine's loop on one shard with the host chunk -> the scheduler after the rollout."""
  sched = scheduler.Scheduler(engine, requests, 4, 1, order, EOS)
  while True:
    while True:
      free_before = len(sched.shards[0].free_pages)
      reserve_before, busy = sched.reserve(0), bool(sched.running())
      plan = sched.admit()
      assert not (engine.static and busy and plan.rows), "the static batch admits into an empty one"
      if any(plan.planned):
        *_, at = sched.prefill_inputs(plan.planned)
        first = np.asarray([[token(b, 0) for b in sched.groups[g].rows] for g in at])
        sched.set_first(dict(zip(at, range(len(at)))), first, np.zeros(first.shape))
      taken = free_before - len(sched.shards[0].free_pages)
      if plan.rows and not engine.static:  # admission kept the running rows' reserve
        assert free_before - taken >= reserve_before
      sched.start(plan.rows)
      check_pages(sched)
      if not plan.rows:
        break
    if refill:  # a free slot while rows wait: only once the pool is short
      assert not (sched.queue and None in sched.shards[0].slots)
    sched.check_progress()
    if not sched.running():
      break
    before = {r.index: len(r.tokens) for r in sched.running()}
    sched.grow()
    check_pages(sched)
    kept = {r.index for r in sched.running()}
    victims = set(before) - kept
    for v in victims:  # preempted: no survivor is less advanced
      assert all((before[v], -v) <= (before[k], -k) for k in kept)
    for r in sched.running():
      assert len(r.pages) >= sched.pages_needed(r, engine.chunk_steps)
    width = sched.width(sched.wants_all_slots())
    assert all(r.slot < width for r in sched.running())
    slots, at = sched.chunk_inputs(width)
    out, n_gen, active, steps_run = fake_chunk(slots, engine.chunk_steps)
    sched.finish_chunk(at, width, steps_run, out, n_gen, active)
  return sched


def random_stream(seed: int):
  rng = np.random.RandomState(seed)
  G = int(rng.choice([1, 2, 3]))
  groups = int(rng.randint(1, 6))
  lens = np.repeat(rng.randint(1, 14, groups), G)
  prompt = np.zeros((groups * G, 13), np.int32)
  max_new = rng.randint(1, 30, groups * G)
  return rng, scheduler.Requests(prompt, lens, max_new, group_size=G)


def random_engine(rng, requests):
  slots = int(rng.randint(1, 5))
  need = max(
    -(-(int(n) + int(m) - 1) // 4) + 2 for n, m in zip(requests.prompt_len_B, requests.max_new_B)
  )
  return scheduler.EngineConfig(
    num_slots=slots,
    num_pages=need + int(rng.randint(0, 12)),
    chunk_steps=int(rng.randint(1, 7)),
    reserve_chunks=int(rng.randint(0, 3)),
    static=bool(rng.rand() < 0.2),
    drain_slots=int(rng.randint(0, slots)),
  )


def test_scheduler_imports_no_jax():
  """scheduler.py alone (loaded by path, without the package's JAX imports) pulls in no JAX."""
  path = pathlib.Path(scheduler.__file__)
  code = (
    "import importlib.util, sys\n"
    f"spec = importlib.util.spec_from_file_location('scheduler', {str(path)!r})\n"
    "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    "assert not any(m == 'jax' or m.startswith('jax.') for m in sys.modules), 'jax imported'\n"
  )
  subprocess.run([sys.executable, "-c", code], check=True)


def test_random_streams_come_out_as_each_row_alone():
  """Any pool, slots, chunk, reserve, drain, static batch and admission order: every row's tokens
  are its tokens decoded alone and pages are never lost or shared (checked at each step), or the
  pool is reported too small; small pools preempt, a pool for every row never does and refills
  a freed slot in the same round while rows wait."""
  completed = preempted = 0
  for seed in range(32):
    rng, requests = random_stream(seed)
    engine = random_engine(rng, requests)
    try:
      sched = drive(engine, requests, rng.permutation(len(requests.max_new_B)))
    except ValueError as e:
      assert "too small" in str(e)
      continue
    for r in sched.rows.values():
      assert r.tokens == alone(r.max_new, r.index)
      assert r.done and not r.pages and r.slot is None
    assert sched.stats.useful_row_steps == sum(len(r.tokens) - 1 for r in sched.rows.values())
    assert sched.stats.peak_pages <= engine.num_pages - 1
    assert len(sched.shards[0].free_pages) == engine.num_pages - 1
    completed, preempted = completed + 1, preempted + sched.stats.preemptions
    large = scheduler.EngineConfig(num_slots=engine.num_slots, num_pages=1000, chunk_steps=3)
    assert drive(large, requests, refill=True).stats.preemptions == 0
  assert completed >= 24 and preempted > 0


def test_a_preemption_cycle_is_reported():
  """Row 2 needs the pages other groups' prompts hold while their rows wait: preempted at the same
  point forever, unless reported."""
  rng, requests = random_stream(10)
  with pytest.raises(ValueError, match="num_pages = 10 is too small: row 2 is preempted again"):
    drive(random_engine(rng, requests), requests, rng.permutation(10))


@pytest.mark.parametrize("reserve_chunks, admitted", [(2, [0]), (0, [0, 1])])
def test_admission_keeps_the_reserve(reserve_chunks, admitted):
  """Two one-row groups of a one-page prompt, 3 free pages once row 0 holds its own: row 1 needs 2
  pages now, row 0 two more within 3 chunks (reserve 2), none more within 1 (reserve 0)."""
  requests = scheduler.Requests(np.zeros((2, 4), np.int32), [4, 4], 13)
  engine = scheduler.EngineConfig(
    num_slots=2, num_pages=6, chunk_steps=4, reserve_chunks=reserve_chunks
  )
  plan = scheduler.Scheduler(engine, requests, 4).admit()
  assert [r.index for r in plan.rows] == admitted


def test_drain_decodes_only_the_rows_left():
  """Short rows and a long one: once it runs alone, chunks decode one slot (drive checks it sits
  in slot 0)."""
  long_row = next(b for b in range(3, 100) if len(alone(30, b)) > 10)
  B = long_row + 1
  requests = scheduler.Requests(np.zeros((B, 4), np.int32), [4] * B, [2] * long_row + [30])
  engine = scheduler.EngineConfig(num_slots=4, num_pages=60, chunk_steps=2, drain_slots=1)
  sched = drive(engine, requests)
  assert sched.rows[long_row].tokens == alone(30, long_row)
  assert sched.stats.computed_row_steps < 4 * sched.stats.decode_steps


def test_rows_in_flight_counts_rows_not_tokens():
  """A dense step keeps one token a row; an exact-mode round up to k + 1: rows in flight are
  row-steps (row-rounds) per step (round), whatever a round emits."""
  dense = scheduler.EngineStats(decode_steps=10, useful_row_steps=30)
  exact = scheduler.EngineStats(decode_steps=10, useful_row_steps=90, rounds=30, emitted=90)
  assert dense.rows_in_flight == 3.0 and exact.rows_in_flight == 3.0


def test_take_returns_the_oldest_ended_groups_when_a_newer_one_ended_first():
  """A partial rollout hands out the groups that ended in queue order, whichever ended first:
  group 2, queued last (`extend`), ends at its first token, then group 0 ends; group 1 runs on.
  take(1) is group 0, the next take(1) group 2, and then nothing while group 1 runs."""
  EOS_ID, OTHER = EOS[0], 2
  engine = scheduler.EngineConfig(num_slots=8, num_pages=100, chunk_steps=2)
  first = scheduler.Requests(np.zeros((4, 4), np.int32), [4] * 4, 6, group_size=2)
  sched = scheduler.Scheduler(engine, first, 4, 1, eos_ids=EOS)
  sched.extend(scheduler.Requests(np.zeros((2, 4), np.int32), [4] * 2, 1, group_size=2))
  plan = sched.admit()
  assert sorted(r.index for r in plan.rows) == list(range(6))
  *_, at = sched.prefill_inputs(plan.planned)
  first_tokens = np.full((len(at), 2), OTHER)
  sched.set_first(at, first_tokens, np.zeros(first_tokens.shape))
  sched.start(plan.rows)  # group 2's rows (max_new 1) end here
  assert sched.ended_groups() == [2]

  # One decode step: group 0's rows draw EOS, group 1's rows go on.
  slots, at = sched.chunk_inputs(engine.num_slots)
  n = len(slots["token"])
  out = dict(tokens=np.full((n, 1), OTHER, np.int32), logprobs=np.zeros((n, 1)))
  n_gen, active = slots["n_gen"].copy(), slots["active"].copy()
  for b, i in at.items():
    n_gen[i] += 1
    if sched.rows[b].group == 0:
      out["tokens"][i, 0], active[i] = EOS_ID, False
  sched.finish_chunk(at, engine.num_slots, 1, out, n_gen, active)
  assert sched.ended_groups() == [0, 2]

  assert [(r.index, r.group) for r in sched.take(1)] == [(0, 0), (1, 0)]
  assert [(r.index, r.group) for r in sched.take(1)] == [(4, 2), (5, 2)]
  assert sched.take(1) == [] and sorted(sched.groups) == [1]
