"""The rollout engine: continuous batching over a page pool.

A fixed number of slots decode together in jitted chunks of `chunk_steps` steps; between chunks the
host scheduler (rollout/scheduler.py) frees the slots and pages of rows that ended and admits the
next rows. A GRPO group's prompt is prefilled once (`programs.prefill`) into pool pages its rows
share; a partial last prompt page is kept as a template and copied into each row's first page of its
own (`programs.copy_pages`). Rows take pages as they grow: before each chunk
(`programs.decode_chunk`) every running row gets the pages its next chunk can fill. Admission holds
back the pages the running rows need for `reserve_chunks` more chunks; if the pool still runs dry,
the row with the fewest generated tokens is preempted (its pages freed) and decoded again from its
first token when it is readmitted. With `drain_slots`, a rollout's last rows move to the first
slots and chunks decode only those.

Each row samples with its own key (`programs.row_key`), so its tokens and log-probs do not depend on
its slot, the number of slots, the chunk length, the admission order or a preemption: a preempted
row decodes the same tokens again.

`EngineConfig(static=True)` is the static batch in the same machinery, the baseline benchmarks
compare with: every row's pages allocated at its full length on admission, and rows admitted only
when every slot is free (waves; no refill).
"""

import dataclasses
import time
from typing import Any, Optional, Sequence

import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import numpy as np

from sparrow_jax import sharding
from sparrow_jax.attention import page_pool
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.model import qwen3
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.rollout import programs, sampler, scheduler
from sparrow_jax.rollout.programs import row_key
from sparrow_jax.rollout.scheduler import EngineConfig, EngineStats, Requests
from sparrow_jax.sparsity.schedule import BudgetTable, DraftPlan

__all__ = [
  "EngineConfig",
  "EngineStats",
  "Requests",
  "Partial",
  "row_key",
  "run",
  "generate",
  "full_batch",
]

DENSE_PAGE_SIZE = 16  # tokens per pool page in dense rollouts (sparse ones use SparseConfig's)
OBSERVATION_CHUNK = 64  # tokens of tool observations a pass of `programs.observe` prefills a row


def page_size(sparse: Optional[SparseConfig]) -> int:
  return DENSE_PAGE_SIZE if sparse is None else sparse.page_size


def pages_for_bytes(
  cfg: Qwen3Config,
  pool_bytes: float,
  page_size: int = 16,
  dtype=jnp.float32,
  page_score: str = "mean",
) -> int:
  """How many pages a pool of `pool_bytes` holds (keys, values and summaries of every layer)."""
  return int(pool_bytes // page_pool.page_bytes(cfg, page_size, dtype, page_score))


def _any_process(flag: bool) -> bool:
  """Whether `flag` holds on any process: every process then takes the same branch, so that they
  all enter the same jitted calls (a collective per call with several processes)."""
  if jax.process_count() == 1:
    return flag
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def _most_of_processes(n: int) -> int:
  """The largest of every process's n: every process then runs the same program."""
  if jax.process_count() == 1:
    return n
  return int(np.max(multihost_utils.process_allgather(np.asarray(n))))


def _budget(schedule, sparse, max_len: int) -> BudgetTable:
  """The BudgetTable over cached lengths 0..max_len of a schedule, or a BudgetTable built once by
  the caller (the trainer's, one cap for all its stages) as it is; its max_selected set (from the
  table where it is 0)."""
  if schedule is None:
    raise ValueError("sparse generation needs a `schedule` (e.g. KVSchedule.fixed(pages))")
  if isinstance(schedule, BudgetTable):
    if schedule.pages_by_len.shape[0] < max_len + 1:
      raise ValueError(
        f"the BudgetTable covers cached lengths up to "
        f"{schedule.pages_by_len.shape[0] - 1}, the rollout needs {max_len}"
      )
    table, budget = None, schedule
  else:
    table = sampler.budget_table(schedule, max_len, sparse)
    budget = BudgetTable(jnp.asarray(table))
  if budget.max_selected:
    return budget
  cap = sampler.max_selected_pages(
    sharding.to_host(budget.pages_by_len) if table is None else table
  )
  return budget.replace(max_selected=cap)


# Once per rollout rather than in every chunk: splitting copies the weights, which a chunk of a
# few steps would pay again each time.
_split_layers = jax.jit(qwen3.unstack_layers)


@dataclasses.dataclass(frozen=True)
class _Programs:
  """The compiled programs bound to one rollout's params and settings, fed this process's shards
  (with several processes, arrays of every shard are assembled from each process's part)."""

  params: Any
  lora: Any
  split: Any  # (params, lora) with their layers split (`qwen3.unstack_layers`): the chunks' weights
  cfg: Qwen3Config
  key: Any
  sampling: sampler.Sampling
  sparse: Optional[SparseConfig]
  budget: Optional[BudgetTable]
  steps: int
  speculate: int  # draft tokens per round (exact mode; the most, with the regime switch), 0: off
  rounds_of: Any  # exact mode's rounds per chunk of a draft count (EngineConfig.rounds_of)
  shards: int  # the pool's shards, every process's
  local: int  # this process's
  rows_sh: Any  # the rows' sharding on a mesh, else None

  @classmethod
  def of(cls, pool, **kwargs):
    mesh = jax.sharding.get_mesh()
    rows_sh = None if mesh.empty else sharding.rows(mesh)
    lo, hi = (0, pool.shards) if rows_sh is None else sharding.process_rows(rows_sh, pool.shards)
    return cls(shards=pool.shards, local=hi - lo, rows_sh=rows_sh, **kwargs)

  def to_global(self, x):
    if self.rows_sh is None:
      return x
    return sharding.from_local_rows(x, self.rows_sh, x.shape[0] // self.local * self.shards)

  def to_local(self, x):
    return np.asarray(x) if self.rows_sh is None else sharding.local_rows(x)

  def prefill(self, pool, sched: scheduler.Scheduler, planned):
    """Prefills the planned groups and hands their rows' first tokens to the scheduler."""
    *inputs, at = sched.prefill_inputs(planned)
    pool, token, logp, top = programs.prefill(
      self.params,
      None if self.speculate else self.lora,  # exact mode: the dense policy's first token
      pool,
      *map(self.to_global, inputs),
      self.key,
      cfg=self.cfg,
      sampling=self.sampling,
    )
    B, n = inputs[-1].shape
    top = None if top is None else tuple(self.to_local(x).reshape(B, n, -1) for x in top)
    sched.set_first(at, self.to_local(token), self.to_local(logp), top)
    return pool

  def observe(self, pool, sched: scheduler.Scheduler):
    """Prefills every observing row's observation, OBSERVATION_CHUNK tokens a pass, and hands the
    scheduler the token each row samples after it."""
    while True:
      slots, tokens, take, at = sched.observe_inputs(OBSERVATION_CHUNK)
      if not _any_process(bool(at)):  # a process whose observations are written passes nothing
        return pool
      pool, token, logp, top = programs.observe(
        self.params,
        None if self.speculate else self.lora,  # exact mode: the dense policy's token, as prefill
        pool,
        self.key,
        {k: self.to_global(v) for k, v in slots.items()},
        self.to_global(tokens),
        self.to_global(take),
        cfg=self.cfg,
        sampling=self.sampling,
      )
      top = None if top is None else tuple(self.to_local(x) for x in top)
      sched.finish_observe(at, take, self.to_local(token), self.to_local(logp), top)

  def copy(self, pool, pairs):
    return programs.copy_pages(pool, self.to_global(pairs[0]), self.to_global(pairs[1]))

  def decode(self, pool, slots, draft: int):
    """One chunk -> (pool, host outputs, n_gen and active after it, steps (rounds) run, and
    exact mode's per-slot counters, else None). draft: the most drafts a round of an exact-mode
    chunk runs (0: dense rounds only)."""
    if self.speculate and not draft:
      return self.dense_rounds(pool, slots)
    args = (*self.split, pool, self.budget, self.key)
    args += ({k: self.to_global(v) for k, v in slots.items()},)
    kw = dict(cfg=self.cfg, sparse=self.sparse, sampling=self.sampling)
    count = None
    if self.speculate:
      pool, after, out, steps_run, count = programs.speculative_chunk(
        *args, rounds=self.rounds_of(draft), draft=draft, **kw
      )
      count = {k: self.to_local(v) for k, v in count.items()}
    else:
      pool, after, out, steps_run = programs.decode_chunk(*args, steps=self.steps, **kw)
    out = {k: self.to_local(v) for k, v in out.items()}
    n_gen, active = self.to_local(after["n_gen"]), self.to_local(after["active"])
    return pool, out, n_gen, active, int(sharding.to_host(steps_run)), count

  def dense_rounds(self, pool, slots):
    """An exact-mode chunk whose rounds draft nothing, as `decode`: the dense policy's own decode
    program (no LoRA, every page), as fast as dense decoding. A round of no drafts draws its token
    from p_0 with the token's own key (`speculative.accept_round`), as a decode step does, so the
    tokens are those a speculative program's dense rounds give. Its counters and NaN alphas are
    made here: each step is a round that emits one token and drafts nothing."""
    args = (self.split[0], None, pool, None, self.key)
    args += ({k: self.to_global(v) for k, v in slots.items()},)
    kw = dict(cfg=self.cfg, sparse=None, sampling=self.sampling, steps=self.rounds_of(0))
    pool, after, out, steps_run = programs.decode_chunk(*args, **kw)
    out = {k: self.to_local(v) for k, v in out.items()}
    out["alpha"] = np.full(out["tokens"].shape, np.nan, np.float32)
    n_gen, active = self.to_local(after["n_gen"]), self.to_local(after["active"])
    emitted = n_gen - np.asarray(slots["n_gen"])
    count = _dense_round_counts(np.asarray(slots["length"]), emitted, self.cfg, pool.page_size)
    return pool, out, n_gen, active, int(sharding.to_host(steps_run)), count


def _dense_round_counts(length_B, emitted_B, cfg: Qwen3Config, page_size: int) -> dict:
  """Exact mode's per-slot counters (`programs.speculative_chunk`'s) of dense decode steps: row b
  ran emitted_B[b] rounds from length_B[b] cached tokens, each emitting one token, drafting
  nothing, and reading every cached page of every layer (as a dense round counts them)."""
  L = cfg.num_hidden_layers
  cached_BC = length_B[:, None] + np.arange(max(int(emitted_B.max(initial=0)), 1))[None]
  ran_BC = np.arange(cached_BC.shape[1])[None] < emitted_B[:, None]
  pages = lambda n: L * -(-n // page_size)
  zeros = np.zeros_like(emitted_B)
  return dict(
    rounds=emitted_B,
    emitted=emitted_B,
    drafted=zeros,
    judged=zeros,
    accepted=zeros,
    read=np.sum(np.where(ran_BC, pages(cached_BC), 0), axis=1).astype(np.float32),
    dense=np.sum(np.where(ran_BC, pages(cached_BC + 1), 0), axis=1).astype(np.float32),
    cached=np.sum(np.where(ran_BC, cached_BC, 0), axis=1),
    round_drafts=zeros,
  )


def _chunk_ran(draft: int, slots, n_gen_B, count) -> tuple:
  """(the draft count a chunk's rounds ran, or None, the mean cached length of its row-rounds),
  as the regime switch's clock files it (`EngineStats.time_chunk`).

  A chunk runs the program of `draft` drafts, the most its rows' rounds may take in it (the
  look-ahead, `Scheduler.drafts_ahead`); each round then runs the most drafts a running row asks
  for (`programs._round_drafts`), and always verifies draft + 1 positions. A round's cost is set by
  those two, not by any one row's k: so the chunk is a chunk of k = draft rounds exactly when every
  round ran all `draft` drafts, and is filed under it then. A round that ran fewer (rows short of
  the bin the look-ahead saw, or its drafting rows ended) is a shape no draft count prices (fewer
  draft steps than its verification's width): the chunk is not filed at all, as filing it under
  `draft` would price that count below what its rounds cost."""
  if count is None:  # a decode chunk of the dense engine: its rows step one token a step
    length_B = np.asarray(slots["length"])
    steps_B = np.asarray(n_gen_B) - np.asarray(slots["n_gen"])
    cached = steps_B * length_B + steps_B * (steps_B - 1) / 2
    return draft, float(np.sum(cached) / max(int(np.sum(steps_B)), 1))
  rounds = int(np.sum(count["rounds"]))
  cached = float(np.sum(count["cached"]) / max(rounds, 1))
  full = int(np.sum(count["round_drafts"])) == draft * rounds
  return (draft if full else None), cached


def run(
  params,
  cfg: Qwen3Config,
  requests: Requests,
  key,
  *,
  engine: EngineConfig = EngineConfig(),
  sampling: sampler.Sampling = sampler.Sampling(),
  sparse: Optional[SparseConfig] = None,
  schedule=None,
  lora=None,
  order: Optional[Sequence[int]] = None,
  draft_plan: Optional[DraftPlan] = None,
  turns: Optional[scheduler.Turns] = None,
):
  """Samples a completion for every request row through the engine.

  On a mesh (`jax.set_mesh`) every device of data x fsdp has its own pool of engine.num_pages pages
  and engine.num_slots slots, and a group runs on one device. With several processes each passes
  the rows its devices hold (`Requests.first_row`), schedules them on its own devices and gets them
  back; the processes agree (`_any_process`) on each flag the scheduler returns that decides
  whether a collective program runs. The pool keeps keys and values in the embedding's dtype.

  Args:
    params: the model's parameters (`init_params` / `load_hf`).
    cfg: the model's Qwen3Config.
    requests: the rows: right-padded prompts, their lengths, each row's max_new_B, the group size
      and the process's first row.
    key: the run's PRNG key.
    engine: the engine's slots, pool pages, chunk length and exact mode (EngineConfig).
    sampling: how tokens are drawn and rows end.
    sparse: as `generate`.
    schedule: as `generate`; a BudgetTable is used as is (its max_selected, when 0, from its
      largest budget rounded up to a power of two).
    lora: as `generate`.
    order: the order rows are admitted in (a permutation of the rows; default: row order); it
      changes nothing in the output.
    draft_plan: with engine.draft_switch, exact mode's drafts per position bin, capped at
      engine.speculate.
    turns: a multi-turn rollout's environments (`scheduler.Turns`, each process's over its own
      rows): a row whose turn ends (an EOS of sampling.eos_ids) may wait on a tool, keeping its
      slot and pages while the other rows decode; its observation's tokens are then prefilled
      into its own pages (`programs.observe`, run by every process when any has one) and it
      decodes on. Observations count toward max_new_B and are marked in the Rollout's
      `observed`.

  Returns:
    (sampler.Rollout, EngineStats): the rollout's arrays are host (numpy) arrays, [B, M] with
    M = max(max_new_B): the scheduler gathers them on the host, and the caller places them once
    where it needs them (the trainer on its mesh, `generate` on the context mesh).

  Raises:
    ValueError: a prompt width plus max_new_B beyond the model's positions, or a draft_plan given
      without engine.draft_switch (or sparse), or missing with it.
  """
  T, max_new = requests.prompt_BT.shape[1], int(requests.max_new_B.max())
  pool = _new_pool(params, cfg, engine, sparse)
  bound = (params, cfg, T + max_new, key, engine, sampling, sparse, schedule, lora, draft_plan)
  progs, draft_by_len = _bind(pool, *bound)
  sched = scheduler.Scheduler(
    engine, requests, page_size(sparse), progs.local, order, sampling.eos_ids, turns
  )
  _decode(pool, progs, sched, engine, draft_by_len)
  rollout = _rollout(sched, sampling)
  if turns is not None:
    rollout = rollout.replace(observed=sched.observed_mask())
  return rollout, sched.stats


class Partial:
  """A rollout that goes on across calls (partial rollouts): each `run` queues its new groups beside
  the rows still under way, which keep their slots and pages, decodes with the weights it is given
  until `groups` groups have ended on every process, and returns the oldest `groups` ended ones. A
  row cut by one call goes on in the next under that call's weights (its cache as it was written);
  each token records the version of the weights that sampled it, and its log-prob is theirs.

  Every row draws with the one `key` and its Requests row index (`first_row` + its place, which the
  caller keeps unique over calls), so with unchanged weights its tokens are those an uncut rollout
  draws, wherever the cuts fall."""

  def __init__(self, cfg: Qwen3Config, key, *, engine: EngineConfig, sampling, sparse=None):
    self.cfg, self.key, self.engine, self.sampling, self.sparse = cfg, key, engine, sampling, sparse
    self.pool, self.sched = None, None

  def run(
    self,
    params,
    requests,
    groups: int,
    version: int,
    *,
    schedule=None,
    lora=None,
    draft_plan=None,
    max_carry: int = 0,
    turns: Optional[scheduler.Turns] = None,
  ):
    """Queues `requests` (this process's new rows; None: none) and decodes; returns
    (sampler.Rollout of the `groups` oldest ended groups with their policy versions, EngineStats
    of this call, their rows' Requests row indices). max_carry > 0: a row that started that many
    versions ago ends in this call (decoding goes on until it has), so no row is carried longer
    and the oldest groups are the ones taken. turns: as `run`'s, over every row under way (the
    same environments each call: a carried row's episode goes on)."""
    if self.sched is None:
      if requests is None:
        raise ValueError("a partial rollout's first call needs requests")
      self.pool = _new_pool(params, self.cfg, self.engine, self.sparse)
      length = requests.prompt_BT.shape[1] + int(requests.max_new_B.max())
    else:
      length = self.sched.prompt_width + self.sched.max_new
    args = (self.cfg, length, self.key, self.engine, self.sampling, self.sparse, schedule, lora)
    progs, draft_by_len = _bind(self.pool, params, *args, draft_plan)
    if self.sched is None:
      Z, eos = page_size(self.sparse), self.sampling.eos_ids
      self.sched = scheduler.Scheduler(self.engine, requests, Z, progs.local, None, eos)
    elif requests is not None:
      self.sched.extend(requests)
    self.sched.turns = turns
    if len(self.sched.groups) < groups:
      raise ValueError(
        f"a partial rollout holds {len(self.sched.groups)} groups, fewer than the {groups} asked"
      )
    self.sched.version, self.sched.stats = version, EngineStats()
    enough = lambda: (
      len(self.sched.ended_groups()) >= groups
      and not (max_carry and self.sched.started_before(version - max_carry + 1))
    )
    self.pool = _decode(self.pool, progs, self.sched, self.engine, draft_by_len, enough)
    rows = self.sched.take(groups)
    keys = np.asarray([r.key for r in rows], np.int64)
    rollout = _rollout(self.sched, self.sampling, rows)
    if turns is not None:
      rollout = rollout.replace(observed=self.sched.observed_mask(rows))
    return rollout, self.sched.stats, keys

  def state(self):
    """(JSON, host arrays, the pool) of the rows under way (`scheduler.Scheduler.state`); None
    before the first call."""
    if self.sched is None:
      return None
    meta, arrays = self.sched.state()
    return meta, arrays, self.pool

  def abstract_pool(self, params):
    """The pool's shapes, dtypes and shardings on this run's devices: what a saved pool is
    restored onto."""
    return jax.eval_shape(lambda: _new_pool(params, self.cfg, self.engine, self.sparse))

  def restore(self, state) -> None:
    """The rows under way of `state()` back, the pool restored onto this run's devices."""
    meta, arrays, self.pool = state
    self.sched = scheduler.Scheduler.from_state(self.engine, self.sampling.eos_ids, meta, arrays)

  def rows_under_way(self) -> int:
    return 0 if self.sched is None else len(self.sched.rows)


def _new_pool(params, cfg: Qwen3Config, engine: EngineConfig, sparse):
  """Every device's empty page pool, in the embedding's dtype."""
  score = sparse.page_score if sparse is not None else "mean"
  return page_pool.init_pool(cfg, engine.num_pages, page_size(sparse), params["embed"].dtype, score)


def _bind(pool, params, cfg, length, key, engine, sampling, sparse, schedule, lora, draft_plan):
  """The programs of a rollout whose rows reach `length` tokens (prompt + max_new), and exact
  mode's drafts by cached length (None without the regime switch)."""
  if length > cfg.max_position_embeddings:
    raise ValueError(
      f"prompt width + max_new_B ({length}) exceeds max_position_embeddings "
      f"({cfg.max_position_embeddings})"
    )
  Z = page_size(sparse)
  max_len = max(-(-length // Z) * Z, length)
  budget = None if sparse is None else _budget(schedule, sparse, max_len)
  if (draft_plan is not None) != engine.draft_switch or (draft_plan and sparse is None):
    raise ValueError(
      "engine.run takes a draft_plan (with sparse) exactly when EngineConfig.draft_switch is on"
    )
  draft_by_len = None
  if draft_plan is not None:
    draft_by_len = np.minimum(draft_plan.k_by_len(max_len), engine.speculate)
    budget = budget.replace(draft_by_len=jnp.asarray(draft_by_len))
  progs = _Programs.of(
    pool,
    params=params,
    lora=lora,
    split=_split_layers(params, lora),
    cfg=cfg,
    key=key,
    sampling=sampling,
    sparse=sparse,
    budget=budget,
    steps=engine.chunk_steps,
    speculate=engine.speculate,
    rounds_of=engine.rounds_of,
  )
  return progs, draft_by_len


def _decode(pool, progs, sched, engine: EngineConfig, draft_by_len, enough=None):
  """Admits and decodes the scheduler's rows until every one has ended, or, with `enough`, until
  enough() holds on every process (a partial rollout's groups). Returns the pool."""
  while True:
    while True:  # admission rounds, until nothing more fits
      plan = sched.admit()
      if _any_process(any(plan.planned)):
        pool = progs.prefill(pool, sched, plan.planned)
      copies = sched.start(plan.rows)
      if _any_process(any(copies)):
        pool = progs.copy(pool, sched.copy_pairs(copies))
      if not _any_process(bool(plan.rows)):
        break
    if sched.turns is not None:
      pool = _observe(pool, progs, sched)
    sched.check_progress()
    if enough is not None and not _any_process(not enough()):
      break
    if not _any_process(bool(sched.running())):
      break
    if not _any_process(bool(sched.decoding())):
      continue  # every row waits on a tool: the next round takes their observations
    start = time.perf_counter()  # a chunk's cost: its program and the host's work around it
    sched.grow()
    width = sched.width(not engine.drain_slots or _any_process(sched.wants_all_slots()))
    slots, at = sched.chunk_inputs(width)
    draft = engine.speculate
    if draft_by_len is not None:
      draft = _most_of_processes(sched.drafts_ahead(draft_by_len))
    program = time.perf_counter()
    pool, out, n_gen, active, steps_run, count = progs.decode(pool, slots, draft)
    program = time.perf_counter() - program
    sched.finish_chunk(at, width, steps_run, out, n_gen, active, count)
    ran, cached = _chunk_ran(draft, slots, n_gen, count)
    sched.stats.time_chunk(ran, time.perf_counter() - start, steps_run, cached, start, program)
  return pool


def _observe(pool, progs, sched: scheduler.Scheduler):
  """Takes the observations that are ready (waiting for one when no row of any process can decode
  and none is queued that could start) into their rows' pages."""
  waiting = any(r.waiting for r in sched.running())
  idle = not _any_process(bool(sched.decoding())) and waiting
  ready = sched.turns.observations(wait=idle)
  if ready:
    sched.add_observations(ready)
    sched.grow()  # pages for the observations and the chunk after them
  if _any_process(bool(ready)):
    pool = progs.observe(pool, sched)
  return pool


def full_batch(
  rows: int,
  group_size: int,
  max_len: int,
  sparse: Optional[SparseConfig],
  chunk_steps: int = EngineConfig.chunk_steps,
  speculate: int = 0,
) -> EngineConfig:
  """Slots for a device's `rows` rows at once (whole GRPO groups: a group runs on one device) and a
  pool that holds them all at `max_len` tokens (their pages, a prompt template page per group, the
  trash page): no row waits or is preempted, and a row stops costing once it ends. `speculate` as
  `EngineConfig.speculate`."""
  groups = max(-(-rows // group_size), 1)
  slots = groups * group_size
  return EngineConfig(
    num_slots=slots,
    num_pages=slots * -(-max_len // page_size(sparse)) + groups + 1,
    chunk_steps=chunk_steps,
    speculate=speculate,
  )


def _local_rows(x, lo: int, hi: int) -> np.ndarray:
  """This process's rows [lo, hi) of a host array or a (possibly multi-process) global array."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return sharding.local_rows(x)
  return np.asarray(x)[lo:hi]


def generate(
  params,
  cfg: Qwen3Config,
  prompt_BT,
  prompt_len_B,
  key,
  *,
  max_new_tokens: int,
  sampling: sampler.Sampling = sampler.Sampling(),
  sparse: Optional[SparseConfig] = None,
  schedule=None,
  lora=None,
  prefill_group: int = 1,
  speculate: int = 0,
  turns: Optional[scheduler.Turns] = None,
) -> sampler.Rollout:
  """Samples completions for right-padded prompts through the engine, every row of a device in a
  slot at once and a pool that holds them all.

  Same key -> same output. On a mesh the prompts may be global arrays and the rollout comes back as
  global arrays with rows over data x fsdp (each process's own).

  Args:
    params: the model's parameters (`init_params` / `load_hf`).
    cfg: the model's Qwen3Config.
    prompt_BT: int [B, T] right-padded prompts: row b's prompt is prompt_BT[b, :prompt_len_B[b]].
    prompt_len_B: int [B] prompt lengths.
    key: the rollout's PRNG key; row b's tokens depend only on it and b.
    max_new_tokens: tokens each row may generate.
    sampling: temperature, top-p / top-k, EOS and pad ids, top log-probs. Rows stop at their first
      of `sampling.eos_ids` (kept in the completion).
    sparse: None for dense attention; a SparseConfig, with `schedule`, for block top-k decoding.
    schedule: the sparse budget: anything with `budget_pages(cached_len)`, checked by
      `budget_table`, or a BudgetTable used as is.
    lora: a model.lora.LoRA, applied in this actor only.
    prefill_group: n: the rows come in runs of n copies of one prompt (a GRPO group), prefilled
      once per run.
    speculate: k > 0 is exact mode (rollout/speculative.py): the sparse actor (sparse, schedule,
      lora) drafts k tokens a round and the dense policy verifies them, so every row is a sample of
      the dense policy (greedy: dense greedy) and its logprobs are the dense policy's. Needs
      `sparse`; 0 (default) is off.
    turns: a multi-turn rollout's environments (envs/turns.EnvTurns, rows by Requests row index):
      a row whose turn ends on a tool call waits for its observation, prefilled into its pages.

  Returns:
    sampler.Rollout, host (numpy) arrays, or global arrays on the context mesh when one is set:
    tokens [B, M] with M = max_new_tokens (pad after a row's end), logprobs [B, M]
    of the policy sampled, lengths [B]; top log-probs [B, M, k] with
    `sampling.num_top_logprobs`; with `speculate`, alpha [B, M], each drafted token's acceptance
    rate (NaN where nothing was drafted).

  Raises:
    ValueError: `speculate` without `sparse`.
  """
  if speculate and sparse is None:
    raise ValueError(
      f"generate(speculate={speculate!r}) drafts with the sparse actor: pass "
      "sparse=SparseConfig(...) (and a schedule), or speculate=0 for dense rollouts"
    )
  B, T = np.shape(prompt_BT)
  mesh = jax.sharding.get_mesh()
  rows_sh = None if mesh.empty else sharding.rows(mesh)
  lo, hi = (0, B) if rows_sh is None else sharding.process_rows(rows_sh, B)
  engine = full_batch(
    B // page_pool.row_shards(), prefill_group, T + max_new_tokens, sparse, speculate=speculate
  )
  requests = Requests(
    _local_rows(prompt_BT, lo, hi),
    _local_rows(prompt_len_B, lo, hi),
    max_new_tokens,
    group_size=prefill_group,
    first_row=lo,
  )
  rollout, _ = run(
    params,
    cfg,
    requests,
    key,
    engine=engine,
    sampling=sampling,
    sparse=sparse,
    schedule=schedule,
    lora=lora,
    turns=turns,
  )
  if rows_sh is None:
    return rollout
  return jax.tree_util.tree_map(
    lambda x: sharding.from_local_rows(np.asarray(x), rows_sh, B), rollout
  )


def _rollout(sched: scheduler.Scheduler, sampling: sampler.Sampling, rows=None) -> sampler.Rollout:
  """Host arrays of `rows` (default: every row); their policy versions with `rows`, a partial
  rollout's."""
  *outputs, versions = sched.outputs(sampling.num_top_logprobs, sampling.pad_id, rows)
  return sampler.Rollout(*outputs, versions=None if rows is None else versions)
