"""Orbax checkpoints of the train state plus a small JSON of loop metadata (data position, ...).

Restarting with the same workdir resumes from the latest checkpoint: the rollout PRNG key is
derived from (seed, step) and the data position is stored, so the resumed run replays exactly what
an uninterrupted run would have done.

Each checkpoint's meta carries a checksum of every array of the state (`checksums`), verified on
restore: a byte flipped on disk reads back as a corrupt checkpoint, not as silently wrong weights.
The meta carries a checksum of itself too, and its step must be its directory's: a meta that was
edited or damaged but still parses stops the restore (it would resume one step's weights at
another's data position), changing nothing.

When a workdir has checkpoints but none is readable, the restore stops (`NoReadableCheckpoint`)
rather than start again at step 0 on its own; `restart_from_scratch=True` says that is wanted.
"""

import asyncio
import contextlib
import hashlib
import json
import os

from etils import epath
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import orbax.checkpoint as ocp
from orbax.checkpoint._src import asyncio_utils

from sparrow_jax import sharding
from sparrow_jax.logging import as_path

CHECKSUMS = "checksums"  # meta key: {leaf path: 16 hex digits}
META_CHECKSUM = "meta_sha256"  # meta key: sha256 of the rest of the meta (`_meta_digest`)
CORRUPT = ".corrupt"  # suffix of a checkpoint moved aside
# What a run has under way beside its state (rl/rollouts.py's `Source.saved`): its JSON is the
# meta's ROLLOUTS, its arrays an item of their own, checksummed under ROLLOUT_CHECKSUMS; restored,
# the arrays come back as the meta's ROLLOUT_ARRAYS.
ROLLOUTS, ROLLOUT_CHECKSUMS, ROLLOUT_ARRAYS = "rollouts", "rollout_checksums", "rollout_arrays"


async def _the_other_tasks_ended() -> None:
  """Returns once every other task of the running loop has ended, however it ended."""
  while rest := asyncio.all_tasks() - {asyncio.current_task()}:
    await asyncio.gather(*rest, return_exceptions=True)


def _run_in_new_loop(coro):
  """orbax's `asyncio_utils._run_sync_via_new_loop`: runs `coro` in a fresh event loop (orbax runs
  each save's writes and each restore's reads so), but when `coro` fails, the loop closes only
  after every other task on it has ended.

  A checkpoint write that fails (a full disk) ends orbax's `asyncio.gather` of the save's writes
  at the first error, the other writes still in flight. Were the loop closed then, each of them
  that finishes would make tensorstore call `call_soon_threadsafe` on the closed loop and print
  its "Event loop is closed" error (a traceback a write, around the run's one-line error), and
  the tasks not yet started would print "coroutine ... was never awaited" at exit.
  """
  loop = asyncio.new_event_loop()
  try:
    asyncio.set_event_loop(loop)
    try:
      return loop.run_until_complete(coro)
    except Exception:  # not KeyboardInterrupt: an interrupted run does not wait for its writes
      loop.run_until_complete(_the_other_tasks_ended())
      raise
  finally:
    asyncio.set_event_loop(None)
    loop.close()


asyncio_utils._run_sync_via_new_loop = _run_in_new_loop  # orbax run_sync looks it up at each call


class NoReadableCheckpoint(ValueError):
  """Every checkpoint of the workdir is unreadable (each moved aside to <step>.corrupt)."""


def manager(workdir: str, keep: int) -> ocp.CheckpointManager:
  # Handlers named up front, so a fresh manager can read a checkpoint's metadata (its tree of
  # shapes and dtypes) before restoring it.
  return ocp.CheckpointManager(
    as_path(workdir) / "checkpoints",
    options=ocp.CheckpointManagerOptions(max_to_keep=keep),
    item_handlers={
      "state": ocp.StandardCheckpointHandler(),
      "meta": ocp.JsonCheckpointHandler(),
      ROLLOUTS: ocp.StandardCheckpointHandler(),
    },
  )


def save(mgr: ocp.CheckpointManager, step: int, state, meta: dict, rollouts=None) -> None:
  """Checkpoint `step`: the state, the meta and (rollouts: (JSON, arrays), or None) what the run
  has under way, in one orbax step: it is committed whole or not at all."""
  items = {"state": ocp.args.StandardSave(state)}
  if rollouts is not None:
    saved, arrays = rollouts
    meta = {**meta, ROLLOUTS: saved, ROLLOUT_CHECKSUMS: checksums(arrays)}
    items[ROLLOUTS] = ocp.args.StandardSave(arrays)
  meta = json.loads(json.dumps({**meta, CHECKSUMS: checksums(state)}))  # as it will read back
  meta[META_CHECKSUM] = _meta_digest(meta)
  mgr.save(step, args=ocp.args.Composite(meta=ocp.args.JsonSave(meta), **items))


def _leaf_checksum(x):
  """uint32[2]: the wrapping sums of the leaf's bit patterns u_i and of u_i * (2i + 1).

  Integer sums are exact in any order, so every sharding and mesh gives the same value (a run may
  resume on another mesh). A changed byte changes u_i by b * 2**(8k) with 0 < |b| < 256, k < 4,
  which is nonzero mod 2**32, and an odd factor keeps it nonzero: one flipped byte always shows.
  """
  if x.dtype == jnp.bool_:
    x = x.astype(jnp.uint8)
  if x.dtype.itemsize >= 4:  # 8-byte values become two uint32 words (a trailing axis)
    u = jax.lax.bitcast_convert_type(x, jnp.uint32)
  else:
    u = jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))
  u = u.astype(jnp.uint32).ravel()
  i = jnp.arange(u.size, dtype=jnp.uint32)
  return jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * (2 * i + 1), dtype=jnp.uint32)])


_checksum_tree = jax.jit(lambda tree: jax.tree_util.tree_map(_leaf_checksum, tree))


def checksums(state) -> dict:
  """{leaf path: 16 hex digits} of every array of `state` (any sharding; computed on device).
  Leaves on different meshes (the rollouts' rows on every process, the pool on the rollout
  devices, while the trainer's mesh is the context) are summed under their own mesh each."""
  by_mesh = {}
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    by_mesh.setdefault(getattr(getattr(x, "sharding", None), "mesh", None), []).append((path, x))
  out = {}
  for mesh, leaves in by_mesh.items():
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
      sums = _checksum_tree([x for _, x in leaves])
    for (path, _), s in zip(leaves, sums):
      out[jax.tree_util.keystr(path)] = "".join(f"{int(v):08x}" for v in sharding.to_host(s))
  return out


def _meta_digest(meta: dict) -> str:
  """sha256 of the meta without its own checksum, over a canonical JSON form."""
  rest = {k: v for k, v in meta.items() if k != META_CHECKSUM}
  return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def _check_meta(meta: dict, step: int, path: str) -> None:
  """A meta that parses but is not the one saved at `step` (edited by hand, or damaged within its
  JSON): ValueError naming what differs, nothing changed. Metas without a checksum (written before
  it existed) are checked for their step only."""
  why = None
  want = meta.get(META_CHECKSUM)
  if want is not None and want != _meta_digest(meta):
    why = f"its meta fails its checksum ({META_CHECKSUM})"
  elif "step" in meta and meta["step"] != step:
    why = f"its meta says step {meta['step']!r}, its directory step {step}"
  if why:
    raise ValueError(
      f"checkpoint {path}: {why}: it was edited or damaged. Nothing was changed; move {path} "
      "aside to resume from the previous checkpoint, or use a new config.workdir"
    )


class _Unreadable(Exception):
  """The checkpoint's bytes do not read as a checkpoint (or not as the one that was saved)."""


def _shapes(tree, serialize: bool) -> dict:
  """{'a/b/c': (shape, dtype name)} of a checkpoint's metadata tree, or (serialize) of an abstract
  state, keyed the way orbax stores a tree (nested dicts of field names), so the two compare."""
  if serialize:
    tree = ocp.tree.serialize_tree(tree, keep_empty_nodes=True)
  return {
    "/".join(map(str, k)): (tuple(v.shape), str(v.dtype))
    for k, v in ocp.tree.to_flat_dict(tree).items()
    if hasattr(v, "shape")
  }


def state_difference(saved: dict, wanted: dict) -> str:
  """'' when the two `_shapes` maps agree, else the first differences in words."""
  diffs = [f"{k} only in the checkpoint" for k in sorted(set(saved) - set(wanted))]
  diffs += [f"{k} only in this config's state" for k in sorted(set(wanted) - set(saved))]
  diffs += [
    f"{k} is {saved[k][0]} {saved[k][1]} in the checkpoint, {wanted[k][0]} {wanted[k][1]} here"
    for k in sorted(set(saved) & set(wanted))
    if saved[k] != wanted[k]
  ]
  return "; ".join(diffs[:3]) + (f" (and {len(diffs) - 3} more)" if len(diffs) > 3 else "")


def _readable(read):
  """read() or, when the checkpoint's bytes do not read (orbax, tensorstore or JSON errors of
  damaged files), _Unreadable; errors of the machine (memory, permissions) pass as they are."""
  try:
    return read()
  except (MemoryError, PermissionError):
    raise
  except Exception as e:
    raise _Unreadable(f"{type(e).__name__}: {e}") from e


def _checked(tree, want: dict | None) -> None:
  """_Unreadable when `tree`'s arrays fail their saved checksums `want` (None: saved without)."""
  if want is None:
    return
  got = checksums(tree)
  bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
  if bad:
    raise _Unreadable(f"checksum mismatch in {len(bad)} array(s), first {bad[0]}")


def _restore(mgr, step, abstract, path, like_rollouts=None):
  """(state, meta) of checkpoint `step`, and with `like_rollouts` the arrays of what it has under
  way as the meta's ROLLOUT_ARRAYS. Raises _Unreadable when its files do not read as a checkpoint
  or fail their checksums, ValueError when it reads but holds another state or a meta that is not
  the one saved at `step`."""
  saved = _readable(lambda: _shapes(mgr.item_metadata(step)["state"].tree, serialize=False))
  difference = state_difference(saved, _shapes(abstract, serialize=True))
  if difference:
    raise ValueError(
      f"checkpoint {path} holds another train state than this config's ({difference}): it was "
      "written by another config or code version. Nothing was changed; resume with that run's "
      "config or use a new config.workdir"
    )
  items = ocp.args.Composite(state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore())
  restored = _readable(lambda: mgr.restore(step, args=items))
  if not isinstance(restored.meta, dict):
    raise _Unreadable(f"its meta is a JSON {type(restored.meta).__name__}, not an object")
  _check_meta(restored.meta, step, path)
  _checked(restored.state, restored.meta.get(CHECKSUMS))  # older checkpoints have none
  meta = {k: v for k, v in restored.meta.items() if k not in (CHECKSUMS, META_CHECKSUM)}
  if like_rollouts is not None and ROLLOUTS in meta:
    # checked against the meta first: its shapes say what this run must restore them onto
    tree = _readable(lambda: mgr.item_metadata(step)[ROLLOUTS].tree)
    like = like_rollouts(_shapes(tree, serialize=False), step)
    args = ocp.args.Composite(**{ROLLOUTS: ocp.args.StandardRestore(like)})
    arrays = _readable(lambda: mgr.restore(step, args=args)[ROLLOUTS])
    _checked(arrays, meta.pop(ROLLOUT_CHECKSUMS))
    meta[ROLLOUT_ARRAYS] = arrays
  return restored.state, meta


def _aside(path: str) -> str:
  """Where to move an unreadable checkpoint: <path>.corrupt, or .corrupt.N when that is taken."""
  target, n = path + CORRUPT, 1
  while epath.Path(target).exists():
    n += 1
    target = f"{path}{CORRUPT}.{n}"
  return target


def moved_aside(mgr: ocp.CheckpointManager) -> list:
  """The checkpoints of `mgr`'s directory moved aside as unreadable (this run or an earlier one)."""
  directory = epath.Path(mgr.directory)
  if not directory.is_dir():
    return []
  return sorted(str(p) for p in directory.iterdir() if CORRUPT in p.name)


def restore_latest(
  mgr: ocp.CheckpointManager, like_state, restart_from_scratch: bool = False, like_rollouts=None
):
  """(state, meta) of the newest readable checkpoint, or None when there is none; arrays come back
  on the shardings of `like_state`'s (any mesh: a run may resume on another one).

    Only a checkpoint whose files fail to read as a checkpoint, or fail their checksums, is moved
    aside, to `<step>.corrupt`, with a warning naming it, and the previous one is tried: a later
    save at that step must not collide with it, and nothing is deleted. A checkpoint that reads but
    holds another state (a changed config), or whose meta fails its checksum or names another
    step, raises ValueError and changes nothing on disk. When none is left and some were moved
    aside (now or by an earlier run), NoReadableCheckpoint names them, unless
    `restart_from_scratch` (then None: the run starts at step 0).

    like_rollouts: (the saved rollout arrays' {name: (shape, dtype)}, step) -> the abstract arrays
    to restore them onto (rl/rollouts.py's `Source.abstract_saved`); with it, a checkpoint that
    keeps rows under way returns their arrays as the meta's ROLLOUT_ARRAYS, checked like the
    state (damaged: moved aside, the previous checkpoint tried).
  """
  abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, like_state)
  for step in sorted(mgr.all_steps(), reverse=True):
    path = os.path.join(str(mgr.directory), str(step))
    try:
      return _restore(mgr, step, abstract, path, like_rollouts)
    except _Unreadable as e:
      target = _aside(path)
      if jax.process_index() == 0:  # on an object store a copy and a delete, not atomic
        epath.Path(path).rename(target)
      multihost_utils.sync_global_devices(f"moved aside checkpoint {step}")
      mgr.reload()
      print(
        f"warning: checkpoint {path} is unreadable ({str(e)[:200]}); moved to "
        f"{target}, trying the previous one",
        flush=True,
      )
  moved = moved_aside(mgr)
  if moved and not restart_from_scratch:
    raise NoReadableCheckpoint(
      f"no checkpoint of {mgr.directory} is readable: {', '.join(moved)} were moved aside as "
      "unreadable (nothing was deleted). A run does not start again at step 0 on its own: pass "
      "--config.restart_from_scratch=True for that (the moved checkpoints stay), put a good "
      "checkpoint back, or use a new config.workdir"
    )
  return None
