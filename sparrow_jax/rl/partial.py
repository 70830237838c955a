"""Partial rollouts (rollout.partial_groups = E > 0): the long tail no longer holds up a step.

Step 0 starts prompts_per_step + E GRPO groups, every later step prompts_per_step new ones, so E
more groups are under way than a step trains on. A step's rollout ends once prompts_per_step groups
have ended (the oldest ended first, so no group waits more than its length needs); the rows still
decoding keep their pages in the engine (`engine.Partial`) and go on in the next step's rollout
under the new weights. Each token records the step whose weights sampled it (Rollout.versions,
logged as `rollout/token_lag/*`) and its log-prob is theirs, the one TIS divides by.

The data position of a step's new groups is a function of the step (`new_groups`), and a row's
sampling key is its group's data position (the rollout key is step 0's), so a resumed run replays
the same rows; the rows under way and the engine's pool are saved with each checkpoint
(`InFlight`).
"""

from typing import NamedTuple, Optional

import jax
import numpy as np

from sparrow_jax.rollout import engine


def new_groups(c, step: int) -> tuple:
  """(count, data position) of the GRPO groups step `step`'s rollout starts."""
  n, extra = c.rollout.prompts_per_step, c.rollout.partial_groups
  if step == 0:
    return n + extra, 0
  return n, step * n + extra


def process_groups(count: int, rows) -> slice:
  """This process's share of `count` new groups (rows: build.Rows, whole groups a process)."""
  return slice(count * rows.lo // rows.count, count * rows.hi // rows.count)


def lag_metrics(step: int, versions_BM, lengths_B) -> dict:
  """How many steps old the weights that sampled the step's tokens are (step - version), over
  every row's tokens, and the rows carried over from an earlier step's rollout."""
  valid_BM = np.arange(versions_BM.shape[1])[None] < np.asarray(lengths_B)[:, None]
  lag = step - np.asarray(versions_BM)[valid_BM]
  carried = np.asarray(versions_BM)[:, 0] < np.max(np.where(valid_BM, versions_BM, -1), axis=1)
  return {
    "rollout/token_lag/mean": float(lag.mean()),
    "rollout/token_lag/max": int(lag.max()),
    "rollout/rows_carried": int(carried.sum()),
  }


class Taken(NamedTuple):
  """The rows a step trains on, this process's, host arrays."""

  problems: list  # one per group
  prompt: np.ndarray
  prompt_len: np.ndarray
  rollout: object  # sampler.Rollout
  engine_stats: engine.EngineStats


class Rollouts:
  """The rows under way across steps: the engine's partial rollout and each queued group's problem
  and prompt, by the group's first row index."""

  def __init__(self, partial: engine.Partial, mesh, group_size: int, groups: int):
    """groups: this process's share of a step's groups (`process_groups`)."""
    self.partial, self.mesh, self.group_size, self.groups = partial, mesh, group_size, groups
    self.queued = {}

  def sample(self, weights, problems, requests: engine.Requests, version: int, budget):
    """Queues the step's new groups, decodes until this process's share of a step's groups has
    ended, and takes them out (Taken)."""
    g = self.group_size
    for i, problem in enumerate(problems):
      b = i * g
      self.queued[requests.first_row + b] = (
        problem,
        requests.prompt_BT[b],
        requests.prompt_len_B[b],
      )
    params, lora = weights
    with jax.set_mesh(self.mesh):  # also in a rollout thread: a mesh context is the thread's own
      rollout, stats, keys = self.partial.run(
        params,
        requests,
        self.groups,
        version,
        schedule=None if budget is None else budget.table,
        lora=lora,
        draft_plan=None if budget is None else budget.drafts,
      )
    first = keys[::g]
    done = [self.queued.pop(int(k)) for k in first]
    prompt = np.repeat(np.stack([d[1] for d in done]), g, axis=0)
    prompt_len = np.repeat(np.asarray([d[2] for d in done], np.int32), g)
    return Taken([d[0] for d in done], prompt, prompt_len, rollout, stats)

  def state(self):
    """What a checkpoint keeps: the queued groups and the engine's rows and pool (host data)."""
    return self.queued, self.partial.state()

  def restore(self, state, params) -> None:
    """The rows under way of `state()` back (params: the policy's, for the pool's dtype)."""
    self.queued, partial = state
    with jax.set_mesh(self.mesh):
      self.partial.restore(partial, params)


class InFlight(NamedTuple):
  """What a run has under way at a checkpoint, saved beside it (workdir.save_in_flight)."""

  ahead: Optional[object]  # the next step's rollouts (trainer.Sampled), one step off
  partial: Optional[tuple]  # Rollouts.state(), partial rollouts
