"""What a training step does besides sample, reward and update, as hooks of the RL loop
(rl/trainer.py). A hook may act before a step's rollout (`begin_step`); after the step's update it
returns the metrics it adds (`metrics`), then acts on the logged metrics (`end_step`); what a
resume needs of it goes in the checkpoint meta (`meta`, read back by `restore`).

  Budgets      the KV budget each step samples and trains under: rollout.schedule's stage, or the
               closed loop's table, which each step's acceptance tail moves (schedule.adapt_topk);
               with rollout.speculate = "auto", exact mode's drafts per bin, which each step's
               mean acceptance prices (cost_model.draft_plan)
  KVMetrics    kv/read_fraction and kv/predicted_speedup of the step's rollouts
  PerfMetrics  perf/* (tokens/s, the engine's occupancy, train step time) and the learning rate
  Evaluation   eval/dense/* and eval/sparse/*: mean@k and pass@k on held-out problems (config.eval)
  Checkpoint   the train state and every other hook's meta, every `ckpt_every` steps and at the end
  Profile      a jax.profiler trace of the steps config.profile_steps names, rollout and update

A hook runs after every `every`-th step only (`due`; 1: each step), as levanter's hooks do.
"""

import dataclasses
import functools
import json
from typing import Callable, NamedTuple, Optional

import jax
from jax.experimental import multihost_utils
import numpy as np

from sparrow_jax import checkpoint, logging, sharding
from sparrow_jax.mismatch import cost_model
from sparrow_jax.rl import evaluate
from sparrow_jax.rollout import engine, sampler
from sparrow_jax.sparsity import schedule as schedule_lib


class StepBudget(NamedTuple):
  """A step's KV budget (sparse runs)."""

  stage: int  # the stage of rollout.schedule in force
  schedule: schedule_lib.KVSchedule  # its schedule (the closed loop's table, when adaptive)
  pages_by_len: np.ndarray  # its pages kept at each cached length, on the host
  table: schedule_lib.BudgetTable  # the same, placed on the mesh, with the run's static cap
  drafts: Optional[schedule_lib.DraftPlan] = None  # rollout.speculate = "auto": drafts per bin


@dataclasses.dataclass
class StepOutput:
  """What a step did, as the hooks see it."""

  step: int  # 0-based
  budget: Optional[StepBudget]  # None: dense rollouts
  prompt_len_B: np.ndarray  # every row's, on the host
  lengths_B: np.ndarray  # every row's completion length
  engine_stats: engine.EngineStats  # this process's engine
  rollout_s: float
  train_s: float
  state: object = None  # the train state after the step's update
  step_s: float = 0.0  # the step's wall time: its wait for rollouts, the weights' copy, the update
  wait_s: float = 0.0  # the wait for its rollouts (about 0 when they ran during the last update)
  sync_s: float = 0.0  # copying the weights the rollouts sampled to the rollout's devices
  sync_bytes: int = 0  # what that copy holds on them (0: the sampler read the trainer's arrays)


class Hook:
  """The hook interface; each method's default does nothing. The loop calls `metrics` and
  `end_step` on the steps the hook is `due`."""

  every: int = 1  # runs after steps every - 1, 2 * every - 1, ... (0-based)

  def due(self, step: int) -> bool:
    return (step + 1) % self.every == 0

  def begin_step(self, step: int) -> None:
    pass

  def metrics(self, out: StepOutput) -> dict:
    return {}

  def end_step(self, out: StepOutput, metrics: dict) -> None:
    pass

  def meta(self) -> dict:
    return {}

  def restore(self, meta: dict) -> None:
    pass


class Budgets(Hook):
  """The budget tables of a sparse run. Every table the run can use (each stage, or up to the
  closed loop's ceiling) selects at most one static number of pages, so a new stage or a moved
  table changes only the traced BudgetTable: neither the sampler nor the train step recompiles.
  Each distinct schedule's table is built and placed once."""

  def __init__(self, stages, loop, switch, cfg, sparse, mesh, cache_len: int):
    """stages: rollout.schedule's ((first step, KVSchedule), ...), ignored with `loop` (a
    ClosedLoop: the adaptive table); switch: exact mode's DraftSwitch, or None."""
    self.loop, self.switch = loop, switch
    self.stages = ((0, loop.first),) if loop else stages
    self._host = functools.cache(lambda s: sampler.budget_table(s, cache_len, sparse))
    largest = [s for _, s in self.stages] + ([self.loop.ceiling] if self.loop else [])
    cap = sampler.max_selected_pages([self._host(s) for s in largest])
    replicated = sharding.replicated(mesh)
    self._placed = functools.cache(
      lambda s: sharding.place(schedule_lib.BudgetTable(self._host(s), cap), replicated)
    )
    self.cfg, self.sparse = cfg, sparse

  @property
  def example_table(self) -> schedule_lib.BudgetTable:
    """A table as every step's (one shape, one static cap): to compile the train step up front."""
    return self._placed(self.stages[0][1])

  def placed(self, budget: StepBudget) -> StepBudget:
    """A budget read back from disk (its placed table left out) with its table placed again."""
    return budget._replace(table=self._placed(budget.schedule))

  def for_step(self, step: int) -> StepBudget:
    stage = schedule_lib.stage_index(self.stages, step)
    schedule = self.stages[stage][1]
    if self.loop:
      schedule = dataclasses.replace(schedule, values=self.loop.state.topk)
    drafts = self.switch.plan(schedule) if self.switch else None
    return StepBudget(stage, schedule, self._host(schedule), self._placed(schedule), drafts)

  def metrics(self, out: StepOutput) -> dict:
    metrics = {"kv/schedule_stage": out.budget.stage}
    if self.loop:
      start = self._host(self.stages[out.budget.stage][1])
      metrics.update(self.loop.metrics(out, start, self.cfg, self.sparse))
    if self.switch:  # the drafts per bin the step's rollout ran (0: dense decoding)
      metrics["rollout/draft_k_bin"] = np.asarray(out.budget.drafts.k_bin, np.int32)
      metrics.update(self.switch.metrics())
      # the share of the step's timed chunks that ran beside the loop's step (kept apart)
      metrics["rollout/round_timing_beside_update"] = out.engine_stats.timed_beside()
    return metrics

  def end_step(self, out: StepOutput, metrics: dict) -> None:
    if self.loop:  # the next step's table, a function of this step's tail: a resume replays it
      self.loop.advance(metrics)
    if self.switch:
      self.switch.advance(out, metrics)

  def meta(self) -> dict:
    meta = {"adaptive": self.loop.meta()} if self.loop else {}
    return meta | ({"drafts": self.switch.meta()} if self.switch else {})

  def restore(self, meta: dict) -> None:
    if self.loop:
      self.loop.restore(meta["adaptive"])
    if self.switch:
      self.switch.restore(meta["drafts"])


# The share of dense decoding's priced rate a k must beat it by to replace it: a plan is priced
# from the engine's clock, whose readings of one program spread between calls by more than the
# small gains a k prices at, and a k taken on a misreading runs slower than dense
# (docs/rollout_engine.md, "The regime switch").
MARGIN = 0.1


class DraftSwitch:
  """rollout.speculate = "auto": exact mode's drafts per position bin, priced each step
  (cost_model.draft_plan: the k of rollout.speculate_ks, or dense decoding, with the most
  tokens/s) at each bin's mean acceptance of the sparse actor's drafts. That acceptance is the
  train step's exact alpha (acceptance/mean_bin: dense p against the sparse actor q on the
  rollout's dense samples), measured in every bin whatever ran there, so a dense bin can switch
  to drafting. A bin not yet measured decodes densely: the first step is dense decoding, never
  slower than it.

  Rounds are priced on the engine's own clock, each chunk at the cached length its rounds ran at:
  the roofline of `rollout.speculate_hardware` gives each round's shape over lengths, measured
  dense rounds (decode steps) what every pass costs beyond it (cost_model.pass_overhead), and
  measured rounds of k drafts the factor k's rounds cost beyond that (cost_model.round_scale). A k
  not yet run is priced by the roofline alone; once run, its measured price holds until it runs
  again, so a k that did not pay stays off unless the acceptance rises enough to pay for it as
  measured.

  Rounds timed while the loop ran its step beside them (one step off: the update and the hooks
  share the machine with the rollout thread, `EngineStats.beside_until`) are slower by what they
  share, for every k: they never set the pass overhead, and a k's factor from them is kept apart
  (`scale_beside`) and charged only relative to the dense rounds timed beside a step too, on the
  quiet dense clock: scale_beside[k] / scale_beside[0] * scale[0]. A factor timed alone wins over
  one timed beside a step."""

  def __init__(self, cfg, sparse, rows: int, ks: tuple, stats, hardware: cost_model.Hardware):
    """rows: the rows a device decodes at once; ks: rollout.speculate_ks; stats: the StatsConfig
    whose bins the acceptance comes in."""
    self.cfg, self.sparse, self.rows = cfg, sparse, rows
    self.ks, self.bin_size, self.hardware = tuple(ks), stats.bin_size, hardware
    self.alpha = [float("nan")] * stats.num_bins
    self.scale = {}  # k -> its rounds timed alone: seconds over the roofline's (round_scale)
    self.scale_beside = {}  # k -> the same of its rounds timed beside the loop's step

  def priced(self) -> dict:
    """{k: the factor the plan charges k's rounds}: the one timed alone, else the one timed beside
    a step relative to dense rounds timed beside one (both slowed by what they shared)."""
    priced = dict(self.scale)
    if 0 in self.scale_beside:
      clock = self.scale.get(0, 1.0) / self.scale_beside[0]
      for k, s in self.scale_beside.items():
        priced.setdefault(k, s * clock)
    return priced

  def plan(self, schedule) -> schedule_lib.DraftPlan:
    kw = dict(bin_size=self.bin_size, ks=self.ks, rows=self.rows, hardware=self.hardware)
    kw.update(scale=self.priced(), margin=MARGIN)
    return cost_model.draft_plan(self.cfg, schedule, self.sparse, self.alpha, **kw)

  def advance(self, out: StepOutput, metrics: dict) -> None:
    """The step's mean acceptance per bin replaces the last where the bin had tokens; the step's
    measured rounds, each at the cached length it ran at, reprice what ran."""
    count = np.asarray(metrics["acceptance/count_bin"])
    mean = np.asarray(metrics["acceptance/mean_bin"], np.float64)
    self.alpha = [float(m) if n else a for a, m, n in zip(self.alpha, mean, count)]
    stats = out.engine_stats
    self.reprice(stats.round_timings(), out.budget.schedule, stats.round_timings(beside=True))

  def reprice(self, timings: dict, schedule, beside: Optional[dict] = None) -> None:
    """timings: {k: [(seconds per round, mean cached length), ...]} (k = 0: dense decode steps) of
    chunks timed alone, the drafts under `schedule`; beside: the same of chunks timed beside the
    loop's step. Every process's factors are its own rounds' at their own lengths; the slowest
    process's count (all run the same programs)."""
    ks = (0, *self.ks)
    overhead = {}
    if 0 in timings:
      seconds, cached = np.asarray(timings[0], np.float64).T
      overhead[0] = cost_model.pass_overhead(self.cfg, self.hardware, self.rows, cached, seconds)
    if overhead := _slowest_process(overhead, (0,)):  # every process gathers, timed or not
      self.hardware = dataclasses.replace(self.hardware, pass_overhead_s=overhead[0])
    kw = dict(rows=self.rows, hardware=self.hardware)
    for book, measured in ((self.scale, timings), (self.scale_beside, beside or {})):
      scale = cost_model.round_scale(self.cfg, schedule, self.sparse, measured, **kw)
      book |= _slowest_process(scale, ks)

  def metrics(self) -> dict:
    return {f"rollout/round_scale/k{k}": s for k, s in sorted(self.priced().items())}

  def meta(self) -> dict:  # strict JSON: an unmeasured bin is null
    alpha = [None if np.isnan(a) else a for a in self.alpha]
    scale, beside = ({str(k): s for k, s in d.items()} for d in (self.scale, self.scale_beside))
    overhead = self.hardware.pass_overhead_s
    return {"alpha": alpha, "pass_overhead_s": overhead, "scale": scale, "scale_beside": beside}

  def restore(self, meta: dict) -> None:
    self.alpha = [float("nan") if a is None else float(a) for a in meta["alpha"]]
    overhead = meta["pass_overhead_s"]
    self.hardware = dataclasses.replace(self.hardware, pass_overhead_s=overhead)
    self.scale = {int(k): float(s) for k, s in meta["scale"].items()}
    self.scale_beside = {int(k): float(s) for k, s in meta.get("scale_beside", {}).items()}


def _slowest_process(values: dict, ks) -> dict:
  """{k: value} for the ks some process measured, each the largest of the processes'."""
  v_k = np.asarray([values.get(k, -np.inf) for k in ks], np.float64)
  if jax.process_count() > 1:
    v_k = np.max(multihost_utils.process_allgather(v_k), axis=0)
  return {k: float(v) for k, v in zip(ks, v_k) if v > -np.inf}


class ClosedLoop:
  """rollout.schedule = 'adaptive:TAU:BASE': the table in force, its floors and pools
  (schedule.LoopState), moved after each step by schedule.adapt_topk.

  The table has a bin per stats bin at least (BASE's last value repeated: the same budgets), so
  every measured bin moves its own value; bins past stats.num_bins are never measured and hold."""

  def __init__(self, tau: float, base, loop: schedule_lib.LoopConfig, num_bins: int):
    """tau, base: the spec's TAU and BASE schedule (schedule.parse_adaptive); num_bins: the stats
    bins measured."""
    self.first = dataclasses.replace(
      base, values=base.values + base.values[-1:] * (num_bins - len(base.values))
    )
    top = loop.ceiling(base.values)
    self.ceiling = dataclasses.replace(base, values=(top,))
    self.unmeasured = len(self.first.values) - num_bins
    self.rule = loop.rule(tau, top)
    self.state = schedule_lib.LoopState.start(self.first.values)

  def metrics(self, out: StepOutput, start_by_len, cfg, sparse) -> dict:
    return {
      "kv/topk_bin": np.asarray(self.state.topk, np.int32),  # the table this step ran under
      "kv/floor_bin": np.asarray(self.state.floor, np.int32),  # and its floors
      # The start table's read of the same rollouts: the loop's saving (or cost) over the table it
      # moved from, paired token for token (two runs' read fractions differ by their lengths).
      "kv/read_fraction_start": cost_model.kv_read_fraction(
        start_by_len, out.prompt_len_B, out.lengths_B, cfg, sparse
      ),
    }

  def advance(self, metrics: dict) -> None:
    pad = lambda x, fill=0: np.pad(
      np.asarray(x, np.float64), (0, self.unmeasured), constant_values=fill
    )
    count_b = pad(metrics["acceptance/count_bin"]).astype(np.int64)
    # the step's tokens under tau per bin (an empty bin's NaN share: none)
    below_b = np.rint(np.nan_to_num(pad(metrics["acceptance/frac_below_tau_bin"])) * count_b)
    p10_b = pad(metrics["acceptance/p10_bin"], np.nan)
    self.state = schedule_lib.adapt_topk(
      self.state, count_b, below_b.astype(np.int64), p10_b, self.rule
    )

  def meta(self) -> dict:
    return {k: list(v) for k, v in self.state._asdict().items()}

  def restore(self, meta: dict) -> None:
    self.state = schedule_lib.LoopState(**{k: tuple(v) for k, v in meta.items()})


@dataclasses.dataclass
class KVMetrics(Hook):
  """The KV the step's rollouts read, relative to dense, and the speedup the roofline predicts for
  them on `hardware`."""

  cfg: object  # the model's Qwen3Config
  sparse: object  # its SparseConfig; None: dense rollouts
  engine_cfg: engine.EngineConfig
  hardware: object  # a cost_model.Hardware (sparse runs)
  max_new_tokens: int  # a row's cap (rollout.max_new_tokens)
  group_size: int  # rows per prompt, which share its prefill

  def metrics(self, out: StepOutput) -> dict:
    by_len = None if out.budget is None else out.budget.pages_by_len
    metrics = {
      "kv/read_fraction": cost_model.kv_read_fraction(
        by_len, out.prompt_len_B, out.lengths_B, self.cfg, self.sparse
      )
    }
    if out.budget is not None:
      metrics["kv/predicted_speedup"] = predicted_speedup(
        self.cfg,
        self.sparse,
        out.budget.schedule,
        self.engine_cfg,
        self.hardware,
        out.prompt_len_B,
        out.lengths_B,
        self.max_new_tokens,
        self.group_size,
      )
    return metrics


def predicted_speedup(
  cfg,
  sparse,
  schedule,
  engine_cfg: engine.EngineConfig,
  hardware,
  prompt_len_B,
  lengths_B,
  max_new_tokens: int,
  group_size: int,
) -> float:
  """Sparse over dense rollout tokens/s of one device of `hardware` running this run's engine
  (its slots and pool) on the step's mean prompt and mean response length (the roofline of
  cost_model.roofline_engine_rate: weights and KV read per decode step, each prompt prefilled
  once)."""
  mean_len_frac = float(np.mean(lengths_B)) / max_new_tokens
  rate = lambda sched: cost_model.roofline_engine_rate(
    cfg,
    sched,
    int(np.mean(prompt_len_B)),
    max_new_tokens,
    slots=engine_cfg.num_slots,
    pool_tokens=engine_cfg.num_pages * sparse.page_size,
    mean_len_frac=min(max(mean_len_frac, 1 / max_new_tokens), 1.0),
    n_samples=group_size,
    hardware=hardware,
    sparse=sparse,
  )[0]
  return rate(schedule) / rate(None)


@dataclasses.dataclass
class PerfMetrics(Hook):
  """Wall-time rates and the engine's use of its slots (they depend on the devices and on this
  process's engine, as timings do), and the learning rate."""

  learning_rate: object  # step -> learning rate (the optimizer's schedule)

  def metrics(self, out: StepOutput) -> dict:
    stats = out.engine_stats
    return {
      "perf/rollout_tokens_per_s": int(np.sum(out.lengths_B)) / out.rollout_s,
      "perf/engine_occupancy": stats.occupancy,
      "perf/engine_rows_in_flight": stats.rows_in_flight,
      "perf/engine_preemptions": stats.preemptions,
      "perf/train_step_s": out.train_s,
      "perf/step_s": out.step_s,
      "perf/rollout_wait_s": out.wait_s,
      "perf/weight_sync_s": out.sync_s,
      "perf/weight_sync_bytes": out.sync_bytes,
      "lr": float(self.learning_rate(out.step)),
    }


@dataclasses.dataclass(eq=False)
class Evaluation(Hook):
  """mean@k and pass@k of the policy after every `every`-th step on held-out problems
  (config.eval: the task's first eval.problems under eval.seed, eval.samples each; rl/evaluate.py
  samples, grades and scores them): dense, and for sparse rollouts also under the step's own KV
  budget (the table its rollouts ran under: a stage's, or the closed loop's) with the sparse
  actor's LoRA, logged at the step as eval/dense/* and eval/sparse/*. Every evaluation draws with
  the same key, dense and sparse alike, so two evaluations differ by the policy and the budget, not
  by the draw. Each evaluation and mode shows eval.completions completions (each problem's first
  sample) as TensorBoard text (eval/<mode>/samples) and rows of `samples_path` (None: another
  process writes it); the history of every evaluation is in the checkpoint meta, so a resumed run
  keeps it."""

  e: evaluate.EvalConfig
  task: object  # the held-out task (eval.seed's)
  problems: list  # its first eval.problems
  tokenizer: object
  weights: object  # (params, lora) -> the sampler's copy (build.rollout_weights)
  cfg: object  # the model's Qwen3Config
  sparse: object  # the SparseConfig of the sparse mode; None: dense rollouts
  generation: tuple  # (max_new_tokens, sampler.Sampling) of the run's rollouts
  batch_size: int  # rows a generate call: the run's rows per step, at most all of them
  samples_path: Optional[str]  # eval_samples.jsonl; None: another process writes it

  def __post_init__(self):
    self.every = self.e.every
    self.key = jax.random.PRNGKey(self.e.seed)
    self.history = []  # {"step": logged step, metric: value, ...} per evaluation

  def metrics(self, out: StepOutput) -> dict:
    params, lora = self.weights(out.state.params, out.state.lora)
    modes = {"dense": {}}
    if out.budget is not None:
      modes["sparse"] = dict(sparse=self.sparse, schedule=out.budget.table, lora=lora)
    metrics, rows = {}, []
    for mode, kwargs in modes.items():
      max_new_tokens, sampling = self.generation
      generate = functools.partial(
        engine.generate,
        params,
        self.cfg,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        **kwargs,
      )
      graded = evaluate.sample_and_grade(
        generate,
        self.tokenizer,
        self.task,
        self.problems,
        self.e.samples,
        self.key,
        self.batch_size,
      )
      scores = evaluate.score(graded, self.e.samples, self.e.ks, max_new_tokens)
      metrics.update({f"eval/{mode}/{name}": value for name, value in scores.items()})
      shown = _shown(graded, self.problems, self.e, out.step + 1, mode)
      metrics[f"eval/{mode}/samples"] = _markdown(shown)
      rows += shown
    self.history.append(
      {"step": out.step + 1, **{k: v for k, v in metrics.items() if not isinstance(v, str)}}
    )
    if self.samples_path:
      logging.append_text(self.samples_path, "".join(json.dumps(row) + "\n" for row in rows))
    return metrics

  def meta(self) -> dict:
    return {"eval_history": self.history}

  def restore(self, meta: dict) -> None:
    # A run that evaluates from its resume on (eval.every may change then) has no history before.
    self.history = list(meta.get("eval_history", []))


def _shown(graded, problems, e, step: int, mode: str) -> list:
  """The rows of eval_samples.jsonl: the first sample of each of the first e.completions
  problems."""
  return [
    {
      "step": step,
      "mode": mode,
      "problem": str(p.id),
      "prompt": p.prompt,
      "completion": graded.responses[i * e.samples],
      "reward": float(graded.rewards_a[i * e.samples]),
    }
    for i, p in enumerate(problems[: e.completions])
  ]


def _markdown(rows) -> str:
  """Completions as TensorBoard text (markdown): each prompt and completion verbatim."""
  return "\n\n".join(
    f"**{r['problem']}**, reward {r['reward']:g}\n\n```\n{r['prompt']}\n```\n\n"
    f"```\n{r['completion']}\n```"
    for r in rows
  )


class Checkpoint(Hook):
  """Saves the train state after every `every`-th step and after the last, with the data position
  and the meta of `hooks` (placed after them in the loop: the meta of the state they end the step
  in), for `_restore` in rl/trainer.py."""

  def __init__(
    self, mgr, every: int, total_steps: int, data_position: Callable, hooks=(), under_way=None
  ):
    """data_position: step -> the data position of the step's first new prompt; under_way: () ->
    what the run has under way (rl/rollouts.py's `Source.saved`), kept in the same checkpoint."""
    self.mgr, self.every, self.total_steps = mgr, every, total_steps
    self.data_position, self.hooks, self.under_way = data_position, list(hooks), under_way

  def due(self, step: int) -> bool:
    return super().due(step) or step + 1 == self.total_steps

  def end_step(self, out: StepOutput, metrics: dict) -> None:
    step = out.step + 1
    meta = {"step": step, "data_position": self.data_position(step)}
    for hook in self.hooks:
      meta.update(hook.meta())
    checkpoint.save(self.mgr, step, out.state, meta, self.under_way and self.under_way())


class Profile(Hook):
  """A jax.profiler trace of steps [start, stop) (0-based, config.profile_steps), each from its
  prompts through its update, into `directory` in the layout TensorBoard's profile plugin reads
  (plugins/profile/<run>/<host>.xplane.pb). A run that ends or resumes inside the range traces the
  steps it runs there; `close` writes the trace out whenever the run ends."""

  def __init__(self, directory: str, start: int, stop: int):
    self.directory, self.start, self.stop, self.tracing = directory, start, stop, False

  def due(self, step: int) -> bool:
    return self.start <= step < self.stop

  def begin_step(self, step: int) -> None:
    if not self.tracing:
      jax.profiler.start_trace(self.directory)
      self.tracing = True

  def end_step(self, out: StepOutput, metrics: dict) -> None:
    if out.step + 1 == self.stop:
      self.close()

  def close(self) -> None:
    if self.tracing:
      jax.profiler.stop_trace()
      self.tracing = False
