"""The RL loop: the step's graded rows from the rollout source (rl/rollouts.py: on-policy, one
step off or carried, the loop does not ask which) -> fused train step -> log, checkpoint. What a
step does beside that (the KV budgets and the closed loop, the kv and perf metrics, the held-out
evaluation, the checkpoint with their meta and the source's saved rows) are hooks (rl/hooks.py);
the run's components are built and checked by rl/build.py (the checks: rl/run_config.py), its
workdir kept by rl/workdir.py.

Everything a step needs is a pure function of (config, step, restored state): the data position
and the rollout key are functions of the step, an adaptive schedule's table is in the checkpoint
meta, and what the source had under way is in the checkpoint. So a run killed at any point and
restarted with the same workdir replays exactly the steps an uninterrupted run would have taken.

A run never loses data: every check that can run before the workdir is written does
(`run_config.validate`, then the checks `build.build` runs against the task, the model and the
train step compiled from abstract inputs, before the weights are read), so a config error leaves
no workdir behind; one run holds a workdir at a time (`workdir.workdir_lock`); whole files are
replaced atomically and metrics.jsonl is append-only (temporary files a kill left are removed at
the next start); only a checkpoint that does not read as one (or fails its checksums) is moved
aside, any other restore error stops the run, changing nothing, and a workdir whose checkpoints
are all unreadable is refused rather than restarted at step 0, unless config.restart_from_scratch
(sparrow_jax.checkpoint). SIGTERM ends the run after the step under way with a checkpoint of it
(`Preemption`).
"""

import contextlib
import dataclasses
import os
import signal
import threading
import time

from etils import epath
import jax
from jax.experimental import multihost_utils
import ml_collections
import numpy as np

from sparrow_jax import checkpoint, dashboard, sharding
from sparrow_jax import logging as metrics_log
from sparrow_jax.rl import build, hooks, rollouts, run_config, workdir
from sparrow_jax.rollout import speculative

_print = metrics_log.progress


def train(c: ml_collections.ConfigDict) -> list:
  """Runs (or resumes) the job described by config `c`; returns the per-step metrics rows."""
  run_config.validate(c)
  build.init_distributed(c)
  mesh = build.make_mesh(c)
  with jax.set_mesh(mesh), contextlib.ExitStack() as stack:
    return _train(c, build.build(c, mesh), stack)


def _train(c, run: build.Run, stack: contextlib.ExitStack) -> list:
  """The loop over the run's steps; what it holds until it ends (the workdir lock, the rollout
  source) goes on `stack`. Nothing is written before `workdir.hold`, so a config error leaves no
  workdir."""
  held = workdir.hold(c, stack)
  step_hooks = list(run.hooks) + _profile(c, stack)
  mgr = checkpoint.manager(c.workdir, c.keep_checkpoints)
  source = stack.enter_context(run.source)
  state, start = _restore(c, mgr, run, step_hooks)
  saver = hooks.Checkpoint(
    mgr, c.ckpt_every, c.total_steps, source.data_position, step_hooks, source.saved
  )
  history = lambda: run.evaluation.history if run.evaluation else []
  if start >= c.total_steps:
    _at_the_end(c, run, state, start, history())
    return []
  log = _StepLog(c, start)
  preemption = stack.enter_context(Preemption())
  for step in range(start, c.total_steps):
    for hook in step_hooks:
      if hook.due(step):
        hook.begin_step(step)
    t0 = time.time()
    state, out, metrics = _update(c, run, state, source.take(step, state))
    out = dataclasses.replace(out, step_s=time.time() - t0)
    for hook in step_hooks:
      if hook.due(step):
        metrics.update(hook.metrics(out))
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
  if source.under_way():
    _print(source.under_way())
  workdir.write_summary(c, run.cfg, state, run.task, log.rows[-1], log.times, history())
  log.done()
  return log.rows


def _profile(c, stack: contextlib.ExitStack) -> list:
  """The profiling hook of config.profile_steps, as a list of hooks (none when it is off)."""
  if not c.profile_steps:
    return []
  profile = hooks.Profile(os.path.join(c.workdir, "profile"), *c.profile_steps)
  stack.callback(profile.close)  # a run stopped inside the range still writes its trace
  return [profile]


def _update(c, run: build.Run, state, sampled: rollouts.Sampled):
  """The update on `sampled`: its rows placed on the trainer's mesh once, the fused train step.
  Returns (state, hooks.StepOutput, metrics)."""
  rows, rollout, engine_stats = run.rows, sampled.rollout, sampled.engine_stats
  rewards = np.asarray([g.reward for g in sampled.grades], np.float32)
  placed = jax.tree.map(rows.place, (sampled.prompt, sampled.prompt_len, rollout, rewards))
  batch = run.to_batch(*placed)  # their one trip there
  t1 = time.time()
  budget = sampled.budget
  state, metrics = run.train_step(state, batch, None if budget is None else budget.table)
  metrics = jax.tree.map(sharding.to_host, metrics)
  metrics.update(sampled.metrics(c.stats.bin_size, c.stats.num_bins))
  # this process's responses the sandbox ran out of its batch's time budget for
  metrics["grading/budget_exceeded"] = sum(g.reason == "budget_exceeded" for g in sampled.grades)
  out = hooks.StepOutput(
    sampled.step,
    budget,
    rows.every_row(sampled.prompt_len, placed[1]),
    rows.every_row(rollout.lengths, placed[2].lengths),
    engine_stats,
    sampled.rollout_s,
    time.time() - t1,
    state,
    wait_s=sampled.wait_s,
    sync_s=sampled.sync_s,
    sync_bytes=sampled.sync_bytes,
  )
  if run.engine_cfg.speculate:  # exact mode: the drafts' acceptance, read with the verification's
    stats = dict(bin_size=c.stats.bin_size, num_bins=c.stats.num_bins)
    alpha = rows.every_row(rollout.alpha, placed[2].alpha)
    metrics.update(speculative.metrics(engine_stats, alpha, out.prompt_len_B, **stats))
  return state, out, metrics


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


def _restore(c, mgr, run: build.Run, step_hooks):
  """(state, first step to run): the latest checkpoint restored onto the state's shardings, each
  hook given its meta and the rollout source what the run had under way; (the initial state, 0)
  when there is none."""
  like = lambda saved, step: run.source.abstract_saved(run.state.params, saved, step)
  restored = checkpoint.restore_latest(mgr, run.state, c.restart_from_scratch, like)
  if restored is None:
    moved = checkpoint.moved_aside(mgr)
    if moved:  # config.restart_from_scratch: said so, or restore_latest would have refused
      _print(f"restarting at step 0 (config.restart_from_scratch); kept aside: {', '.join(moved)}")
    return run.state, 0
  state, meta = restored
  for hook in step_hooks:
    hook.restore(meta)
  step = int(meta["step"])
  under_way = meta.get(checkpoint.ROLLOUTS)
  run.source.restore(under_way and (under_way, meta[checkpoint.ROLLOUT_ARRAYS]), step, state.params)
  _print(f"resumed from {c.workdir} at step {step} (data position {meta['data_position']})")
  return state, step


def _at_the_end(c, run: build.Run, state, start: int, eval_history: list) -> None:
  """A workdir restored at or past config.total_steps: a run cut after its last checkpoint gets
  what it had left; otherwise nothing runs and nothing is rewritten."""
  if start == c.total_steps and not epath.Path(c.workdir, "summary.json").exists():
    _print(
      f"{c.workdir} is at its last step {start} without summary.json: the run was cut after "
      "its last checkpoint; writing what it had left"
      + (" (hf export, summary)" if c.export_hf else " (summary)")
    )
    lead = jax.process_index() == 0
    last = workdir.logged_row(c.workdir, start) if lead else None
    workdir.write_summary(c, run.cfg, state, run.task, last, None, eval_history)
    return
  _print(
    f"{c.workdir} is at step {start} >= config.total_steps = {c.total_steps}: nothing to "
    "run, nothing rewritten (raise config.total_steps to continue)"
  )


class _StepLog:
  """Each step's metrics with the tags the dashboard draws beside them: metrics.jsonl and
  TensorBoard (written by the lead process, after the run's config.json; the run's dashboard and
  hyperparameters with its first events), the rows `train` returns, the guard against non-finite
  updates, a progress line with an ETA, and the run's wall time by part (the first step of a
  process also compiles)."""

  def __init__(self, c, start: int):
    self.c, self.start, self.rows, self.nonfinite = c, start, [], 0
    self.times = {"first_step": 0.0, "rollout": 0.0, "train_step": 0.0, "total": time.time()}
    self.logger = None
    if jax.process_index() == 0:
      metrics_log.write_atomic(
        os.path.join(c.workdir, "config.json"), c.to_json_best_effort(indent=2)
      )
      self.logger = metrics_log.MetricsLogger(
        c.workdir, resume_step=start, first_events=dashboard.summaries(c)
      )

  def write(self, out: hooks.StepOutput, metrics: dict, t0: float) -> None:
    c, step = self.c, out.step
    metrics.update(dashboard.chart_metrics(metrics, c.stats.tau))
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
