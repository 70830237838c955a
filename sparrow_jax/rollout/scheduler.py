"""The rollout engine's host scheduler: which rows run in which slots on which pool pages.

Plain host code (numpy, no JAX), so the scheduling policy is tested without compiling anything
(tests/test_scheduler.py). The engine (rollout/engine.py) asks it what to run, runs the compiled
programs (rollout/programs.py) and hands their results back:

  admit()          plans admissions: rows into free slots, new groups onto a device, pages taken
  prefill_inputs() the planned groups' prompts and pages, as the prefill program takes them
  set_first()      the first token each prefilled row sampled
  start()          the admitted rows restarted and placed; the prompt-template page copies
  grow()           pages for every running row's next chunk, preempting the least advanced if short
  width() compact() the slots a chunk decodes (all, or `drain_slots` once few rows are left)
  chunk_inputs()   the slots' state, as the decode-chunk program takes it
  finish_chunk()   the chunk's tokens appended, ended rows released

A partial rollout (`extend`, `take`) goes on across calls: new groups join the rows still under
way, which keep their slots and pages, and the first groups to end are taken out.

Every decision that decides whether a collective program runs is returned as a flag: with several
processes the engine agrees on it across processes before it acts (each process schedules only
its own devices' shards).
"""

import collections
import dataclasses
from typing import Optional, Protocol, Sequence

import numpy as np

TRASH_PAGE = 0  # page_pool.TRASH_PAGE: what free slots and table padding point at


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  num_slots: int = 8  # rows decoding together: the decode step's batch
  num_pages: int = 1024  # pages in the pool, page_pool.TRASH_PAGE included (`pages_for_bytes`)
  chunk_steps: int = 16  # decode steps per jitted chunk; the scheduler runs between chunks
  reserve_chunks: int = 2  # admission keeps back the pages running rows fill in this many chunks
  static: bool = False  # the static batch: full-length pages, admission only into an empty batch
  # Once every device runs at most this many rows, chunks decode that many slots only (the rows
  # moved to the first slots), so a rollout's last long rows stop paying for the empty slots
  # beside them. 0: off. A second compiled decode program, built on first use.
  drain_slots: int = 0
  # Exact mode (rollout/speculative.py): each round the sparse policy drafts this many tokens and
  # the dense policy verifies them in one pass, so rows are the dense policy's samples; a chunk
  # runs chunk_steps // (speculate + 1) rounds (at least one). 0: off (rows sampled as decoded).
  speculate: int = 0
  # Exact mode's regime switch (`engine.run`'s draft_plan): each row-round drafts the plan's k at
  # its cached length (at most speculate; 0: one dense step), and each chunk runs the program of
  # the most drafts a round of it can run (one compiled program per draft count, built on first
  # use; 0: chunk_steps dense rounds).
  draft_switch: bool = False

  def __post_init__(self):
    for name, low in (
      ("num_slots", 1),
      ("num_pages", 2),
      ("chunk_steps", 1),
      ("reserve_chunks", 0),
      ("drain_slots", 0),
      ("speculate", 0),
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or value < low:
        raise ValueError(f"EngineConfig.{name} must be an int >= {low}, got {value!r}")
    if self.draft_switch and not self.speculate:
      raise ValueError("EngineConfig.draft_switch needs speculate > 0 (the most drafts a round)")
    if self.drain_slots >= self.num_slots:
      raise ValueError(
        f"EngineConfig.drain_slots ({self.drain_slots}) must be below num_slots "
        f"({self.num_slots}), or 0 (off)"
      )

  @property
  def chunk_rounds(self) -> int:
    """Speculative rounds per chunk."""
    return self.rounds_of(self.speculate)

  def rounds_of(self, draft: int) -> int:
    """Rounds of `draft` drafts per chunk (dense rounds, draft 0: chunk_steps)."""
    return max(self.chunk_steps // (draft + 1), 1)

  @property
  def chunk_tokens(self) -> int:
    """The most positions a row's chunk writes past its cache (and tokens it may advance)."""
    if self.draft_switch:  # dense rounds, or fewer drafts: at most this (rounds_of)
      return max(self.chunk_steps, self.speculate + 1)
    if self.speculate:
      return self.chunk_rounds * (self.speculate + 1)
    return self.chunk_steps


@dataclasses.dataclass
class EngineStats:
  decode_steps: int = 0  # decode steps run (every slot computes in each)
  chunks: int = 0
  useful_row_steps: int = 0  # decoded tokens the rollout keeps (a preempted row's are not)
  computed_row_steps: int = 0  # slots decoded x decode steps
  preemptions: int = 0
  peak_pages: int = 0  # most pool pages in use at once
  # Speculative rollouts: row-rounds run, tokens they emitted, drafts run,
  # drafts judged (those at the offsets of emitted tokens: the accepted ones and the rejected one
  # a residual replaced; not the bonus, nor drafts past a rejection or a cut by EOS or max_new) and
  # accepted, and the KV pages (x layers) the rounds read, drafts and verification together, next
  # to what dense decoding of the same tokens reads.
  rounds: int = 0
  emitted: int = 0
  drafted: int = 0
  judged: int = 0
  accepted: int = 0
  kv_pages_read: float = 0.0
  kv_pages_dense: float = 0.0
  # Each timed chunk by the draft count its rounds ran (0: dense rounds): [wall seconds per round
  # (decode step), the host's scheduling around its program included (a chunk of few long rounds
  # pays it over fewer tokens), the mean cached length of its row-rounds, the perf_counter second it
  # started]: what exact mode's regime switch prices rounds by (`round_timings`), each at its own
  # length. A clock, so two rollouts' stats compare equal without it.
  chunk_rounds: dict = dataclasses.field(default_factory=dict, compare=False)
  # The perf_counter second until which the training loop ran its step (the update, the hooks)
  # beside this rollout, sampled ahead in its thread; None: nothing ran beside it. A chunk started
  # before it shared the machine with that step, so its clock is kept apart (`round_timings`).
  beside_until: Optional[float] = dataclasses.field(default=None, compare=False)
  # Wall seconds of the decode chunks, the host's work around each included (prefills, copies and
  # observations not): what a rollout's decode rate is measured by. A clock, as chunk_rounds.
  decode_seconds: float = dataclasses.field(default=0.0, compare=False)
  # Of those, the seconds inside the decode programs' calls (dispatch to host outputs): the rest
  # is the host's scheduling between chunks. A clock, as chunk_rounds.
  program_seconds: float = dataclasses.field(default=0.0, compare=False)

  def state(self) -> dict:
    """The counters as JSON (a checkpoint's): the clock's draft counts become string keys."""
    state = dataclasses.asdict(self)
    state["chunk_rounds"] = {str(k): v for k, v in self.chunk_rounds.items()}
    return state

  @classmethod
  def from_state(cls, state: dict) -> "EngineStats":
    clock = {int(k): [list(c) for c in v] for k, v in state["chunk_rounds"].items()}
    return cls(**{**state, "chunk_rounds": clock})

  def time_chunk(
    self,
    draft: Optional[int],
    seconds: float,
    rounds: int,
    cached_len: float,
    started: float,
    program_seconds: float = 0.0,
  ) -> None:
    """Files a chunk of `rounds` rounds of `draft` drafts each (None: rounds no draft count
    prices, not filed) that ran at `cached_len` cached tokens a row-round on average, taking
    `seconds`, `program_seconds` of them in its program."""
    self.decode_seconds += seconds
    self.program_seconds += program_seconds
    if rounds and draft is not None:
      self.chunk_rounds.setdefault(draft, []).append([seconds / rounds, cached_len, started])

  def round_timings(self, beside: bool = False) -> dict:
    """{draft count: [(seconds per round, mean cached length), ...]} of its chunks but its first,
    which may have compiled its program: those that ran beside the loop's step (`beside_until`),
    or those that ran alone."""
    until = -np.inf if self.beside_until is None else self.beside_until
    timings = {}
    for k, chunks in self.chunk_rounds.items():
      kept = [(s, n) for s, n, started in chunks[1:] if (started < until) == beside]
      if kept:
        timings[k] = kept
    return timings

  def timed_beside(self) -> float:
    """The share of the timed chunks (each count's first aside) that ran beside the loop's step
    (NaN: none timed)."""
    alone, beside = self.round_timings(), self.round_timings(beside=True)
    count = lambda t: sum(len(v) for v in t.values())
    total = count(alone) + count(beside)
    return count(beside) / total if total else float("nan")

  @property
  def accepted_per_round(self) -> float:
    """Tokens a row-round emits on average: accepted drafts plus the residual or bonus token."""
    return self.emitted / max(self.rounds, 1)

  @property
  def draft_acceptance(self) -> float:
    """Accepted drafts over judged ones: the sampled counterpart of the drafts' mean alpha (NaN
    when no draft was judged)."""
    return self.accepted / self.judged if self.judged else float("nan")

  @property
  def occupancy(self) -> float:
    return self.useful_row_steps / max(self.computed_row_steps, 1)

  @property
  def rows_in_flight(self) -> float:
    """Rows decoding at once, on average: kept tokens per decode step; in exact mode row-rounds per
    round (a round emits up to k + 1 tokens a row: its tokens would count a row several times)."""
    row_steps = self.rounds if self.rounds else self.useful_row_steps
    return row_steps / max(self.decode_steps, 1)


@dataclasses.dataclass(frozen=True, eq=False)
class Requests:
  """The rows a rollout samples, host arrays: right-padded prompts (row b's is
  prompt_BT[b, :prompt_len_B[b]]) in runs of `group_size` copies of one prompt (GRPO groups, each
  prefilled once)."""

  prompt_BT: np.ndarray  # [B, T] int32
  prompt_len_B: np.ndarray  # [B] int32 in [1, T]
  max_new_B: np.ndarray  # [B] tokens each row may generate (an int: the same for every row)
  group_size: int = 1
  # With several processes, each passes its own rows (`sharding.process_rows`) and the index of
  # its first row in the whole batch: the rows' keys are global.
  first_row: int = 0

  def __post_init__(self):
    prompt_BT = np.asarray(self.prompt_BT, np.int32)
    B, T = prompt_BT.shape
    prompt_len_B = np.asarray(self.prompt_len_B, np.int32)
    max_new_B = np.broadcast_to(np.asarray(self.max_new_B, np.int32), (B,)).copy()
    for name, value in (("prompt_BT", prompt_BT), ("prompt_len_B", prompt_len_B)):
      object.__setattr__(self, name, value)
    object.__setattr__(self, "max_new_B", max_new_B)
    if prompt_len_B.shape != (B,) or prompt_len_B.min() < 1 or prompt_len_B.max() > T:
      raise ValueError(
        f"Requests.prompt_len_B must be [{B}] lengths in [1, {T}] (the prompt width), got "
        f"{prompt_len_B.tolist()}"
      )
    if max_new_B.min() < 1:
      raise ValueError(
        f"Requests.max_new_B (max_new_tokens: one per row or one for all) must be positive, "
        f"got {max_new_B.tolist()}"
      )
    g = self.group_size
    if g < 1 or B % g:
      raise ValueError(f"Requests.group_size must be >= 1 and divide the {B} rows, got {g}")
    runs = lambda x: x.reshape(-1, g, *x.shape[1:])
    if not (
      np.all(runs(prompt_BT) == runs(prompt_BT)[:, :1])
      and np.all(runs(prompt_len_B) == runs(prompt_len_B)[:, :1])
    ):
      raise ValueError(f"Requests.group_size = {g}: the rows are not runs of {g} identical prompts")


@dataclasses.dataclass
class Row:
  index: int  # the row's index in the scheduler: its place in the output
  key: int  # the row's index in its key (`programs.row_key`): global over processes and calls
  group: int
  prompt_len: int
  max_new: int
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  top: list = dataclasses.field(default_factory=list)
  alpha: list = dataclasses.field(default_factory=list)  # speculative rollouts
  versions: list = dataclasses.field(default_factory=list)  # each token's policy version
  pages: list = dataclasses.field(default_factory=list)  # its own pool pages, in logical order
  first: Optional[tuple] = None  # (token, logp, top, version) sampled at its group's prefill
  slot: Optional[int] = None  # its slot on its group's shard while it runs
  done: bool = False
  # Multi-turn rows (`Turns`): the [start, end) spans of `tokens` that are tool observations
  # (context, not sampled), whether the row waits on a tool (it keeps its slot and pages but does
  # not decode), and how many of its last tokens are still to be prefilled (its last sampled token
  # and the observation after it).
  observed: list = dataclasses.field(default_factory=list)
  waiting: bool = False
  unwritten: int = 0

  def turn_start(self) -> int:
    """Where the row's current turn starts in `tokens`: after its last observation."""
    return self.observed[-1][1] if self.observed else 0


@dataclasses.dataclass
class Group:
  rows: list
  prompt: np.ndarray  # [T] the prompt, right-padded to whole pages
  shard: Optional[int] = None  # the device whose pool holds its prompt (set at its prefill)
  shared: list = dataclasses.field(default_factory=list)  # full prompt pages, shared by the rows
  template: Optional[int] = None  # the partial last prompt page
  unfinished: int = 0


class Shard:
  """One device's slots and free pages."""

  def __init__(self, engine: EngineConfig, max_pages_per_row: int):
    self.free_pages = collections.deque(range(1, engine.num_pages))
    self.slots = [None] * engine.num_slots
    self.page_table = np.zeros((engine.num_slots, max_pages_per_row), np.int32)


@dataclasses.dataclass
class Admission:
  """One admission round's plan: the groups each shard prefills, the rows admitted (slots held,
  pages taken)."""

  planned: list  # [shards] lists of group indices
  rows: list  # Rows


class Turns(Protocol):
  """A multi-turn rollout's environments, as the scheduler calls them (rows by their key, the
  Requests row index): a row whose turn ends (its EOS) may wait on a tool, keeping its slot and
  pages while the other rows decode, and goes on after the observation's tokens."""

  def turn_ended(self, row: int, turn: list) -> bool:
    """The row's turn ended with these tokens: True if it now waits on an observation (a tool call
    was submitted), False if the row is done. Must not block."""

  def observations(self, wait: bool) -> dict:
    """{row: observation token ids} of the rows whose observations are ready; with `wait`, blocks
    until one is (no row can decode until then)."""

  def restart(self, row: int) -> None:
    """The row decodes again from its first token (admitted, or readmitted after a preemption):
    its episode starts over, and an observation it waited on is never delivered."""


class Scheduler:
  """Every shard's slots and pages for one rollout of `requests` (this process's rows).

  page_size: tokens per pool page; shards: this process's pool shards (devices); order: the
  order rows are admitted in (a permutation of the rows; default: row order); eos_ids: tokens
  that end a row (a turn, with `turns`); turns: the environments of a multi-turn rollout."""

  def __init__(
    self,
    engine: EngineConfig,
    requests: Requests,
    page_size: int,
    shards: int = 1,
    order: Optional[Sequence[int]] = None,
    eos_ids: Sequence[int] = (),
    turns: Optional[Turns] = None,
  ):
    T = requests.prompt_BT.shape[1]
    self.engine, self.Z, self.eos_ids, self.turns = engine, page_size, tuple(eos_ids), turns
    self.group_size, self.prompt_width = requests.group_size, T
    self.max_new = int(requests.max_new_B.max())
    self.max_pages_per_row = -(-(T + self.max_new) // page_size)
    # groups a device prefills per prefill call
    self.per_prefill = max(1, engine.num_slots // self.group_size)
    self.rows, self.groups = {}, {}  # by index, in the order they came
    self.queue = collections.deque()
    self.shards = [Shard(engine, self.max_pages_per_row) for _ in range(shards)]
    self.stats = EngineStats()
    self.version = 0  # the policy version the tokens sampled now are recorded with
    self._preempted = set()  # states preempted from (`_check_not_cycling`)
    self.extend(requests, order)

  def extend(self, requests: Requests, order: Optional[Sequence[int]] = None):
    """Queues the rows of `requests` (in `order`, a permutation of them; default: row order)
    after the ones it holds, as rows and groups numbered on from theirs."""
    B, T = requests.prompt_BT.shape
    n, Z = requests.group_size, self.Z
    if (n, T) != (self.group_size, self.prompt_width) or requests.max_new_B.max() > self.max_new:
      raise ValueError(
        f"a partial rollout's new rows must have its group size {self.group_size}, prompt width "
        f"{self.prompt_width} and at most {self.max_new} new tokens, got {n}, {T}, "
        f"{requests.max_new_B.max()}"
      )
    b0 = max(self.rows, default=-1) + 1
    g0 = max(self.groups, default=-1) + 1
    prompt_BT = np.pad(requests.prompt_BT, ((0, 0), (0, -T % Z)))  # whole pages
    for b in range(B):
      row = Row(
        b0 + b,
        requests.first_row + b,
        g0 + b // n,
        *map(int, (requests.prompt_len_B[b], requests.max_new_B[b])),
      )
      need = -(-(row.prompt_len + row.max_new - 1) // Z) + 1
      if need > self.engine.num_pages - 1:  # a row that cannot fit alone would wait forever
        raise ValueError(
          f"EngineConfig.num_pages = {self.engine.num_pages} cannot hold row {b} "
          f"({row.prompt_len} prompt + {row.max_new} new tokens need {need} pages "
          f"with the trash page and a prompt template)"
        )
      self.rows[row.index] = row
    for g in range(B // n):
      rows = list(range(b0 + g * n, b0 + (g + 1) * n))
      self.groups[g0 + g] = Group(rows, prompt_BT[g * n], unfinished=n)
    order = list(range(B)) if order is None else [int(b) for b in order]
    if sorted(order) != list(range(B)):
      raise ValueError(f"order must be a permutation of the {B} rows, got {order}")
    self.queue.extend(b0 + b for b in order)

  # -- pages and slots

  def shared_count(self, row) -> int:
    return row.prompt_len // self.Z

  def pages_needed(self, row, steps_ahead: int, n_gen: Optional[int] = None) -> int:
    """Own pages the row needs to hold its cache `steps_ahead` decode steps from now, with n_gen
    tokens generated (default: its own count), capped at its last cached token (the final sampled
    token is never appended); the static batch takes them all at once."""
    cached = row.prompt_len + (len(row.tokens) if n_gen is None else n_gen) - 1
    last = row.prompt_len + row.max_new - 1
    horizon = last if self.engine.static else min(cached + steps_ahead, last)
    return -(-horizon // self.Z) - self.shared_count(row)

  def running(self, shard=None) -> list:
    shards = range(len(self.shards)) if shard is None else (shard,)
    return [self.rows[i] for r in shards for i in self.shards[r].slots if i is not None]

  def decoding(self, shard=None) -> list:
    """The running rows that decode: not waiting on a tool, nothing left to prefill."""
    return [r for r in self.running(shard) if not (r.waiting or r.unwritten)]

  def shard_of(self, row) -> int:
    return self.groups[row.group].shard

  def take_pages(self, shard: int, n: int) -> list:
    free = self.shards[shard].free_pages
    pages = [free.popleft() for _ in range(n)]
    used = self.engine.num_pages - 1 - len(free)
    self.stats.peak_pages = max(self.stats.peak_pages, used)
    return pages

  def place(self, row, slot):
    shard = self.shards[self.shard_of(row)]
    row.slot = slot
    shard.slots[slot] = row.index
    table = self.groups[row.group].shared + row.pages
    shard.page_table[slot] = 0
    shard.page_table[slot, : len(table)] = table

  def release(self, row):
    """The row leaves its slot and gives back its own pages; a finished group's shared pages
    go back too."""
    group = self.groups[row.group]
    shard = self.shards[group.shard]
    if row.slot is not None:
      shard.slots[row.slot] = None
      shard.page_table[row.slot] = 0
      row.slot = None
    shard.free_pages.extend(row.pages)
    row.pages = []
    if row.done:
      group.unfinished -= 1
      if group.unfinished == 0:
        shard.free_pages.extend(group.shared + ([group.template] if group.template else []))
        group.shared, group.template = [], None

  def reserve(self, shard: int) -> int:
    """Pages the shard's running rows will still take over `reserve_chunks` more chunks."""
    ahead = self.engine.chunk_tokens * (1 + self.engine.reserve_chunks)
    return sum(max(self.pages_needed(r, ahead) - len(r.pages), 0) for r in self.running(shard))

  # -- admission

  def admit(self) -> Admission:
    """Plans what fits from the queue: rows of prefilled groups into their device's free slots,
    new groups (up to per_prefill a device) onto the device with the most free slots, as long as
    each device keeps its reserve. The admitted rows hold their slots and pages; they start once
    their first tokens are known (`set_first`, `start`)."""
    engine, Z, C, Y = self.engine, self.Z, self.engine.chunk_tokens, len(self.shards)
    planned = [[] for _ in range(Y)]
    free_slots = [sh.slots.count(None) for sh in self.shards]
    busy = [bool(self.running(r)) for r in range(Y)]  # the static batch waits for empty
    admitted = []
    for b in list(self.queue):
      row, group = self.rows[b], self.groups[self.rows[b].group]
      new_group = group.shard is None
      need = self.pages_needed(row, C, n_gen=1) + (
        self.shared_count(row) + (1 if row.prompt_len % Z else 0) if new_group else 0
      )
      fits = lambda r: (
        free_slots[r] > 0
        and not (engine.static and busy[r])
        and len(self.shards[r].free_pages) >= need + (0 if engine.static else self.reserve(r))
      )
      if new_group:
        options = [r for r in range(Y) if len(planned[r]) < self.per_prefill and fits(r)]
        if not options:
          continue
        r = max(options, key=lambda r: (free_slots[r], len(self.shards[r].free_pages), -r))
        group.shard = r
        group.shared = self.take_pages(r, self.shared_count(row))
        if row.prompt_len % Z:
          group.template = self.take_pages(r, 1)[0]
        planned[r].append(row.group)
      elif not fits(group.shard):
        continue
      r = group.shard
      self.queue.remove(b)
      row.pages = self.take_pages(r, self.pages_needed(row, C, n_gen=1))
      row.slot = self.shards[r].slots.index(None)
      self.shards[r].slots[row.slot] = row.index  # held; placed once its first token is known
      free_slots[r] -= 1
      admitted.append(row)
    return Admission(planned, admitted)

  def prefill_inputs(self, planned) -> tuple:
    """(prompts [B, T], lengths [B], destination pages [B, T / Z], row indices [B, n], {group:
    its place}) for the planned groups, per_prefill places a shard (unused places: length-1
    prompts written to the trash page); n = group_size."""
    B, T = len(self.shards) * self.per_prefill, -(-self.prompt_width // self.Z) * self.Z
    prompts = np.zeros((B, T), np.int32)
    lens = np.ones(B, np.int32)
    dest = np.zeros((B, T // self.Z), np.int32)
    row_ids = np.zeros((B, self.group_size), np.int32)
    at = {}
    for r, group_ids in enumerate(planned):
      for j, g in enumerate(group_ids):
        i, group = r * self.per_prefill + j, self.groups[g]
        pages = group.shared + ([group.template] if group.template is not None else [])
        prompts[i], lens[i] = group.prompt, self.rows[group.rows[0]].prompt_len
        dest[i, : len(pages)] = pages
        row_ids[i], at[g] = [self.rows[b].key for b in group.rows], i
    return prompts, lens, dest, row_ids, at

  def set_first(self, at, token_Bn, logp_Bn, top=None):
    """The first token (log-prob, top log-probs) of each prefilled group's rows."""
    for g, i in at.items():
      for j, b in enumerate(self.groups[g].rows):
        self.rows[b].first = (
          int(token_Bn[i, j]),
          float(logp_Bn[i, j]),
          None if top is None else (top[0][i, j], top[1][i, j]),
          self.version,
        )

  def restart(self, row):
    """The row back to its first token (at admission and after a preemption)."""
    token, logp, top, version = row.first
    row.tokens, row.logprobs, row.top = [token], [logp], ([top] if top is not None else [])
    row.versions = [version]
    row.alpha = [float("nan")]  # sampled at the prefill: no draft
    row.observed, row.waiting, row.unwritten = [], False, 0
    row.done = token in self.eos_ids or row.max_new == 1
    if self.turns is not None:
      self.turns.restart(row.key)
      row.done = row.done and not self._waits(row)

  def start(self, admitted) -> list:
    """Restarts and places the admitted rows (a row done at its first token leaves at once).
    Returns each shard's (template page, row's first page) copies."""
    copies = [[] for _ in self.shards]
    for row in admitted:
      self.restart(row)
      if row.done:
        self.release(row)
        continue
      group = self.groups[row.group]
      if group.template is not None:
        copies[group.shard].append((group.template, row.pages[0]))
      self.place(row, row.slot)
    return copies

  def copy_pairs(self, copies) -> np.ndarray:
    """[2, shards, num_slots] source and destination pages (unused: the trash page)."""
    pairs = np.full((2, len(self.shards), self.engine.num_slots), TRASH_PAGE, np.int32)
    for r, shard_copies in enumerate(copies):
      for j, (src, dst) in enumerate(shard_copies):
        pairs[:, r, j] = src, dst
    return pairs

  def check_progress(self):
    if self.queue and not self.running():
      raise ValueError(
        f"EngineConfig.num_pages = {self.engine.num_pages} is too small to admit "
        f"row {self.queue[0]} while other groups hold their prompt pages"
      )

  # -- decoding

  def grow(self):
    """Pages for every running row's next chunk; preempt the least advanced rows if short."""
    C = self.engine.chunk_tokens
    for r in range(len(self.shards)):
      while True:
        # A row waiting on a tool keeps what it holds: its observation is not known yet.
        growing = [x for x in self.running(r) if not x.waiting]
        short = {x.index: self.pages_needed(x, C) - len(x.pages) for x in growing}
        if sum(max(n, 0) for n in short.values()) <= len(self.shards[r].free_pages):
          break
        victim = min(growing, key=lambda x: (len(x.tokens), -x.index))
        self._check_not_cycling(victim)
        self.release(victim)
        self.stats.preemptions += 1
        self.stats.useful_row_steps -= len(victim.tokens) - 1  # decoded again on readmission
        self.queue.appendleft(victim.index)
      for x in growing:
        if short[x.index] > 0:
          x.pages += self.take_pages(r, short[x.index])
          self.place(x, x.slot)

  def _check_not_cycling(self, victim):
    """Raises if this preemption repeats one from the same state: the scheduler is deterministic,
    so the rollout would cycle forever (a pool too small for a row while other groups hold their
    prompt pages)."""
    state = (
      victim.index,
      tuple(len(r.tokens) if not r.done else -1 for r in self.rows.values()),
      tuple(self.queue),
      tuple(tuple(sh.slots) for sh in self.shards),
    )
    if state in self._preempted:
      raise ValueError(
        f"EngineConfig.num_pages = {self.engine.num_pages} is too small: row {victim.index} is "
        f"preempted again at {len(victim.tokens)} tokens with nothing else advanced, while "
        f"other groups hold their prompt pages"
      )
    self._preempted.add(state)

  def wants_all_slots(self) -> bool:
    """Whether some shard runs more rows than `drain_slots` (always, with drain off)."""
    drain = self.engine.drain_slots
    return not drain or max(len(self.running(r)) for r in range(len(self.shards))) > drain

  def compact(self, width: int):
    """Moves every shard's running rows into its first `width` slots."""
    for shard in self.shards:
      free = [i for i in range(width) if shard.slots[i] is None]
      for i in range(width, len(shard.slots)):
        if shard.slots[i] is not None:
          row = self.rows[shard.slots[i]]
          shard.slots[i] = None
          shard.page_table[i] = 0
          self.place(row, free.pop(0))

  def width(self, all_slots: bool) -> int:
    """The slots the next chunk decodes per shard, given whether any process wants them all;
    with drain, the rows move into the first ones."""
    if all_slots:
      return self.engine.num_slots
    self.compact(self.engine.drain_slots)
    return self.engine.drain_slots

  def drafts_ahead(self, draft_by_len: np.ndarray) -> int:
    """The most drafts a running row's round may run in the next chunk (exact mode's regime
    switch): a chunk's rounds start within a row's next chunk_steps cached lengths."""
    last, most = len(draft_by_len) - 1, 0
    for r in self.running():
      length = min(r.prompt_len + len(r.tokens) - 1, last)
      window = draft_by_len[length : min(length + self.engine.chunk_steps, last + 1)]
      most = max(most, int(window.max()))
    return most

  def chunk_inputs(self, width: int) -> tuple:
    """The first `width` slots of every shard as the decode-chunk program takes them: dict of
    [shards * width] arrays token, length, n_gen, max_new, row, active and the page_table; and
    {row index: its place}."""
    n = len(self.shards) * width
    slots = dict(
      token=np.zeros(n, np.int32),
      length=np.zeros(n, np.int32),
      n_gen=np.zeros(n, np.int32),
      max_new=np.ones(n, np.int32),
      row=np.zeros(n, np.int32),
      active=np.zeros(n, bool),
      page_table=np.concatenate([sh.page_table[:width] for sh in self.shards]),
    )
    at = {r.index: self.shard_of(r) * width + r.slot for r in self.decoding()}
    for r in self.decoding():
      i = at[r.index]
      slots["token"][i], slots["length"][i] = r.tokens[-1], r.prompt_len + len(r.tokens) - 1
      slots["n_gen"][i], slots["max_new"][i] = len(r.tokens), r.max_new
      slots["row"][i], slots["active"][i] = r.key, True
    return slots, at

  def finish_chunk(
    self, at, width: int, steps_run: int, out, n_gen_after, active_after, count=None
  ):
    """Appends each running row's new tokens (out: host [shards * width, steps] arrays tokens,
    logprobs and, with top log-probs, top_lp / top_id; speculative chunks add alpha and their
    per-slot counters `count`) and releases the rows that ended."""
    self.stats.chunks += 1
    self.stats.decode_steps += steps_run
    per_step = self.engine.speculate + 1  # tokens a decode step (a round) can emit per slot
    self.stats.computed_row_steps += steps_run * per_step * len(self.shards) * width
    if count is not None:
      self._count_rounds(count)
    for r in [self.rows[b] for b in at]:
      i = at[r.index]
      new = int(n_gen_after[i]) - len(r.tokens)
      self.stats.useful_row_steps += new
      r.tokens += out["tokens"][i, :new].tolist()
      r.logprobs += out["logprobs"][i, :new].tolist()
      r.versions += [self.version] * new
      if "top_lp" in out:
        r.top += list(zip(out["top_lp"][i, :new], out["top_id"][i, :new]))
      if "alpha" in out:
        r.alpha += out["alpha"][i, :new].tolist()
      if not active_after[i]:
        self._end_turn(r)

  # -- multi-turn rows

  def _waits(self, row) -> bool:
    """Whether a row whose turn just ended (its last token an EOS, or its length reached) waits
    on a tool: only an EOS with room for an observation and a token after it asks `turns`."""
    if row.tokens[-1] not in self.eos_ids or len(row.tokens) + 1 >= row.max_new:
      return False
    row.waiting = self.turns.turn_ended(row.key, row.tokens[row.turn_start() :])
    return row.waiting

  def _end_turn(self, row) -> None:
    """A row stopped decoding: it waits on a tool (keeping its slot and pages), or it is done."""
    if self.turns is None or not self._waits(row):
      row.done = True
      self.release(row)

  def add_observations(self, ready: dict) -> None:
    """Appends each ready observation (row key -> token ids, cut to leave the row room for one
    sampled token) to its row, to be prefilled (`observe_inputs`); rows no longer waiting (restarted
    since) are skipped."""
    by_key = {r.key: r for r in self.running() if r.waiting}
    for key, ids in ready.items():
      row = by_key.get(key)
      if row is None:
        continue
      ids = list(ids)[: row.max_new - len(row.tokens) - 1]
      start = len(row.tokens)
      row.tokens += ids
      row.logprobs += [0.0] * len(ids)
      row.versions += [self.version] * len(ids)
      if row.top:
        k = len(row.top[0][0])
        row.top += [(np.zeros(k, np.float32), np.zeros(k, np.int32))] * len(ids)
      if self.engine.speculate:
        row.alpha += [float("nan")] * len(ids)
      row.observed.append((start, len(row.tokens)))
      row.waiting, row.unwritten = False, len(ids) + 1  # the turn's last token is not cached yet

  def observe_inputs(self, chunk: int) -> tuple:
    """The observe program's inputs over every shard's slots: dict of [shards * slots] arrays
    length, n_gen, row, active and the page tables; tokens [shards * slots, chunk] (each
    observing row's next unwritten tokens) and how many each writes; {row index: its place}."""
    n = len(self.shards) * self.engine.num_slots
    slots = dict(
      length=np.zeros(n, np.int32),
      n_gen=np.zeros(n, np.int32),
      row=np.zeros(n, np.int32),
      active=np.zeros(n, bool),
      page_table=np.concatenate([sh.page_table for sh in self.shards]),
    )
    tokens, take = np.zeros((n, chunk), np.int32), np.zeros(n, np.int32)
    at = {}
    for r in self.running():
      if not r.unwritten:
        continue
      i = at[r.index] = self.shard_of(r) * self.engine.num_slots + r.slot
      cached = r.prompt_len + len(r.tokens) - r.unwritten
      take[i] = min(r.unwritten, chunk)
      tokens[i, : take[i]] = r.tokens[len(r.tokens) - r.unwritten :][: take[i]]
      slots["length"][i], slots["n_gen"][i], slots["row"][i] = cached, len(r.tokens), r.key
      slots["active"][i] = True
    return slots, tokens, take, at

  def finish_observe(self, at, take, token, logp, top=None) -> None:
    """Marks what the observe program wrote; a row with its observation all written takes the
    token sampled after it, and decodes on (or its turn ends at once)."""
    for b, i in at.items():
      r = self.rows[b]
      r.unwritten -= int(take[i])
      if r.unwritten:
        continue
      r.tokens.append(int(token[i]))
      r.logprobs.append(float(logp[i]))
      r.versions.append(self.version)
      if top is not None and r.top:
        r.top.append((top[0][i], top[1][i]))
      if self.engine.speculate:
        r.alpha.append(float("nan"))  # the dense policy's token, no draft
      self.stats.useful_row_steps += 1
      if r.tokens[-1] in self.eos_ids or len(r.tokens) >= r.max_new:
        self._end_turn(r)

  def _count_rounds(self, count: dict) -> None:
    """A speculative chunk's per-slot counters (host arrays) into the rollout's stats."""
    for name in ("rounds", "emitted", "drafted", "judged", "accepted"):
      setattr(self.stats, name, getattr(self.stats, name) + int(np.sum(count[name])))
    self.stats.kv_pages_read += float(np.sum(count["read"]))
    self.stats.kv_pages_dense += float(np.sum(count["dense"]))

  def started_before(self, version: int) -> bool:
    """Whether a row still decoding started (was prefilled) with weights older than `version`."""
    return any(not r.done and r.first and r.first[3] < version for r in self.rows.values())

  def ended_groups(self) -> list:
    """The groups whose rows have all ended, oldest first."""
    return [g for g, group in self.groups.items() if not group.unfinished]

  def take(self, n: int) -> list:
    """Takes the `n` oldest ended groups out of a partial rollout; returns their rows, in order."""
    rows = []
    for g in self.ended_groups()[:n]:
      rows += [self.rows.pop(b) for b in self.groups.pop(g).rows]
    return rows

  def state(self) -> tuple:
    """(JSON-able dict, dict of host arrays): everything a partial rollout needs to go on in a
    later process (`from_state`), as plain data: a checkpoint holds no object of this class, so a
    resume runs no code from it and a change of this class cannot misread it."""
    rows = list(self.rows.values())
    flat = lambda field, dtype: np.asarray(
      [x for r in rows for x in getattr(r, field)], dtype
    ).reshape(-1)
    tops = [t for r in rows for t in r.top]
    firsts = [r.first for r in rows if r.first is not None and r.first[2] is not None]
    k = len(tops[0][0]) if tops else (len(firsts[0][2][0]) if firsts else 0)
    stack = lambda items, i, dtype: np.asarray([t[i] for t in items], dtype).reshape(len(items), k)
    arrays = {
      "tokens": flat("tokens", np.int32),
      "logprobs": flat("logprobs", np.float32),
      "alpha": flat("alpha", np.float32),
      "versions": flat("versions", np.int32),
      "top_lp": stack(tops, 0, np.float32),
      "top_id": stack(tops, 1, np.int32),
      "first_top_lp": stack([f[2] for f in firsts], 0, np.float32),
      "first_top_id": stack([f[2] for f in firsts], 1, np.int32),
      "group_prompts": np.asarray([g.prompt for g in self.groups.values()], np.int32).reshape(
        len(self.groups), -(-self.prompt_width // self.Z) * self.Z
      ),
      "page_tables": np.asarray([sh.page_table for sh in self.shards], np.int32),
    }
    first = lambda r: (
      None if r.first is None else [*r.first[:2], r.first[3], r.first[2] is not None]
    )
    row = lambda r: {
      "index": r.index,
      "key": r.key,
      "group": r.group,
      "prompt_len": r.prompt_len,
      "max_new": r.max_new,
      "counts": [len(r.tokens), len(r.alpha), len(r.top)],
      "pages": list(r.pages),
      "first": first(r),  # token, log-prob, version, whether it has top log-probs
      "slot": r.slot,
      "done": r.done,
      "observed": [list(span) for span in r.observed],  # a multi-turn row's turn state
      "waiting": r.waiting,
      "unwritten": r.unwritten,
    }
    group = lambda i, g: {
      "index": i,
      "rows": list(g.rows),
      "shard": g.shard,
      "shared": list(g.shared),
      "template": g.template,
      "unfinished": g.unfinished,
    }
    meta = {
      "group_size": self.group_size,
      "prompt_width": self.prompt_width,
      "max_new": self.max_new,
      "page_size": self.Z,
      "version": self.version,
      "rows": [row(r) for r in rows],
      "groups": [group(i, g) for i, g in self.groups.items()],
      "queue": list(self.queue),
      "shards": [{"free_pages": list(sh.free_pages), "slots": sh.slots} for sh in self.shards],
      "stats": self.stats.state(),
    }
    return meta, arrays

  @classmethod
  def from_state(cls, engine: EngineConfig, eos_ids: Sequence[int], meta: dict, arrays: dict):
    """The scheduler `state()` was taken of, for `engine` (the run's, which must hold its pages
    and slots: ValueError naming the difference)."""
    shards, slots = meta["shards"], len(meta["shards"][0]["slots"]) if meta["shards"] else 0
    if slots != engine.num_slots or arrays["page_tables"].shape[0] != len(shards):
      raise ValueError(
        f"the saved rows under way ran {len(shards)} device(s) x {slots} slots, this run's engine "
        f"has {engine.num_slots} slots a device"
      )
    self = cls.__new__(cls)
    self.engine, self.Z, self.eos_ids = engine, meta["page_size"], tuple(eos_ids)
    self.turns = None  # a multi-turn rollout's are the caller's (Partial.run's), saved apart
    self.group_size, self.prompt_width = meta["group_size"], meta["prompt_width"]
    self.max_new = meta["max_new"]
    self.max_pages_per_row = -(-(self.prompt_width + self.max_new) // self.Z)
    self.per_prefill = max(1, engine.num_slots // self.group_size)
    self.version, self._preempted = meta["version"], set()
    self.stats = EngineStats.from_state(meta["stats"])
    self.queue = collections.deque(meta["queue"])
    self.shards = []
    for sh, table in zip(shards, arrays["page_tables"]):
      shard = Shard(engine, self.max_pages_per_row)
      shard.free_pages, shard.slots = collections.deque(sh["free_pages"]), list(sh["slots"])
      shard.page_table = np.array(table, np.int32)
      self.shards.append(shard)
    ends = {"tokens": 0, "alpha": 0, "top": 0, "first": 0}  # each flat array's rows read so far

    def take(name, n):
      ends[name] += n
      return slice(ends[name] - n, ends[name])

    self.rows = {}
    for r in meta["rows"]:
      n, n_alpha, n_top = r["counts"]
      tok, top = take("tokens", n), take("top", n_top)
      first = None
      if r["first"] is not None:
        token, logp, version, has_top = r["first"]
        f = take("first", int(has_top))
        top0 = (arrays["first_top_lp"][f][0], arrays["first_top_id"][f][0]) if has_top else None
        first = (token, logp, top0, version)
      self.rows[r["index"]] = Row(
        r["index"],
        r["key"],
        r["group"],
        r["prompt_len"],
        r["max_new"],
        tokens=arrays["tokens"][tok].tolist(),
        logprobs=arrays["logprobs"][tok].tolist(),
        top=list(zip(arrays["top_lp"][top], arrays["top_id"][top])),
        alpha=arrays["alpha"][take("alpha", n_alpha)].tolist(),
        versions=arrays["versions"][tok].tolist(),
        pages=list(r["pages"]),
        first=first,
        slot=r["slot"],
        done=r["done"],
        # a checkpoint of single-turn rows may hold none of the turn state
        observed=[tuple(span) for span in r.get("observed", [])],
        waiting=r.get("waiting", False),
        unwritten=r.get("unwritten", 0),
      )
    self.groups = {}
    for g, prompt in zip(meta["groups"], arrays["group_prompts"]):
      self.groups[g["index"]] = Group(
        list(g["rows"]),
        np.array(prompt, np.int32),
        g["shard"],
        list(g["shared"]),
        g["template"],
        g["unfinished"],
      )
    return self

  def outputs(self, num_top: int, pad_id: int, rows: Optional[list] = None) -> tuple:
    """Host [B, max_new] tokens, logprobs, [B] lengths, [B, max_new, k] top_lp, top_id (None
    without top log-probs), [B, max_new] alpha (speculative rollouts, else None) and [B, max_new]
    policy versions of `rows` (default: every row), in order."""
    rows = list(self.rows.values()) if rows is None else rows
    B, M = len(rows), self.max_new
    tokens = np.full((B, M), pad_id, np.int32)
    logprobs = np.zeros((B, M), np.float32)
    versions = np.full((B, M), -1, np.int32)
    lengths = np.asarray([len(r.tokens) for r in rows], np.int32)
    top_lp = np.zeros((B, M, num_top), np.float32) if num_top else None
    top_id = np.zeros((B, M, num_top), np.int32) if num_top else None
    alpha = np.full((B, M), np.nan, np.float32) if self.engine.speculate else None
    for i, r in enumerate(rows):
      n = len(r.tokens)
      tokens[i, :n], logprobs[i, :n], versions[i, :n] = r.tokens, r.logprobs, r.versions
      if num_top:
        top_lp[i, :n] = np.stack([t[0] for t in r.top])
        top_id[i, :n] = np.stack([t[1] for t in r.top])
      if alpha is not None:
        alpha[i, : len(r.alpha)] = r.alpha
    return tokens, logprobs, lengths, top_lp, top_id, alpha, versions

  def observed_mask(self, rows: Optional[list] = None) -> np.ndarray:
    """Host [B, max_new] bool of `rows` (default: every row): True at the tokens of tool
    observations, which the rows did not sample."""
    rows = list(self.rows.values()) if rows is None else rows
    mask = np.zeros((len(rows), self.max_new), bool)
    for i, r in enumerate(rows):
      for start, end in r.observed:
        mask[i, start:end] = True
    return mask
