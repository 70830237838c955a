"""A run's assembly: every component of a training run built from its experiment config (the task,
the tokenizer, the model and its config, the sparse config, each device's engine, the sampling,
the optimizers, the train state, the sampler, the hooks) and `build(config, mesh) -> Run`, which
builds them in the order that lets every check run before the weights are read or the workdir is
written (rl/run_config.py holds the checks). rl/trainer.py drives the Run; rl/ modules take their
builders from here only.
"""

import dataclasses
import math
import os
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from sparrow_jax import schema, sharding
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.data import synthetic, tasks
from sparrow_jax.data.tokenizer import load_tokenizer
from sparrow_jax.envs import registry as env_registry
from sparrow_jax.envs import task as env_task_lib
from sparrow_jax.mismatch import cost_model
from sparrow_jax.model import lora as lora_lib
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.model.hf import load_config, load_hf
from sparrow_jax.model.qwen3 import init_params
from sparrow_jax.rl import evaluate, hooks, memory, rollouts, run_config, step_schema
from sparrow_jax.rl import train_step as ts
from sparrow_jax.rollout import engine, sampler
from sparrow_jax.sparsity import schedule as schedule_lib


def make_task(c, seed: int | None = None):
  """The task of config `c` (its `task` group, seeded by `seed` or else config.seed) from the task
  registry, or an environment's (`env_task`); an unknown name or unreadable data names the config
  fields, a synthetic task's own settings their field."""
  if c.task.name.startswith("env:"):
    return env_task(c, seed)
  with schema.naming_config_fields({"task": synthetic.PointerChase}):
    try:
      return tasks.make_task(
        c.task.name,
        c.task.path or None,
        seed=c.seed if seed is None else seed,
        min_hops=c.task.min_hops,
        max_hops=c.task.max_hops,
      )
    except (ValueError, OSError) as e:
      if str(e).startswith(f"{synthetic.PointerChase.__name__}."):
        raise
      raise ValueError(
        f"config.task.name = {c.task.name!r} with config.task.path = {c.task.path!r} is invalid: "
        f"{e}"
      ) from None


def env_task(c, seed: int | None = None) -> env_task_lib.EnvTask:
  """The multi-turn task of environment config.task.name, its fields from the config's `env`
  group (configs/common.env), its problems drawn under `seed` in place of config.env.seed when
  given (the held-out evaluation's); a bad field or value names it."""
  name = c.task.name
  if "env" not in c:
    raise ValueError(
      f"config.task.name = {name!r} is an environment: its fields go in a config.env group "
      "(configs/common.py's env())"
    )
  fields = dict(c.env) | ({} if seed is None else {"seed": seed})
  workers = fields.pop("tool_workers", 4)
  if name not in env_registry.ENVS:
    raise ValueError(
      f"config.task.name = {name!r}: unknown environment; known: {env_registry.env_names()}"
    )
  with schema.naming_config_fields({"env": env_registry.ENVS[name][0]}):
    try:
      config = env_registry.env_config(name, **fields)
    except ValueError as e:
      if str(e).startswith("unknown field"):
        raise ValueError(f"config.env: {e}") from None
      raise
  with schema.naming_config_fields({"env": env_task_lib.EnvTask}):
    return env_task_lib.EnvTask(name, config, workers)


def load_tokenizer_of(c, task):
  """The model dir's tokenizer, or for a random preset model the task's own vocabulary."""
  if c.model.hf_dir:
    return load_tokenizer(c.model.hf_dir)
  if task.own_tokenizer is None:
    raise ValueError(
      f"config.model.preset (random init) needs a task with its own vocabulary "
      f"(synthetic:pointer_chase), not {task.name!r}: set config.model.hf_dir for "
      "dataset tasks"
    )
  return task.own_tokenizer


def load_model(c, task):
  """(cfg, params, tokenizer). A random preset model is sized to the task's own vocabulary."""
  tokenizer = load_tokenizer_of(c, task)
  cfg = model_config(c, tokenizer)
  return cfg, load_params(c, cfg), tokenizer


def load_params(c, cfg: Qwen3Config):
  """The weights of config.model.hf_dir, or the preset's random init (`cfg`: `model_config`)."""
  dtype = jnp.dtype(c.model.dtype)
  if c.model.hf_dir:
    return load_hf(c.model.hf_dir, dtype=dtype)[1]
  return init_params(cfg, jax.random.PRNGKey(c.seed), dtype=dtype)


def model_config(c, tokenizer=None) -> Qwen3Config:
  """The model's config.json (read without its weights) or preset, the preset sized to
  `tokenizer`'s vocabulary when given (as `load_model` initialises it)."""
  if c.model.hf_dir:
    return load_config(c.model.hf_dir)
  preset = Qwen3Config.preset(c.model.preset)
  if tokenizer is None:
    return preset
  return Qwen3Config(**{**preset.__dict__, "vocab_size": tokenizer.vocab_size})


def sparse_config(c) -> Optional[SparseConfig]:
  """The sparse rollouts' SparseConfig from the rollout group; None for dense rollouts."""
  return schema.from_group(SparseConfig, c, "rollout") if c.rollout.sparse else None


def sampling(c, tokenizer) -> sampler.Sampling:
  """How the run samples: the rollout group's fields, the tokenizer's EOS and pad ids."""
  return dataclasses.replace(
    schema.from_group(sampler.Sampling, c, "rollout"),
    eos_ids=tokenizer.eos_ids,
    pad_id=tokenizer.pad_id,
  )


def engine_config(c, cfg: Qwen3Config, rows_per_device: int) -> engine.EngineConfig:
  """Each device's slots and pool from config.rollout: by default `engine.full_batch` (every row of
  the device's step at once, no row waits or is preempted); engine_slots / pool_gb size them for
  long-tailed lengths (more rows than slots: a finished row's slot is refilled at once)."""
  r, sparse = c.rollout, sparse_config(c)
  config = engine.full_batch(
    rows_per_device, r.group_size, r.max_prompt_len + r.max_new_tokens, sparse, r.chunk_steps
  )
  if r.engine_slots:
    config = dataclasses.replace(config, num_slots=r.engine_slots)
  if r.speculate == "auto":  # the regime switch: drafts per bin up to the largest of speculate_ks
    config = dataclasses.replace(config, speculate=max(r.speculate_ks), draft_switch=True)
  elif r.speculate:
    config = dataclasses.replace(config, speculate=r.speculate)
  if r.pool_gb:
    config = dataclasses.replace(
      config,
      num_pages=engine.pages_for_bytes(
        cfg,
        r.pool_gb * 1e9,
        engine.page_size(sparse),
        jnp.dtype(c.model.dtype),
        sparse.page_score if sparse else "mean",
      ),
    )
  return config


def init_distributed(c) -> None:
  """jax.distributed.initialize when config.distributed.enabled (before anything touches a
  device). Empty coordinator / -1 counts: detected from the cluster (SLURM, Open MPI, TPU pods)."""
  d = c.distributed
  if not d.enabled or jax.distributed.is_initialized():
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices: gloo collectives
  kwargs = {
    "coordinator_address": d.coordinator or None,
    "num_processes": d.num_processes if d.num_processes > 0 else None,
    "process_id": d.process_id if d.process_id >= 0 else None,
  }
  jax.distributed.initialize(**{k: v for k, v in kwargs.items() if v is not None})


def make_mesh(c):
  """The trainer's (data, fsdp, tensor) mesh of config.mesh, checked against the batch
  (run_config.check_mesh): over every process's devices, less each process's first
  mesh.rollout_devices, which only roll out (`rollout_mesh`)."""
  m, n = c.mesh, rollouts.AsyncConfig.of(c).rollout_devices
  run_config.require(
    n < jax.local_device_count(),
    "mesh.rollout_devices",
    n,
    f"must leave the trainer devices: each process has {jax.local_device_count()}",
  )
  devices = sharding.split_devices(n)[0] if n else None
  try:
    mesh = sharding.make_mesh(m.data, m.fsdp, m.tensor, devices=devices)
  except ValueError as e:
    raise ValueError(
      f"config.mesh (data={m.data}, fsdp={m.fsdp}, tensor={m.tensor}, rollout_devices={n}) is "
      f"invalid: {e}"
    ) from None
  run_config.check_mesh(c, mesh)
  return mesh


def rollout_mesh(c, mesh):
  """The mesh the step's rollouts run on: the trainer's `mesh` (colocated, mesh.rollout_devices =
  0), or each process's first mesh.rollout_devices devices, rows over data and the weights whole
  on each (decode reads every weight at every token: no FSDP gathers there). Each process rolls
  out the same rows it trains on (checked)."""
  n = rollouts.AsyncConfig.of(c).rollout_devices
  if not n:
    return mesh
  devices = sharding.split_devices(n)[1]
  count = c.rollout.prompts_per_step * c.rollout.group_size
  run_config.check_rollout_split(c, n, len(devices), count)  # before the rows are split over them
  rollout = sharding.make_mesh(len(devices), 1, 1, devices=devices)
  run_config.check_rollout_mesh(n, Rows.of(rollout, count), Rows.of(mesh, count))
  return rollout


class Optimizers(NamedTuple):
  learning_rate: optax.Schedule  # step -> learning rate (warmup, then constant)
  base: optax.GradientTransformation  # of the base params
  lora: Optional[optax.GradientTransformation]  # of the sparse actor's LoRA; None without distill


def optimizers(c) -> Optimizers:
  lr = optax.join_schedules(
    [
      optax.linear_schedule(0.0, c.rl.learning_rate, c.rl.warmup_steps),
      optax.constant_schedule(c.rl.learning_rate),
    ],
    [c.rl.warmup_steps],
  )
  base = optax.chain(
    optax.clip_by_global_norm(c.rl.max_grad_norm), optax.adamw(lr, weight_decay=c.rl.weight_decay)
  )
  lora = None
  if c.distill.enabled:
    lora = optax.chain(
      optax.clip_by_global_norm(c.rl.max_grad_norm), optax.adam(c.distill.learning_rate)
    )
  return Optimizers(lr, base, lora)


def _state_init(c, opt: Optimizers):
  """(init(params, lora) -> TrainState, make_lora(params) -> the LoRA to start from, or None)."""
  make_lora = None
  if c.distill.enabled:
    make_lora = lambda p: lora_lib.init_lora(
      p,
      jax.random.PRNGKey(c.seed + 1),
      rank=c.distill.rank,
      alpha=c.distill.alpha,
      targets=tuple(c.distill.targets.split(",")),
    )
  init = lambda p, lora: step_schema.init_state(
    p,
    opt.base,
    lora,
    opt.lora,
    keep_reference=c.rl.kl_coef > 0,
    keep_behaviour=rollouts.AsyncConfig.of(c).off_policy_steps > 0,
  )
  return init, make_lora


def abstract_state(c, cfg, mesh, opt: Optimizers):
  """(the train state's shapes and dtypes, its shardings on `mesh`): the state `build_state`
  makes from params of `cfg`, with nothing allocated and no weights read."""
  params = jax.eval_shape(
    lambda: init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.dtype(c.model.dtype))
  )
  init, make_lora = _state_init(c, opt)
  state = jax.eval_shape(init, params, jax.eval_shape(make_lora, params) if make_lora else None)
  return state, step_schema.state_sharding(state, mesh, opt.base, opt.lora)


def build_state(c, params, shardings, opt: Optimizers):
  """The initial TrainState, born on `shardings` (`abstract_state`'s: the optimizer and LoRA
  states are created on their shards)."""
  init, make_lora = _state_init(c, opt)
  lora = make_lora(params) if make_lora else None
  params = sharding.place(params, shardings.params)
  lora = None if lora is None else sharding.place(lora, shardings.lora)
  return jax.jit(init, out_shardings=shardings)(params, lora)


def _placed_like(abstract, shardings):
  """The abstract arrays `abstract` on `shardings` (a matching tree, or one sharding for all)."""
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, abstract)
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type),
    abstract,
    shardings,
  )


def train_step(c, cfg, opt: Optimizers, sparse, shardings):
  """The fused train step (rl/train_step.py) of config `c`, jitted for the state's shardings."""
  step_config = step_schema.StepConfig.from_config(c)
  return ts.make_train_step(cfg, step_config, opt.base, opt.lora, sparse, shardings)


def lower_step(c):
  """The config's train step lowered at full size on the current devices' mesh, from abstract
  params and batch (nothing is allocated, no weights or data read): checks that a real-run config
  builds, shards and traces before a cluster is booked. Returns the jax `Lowered` and the train
  state's shardings."""
  run_config.validate(c)
  mesh = make_mesh(c)
  r = c.rollout
  cfg, opt = model_config(c), optimizers(c)
  state, shardings = abstract_state(c, cfg, mesh, opt)
  step = train_step(c, cfg, opt, sparse_config(c), shardings)
  length = r.max_prompt_len + r.max_new_tokens
  batch = step_schema.Batch.abstract(r.prompts_per_step * r.group_size, length, r.num_top_logprobs)
  table = jax.ShapeDtypeStruct((budget_len(c) + 1,), jnp.int32)
  budget = schedule_lib.BudgetTable(table) if r.sparse else None
  with jax.set_mesh(mesh):
    return step.lower(state, batch, budget), shardings


def rollout_weights(state, mesh, rollout, copy: bool = False):
  """(params, lora) on the trainer's `mesh` -> the sampler's copy on the `rollout` mesh, gathered
  over fsdp once per rollout (sharding.ROLLOUT_RULES). On the trainer's own mesh without FSDP it is
  the same arrays, unless `copy` (an off-policy rollout still reads them while the update, which
  donates the state, runs); on a mesh of its own (`rollout_mesh`) the arrays are resharded onto
  its devices, device to device (`jax.device_put`)."""
  rules = sharding.ROLLOUT_RULES
  out = (
    sharding.param_shardings(state.params, rollout, rules),
    None if state.lora is None else sharding.lora_shardings(state.lora, rollout, rules),
  )
  if rollout is not mesh:
    return lambda params, lora: jax.device_put((params, lora), out)
  if mesh.shape["fsdp"] == 1 and not copy:
    return lambda params, lora: (params, lora)
  fresh = (lambda tree: jax.tree.map(jnp.copy, tree)) if copy else (lambda tree: tree)
  return jax.jit(lambda params, lora: fresh((params, lora)), out_shardings=out)


class Sampler(NamedTuple):
  """The step's rollouts on the rollout mesh: `sync` copies the policy's weights there (timed by
  the loop), `sample` runs the engine on them."""

  sync: Callable  # TrainState -> the rollout's (params, lora)
  # ((params, lora), the new groups' problems, their Requests, key, StepBudget | None, the
  # weights' version, a multi-turn task's turns or None) -> rollouts.Taken: the rows the step
  # trains on
  sample: Callable
  mesh: Any  # the rollout mesh (the trainer's when colocated)
  carried: Optional[rollouts.Carried]  # the rows under way across steps (rollout.partial_groups)


def sampler_of(c, cfg, task, tokenizer, state, meshes, engine_cfg, sparse) -> Sampler:
  """The engine over the policy's weights on the rollout mesh, fed this process's
  engine.Requests; state: the train state (abstract) whose weights it samples; meshes: (the
  trainer's, the rollout's: `rollout_mesh`)."""
  how, overlap = sampling(c, tokenizer), rollouts.AsyncConfig.of(c)
  weights = rollout_weights(state, *meshes, copy=overlap.off_policy_steps > 0)
  mesh, r = meshes[1], c.rollout
  replicated = sharding.replicated(mesh)
  carried = None
  if overlap.partial_groups:  # one key for rows of every step: step 0's (fold_in(key, step))
    key = np.asarray(jax.random.fold_in(jax.random.PRNGKey(c.seed), 0))
    kept = engine.Partial(cfg, key, engine=engine_cfg, sampling=how, sparse=sparse)
    rows = Rows.of(mesh, r.prompts_per_step * r.group_size)
    share = rollouts.process_groups(r.prompts_per_step, rows)
    groups = share.stop - share.start
    parts = (r.group_size, groups, overlap.max_carry_steps)
    carried = rollouts.Carried(kept, mesh, task, tokenizer, *parts)

  def sync(state):
    return weights(state.params, state.lora)

  def sample(synced, problems, requests, key, budget, version, turns=None):
    params, lora = synced
    if budget is not None:
      budget = budget._replace(table=jax.device_put(budget.table, replicated))
    if carried:
      return carried.sample(synced, problems, requests, version, budget, turns)
    with jax.set_mesh(mesh):  # also in a rollout thread: a mesh context is the thread's own
      rollout, stats = engine.run(
        params,
        cfg,
        requests,
        np.asarray(key),
        engine=engine_cfg,
        sampling=how,
        sparse=sparse,
        lora=lora,
        turns=turns,
        **rollouts.budget_args(budget),
      )
    rows = range(requests.first_row, requests.first_row + len(requests.prompt_len_B))
    parts = (requests.prompt_BT, requests.prompt_len_B, rollout, stats, rows, turns)
    return rollouts.Taken(problems, *parts)

  return Sampler(sync, sample, mesh, carried)


def budget_len(c) -> int:
  """The longest cached length a sparse run's budget tables cover: prompt + completion up to the
  end of its last page, where the engine's cache of a row ends (`engine.run`)."""
  r = c.rollout
  return -(-(r.max_prompt_len + r.max_new_tokens) // r.page_size) * r.page_size


def budgets(c, cfg, sparse, mesh, cache_len: int, rows: int = 1) -> hooks.Budgets:
  """The budget tables of a sparse run (hooks.Budgets): rollout.schedule's stages, or its closed
  loop's table; with rollout.speculate = "auto", exact mode's drafts per bin for a device's
  `rows` at once."""
  r = c.rollout
  stats = step_schema.StepConfig.from_config(c).stats
  adaptive = schedule_lib.parse_adaptive(r.schedule, r.page_size)  # (tau, BASE) or None
  loop = stages = switch = None
  if adaptive:
    config = schema.from_group(schedule_lib.LoopConfig, c, "rollout", "stats")
    loop = hooks.ClosedLoop(*adaptive, config, stats.num_bins)
  else:
    stages = schedule_lib.parse_stages(r.schedule, r.page_size)
  if r.speculate == "auto":
    hardware = cost_model.get_hardware(r.speculate_hardware)
    switch = hooks.DraftSwitch(cfg, sparse, rows, r.speculate_ks, stats, hardware)
  return hooks.Budgets(stages, loop, switch, cfg, sparse, mesh, cache_len)


def kv_metrics(c, cfg, sparse, engine_cfg, hardware) -> hooks.KVMetrics:
  r = c.rollout
  return hooks.KVMetrics(cfg, sparse, engine_cfg, hardware, r.max_new_tokens, r.group_size)


def evaluation(c, cfg, sparse, task, tokenizer, weights, samples_path) -> hooks.Evaluation:
  """The held-out evaluation hook of config.eval on `task` (eval.seed's), its rows checked."""
  e, r = schema.from_group(evaluate.EvalConfig, c, "eval"), c.rollout
  run_config.check_evaluation_rows(c, task)
  problems = evaluate.first_problems(task, e.problems, "config.eval.problems")
  run_config.check_prompt_lengths(problems, tokenizer, r.max_prompt_len)
  # The run's rows per step: a batch its engine and KV pool are sized (and checked) for.
  batch_size = min(r.prompts_per_step * r.group_size, len(problems) * e.samples)
  generation = (r.max_new_tokens, sampling(c, tokenizer))
  return hooks.Evaluation(
    e, task, problems, tokenizer, weights, cfg, sparse, generation, batch_size, samples_path
  )


class Rows(NamedTuple):
  """The step's rollout rows on the mesh: their sharding, their number and the block [lo, hi) of
  them this process samples, rewards and places (whole GRPO groups: run_config.check_mesh)."""

  sharding: jax.sharding.NamedSharding
  count: int
  lo: int
  hi: int

  @classmethod
  def of(cls, mesh, count: int) -> "Rows":
    rows = sharding.rows(mesh)
    return cls(rows, count, *sharding.process_rows(rows, count))

  def place(self, local):
    """This process's rows (host data) -> the global array of every row."""
    return sharding.from_local_rows(np.asarray(local), self.sharding, self.count)

  def every_row(self, local, placed):
    """Every row's value on this host: `local` (host data) where this process holds every row,
    else the global array `placed` gathered from the other processes."""
    return local if self.hi - self.lo == self.count else sharding.to_host(placed)


@dataclasses.dataclass
class Run:
  """A training run's components, built and checked (`build`); rl/trainer.py drives it."""

  task: object
  tokenizer: object
  cfg: Qwen3Config
  state: step_schema.TrainState  # the initial train state, on its shardings
  train_step: Callable  # (state, Batch, BudgetTable | None) -> (state, metrics), jitted
  source: rollouts.Source  # the graded rows of each step, whatever the rollout mode
  engine_cfg: engine.EngineConfig  # each device's engine
  budgets: Optional[hooks.Budgets]  # None: dense rollouts
  hooks: list  # the step hooks, Budgets among them
  evaluation: Optional[hooks.Evaluation]  # also among `hooks`; None: config.eval.every = 0
  rows: Rows  # the step's rows on the mesh
  to_batch: Callable  # placed (prompt, prompt_len, Rollout, rewards) -> the step's Batch


def build(c: ml_collections.ConfigDict, mesh) -> Run:
  """Every component of config `c`'s run on `mesh`, each check run as soon as what it needs is
  known and all of them before the model's weights are read: the task before the model (a bad
  dataset fails in seconds), the train step compiled from abstract inputs for XLA's memory
  analysis, then the weights. Nothing is written."""
  run_config.check_workdir(c.workdir)
  run_config.check_resume(c)  # reads only: a changed config fails before the model loads
  r, sparse, overlap = c.rollout, sparse_config(c), rollouts.AsyncConfig.of(c)
  task = make_task(c)
  tokenizer = load_tokenizer_of(c, task)
  cfg = model_config(c, tokenizer)
  rows = Rows.of(mesh, r.prompts_per_step * r.group_size)
  rollout = rollout_mesh(c, mesh)
  device = jax.local_devices()[0]
  devices = math.prod(rollout.shape[a] for a in sharding.BATCH)
  run_config.require(
    overlap.partial_groups % jax.process_count() == 0,
    "rollout.partial_groups",
    overlap.partial_groups,
    f"must split evenly over the {jax.process_count()} processes (each rolls out its share)",
  )
  device_rows = rows.count // devices
  run_config.check_rows(c, device_rows, device, sparse)
  run_config.check_inputs(c, task, cfg, tokenizer)
  # partial rollouts: a device holds its share of the groups under way, partial_groups more
  under_way = -(-(r.prompts_per_step + overlap.partial_groups) // devices) * r.group_size
  engine_cfg = engine_config(c, cfg, under_way)
  run_config.check_pool(c, sparse, engine_config(c, cfg, rows_per_device=1))
  opt = optimizers(c)
  abstract, shardings = abstract_state(c, cfg, mesh, opt)
  weights = rollout_weights(abstract, mesh, mesh)  # the held-out evaluation's, on this mesh
  cache_len = r.max_prompt_len + r.max_new_tokens
  step_hooks = [hooks.PerfMetrics(opt.learning_rate)]
  step_hooks.append(kv_metrics(c, cfg, sparse, engine_cfg, _hardware(c, sparse)))
  budget = budgets(c, cfg, sparse, mesh, budget_len(c), engine_cfg.num_slots) if sparse else None
  step_hooks += [budget] if budget else []
  held_out = None
  if c.eval.every:
    samples = os.path.join(c.workdir, "eval_samples.jsonl") if jax.process_index() == 0 else None
    eval_task = make_task(c, c.eval.seed)
    held_out = evaluation(c, cfg, sparse, eval_task, tokenizer, weights, samples)
    step_hooks.append(held_out)
  step = train_step(c, cfg, opt, sparse, shardings)
  # Compiled from abstract inputs before any weight is read, for XLA's memory analysis of the
  # step. The jit keeps the executable for inputs of these shapes and shardings, so the loop's
  # first call does not compile it again.
  batch = step_schema.Batch.abstract(rows.count, cache_len, r.num_top_logprobs)
  compiled = step.lower(
    _placed_like(abstract, shardings),
    _placed_like(batch, rows.sharding),
    budget.example_table if budget else None,
  ).compile()
  step_memory = memory.StepMemory.of(compiled, abstract, shardings)
  # rollout devices of their own hold the weights whole (bytes of every leaf), no train state
  whole = (abstract.params, abstract.lora) if overlap.rollout_devices else ()
  whole = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(whole))
  run_config.check_memory(c, cfg, engine_cfg, sparse, step_memory, device, whole)
  state = build_state(c, load_params(c, cfg), shardings, opt)
  sampler_ = sampler_of(c, cfg, task, tokenizer, abstract, (mesh, rollout), engine_cfg, sparse)
  source = rollouts.Source(rollouts.Settings.of(c), task, tokenizer, sampler_, rows, budget)
  to_batch = jax.jit(step_schema.batch_from_rollout, out_shardings=rows.sharding)
  parts = (task, tokenizer, cfg, state, step, source, engine_cfg, budget, step_hooks, held_out)
  return Run(*parts, rows, to_batch)


def _hardware(c, sparse) -> Optional[cost_model.Hardware]:
  """The roofline kv/predicted_speedup prices (sparse runs), measured once."""
  return cost_model.get_hardware(c.hardware) if sparse else None
