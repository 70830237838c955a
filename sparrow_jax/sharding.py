"""Logical axis names for every parameter, LoRA, optimizer and cache array, the rules that map them
to a mesh, and the host side of many processes.

A mesh has axes ("data", "fsdp", "tensor"); one device is the mesh of size one, and every run goes
through this code path. Parameters are FSDP-sharded along the model width and tensor-parallel along
heads / FFN / vocab (Megatron layout: column-parallel q/k/v/gate/up, row-parallel o/down); rows of a
batch (rollouts, the cache) are sharded over data x fsdp and KV heads over tensor.

Model code names the axes of its activations with `constrain(x, axes)`, resolved against the mesh
set by `jax.set_mesh` (the trainer sets it); without one it is the identity, so library calls on a
single device need no mesh.

Many processes: each process holds the rows of its own devices (`process_rows`), builds them on the
host and joins them into global arrays (`jax.make_array_from_process_local_data`); `local_rows`
reads them back. Devices are laid out process-major (jax.devices() order), with tensor the fastest
axis, so a process's rows are one contiguous block and a tensor-parallel group stays on one host.
"""

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np

MESH_AXES = ("data", "fsdp", "tensor")
BATCH = ("data", "fsdp")  # the mesh axes rows are sharded over

# logical axis -> mesh axis (None = replicated)
RULES = {
  "batch": BATCH,
  "vocab": "tensor",
  "embed": "fsdp",
  "heads": "tensor",
  "kv_heads": "tensor",
  "mlp": "tensor",
  "layers": None,  # the scanned axis of stacked layers and of the cache
  "lora_rank": None,
  "norm": None,
  "head_dim": None,
  "q_group": None,  # the query heads that share one KV head (G)
  "cache_len": None,
  "pages": None,
  "summary_rows": None,  # a page summary's rows (paged_cache.PAGE_SCORES)
  "length": None,  # positions of a row
  "micro_batch": None,  # the stacked slices of gradient accumulation
  "lookup_vocab": None,  # the embedding table at lookup is gathered: any row may hold any id
  "act_embed": None,  # the model width of activations (weights' "embed" is FSDP-sharded)
}

# The sampler's weights: gathered over fsdp once per rollout instead of at every decode step and
# layer (FSDP's all-gathers would run per generated token), still split over tensor.
ROLLOUT_RULES = {**RULES, "embed": None}

_LAYER_AXES = {
  "attn_norm": ("norm",),
  "mlp_norm": ("norm",),
  "q_norm": ("head_dim",),
  "k_norm": ("head_dim",),
  "q": ("embed", "heads"),
  "k": ("embed", "kv_heads"),
  "v": ("embed", "kv_heads"),
  "o": ("heads", "embed"),
  "gate": ("embed", "mlp"),
  "up": ("embed", "mlp"),
  "down": ("mlp", "embed"),
}


def param_axes(params):
  """The params pytree with each array replaced by its tuple of logical axis names."""
  axes = {
    "embed": ("vocab", "embed"),
    "final_norm": ("norm",),
    "layers": {name: ("layers",) + _LAYER_AXES[name] for name in params["layers"]},
  }
  if "lm_head" in params:
    axes["lm_head"] = ("embed", "vocab")
  return axes


def lora_axes(lora_params):
  """LoRA adapters {"layers": {name: {"a": [L, in, r], "b": [L, r, out]}}}: a and b shard like the
  projection's input and output axes; the rank is replicated."""
  return {
    "layers": {
      name: {
        "a": ("layers", _LAYER_AXES[name][0], "lora_rank"),
        "b": ("layers", "lora_rank", _LAYER_AXES[name][1]),
      }
      for name in lora_params["layers"]
    }
  }


CACHE_AXES = {
  "k_stored": ("layers", "batch", "kv_heads", "cache_len", "head_dim"),
  "v_stored": ("layers", "batch", "kv_heads", "cache_len", "head_dim"),
  "summaries": ("layers", "batch", "kv_heads", "pages", "summary_rows", "head_dim"),
  "lengths": ("batch",),
}


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh over `devices` (default: all of them, every process's);
  data = -1 takes the devices fsdp x tensor leaves."""
  devices = list(devices if devices is not None else jax.devices())
  if data == -1 and fsdp >= 1 and tensor >= 1 and len(devices) % (fsdp * tensor) == 0:
    data = len(devices) // (fsdp * tensor)
  if min(data, fsdp, tensor) < 1 or data * fsdp * tensor != len(devices):
    raise ValueError(
      f"mesh data*fsdp*tensor = {data}*{fsdp}*{tensor} does not match the "
      f"{len(devices)} devices (data = -1: the devices fsdp*tensor leaves)"
    )
  return Mesh(np.asarray(devices).reshape(data, fsdp, tensor), MESH_AXES)


def split_devices(rollout_per_process: int) -> tuple:
  """Every process's devices in two lists, process-major: (the trainer's, the rollout's), each
  process giving its first `rollout_per_process` devices (by id) to the rollout."""
  by_process = {}
  for d in jax.devices():
    by_process.setdefault(d.process_index, []).append(d)
  train, rollout = [], []
  for p in sorted(by_process):
    devices = sorted(by_process[p], key=lambda d: d.id)
    rollout += devices[:rollout_per_process]
    train += devices[rollout_per_process:]
  return train, rollout


def platform() -> str:
  """What is being compiled for: the platform of the enclosing mesh's devices (compile-only TPU
  devices on this CPU give "tpu"), else the default backend's."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  return jax.default_backend() if device is None else device.platform


def spec(logical_axes, shape, mesh, rules=None) -> PartitionSpec:
  """PartitionSpec for one array on `mesh` (concrete or abstract) by `rules` (default RULES); an
  axis whose size the mesh axes do not divide stays replicated."""
  out = []
  for name, size in zip(logical_axes, shape):
    mesh_axes = (rules or RULES)[name]
    names = (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ())
    ways = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    out.append(mesh_axes if names and ways > 1 and size % ways == 0 else None)
  return PartitionSpec(*out)


def shardings(tree, axes_tree, mesh: Mesh, rules=None):
  """NamedShardings for the arrays (or ShapeDtypeStructs) of `tree`, by their logical axes."""
  return jax.tree_util.tree_map(
    lambda axes, x: NamedSharding(mesh, spec(axes, x.shape, mesh, rules)),
    axes_tree,
    tree,
    is_leaf=lambda a: isinstance(a, tuple),
  )


def param_shardings(params, mesh: Mesh, rules=None):
  return shardings(params, param_axes(params), mesh, rules)


def lora_shardings(lora, mesh: Mesh, rules=None):
  """A model.lora.LoRA whose arrays are replaced by their shardings."""
  return lora.replace(params=shardings(lora.params, lora_axes(lora.params), mesh, rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def rows(mesh: Mesh) -> NamedSharding:
  """Leading axis (rows) over the batch axes, the rest replicated: rollouts, train batches."""
  return NamedSharding(mesh, PartitionSpec(BATCH))


def constrain(x, logical_axes):
  """x constrained to its logical axes on the mesh of the enclosing `jax.set_mesh` (identity when
  none is set)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return x
  return jax.lax.with_sharding_constraint(x, spec(logical_axes, x.shape, mesh))


def place(tree, shardings_tree):
  """Host or single-device arrays -> global arrays with the given shardings (a tree like `tree`,
  or one sharding for every leaf). Every process passes the same values (each loads the
  checkpoint) and keeps only its devices' shards."""

  def put(x, sharding):
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

  if isinstance(shardings_tree, NamedSharding):
    return jax.tree_util.tree_map(lambda x: put(x, shardings_tree), tree)
  return jax.tree_util.tree_map(put, tree, shardings_tree)


def process_rows(sharding: NamedSharding, rows: int) -> tuple:
  """[start, stop) of the rows this process's devices hold under `sharding` (one block)."""
  slices = sharding.addressable_devices_indices_map((rows,)).values()
  starts = sorted({s[0].start or 0 for s in slices})
  stops = sorted({rows if s[0].stop is None else s[0].stop for s in slices})
  if any(b != a for a, b in zip(stops[:-1], starts[1:])):
    raise ValueError(f"this process's rows {list(zip(starts, stops))} are not one block")
  return starts[0], stops[-1]


def from_local_rows(local, sharding: NamedSharding, rows: int):
  """This process's rows (host data) -> the global array of `rows` rows."""
  local = np.asarray(local)
  return jax.make_array_from_process_local_data(sharding, local, (rows, *local.shape[1:]))


def local_rows(x) -> np.ndarray:
  """The rows of a row-sharded array that this process holds, in order, on the host."""
  if x.is_fully_addressable:
    return np.asarray(x)
  shards = {s.index[0].start or 0: s.data for s in x.addressable_shards}
  return np.concatenate([np.asarray(shards[k]) for k in sorted(shards)])


def to_host(x) -> np.ndarray:
  """The whole value of a global array on every process's host (a small one: it is all-gathered
  when rows live on other processes)."""
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  if x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
