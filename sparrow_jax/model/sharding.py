"""Logical axis names for every parameter and cache array, and the rules that map them to a mesh.

A mesh has axes ("data", "fsdp", "tensor"); one device is the mesh of size one. Parameters are
FSDP-sharded along the model width and tensor-parallel along heads / FFN / vocab (Megatron layout:
column-parallel q/k/v/gate/up, row-parallel o/down), the cache along batch and KV heads.
"""
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axis -> mesh axis (None = replicated)
RULES = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "layers": None,  # the scanned axis of stacked layers and of the cache
    "norm": None,
    "head_dim": None,
    "cache_len": None,
    "pages": None,
}

_LAYER_AXES = {
    "attn_norm": ("norm",), "mlp_norm": ("norm",), "q_norm": ("head_dim",), "k_norm": ("head_dim",),
    "q": ("embed", "heads"), "k": ("embed", "kv_heads"), "v": ("embed", "kv_heads"),
    "o": ("heads", "embed"), "gate": ("embed", "mlp"), "up": ("embed", "mlp"), "down": ("mlp", "embed"),
}


def param_axes(params):
  """The params pytree with each array replaced by its tuple of logical axis names."""
  axes = {"embed": ("vocab", "embed"), "final_norm": ("norm",),
          "layers": {name: ("layers",) + _LAYER_AXES[name] for name in params["layers"]}}
  if "lm_head" in params:
    axes["lm_head"] = ("embed", "vocab")
  return axes


CACHE_AXES = {"k_bits": ("layers", "batch", "kv_heads", "cache_len", "head_dim"),
              "v_bits": ("layers", "batch", "kv_heads", "cache_len", "head_dim"),
              "centroid_sum": ("layers", "batch", "kv_heads", "pages", "head_dim"),
              "lengths": ("batch",)}


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
  devices = devices if devices is not None else jax.devices()
  if data * fsdp * tensor != len(devices):
    raise ValueError(f"mesh data*fsdp*tensor = {data}*{fsdp}*{tensor} does not equal the "
                     f"{len(devices)} devices")
  return Mesh(np.asarray(devices).reshape(data, fsdp, tensor), MESH_AXES)


def spec(logical_axes, shape, mesh: Mesh) -> PartitionSpec:
  """PartitionSpec for one array; an axis whose size the mesh axes do not divide stays replicated."""
  out = []
  for name, size in zip(logical_axes, shape):
    mesh_axes = RULES[name]
    names = (mesh_axes,) if isinstance(mesh_axes, str) else (mesh_axes or ())
    ways = int(np.prod([mesh.shape[a] for a in names])) if names else 1
    out.append(mesh_axes if names and size % ways == 0 else None)
  return PartitionSpec(*out)


def shard_params(params, mesh: Mesh):
  """Places params on the mesh per the rules table."""
  def place(x, axes):
    return jax.device_put(x, NamedSharding(mesh, spec(axes, x.shape, mesh)))
  return jax.tree_util.tree_map(place, params, param_axes(params))
