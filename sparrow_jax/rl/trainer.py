"""The RL loop: sample prompts -> (sparse) rollout -> rewards -> fused train step -> log,
checkpoint. What a step does beside that (the KV budgets and the closed loop, the kv and perf
metrics, the held-out evaluation, the checkpoint with their meta) are hooks (rl/hooks.py); the
config's checks and the components it builds are rl/run_config.py.

Everything a step needs is a pure function of (config, step, restored state): the data position is
`step * prompts_per_step`, the rollout key is fold_in(seed key, step), and an adaptive schedule's
table is in the checkpoint meta. So a run killed at any point and restarted with the same workdir
replays exactly the steps an uninterrupted run would have taken.

A run never loses data: every check that can run before the workdir is written does
(`run_config.validate`, then `run_config.check_inputs` against the task and the model, and
`run_config.check_memory` with the train step compiled from abstract inputs, before the weights
are read), so a config error leaves no workdir behind; one run holds a workdir at a time
(`workdir_lock`); whole files are replaced atomically and metrics.jsonl is append-only (temporary
files a kill left are removed at the next start); only a checkpoint that does not read as one (or
fails its checksums) is moved aside, any other restore error stops the run, changing nothing, and
a workdir whose checkpoints are all unreadable is refused rather than restarted at step 0, unless
config.restart_from_scratch (sparrow_jax.checkpoint). SIGTERM ends the run after the step under
way with a checkpoint of it (`Preemption`).
"""

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time

from etils import epath
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from sparrow_jax import checkpoint, records, sharding
from sparrow_jax import logging as metrics_log
from sparrow_jax.attention import page_pool
from sparrow_jax.data import rewards as reward_lib
from sparrow_jax.mismatch import cost_model
from sparrow_jax.model import lora as lora_lib
from sparrow_jax.model.hf import save_hf
from sparrow_jax.model.qwen3 import init_params
from sparrow_jax.rl import hooks, lease, run_config
from sparrow_jax.rl import train_step as ts
from sparrow_jax.rollout import engine, speculative
from sparrow_jax.sparsity import schedule as schedule_lib


def export_policy(c, cfg, params, directory, task):
  """The trained policy as a Hugging Face dir (sj.load_hf, transformers, experiments/evaluate.py):
  weights and config, plus the tokenizer and generation files of the source model dir (or, for a
  random preset, the task's own vocabulary). Any other epath URL: written to a local temporary
  folder, then copied file by file (safetensors and the tokenizers write local files only)."""
  if not metrics_log.is_local(directory):
    with tempfile.TemporaryDirectory() as local:
      export_policy(c, cfg, params, local, task)
      _copy_files(local, directory)
    return
  save_hf(directory, cfg, params)
  if not c.model.hf_dir:
    task.save_tokenizer(directory)
    return
  for name in _TOKENIZER_FILES:
    if os.path.exists(os.path.join(c.model.hf_dir, name)):
      shutil.copy(os.path.join(c.model.hf_dir, name), directory)


def _copy_files(local: str, directory: str) -> None:
  """The files of local folder `local` into epath folder `directory`, streamed."""
  epath.Path(directory).mkdir(parents=True, exist_ok=True)
  for name in sorted(os.listdir(local)):
    with open(os.path.join(local, name), "rb") as src:
      with epath.Path(directory, name).open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)


_TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "vocab.json",
  "merges.txt",
  "generation_config.json",
)


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


def _responses(rollout, tokenizer):
  """Decoded completions of this process's rows."""
  tokens, lengths = sharding.local_rows(rollout.tokens), sharding.local_rows(rollout.lengths)
  return [tokenizer.decode(row[:n]) for row, n in zip(tokens, lengths)]


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
  """The config's (data, fsdp, tensor) mesh over every process's devices, checked against the
  batch: each micro-batch's rows must split evenly over data x fsdp, and each process must hold
  whole GRPO groups (it samples and rewards its own prompts)."""
  m, r = c.mesh, c.rollout
  try:
    mesh = sharding.make_mesh(m.data, m.fsdp, m.tensor)
  except ValueError as e:
    raise ValueError(
      f"config.mesh (data={m.data}, fsdp={m.fsdp}, tensor={m.tensor}) is invalid: {e}"
    ) from None
  ways = mesh.shape["data"] * mesh.shape["fsdp"]
  rows = r.prompts_per_step * r.group_size
  slices = c.rl.num_minibatches * c.rl.micro_batches
  run_config.require(
    rows % (slices * ways) == 0,
    "rl.micro_batches",
    c.rl.micro_batches,
    f"rows per micro-batch ({rows} rollouts / rl.num_minibatches {c.rl.num_minibatches} / "
    f"rl.micro_batches = {rows / slices:g}) must be a whole multiple of mesh data x fsdp = "
    f"{ways}",
  )
  lo, hi = sharding.process_rows(sharding.rows(mesh), rows)
  run_config.require(
    lo % r.group_size == 0 and hi % r.group_size == 0,
    "rollout.group_size",
    r.group_size,
    f"this process holds rows [{lo}, {hi}): each process must hold whole groups",
  )
  return mesh


def _strict_json(value):
  """NaN / inf (an empty bin's p5, ...) as null, so the file is strict JSON."""
  if isinstance(value, dict):
    return {k: _strict_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_strict_json(v) for v in value]
  return None if isinstance(value, float) and not np.isfinite(value) else value


def _optimizers(c):
  """(learning-rate schedule, optimizer of the base params, optimizer of the LoRA or None)."""
  lr = optax.join_schedules(
    [
      optax.linear_schedule(0.0, c.rl.learning_rate, c.rl.warmup_steps),
      optax.constant_schedule(c.rl.learning_rate),
    ],
    [c.rl.warmup_steps],
  )
  optimizer = optax.chain(
    optax.clip_by_global_norm(c.rl.max_grad_norm), optax.adamw(lr, weight_decay=c.rl.weight_decay)
  )
  lora_opt = None
  if c.distill.enabled:
    lora_opt = optax.chain(
      optax.clip_by_global_norm(c.rl.max_grad_norm), optax.adam(c.distill.learning_rate)
    )
  return lr, optimizer, lora_opt


def _state_init(c, optimizer, lora_opt):
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
  init = lambda p, lora: ts.init_state(
    p, optimizer, lora, lora_opt, keep_reference=c.rl.kl_coef > 0
  )
  return init, make_lora


def _abstract_state(c, cfg, mesh, optimizer, lora_opt):
  """(the train state's shapes and dtypes, its shardings on `mesh`): the state `_build_state`
  makes from params of `cfg`, with nothing allocated and no weights read."""
  params = jax.eval_shape(
    lambda: init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.dtype(c.model.dtype))
  )
  init, make_lora = _state_init(c, optimizer, lora_opt)
  state = jax.eval_shape(init, params, jax.eval_shape(make_lora, params) if make_lora else None)
  return state, ts.state_sharding(state, mesh, optimizer, lora_opt)


def _placed_like(abstract, shardings):
  """The abstract arrays `abstract` on `shardings` (a matching tree, or one sharding for all)."""
  if isinstance(shardings, jax.sharding.Sharding):
    shardings = jax.tree.map(lambda _: shardings, abstract)
  return jax.tree.map(
    lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s, weak_type=x.weak_type),
    abstract,
    shardings,
  )


def _build_state(c, params, shardings, optimizer, lora_opt):
  """The initial TrainState, born on `shardings` (`_abstract_state`'s: the optimizer and LoRA
  states are created on their shards)."""
  init, make_lora = _state_init(c, optimizer, lora_opt)
  lora = make_lora(params) if make_lora else None
  params = sharding.place(params, shardings.params)
  lora = None if lora is None else sharding.place(lora, shardings.lora)
  return jax.jit(init, out_shardings=shardings)(params, lora)


def lower_step(c):
  """The config's train step lowered at full size on the current devices' mesh, from abstract
  params and batch (nothing is allocated, no weights or data read): checks that a real-run config
  builds, shards and traces before a cluster is booked. Returns the jax `Lowered` and the train
  state's shardings."""
  run_config.validate(c)
  mesh = make_mesh(c)
  r = c.rollout
  cfg = run_config.model_config(c)
  _, optimizer, lora_opt = _optimizers(c)
  state, shardings = _abstract_state(c, cfg, mesh, optimizer, lora_opt)
  step = ts.make_train_step(
    cfg, ts.StepConfig.from_config(c), optimizer, lora_opt, run_config.sparse_config(c), shardings
  )
  length = r.max_prompt_len + r.max_new_tokens
  batch = ts.Batch.abstract(r.prompts_per_step * r.group_size, length, r.num_top_logprobs)
  budget = (
    schedule_lib.BudgetTable(jax.ShapeDtypeStruct((length + 1,), jnp.int32)) if r.sparse else None
  )
  with jax.set_mesh(mesh):
    return step.lower(state, batch, budget), shardings


def _rollout_weights(state, mesh):
  """(params, lora) -> the sampler's copy, gathered over fsdp once per rollout
  (sharding.ROLLOUT_RULES); the identity without FSDP."""
  if mesh.shape["fsdp"] == 1:
    return lambda params, lora: (params, lora)
  rules = sharding.ROLLOUT_RULES
  out = (
    sharding.param_shardings(state.params, mesh, rules),
    None if state.lora is None else sharding.lora_shardings(state.lora, mesh, rules),
  )
  return jax.jit(lambda params, lora: (params, lora), out_shardings=out)


LOCK_FILE = "run.lock"


def workdir_lock(workdir: str, lease_s: float = lease.LEASE_S, settle_s: float = lease.SETTLE_S):
  """One run per workdir, held while the run lasts; a second run is refused (ValueError naming
  the holder). A local workdir: an flock (`_flock`). Any other epath URL (an object store, no
  flock): a lease with a heartbeat (`lease.Lease`, which says what it guarantees)."""
  path = os.path.join(workdir, LOCK_FILE)
  if metrics_log.is_local(workdir):
    return _flock(workdir, path)
  return lease.Lease(path, lambda holder: _in_use(workdir, path, holder), lease_s, settle_s)


def _in_use(workdir: str, path: str, holder: str) -> ValueError:
  return ValueError(
    f"config.workdir = {workdir!r} is in use by another run ({holder}; {path} is locked): one "
    "run per workdir; wait for it to end or use another config.workdir"
  )


@contextlib.contextmanager
def _flock(workdir: str, path: str):
  """An exclusive flock on `path`. The kernel drops it when the process dies, even by SIGKILL, so
  a killed run leaves nothing stuck. flock is per host: on a shared file system it holds across
  hosts only where that file system supports flock."""
  f = open(path, "a+")
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    f.seek(0)
    holder = f.read().strip() or "another process"
    f.close()
    raise _in_use(workdir, path, holder) from None
  try:
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    yield
  finally:
    f.close()  # releases the lock


def train(c: ml_collections.ConfigDict) -> list:
  """Runs (or resumes) the job described by config `c`; returns the per-step metrics rows."""
  run_config.validate(c)
  init_distributed(c)
  mesh = make_mesh(c)
  with jax.set_mesh(mesh), contextlib.ExitStack() as run:
    return _train(c, mesh, run)


def _train(c, mesh, run: contextlib.ExitStack):
  """The run; what it holds until it ends (the workdir lock) goes on `run`."""
  run_config.check_workdir(c.workdir)
  run_config.check_resume(c)  # reads only: a changed config fails before the model loads
  task = run_config.make_task(c)  # before the model: a bad dataset fails in seconds
  tokenizer = run_config.load_tokenizer_of(c, task)
  cfg = run_config.model_config(c, tokenizer)  # its weights are read once the step fits
  r, sparse = c.rollout, run_config.sparse_config(c)
  n_prompts, n_rows = r.prompts_per_step, r.prompts_per_step * r.group_size
  device, device_rows = jax.local_devices()[0], n_rows // page_pool.row_shards()
  run_config.check_rows(c, device_rows, device)
  run_config.check_inputs(c, task, cfg, tokenizer)
  engine_cfg = run_config.engine_config(c, cfg, device_rows)
  lr, optimizer, lora_opt = _optimizers(c)
  abstract, shardings = _abstract_state(c, cfg, mesh, optimizer, lora_opt)
  weights = _rollout_weights(abstract, mesh)
  sample = _sampler(c, cfg, tokenizer, weights, engine_cfg, sparse)
  cache_len = r.max_prompt_len + r.max_new_tokens
  budgets = hooks.Budgets(c, cfg, sparse, mesh, cache_len, engine_cfg.num_slots) if sparse else None
  hardware = cost_model.get_hardware(c.hardware) if sparse else None  # measured once, here
  kv = hooks.KVMetrics(c, cfg, sparse, engine_cfg, hardware)
  step_hooks = [hooks.PerfMetrics(lr), kv] + ([budgets] if budgets else [])
  evaluation = None
  if c.eval.every:
    samples_path = os.path.join(c.workdir, "eval_samples.jsonl")
    evaluation = hooks.Evaluation(
      c,
      cfg,
      sparse,
      run_config.make_task(c, c.eval.seed),
      tokenizer,
      weights,
      samples_path if jax.process_index() == 0 else None,
    )
    step_hooks.append(evaluation)
  step_config = ts.StepConfig.from_config(c)
  train_step = ts.make_train_step(cfg, step_config, optimizer, lora_opt, sparse, shardings)
  # Compiled from abstract inputs before any weight is read, for XLA's memory analysis of the
  # step. The jit keeps the executable for inputs of these shapes and shardings, so the loop's
  # first call does not compile it again.
  compiled = train_step.lower(
    _placed_like(abstract, shardings),
    _placed_like(ts.Batch.abstract(n_rows, cache_len, r.num_top_logprobs), sharding.rows(mesh)),
    budgets.example_table if budgets else None,
  ).compile()
  step_memory = run_config.StepMemory.of(compiled, abstract, shardings)
  run_config.check_memory(c, cfg, engine_cfg, step_memory, device)
  state = _build_state(c, run_config.load_params(c, cfg), shardings, optimizer, lora_opt)
  to_batch = jax.jit(ts.batch_from_rollout, out_shardings=sharding.rows(mesh))
  global_rows = lambda x: sharding.from_local_rows(np.asarray(x), sharding.rows(mesh), n_rows)
  lo, hi = sharding.process_rows(sharding.rows(mesh), n_rows)  # this process's prompts

  # Nothing is written before this point, so a config error leaves no workdir (or the old one).
  metrics_log.as_path(c.workdir).mkdir(parents=True, exist_ok=True)
  held = None
  if jax.process_index() == 0:
    held = run.enter_context(workdir_lock(c.workdir))
    run_config.check_resume(c)  # again under the lock: a run may have written it meanwhile
    remove_stale_tmp(c.workdir)
  if c.profile_steps:
    profile = hooks.Profile(os.path.join(c.workdir, "profile"), *c.profile_steps)
    run.callback(profile.close)  # a run stopped inside the range still writes its trace
    step_hooks.append(profile)
  mgr = checkpoint.manager(c.workdir, c.keep_checkpoints)
  state, start = _restore(c, mgr, state, step_hooks)
  saver = hooks.Checkpoint(mgr, c.ckpt_every, c.total_steps, n_prompts, step_hooks)
  if start >= c.total_steps:
    _at_the_end(c, cfg, state, task, start, evaluation.history if evaluation else [])
    return []
  log = _StepLog(c, start)
  key = jax.random.PRNGKey(c.seed)
  preemption = run.enter_context(Preemption())

  for step in range(start, c.total_steps):
    for hook in step_hooks:
      if hook.due(step):
        hook.begin_step(step)
    t0 = time.time()
    budget = budgets.for_step(step) if budgets else None
    problems = task.sample(n_prompts, step * n_prompts)[lo // r.group_size : hi // r.group_size]
    local_prompts = _prompts(problems, tokenizer, r.group_size, r.max_prompt_len)
    requests = engine.Requests(*local_prompts, r.max_new_tokens, r.group_size, first_row=lo)
    rollout, engine_stats = sample(state, requests, jax.random.fold_in(key, step), budget)
    rollout = jax.tree_util.tree_map(global_rows, rollout)  # this process's rows -> all rows
    rollout_s = time.time() - t0
    grouped = [p for p in problems for _ in range(r.group_size)]
    rewards = task.reward(_responses(rollout, tokenizer), grouped)
    prompt, prompt_len = map(global_rows, local_prompts)
    batch = to_batch(prompt, prompt_len, rollout, global_rows(np.asarray(rewards, np.float32)))
    t1 = time.time()
    state, metrics = train_step(state, batch, None if budget is None else budget.table)
    metrics = jax.tree_util.tree_map(sharding.to_host, metrics)
    metrics["grading/budget_exceeded"] = reward_lib.take_budget_exceeded()
    out = hooks.StepOutput(
      step,
      budget,
      sharding.to_host(prompt_len),
      sharding.to_host(rollout.lengths),
      engine_stats,
      rollout_s,
      time.time() - t1,
      state,
    )
    for hook in step_hooks:
      if hook.due(step):
        metrics.update(hook.metrics(out))
    if engine_cfg.speculate:  # exact mode: the drafts' acceptance, reads with the verification's
      metrics.update(
        speculative.metrics(
          engine_stats,
          sharding.to_host(rollout.alpha),
          out.prompt_len_B,
          bin_size=c.stats.bin_size,
          num_bins=c.stats.num_bins,
        )
      )
    log.write(out, metrics, t0)
    if held:  # a lease taken over while this run stalled
      held.check()
    stop = preemption.requested()
    for hook in step_hooks + [saver]:
      if hook.due(step) or (stop and hook is saver):
        hook.end_step(out, metrics)
    if stop and step + 1 < c.total_steps:
      mgr.wait_until_finished()
      log.close()
      _print(
        f"stopped by {preemption.name} after step {step + 1}: saved checkpoint "
        f"{mgr.directory}/{step + 1}; the same command resumes there"
      )
      return log.rows
  mgr.wait_until_finished()
  log.close()
  _finish(c, cfg, state, task, log.rows[-1], log.times, evaluation.history if evaluation else [])
  log.done()
  return log.rows


class Preemption:
  """SIGTERM (what cluster schedulers send before they kill a job) as a flag the loop reads at the
  end of each step, which then saves a checkpoint and returns (exit 0) instead of losing the steps
  since the last one. Installed from the main thread only (Python's rule for signal handlers)."""

  def __init__(self):
    self.name, self.previous = None, None

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():
      self.previous = signal.signal(signal.SIGTERM, self._handle)
    return self

  def _handle(self, signum, frame):
    self.name = signal.Signals(signum).name

  def __exit__(self, *exc):
    if self.previous is not None:
      signal.signal(signal.SIGTERM, self.previous)

  def requested(self) -> bool:
    """Whether any process was sent SIGTERM (all of them stop at the same step)."""
    stop = self.name is not None
    if jax.process_count() > 1:
      stop = bool(np.any(multihost_utils.process_allgather(np.int32(stop))))
    if stop:
      self.name = self.name or "SIGTERM (to another process)"
    return stop


# metrics_log.write_atomic's temporary files: .<name>.<pid>.tmp
_TMP_FILE = re.compile(r"^\..+\.\d+\.tmp$")


def remove_stale_tmp(workdir: str) -> None:
  """Deletes the temporary files a killed run left (metrics_log.write_atomic's); called under the
  workdir's lock, so no live writer owns one."""
  stale = sorted(p.name for p in epath.Path(workdir).iterdir() if _TMP_FILE.match(p.name))
  for name in stale:
    epath.Path(workdir, name).unlink()
  if stale:
    _print(f"removed temporary files a killed run left in {workdir}: {', '.join(stale)}")


def _sampler(c, cfg, tokenizer, weights, engine_cfg, sparse):
  """sample(state, this process's engine.Requests, key, StepBudget or None) -> (its rollout,
  EngineStats): the engine over the policy's weights (`weights`, `_rollout_weights`: gathered over
  fsdp once per rollout)."""
  sampling = run_config.sampling(c, tokenizer)

  def sample(state, requests, key, budget):
    params, lora = weights(state.params, state.lora)
    return engine.run(
      params,
      cfg,
      requests,
      np.asarray(key),
      engine=engine_cfg,
      sampling=sampling,
      sparse=sparse,
      schedule=None if budget is None else budget.table,
      lora=lora,
      draft_plan=None if budget is None else budget.drafts,
    )

  return sample


def _restore(c, mgr, state, step_hooks):
  """(state, first step to run): the latest checkpoint restored onto the state's shardings, each
  hook given its meta; (state, 0) when there is none."""
  restored = checkpoint.restore_latest(mgr, state, c.restart_from_scratch)
  if restored is None:
    moved = checkpoint.moved_aside(mgr)
    if moved:  # config.restart_from_scratch: said so, or restore_latest would have refused
      _print(f"restarting at step 0 (config.restart_from_scratch); kept aside: {', '.join(moved)}")
    return state, 0
  state, meta = restored
  for hook in step_hooks:
    hook.restore(meta)
  _print(f"resumed from {c.workdir} at step {meta['step']} (data position {meta['data_position']})")
  return state, int(meta["step"])


def _at_the_end(c, cfg, state, task, start: int, eval_history: list) -> None:
  """A workdir restored at or past config.total_steps: a run cut after its last checkpoint gets
  what it had left; otherwise nothing runs and nothing is rewritten."""
  if start == c.total_steps and not epath.Path(c.workdir, "summary.json").exists():
    _print(
      f"{c.workdir} is at its last step {start} without summary.json: the run was cut after "
      "its last checkpoint; writing what it had left"
      + (" (hf export, summary)" if c.export_hf else " (summary)")
    )
    lead = jax.process_index() == 0
    last = _logged_row(c.workdir, start) if lead else None
    _finish(c, cfg, state, task, last, None, eval_history)
    return
  _print(
    f"{c.workdir} is at step {start} >= config.total_steps = {c.total_steps}: nothing to "
    "run, nothing rewritten (raise config.total_steps to continue)"
  )


class _StepLog:
  """Each step's metrics: metrics.jsonl and TensorBoard (written by the lead process, after the
  run's config.json), the rows `train` returns, the guard against non-finite updates, a progress
  line with an ETA, and the run's wall time by part (the first step of a process also compiles)."""

  def __init__(self, c, start: int):
    self.c, self.start, self.rows, self.nonfinite = c, start, [], 0
    self.times = {"first_step": 0.0, "rollout": 0.0, "train_step": 0.0, "total": time.time()}
    self.logger = None
    if jax.process_index() == 0:
      metrics_log.write_atomic(
        os.path.join(c.workdir, "config.json"), c.to_json_best_effort(indent=2)
      )
      self.logger = metrics_log.MetricsLogger(c.workdir, resume_step=start)

  def write(self, out: hooks.StepOutput, metrics: dict, t0: float) -> None:
    c, step = self.c, out.step
    if self.logger:
      self.logger.write(step + 1, metrics)
    # text (an evaluation's completions) goes to TensorBoard only
    self.rows.append(
      {k: np.asarray(v).tolist() for k, v in metrics.items() if not isinstance(v, str)}
    )
    self.times["rollout"] += out.rollout_s
    self.times["train_step"] += out.train_s
    self.nonfinite = self.nonfinite + 1 if metrics["skipped"] else 0
    if self.nonfinite >= c.max_nonfinite_steps:
      raise FloatingPointError(
        f"{self.nonfinite} non-finite updates in a row (step {step + 1}); see "
        f"{c.workdir}/metrics.jsonl"
      )
    done = step + 1 - self.start
    if done == 1:
      self.times["first_step"] = time.time() - t0
      self.compiled = time.time()
    # compile time excluded: from the steps after the first
    left = (time.time() - self.compiled) / max(done - 1, 1) * (c.total_steps - step - 1)
    eta = "--" if done == 1 else f"{left:.0f}s"
    _print(
      f"step {step + 1}/{c.total_steps}  reward {metrics['reward/mean']:.3f}  "
      f"p5 {metrics.get('acceptance/p5', metrics['acceptance_sampled/p5']):.3f}  "
      f"len {metrics['response_length/mean']:.0f}  "
      f"{metrics['perf/rollout_tokens_per_s']:.0f} tok/s  kv {metrics['kv/read_fraction']:.2f}  "
      f"{'SKIPPED ' if metrics['skipped'] else ''}ETA {eta}"
    )

  def close(self) -> None:
    if self.logger:
      self.logger.close()
    self.times["total"] = time.time() - self.times["total"]

  def done(self) -> None:
    c, times = self.c, self.times
    _print(
      f"time: {times['total']:.0f}s in all, first step (with compilation) "
      f"{times['first_step']:.0f}s, rollouts {times['rollout']:.0f}s, train steps "
      f"{times['train_step']:.0f}s"
    )
    _print(
      f"done: {c.total_steps} steps; metrics {c.workdir}/metrics.jsonl, TensorBoard "
      f"{c.workdir}/tensorboard, checkpoints {c.workdir}/checkpoints"
      + (f", policy {c.workdir}/hf" if c.export_hf else "")
    )


def _finish(c, cfg, state, task, last_row: dict, times, eval_history: list) -> None:
  """The end of a run after its last checkpoint: the exported policy (config.export_hf), then
  summary.json (with every held-out evaluation: `eval`), written last, so a workdir without one is
  a run cut before its end."""
  lead = jax.process_index() == 0
  if c.export_hf:  # every process joins the gather; the lead writes
    params = jax.tree_util.tree_map(sharding.to_host, state.params)
    if lead:
      export_policy(c, cfg, params, os.path.join(c.workdir, "hf"), task)
  if lead:  # time_s null: the run's time was not measured by the process that finished it
    metrics_log.write_atomic(
      os.path.join(c.workdir, "summary.json"),
      json.dumps(
        {
          "steps": c.total_steps,
          "time_s": times,
          "last": _strict_json(last_row),
          "eval": _strict_json(eval_history),
          "peak_rss_gib": records.peak_rss_gib(),  # this process's, the lead's
          # float results follow the code and the CPU type (docs/configuration.md)
          "command": records.command(),
          "commit": records.commit_at_start(),
          "machine": records.machine(),
        },
        indent=2,
        allow_nan=False,
      ),
    )


def _logged_row(workdir: str, step: int) -> dict | None:
  """Step `step`'s row of metrics.jsonl (the logger's form: per-bin lists, no histograms); None,
  with a warning, when the file does not hold it (a write the machine lost)."""
  path = os.path.join(workdir, "metrics.jsonl")
  rows = [
    r
    for r in (metrics_log.read_rows(path) if epath.Path(path).exists() else ())
    if r.get("step") == step
  ]
  if not rows:
    _print(f"warning: {path} has no row of step {step}; summary.json's last is null")
    return None
  return rows[-1]


def _print(message: str) -> None:
  """Progress on the lead process only (every process runs the same loop)."""
  if jax.process_index() == 0:
    print(message, flush=True)
