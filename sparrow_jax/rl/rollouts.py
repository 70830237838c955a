"""The rollout source: the graded rows each step trains on, whatever the rollout mode.

The loop asks `take(step, state)` for a step's rows and trains on them; it never branches on how
they were sampled. The modes are the source's:
- on-policy: the step's rows are sampled at its start, with its weights;
- one step off (`rl.off_policy_steps = 1`): step t + 1's rows are sampled with step t's weights
  while step t's update runs (in a thread; several processes sample in order instead);
- carried rows (`rollout.partial_groups = E`): E groups more are under way than a step trains on;
  a step takes the first groups to end, and the rows still decoding are carried over to the next
  step's rollout under its weights (`Carried`);
- rollout devices of their own (`mesh.rollout_devices`): the weights are synced there each step.

Everything a step samples is a pure function of (config, step, the source's saved state): the data
position of a step's new groups is `new_groups`, the rollout key is fold_in(seed key, step), and a
carried row's key is its group's data position. A checkpoint keeps the source's state (`saved`):
the rows sampled ahead, the carried rows and their KV pool, as arrays and JSON inside the same
orbax step as the train state, checked with it, never as an object: a workdir may be a shared
bucket, and loading it must run no code.
"""

import concurrent.futures
import dataclasses
import json
import time
from typing import NamedTuple, Optional, Sequence

import jax
from jax.experimental import multihost_utils
import numpy as np

from sparrow_jax import schema
from sparrow_jax.data.rewards import Grade
from sparrow_jax.envs import turns as env_turns
from sparrow_jax.rl import hooks
from sparrow_jax.rollout import engine, sampler
from sparrow_jax.sparsity import schedule as schedule_lib


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
  """How rollouts overlap training: each setting declared here once, with its bound, and read by
  every module through it (`of`: from the config's rl, rollout and mesh groups; a bad value names
  its config field)."""

  off_policy_steps: int = 0  # rl: 1: a step trains on rows of the previous step's weights
  partial_groups: int = 0  # rollout: E groups under way beyond a step's (0: no row is carried)
  max_carry_steps: int = 2  # rollout: a row carried this many steps ends before a step trains
  rollout_devices: int = 0  # mesh: each process's first n devices only roll out (0: colocated)

  def __post_init__(self):
    for name, ok, allowed in (
      (
        "off_policy_steps",
        self.off_policy_steps in (0, 1),
        "must be 0 (each step trains on rollouts of its own weights) or 1 (one-step-off: on "
        "rollouts of the previous step's weights, sampled while the previous update ran)",
      ),
      ("partial_groups", _count(self.partial_groups), "must be >= 0 GRPO groups (0: off)"),
      ("max_carry_steps", _count(self.max_carry_steps), "must be >= 0 steps (0: no bound)"),
      (
        "rollout_devices",
        _count(self.rollout_devices),
        "must be >= 0 devices of each process (0: rollouts on the trainer's devices)",
      ),
    ):
      if not ok:
        value = getattr(self, name)
        raise ValueError(f"AsyncConfig.{name} = {value!r} is invalid: {allowed}")

  @classmethod
  def of(cls, c) -> "AsyncConfig":
    return schema.from_group(cls, c, "rl", "rollout", "mesh")

  @property
  def under_way(self) -> bool:
    """Whether a checkpoint keeps rows under way (sampled ahead, or carried)."""
    return bool(self.off_policy_steps or self.partial_groups)


def _count(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclasses.dataclass(frozen=True)
class Settings:
  """What the source reads of the run's config (`of`)."""

  prompts_per_step: int  # GRPO groups a step trains on
  group_size: int  # rows a group
  max_prompt_len: int  # the prompt width, in tokens
  max_new_tokens: int
  overlap: AsyncConfig
  total_steps: int  # no rows are sampled ahead for a step past it
  seed: int  # the rollout key of step s is fold_in(PRNGKey(seed), s)
  bin_size: int  # tokens a position bin of the per-bin metrics (stats.bin_size)
  num_bins: int

  @classmethod
  def of(cls, c) -> "Settings":
    r = c.rollout
    parts = (r.prompts_per_step, r.group_size, r.max_prompt_len, r.max_new_tokens)
    return cls(*parts, AsyncConfig.of(c), c.total_steps, c.seed, c.stats.bin_size, c.stats.num_bins)


def new_groups(s: Settings, step: int) -> tuple:
  """(count, data position) of the GRPO groups step `step`'s rollout starts."""
  n, extra = s.prompts_per_step, s.overlap.partial_groups
  if step == 0:
    return n + extra, 0
  return n, step * n + extra


def process_groups(count: int, rows) -> slice:
  """This process's share of `count` new groups (rows: build.Rows, whole groups a process)."""
  return slice(count * rows.lo // rows.count, count * rows.hi // rows.count)


def lag_metrics(step: int, versions_BM, lengths_B, prompt_len_B, bin_size: int, bins: int) -> dict:
  """How many steps old the weights that sampled the step's tokens are (step - version), over
  every row's tokens and per position bin (by cached length, as the acceptance bins: where long
  rows' tokens are older, the length bias shows), the trained tokens per bin, and the rows carried
  over from an earlier step's rollout."""
  versions_BM = np.asarray(versions_BM)
  valid_BM = np.arange(versions_BM.shape[1])[None] < np.asarray(lengths_B)[:, None]
  lag_BM = step - versions_BM
  bin_BM = np.minimum(
    (np.asarray(prompt_len_B)[:, None] + np.arange(versions_BM.shape[1])) // bin_size, bins - 1
  )
  tokens_bin = np.bincount(bin_BM[valid_BM], minlength=bins)
  lag_bin = np.bincount(bin_BM[valid_BM], lag_BM[valid_BM], minlength=bins)
  carried = versions_BM[:, 0] < np.max(np.where(valid_BM, versions_BM, -1), axis=1)
  with np.errstate(invalid="ignore", divide="ignore"):  # a bin without tokens: NaN, not logged
    mean_bin = lag_bin / tokens_bin
  return {
    "rollout/token_lag/mean": float(lag_BM[valid_BM].mean()),
    "rollout/token_lag/max": int(lag_BM[valid_BM].max()),
    "rollout/token_lag_bin": mean_bin,
    "rollout/tokens_bin": np.where(tokens_bin > 0, tokens_bin, np.nan),
    "rollout/rows_carried": int(carried.sum()),
  }


def budget_args(budget) -> dict:
  """The engine's arguments of a rollout's KV budget (hooks.StepBudget; None: dense rollouts):
  its table and exact mode's drafts."""
  if budget is None:
    return dict(schedule=None, draft_plan=None)
  return dict(schedule=budget.table, draft_plan=budget.drafts)


class Taken(NamedTuple):
  """The rows a step trains on, this process's, host arrays."""

  problems: list  # one per group
  prompt: np.ndarray
  prompt_len: np.ndarray
  rollout: sampler.Rollout
  engine_stats: engine.EngineStats
  rows: Sequence[int]  # their Requests row indices (a carried row's: its group's data position)
  turns: Optional[object] = None  # a multi-turn task's episodes (envs/turns.EnvTurns) of the rows


class Synced(NamedTuple):
  """The sampler's copy of the policy's weights (`build.Sampler.sync`)."""

  version: int  # the step whose weights they are (the step that starts with them)
  weights: tuple  # (params, lora) where the rollouts run
  seconds: float  # the copy's wall time
  nbytes: int  # what it holds on this process's devices (0: the trainer's arrays themselves)


class Sampled(NamedTuple):
  """A step's rollouts, graded, on the host: what its update trains on."""

  step: int
  weights_step: int  # the policy version that sampled them: the step whose weights it was
  budget: Optional[object]  # hooks.StepBudget: the KV budget (and drafts) they were sampled under
  prompt: np.ndarray  # this process's rows
  prompt_len: np.ndarray
  rollout: sampler.Rollout  # host arrays
  engine_stats: engine.EngineStats
  grades: list
  rollout_s: float  # the engine's wall time
  sync_s: float  # Synced.seconds of the weights that sampled them
  sync_bytes: int  # Synced.nbytes
  wait_s: float = 0.0  # how long `take` waited for them (about 0 when sampled ahead)
  env_metrics: Optional[dict] = None  # a multi-turn task's tool use (EnvTurns.metrics)

  def metrics(self, bin_size: int, bins: int) -> dict:
    """The rollout's own tags: the weights that sampled it, a multi-turn task's tool use and, for
    carried rows, their age."""
    metrics = {"rollout/weights_step": self.weights_step, **(self.env_metrics or {})}
    if self.rollout.versions is not None:
      parts = (self.rollout.versions, self.rollout.lengths, self.prompt_len, bin_size, bins)
      metrics.update(lag_metrics(self.step, *parts))
    return metrics


class Carried:
  """The rows under way across steps: the engine's partial rollout, each queued group's prompt, by
  the group's first row key (its data position x group size), and a multi-turn task's episodes of
  every row under way."""

  def __init__(
    self,
    partial: engine.Partial,
    mesh,
    task,
    tokenizer,
    group_size: int,
    groups: int,
    max_carry: int,
  ):
    """groups: this process's share of a step's groups (`process_groups`); max_carry: steps a row
    may be carried (AsyncConfig.max_carry_steps)."""
    self.partial, self.mesh, self.task, self.tokenizer = partial, mesh, task, tokenizer
    self.group_size, self.groups, self.max_carry = group_size, groups, max_carry
    self.queued = {}  # first row key -> (prompt row, prompt length)
    self.turns = None  # envs/turns.EnvTurns of every row under way (a multi-turn task's)

  def sample(
    self, weights, problems, requests: engine.Requests, version: int, budget, turns=None
  ) -> Taken:
    """Queues the step's new groups (`turns`: their rows' episodes), decodes until this process's
    share of a step's groups has ended, and takes them out, oldest first."""
    g = self.group_size
    for i in range(len(problems)):
      b = i * g
      self.queued[requests.first_row + b] = (requests.prompt_BT[b], requests.prompt_len_B[b])
    if turns is not None:
      if self.turns is None:
        self.turns = turns
      else:
        self.turns.add(turns)
    params, lora = weights
    with jax.set_mesh(self.mesh):  # also in a rollout thread: a mesh context is the thread's own
      rollout, stats, keys = self.partial.run(
        params,
        requests,
        self.groups,
        version,
        lora=lora,
        max_carry=self.max_carry,
        turns=self.turns,
        **budget_args(budget),
      )
    first = [int(k) for k in keys[::g]]
    done = [self.queued.pop(k) for k in first]
    prompt = np.repeat(np.stack([d[0] for d in done]), g, axis=0)
    prompt_len = np.repeat(np.asarray([d[1] for d in done], np.int32), g)
    problems = [self.task.sample(1, k // g)[0] for k in first]  # a group's key: its position
    return Taken(problems, prompt, prompt_len, rollout, stats, keys.tolist(), self.turns)

  def state(self) -> Optional[tuple]:
    """(JSON, host arrays, the pool's arrays) of the rows under way, a multi-turn task's episodes
    with them (`EnvTurns.state`: calls in flight are waited for); None before the first call."""
    under_way = self.partial.state()
    if under_way is None:
      return None
    meta, arrays, pool = under_way
    keys = sorted(self.queued)
    meta = {"scheduler": meta, "queued": [[k, int(self.queued[k][1])] for k in keys]}
    meta["turns"] = None if self.turns is None else self.turns.state()
    prompts = np.asarray([self.queued[k][0] for k in keys], np.int32).reshape(len(keys), -1)
    return meta, {**arrays, "queued_prompts": prompts}, jax.tree.leaves(pool)

  def abstract_pool(self, params) -> list:
    """The pool's arrays as `state()` lists them, as this run's devices hold them."""
    with jax.set_mesh(self.mesh):
      return jax.tree.leaves(self.partial.abstract_pool(params))

  def restore(self, meta: dict, arrays: dict, pool: list, params) -> None:
    """The rows under way of `state()` back, `pool` (restored onto `abstract_pool`'s devices)
    their KV pages."""
    self.queued = {
      k: (np.asarray(p, np.int32), np.int32(n))
      for (k, n), p in zip(meta["queued"], arrays.pop("queued_prompts"))
    }
    with jax.set_mesh(self.mesh):
      structure = jax.tree.structure(self.partial.abstract_pool(params))
    self.partial.restore((meta["scheduler"], arrays, jax.tree.unflatten(structure, pool)))
    episodes = meta.get("turns")
    if self.task.kind == "env" and episodes is None:
      raise ValueError(
        "the checkpoint's carried rows have no episodes saved, but this run's task "
        f"{self.task.name!r} is multi-turn: resume with the config that wrote it"
      )
    if episodes is not None:  # each row's problem is its group's, by its data position
      g = self.group_size
      problems = {int(k): self.task.sample(1, int(k) // g)[0] for k in episodes}
      self.turns = self.task.turns(problems, self.tokenizer)
      self.turns.restore(episodes)

  def rows_under_way(self) -> int:
    return self.partial.rows_under_way()


class _InOrder:
  """submit() runs the call at once and returns its finished future."""

  def submit(self, fn, *args):
    future = concurrent.futures.Future()
    future.set_result(fn(*args))
    return future

  def shutdown(self):
    pass


class Source:
  """The rows of each step (`take`), sampled by `sampler` (build.Sampler) from `task`'s problems
  under the `budgets` hook's KV budgets (None: dense rollouts), graded; `rows`: the step's rows on
  the mesh (build.Rows). A context manager: one step off, its thread lives while the run does."""

  def __init__(self, settings: Settings, task, tokenizer, sampler_, rows, budgets):
    self.s, self.task, self.tokenizer = settings, task, tokenizer
    self.sampler, self.rows, self.budgets = sampler_, rows, budgets
    self.key = jax.random.PRNGKey(settings.seed)
    self.ahead = None  # the next step's rows, a future (one step off)
    self.ahead_beside = False  # whether they are sampled in the thread, beside the loop's step
    self.thread = _InOrder()

  def __enter__(self) -> "Source":
    # Several processes sample in the loop's own thread, in order (every process must issue its
    # collectives in the same order), still one step off, without the overlap.
    if self.s.overlap.off_policy_steps and jax.process_count() == 1:
      self.thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="rollout")
    return self

  def __exit__(self, *exc) -> None:
    self.thread.shutdown()

  def data_position(self, step: int) -> int:
    """The data position of step `step`'s first new group (what the checkpoint meta records)."""
    return new_groups(self.s, step)[1]

  def take(self, step: int, state) -> Sampled:
    """Step `step`'s graded rows: sampled during the last update (one step off) or now; one step
    off, the next step's are started on `state`'s weights before this returns (the update, which
    donates the state, may then run)."""
    t0 = time.time()
    sampled = self._ahead() if self.ahead else self._sample(*self._args(state, step, step))
    waited = time.time() - t0
    self.ahead = None
    if self.s.overlap.off_policy_steps and step + 1 < self.s.total_steps:
      self.ahead = self.thread.submit(self._sample, *self._args(state, step, step + 1))
      self.ahead_beside = not isinstance(self.thread, _InOrder)
    return sampled._replace(wait_s=waited)

  def _ahead(self) -> Sampled:
    """The rows sampled ahead, waited for. Sampled in the thread, every chunk of theirs that
    started before the loop came to wait for them ran beside the loop's step (the update, the
    hooks): their engine's clock says so (`EngineStats.beside_until`), for the regime switch to
    keep those timings apart."""
    waits = time.perf_counter()
    sampled = self.ahead.result()
    stats = sampled.engine_stats
    if self.ahead_beside and stats.beside_until is None:
      stats.beside_until = waits
    return sampled

  def _args(self, state, version: int, step: int) -> tuple:
    """The sampler's weights (version `version`), the step, its key and the budget in force now,
    which is the one a rollout that starts now samples under."""
    budget = self.budgets.for_step(step) if self.budgets else None
    return _sync(self.sampler, state, version), step, jax.random.fold_in(self.key, step), budget

  def _sample(self, synced: Synced, step: int, key, budget) -> Sampled:
    """Step `step`'s new prompts (this process's), their rollouts drawn with `key` from the synced
    weights under `budget`, and the grades of the rows the step trains on (with carried rows, the
    first groups to end, new or carried over)."""
    s, g = self.s, self.s.group_size
    t0 = time.time()
    count, position = new_groups(s, step)
    share = process_groups(count, self.rows)
    problems = self.task.sample(count, position)[share]
    prompt, prompt_len = _prompts(problems, self.tokenizer, g, s.max_prompt_len)
    # carried rows are keyed by their group's data position: rows go on over steps
    first = (position + share.start) * g if s.overlap.partial_groups else self.rows.lo
    requests = engine.Requests(prompt, prompt_len, s.max_new_tokens, g, first_row=first)
    rows = range(first, first + len(prompt))
    turns = None
    if self.task.kind == "env":  # each row plays its own episode of its group's problem
      turns = self.task.turns({r: problems[i // g] for i, r in enumerate(rows)}, self.tokenizer)
    parts = (synced.weights, problems, requests, key, budget, synced.version, turns)
    taken = self.sampler.sample(*parts)
    rollout_s = time.time() - t0
    rollout = taken.rollout
    if taken.turns is None:
      responses = [self.tokenizer.decode(t[:n]) for t, n in zip(rollout.tokens, rollout.lengths)]
      grades = self.task.grade(responses, [p for p in taken.problems for _ in range(g)])
      env_metrics = None
    else:  # the rows taken, which with carried rows are not the new ones
      grades = [taken.turns.grade(r) for r in taken.rows]
      tallies = taken.turns.tallies(rollout.observed, rollout.lengths, taken.rows)
      env_metrics = env_turns.metrics(_all_processes(tallies))  # the processes sample in order
      taken.turns.drop(taken.rows)
    parts = (taken.prompt, taken.prompt_len, taken.rollout, taken.engine_stats, grades, rollout_s)
    sync = (synced.seconds, synced.nbytes)
    return Sampled(step, synced.version, budget, *parts, *sync, env_metrics=env_metrics)

  # -- what a checkpoint keeps

  def saved(self) -> Optional[tuple]:
    """(JSON, arrays) of what the run has under way after the step taken last, for a checkpoint:
    the next step's rows sampled ahead (waited for) and the carried rows with their pool (read
    once those rollouts, which move them, are done). The JSON is every process's; the arrays are
    global (`_per_process`). None when nothing is under way."""
    ahead = self.ahead and self._ahead()
    carried = self.sampler.carried and self.sampler.carried.state()
    if not (ahead or carried):
      return None
    meta, arrays, pool = {"ahead": None, "carried": None}, {}, None
    if ahead:
      meta["ahead"], arrays["ahead"] = _sampled_state(ahead)
    if carried:
      meta["carried"], arrays["carried"], pool = carried
    shapes = {name: list(x.shape) for name, x in _flat(arrays).items()}
    processes = _all_processes({**meta, "shapes": shapes})
    saved = {"host": _per_process(arrays, processes)}
    return {"processes": processes}, {**saved, **({"pool": pool} if pool else {})}

  def abstract_saved(self, params, saved: dict, step: int) -> dict:
    """The abstract arrays the checkpoint of `step` restores the saved ones onto, given their
    shapes and dtypes there (`saved`: {name: (shape, dtype)}): the host rows on one entry a
    process, the pool on this run's devices (ValueError when it cannot hold the saved one)."""
    sharding = _process_sharding()
    host = {
      name.removeprefix("host/"): jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
      for name, (shape, dtype) in saved.items()
      if name.startswith("host/")
    }
    out = {"host": _nested(host)}
    pool = [(k, v) for k, v in saved.items() if k.startswith("pool/")]
    if pool:
      if not self.sampler.carried:
        raise ValueError(
          f"checkpoint {step} holds carried rows, but this config has rollout.partial_groups "
          "= 0: resume with the config that wrote it or start a new config.workdir"
        )
      mine = self.sampler.carried.abstract_pool(params)
      theirs = [v for _, v in sorted(pool, key=lambda kv: int(kv[0].split("/")[1]))]
      if [(tuple(x.shape), str(x.dtype)) for x in mine] != [(tuple(s), d) for s, d in theirs]:
        raise ValueError(
          f"checkpoint {step} holds carried rows in a KV pool of shape {theirs[0][0]}, this "
          f"run's is {list(mine[0].shape)} (another device count or pool size): resume with "
          "the devices and config that wrote it or start a new config.workdir"
        )
      out["pool"] = mine
    return out

  def restore(self, saved: Optional[tuple], step: int, params) -> None:
    """What the checkpoint the run resumes at `step` from kept (`saved`'s, None: nothing). Rows
    sampled ahead come back as the next `take`'s; carried rows go back into the engine. A
    one-step-off run's last checkpoint keeps no rows ahead (no later step was to run): the run
    was extended, and step `step` samples its own rows, on-policy, and says so."""
    if not step or not self.s.overlap.under_way:
      return
    if saved is None:
      if self.s.overlap.partial_groups:
        raise ValueError(
          f"checkpoint {step} keeps no carried rows (rollout.partial_groups = "
          f"{self.s.overlap.partial_groups}): it was written by another config, or by a "
          "version that kept them beside it in in_flight/ as a pickle, which is not read (it "
          "could run code); resume with what wrote it or start a new config.workdir"
        )
      print(
        f"checkpoint {step} holds no rows sampled ahead (it was the run's last step): step "
        f"{step} samples its own rows with its weights",
        flush=True,
      )
      return
    meta, arrays = saved
    processes = meta["processes"]
    if len(processes) != jax.process_count():
      raise ValueError(
        f"checkpoint {step} holds rows under way of {len(processes)} processes; this run has "
        f"{jax.process_count()}: resume on {len(processes)} processes or start a new workdir"
      )
    mine = processes[jax.process_index()]
    host = _this_process(arrays["host"], mine["shapes"])
    if mine["ahead"] is not None:
      sampled = _sampled_from_state(mine["ahead"], host["ahead"], self.budgets)
      self.ahead = _InOrder().submit(lambda: sampled)
      self.ahead_beside = False  # its clock was marked when the checkpoint was written
    if mine["carried"] is not None:
      self.sampler.carried.restore(mine["carried"], host["carried"], arrays["pool"], params)

  def under_way(self) -> str:
    """What the run leaves under way at its end, in words ('' when nothing): carried rows are
    kept in the last checkpoint, and raising total_steps trains them."""
    carried = self.sampler.carried
    rows = carried.rows_under_way() if carried else 0
    if not rows:
      return ""
    return (
      f"{rows} carried rows were still under way at the run's end (this process's); the last "
      "checkpoint keeps them: raising config.total_steps trains them"
    )


def _sync(sampler_, state, version: int) -> Synced:
  """The sampler's copy of the state's weights, complete before the update that donates the state
  is dispatched."""
  t0 = time.time()
  weights = sampler_.sync(state)
  moved = weights[0] is not state.params
  if moved:  # on-policy the sampler reads the state's own arrays: nothing to wait for here
    weights = jax.block_until_ready(weights)
  leaves = jax.tree.leaves(weights) if moved else []
  nbytes = sum(shard.data.nbytes for x in leaves for shard in x.addressable_shards)
  return Synced(version, weights, time.time() - t0, nbytes)


def _prompts(problems, tokenizer, group_size, width):
  """Host arrays of right-padded prompt rows (each problem group_size times) and their lengths."""
  texts = [p.prompt for p in problems for _ in range(group_size)]
  tokens, lengths = tokenizer.encode_batch(texts)
  if tokens.shape[1] > width:
    raise ValueError(
      f"a prompt has {tokens.shape[1]} tokens, more than config.rollout.max_prompt_len = {width}"
    )
  tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])), constant_values=tokenizer.pad_id)
  return tokens.astype(np.int32), np.asarray(lengths, np.int32)


# -- rows as plain data: JSON and host arrays (a checkpoint's), never objects

_ROLLOUT_FIELDS = [f.name for f in dataclasses.fields(sampler.Rollout)]


def _sampled_state(sampled: Sampled) -> tuple:
  """(JSON, host arrays) of rows sampled ahead; the budget's placed table is left out (placed
  again from its schedule on restore)."""
  rollout = {k: getattr(sampled.rollout, k) for k in _ROLLOUT_FIELDS}
  rollout = {k: np.asarray(v) for k, v in rollout.items() if v is not None}
  budget = None
  if sampled.budget is not None:
    b = sampled.budget
    drafts = None if b.drafts is None else dataclasses.asdict(b.drafts)
    budget = {"stage": b.stage, "schedule": dataclasses.asdict(b.schedule), "drafts": drafts}
  meta = {
    "step": sampled.step,
    "weights_step": sampled.weights_step,
    "budget": budget,
    "engine_stats": sampled.engine_stats.state(),
    "grades": [[float(g.reward), g.reason] for g in sampled.grades],
    "seconds": [sampled.rollout_s, sampled.sync_s],
    "sync_bytes": sampled.sync_bytes,
    "rollout_fields": sorted(rollout),
    "env_metrics": sampled.env_metrics,
  }
  arrays = {"prompt": sampled.prompt, "prompt_len": sampled.prompt_len, "rollout": rollout}
  if sampled.budget is not None:
    arrays["pages_by_len"] = np.asarray(sampled.budget.pages_by_len)
  return meta, arrays


def _sampled_from_state(meta: dict, arrays: dict, budgets) -> Sampled:
  """The rows `_sampled_state` wrote, their budget's table placed again (budgets: hooks.Budgets)."""
  rollout = sampler.Rollout(**{k: arrays["rollout"][k] for k in meta["rollout_fields"]})
  budget = None
  if meta["budget"] is not None:
    b = meta["budget"]
    drafts = b["drafts"] and schedule_lib.DraftPlan(
      **{**b["drafts"], "k_bin": tuple(b["drafts"]["k_bin"])}
    )
    schedule = schedule_lib.KVSchedule(**b["schedule"])
    host = hooks.StepBudget(b["stage"], schedule, arrays["pages_by_len"], None, drafts)
    budget = budgets.placed(host)
  grades = [Grade(reward, reason) for reward, reason in meta["grades"]]
  return Sampled(
    meta["step"],
    meta["weights_step"],
    budget,
    arrays["prompt"],
    arrays["prompt_len"],
    rollout,
    engine.EngineStats.from_state(meta["engine_stats"]),
    grades,
    *meta["seconds"],
    meta["sync_bytes"],
    env_metrics=meta.get("env_metrics"),
  )


def _all_processes(meta: dict) -> list:
  """Every process's JSON `meta`, in process order (a checkpoint's meta is written by one)."""
  if jax.process_count() == 1:
    return [json.loads(json.dumps(meta))]
  data = np.frombuffer(json.dumps(meta).encode(), np.uint8)
  sizes = multihost_utils.process_allgather(np.int64(data.size))
  padded = np.zeros(int(np.max(sizes)), np.uint8)
  padded[: data.size] = data
  every = multihost_utils.process_allgather(padded)
  return [json.loads(bytes(every[p, : sizes[p]])) for p in range(jax.process_count())]


def _process_sharding():
  """A leading axis of one entry per process, each process's on its own devices."""
  devices = [[d for d in jax.devices() if d.process_index == p] for p in range(jax.process_count())]
  mesh = jax.sharding.Mesh(np.asarray(devices), ("process", "local"))
  return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("process"))


def _flat(tree: dict, prefix: str = "") -> dict:
  """{'a/b': leaf} of a nested dict of arrays."""
  out = {}
  for k, v in tree.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}/"))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _nested(flat: dict) -> dict:
  """The nested dict `_flat` made `flat` of."""
  out = {}
  for name, v in flat.items():
    *path, leaf = name.split("/")
    node = out
    for k in path:
      node = node.setdefault(k, {})
    node[leaf] = v
  return out


def _per_process(arrays: dict, processes: list) -> dict:
  """This process's host `arrays` (a nested dict) as global arrays with a leading process axis,
  each padded to the largest shape any process has, and to at least 1 a dimension (orbax writes
  no empty array; processes: every process's JSON, whose "shapes" are the true ones)."""
  sharding = _process_sharding()
  out = {}
  for name, x in _flat(arrays).items():
    shape = np.max([p["shapes"][name] for p in processes] + [[1] * x.ndim], axis=0).tolist()
    padded = np.zeros(shape, x.dtype)
    padded[tuple(slice(0, n) for n in x.shape)] = x
    out[name] = jax.make_array_from_process_local_data(
      sharding, padded[None], (len(processes), *shape)
    )
  return _nested(out)


def _this_process(arrays: dict, shapes: dict) -> dict:
  """This process's entries of `_per_process` arrays, unpadded to their true `shapes`."""
  out = {}
  for name, x in _flat(arrays).items():
    local = np.asarray(x.addressable_shards[0].data)[0]
    out[name] = local[tuple(slice(0, n) for n in shapes[name])]
  return _nested(out)
