"""Orbax checkpoints of the train state plus a small JSON of loop metadata (data position, ...).

Restarting with the same workdir resumes from the latest checkpoint: the rollout PRNG key is
derived from (seed, step) and the data position is stored, so the resumed run replays exactly what
an uninterrupted run would have done.
"""
import os

import jax
from jax.experimental import multihost_utils
import orbax.checkpoint as ocp


def manager(workdir: str, keep: int) -> ocp.CheckpointManager:
  return ocp.CheckpointManager(os.path.abspath(os.path.join(workdir, "checkpoints")),
                               options=ocp.CheckpointManagerOptions(max_to_keep=keep))


def save(mgr: ocp.CheckpointManager, step: int, state, meta: dict) -> None:
  mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                         meta=ocp.args.JsonSave(meta)))


def restore_latest(mgr: ocp.CheckpointManager, like_state):
  """(state, meta) of the newest readable checkpoint, or None when there is none; arrays come back
on the shardings of `like_state`'s (any mesh: a run may resume on another one).

  A checkpoint that fails to restore (e.g. a write cut short) is moved aside to
  `<step>.corrupt` with a warning naming it, and the previous one is tried: a later save at that
  step must not collide with it, and nothing is deleted.
  """
  abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like_state)
  for step in sorted(mgr.all_steps(), reverse=True):
    try:
      restored = mgr.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
      return restored.state, restored.meta
    except Exception as e:  # orbax / tensorstore / JSON errors of a damaged checkpoint
      path = os.path.join(str(mgr.directory), str(step))
      if jax.process_index() == 0:
        os.replace(path, f"{path}.corrupt")
      multihost_utils.sync_global_devices(f"moved aside checkpoint {step}")
      mgr.reload()
      print(f"warning: checkpoint {path} is unreadable ({type(e).__name__}: {str(e)[:200]}); "
            f"moved to {path}.corrupt, trying the previous one", flush=True)
  return None
