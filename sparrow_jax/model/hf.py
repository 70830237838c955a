"""Hugging Face Qwen3 and Llama checkpoints (config.json + safetensors, single file or sharded)
<-> params.

Tensors are read one at a time (safetensors memory-maps the file), converted, transposed to our
input-major layout and written into its layer's slot of the stacked [L, ...] array on device (an
in-place update of a donated buffer) before the next is read, so a load never holds two copies of
the model. torch's Linear stores [out, in]; we store [in, out].
"""

import functools
import json
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from sparrow_jax.model.config import Qwen3Config

_LAYER_NAMES = {  # our name -> (HF suffix under model.layers.{i}., transpose?)
  "attn_norm": ("input_layernorm.weight", False),
  "q": ("self_attn.q_proj.weight", True),
  "k": ("self_attn.k_proj.weight", True),
  "v": ("self_attn.v_proj.weight", True),
  "o": ("self_attn.o_proj.weight", True),
  "q_norm": ("self_attn.q_norm.weight", False),
  "k_norm": ("self_attn.k_norm.weight", False),
  "mlp_norm": ("post_attention_layernorm.weight", False),
  "gate": ("mlp.gate_proj.weight", True),
  "up": ("mlp.up_proj.weight", True),
  "down": ("mlp.down_proj.weight", True),
}

_QK_NORMS = ("q_norm", "k_norm")  # Qwen3's per-head norms, absent from Llama checkpoints
# Buffers some Llama checkpoints carry beside the weights; recomputed from the config, not loaded.
_LLAMA_BUFFERS = ("self_attn.rotary_emb.inv_freq",)


def hf_tensor_specs(cfg: Qwen3Config) -> dict:
  """HF tensor name -> (path into our params, expected HF shape, transpose?)."""
  D, F, E = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  H, K, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size
  our_shapes = {
    "attn_norm": (D,),
    "q": (D, H * E),
    "k": (D, K * E),
    "v": (D, K * E),
    "o": (H * E, D),
    "q_norm": (E,),
    "k_norm": (E,),
    "mlp_norm": (D,),
    "gate": (D, F),
    "up": (D, F),
    "down": (F, D),
  }
  specs = {
    "model.embed_tokens.weight": (("embed",), (V, D), False),
    "model.norm.weight": (("final_norm",), (D,), False),
  }
  if not cfg.tie_word_embeddings:
    specs["lm_head.weight"] = (("lm_head",), (V, D), True)
  for i in range(cfg.num_hidden_layers):
    for ours, (suffix, transpose) in _LAYER_NAMES.items():
      if ours in _QK_NORMS and not cfg.qk_norm:  # Llama
        continue
      shape = our_shapes[ours][::-1] if transpose else our_shapes[ours]
      specs[f"model.layers.{i}.{suffix}"] = (("layers", i, ours), shape, transpose)
  return specs


def _open(file: str):
  """safe_open, with errors (a truncated or corrupt file) that name the file."""
  try:
    return safe_open(file, "np")
  except (SafetensorError, OSError) as e:
    raise ValueError(f"{file}: unreadable safetensors file ({e})") from None


def _tensor_files(path: str) -> dict:
  """HF tensor name -> safetensors file holding it."""
  index = os.path.join(path, "model.safetensors.index.json")
  if os.path.exists(index):
    return {name: os.path.join(path, file) for name, file in _weight_map(index).items()}
  single = os.path.join(path, "model.safetensors")
  if not os.path.exists(single):
    raise FileNotFoundError(
      f"{path} has neither model.safetensors nor model.safetensors.index.json"
    )
  with _open(single) as f:
    return {name: single for name in f.keys()}


def _weight_map(index: str) -> dict:
  """The index's tensor name -> file map, checked: a JSON object whose 'weight_map' maps names to
  file names."""
  try:
    with open(index) as f:
      weight_map = json.load(f).get("weight_map")
  except (ValueError, AttributeError) as e:  # not JSON, or JSON but not an object
    raise ValueError(f"{index}: not a safetensors index (a JSON object; {e})") from None
  if not isinstance(weight_map, dict) or not all(
    isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
  ):
    raise ValueError(
      f"{index}: 'weight_map' must map tensor names to safetensors file names, got "
      f"{str(weight_map)[:80]}"
    )
  return weight_map


def load_config(path: str) -> Qwen3Config:
  config_file = os.path.join(path, "config.json")
  if not os.path.exists(config_file):
    raise FileNotFoundError(f"no config.json in checkpoint dir {path!r}")
  try:
    with open(config_file) as f:
      return Qwen3Config.from_hf_dict(json.load(f))
  except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
    raise ValueError(f"{config_file}: not a Qwen3 or Llama config.json ({e})") from None


def load_hf(path: str, dtype=None):
  """Loads an HF Qwen3 or Llama dir -> (Qwen3Config, params). dtype=None keeps the stored
  dtype."""
  cfg = load_config(path)
  specs = hf_tensor_specs(cfg)
  files = _tensor_files(path)
  missing = [name for name in specs if name not in files]
  if missing:
    name = missing[0]
    raise ValueError(
      f"checkpoint {path!r} lacks {len(missing)} tensors, e.g. {name!r} "
      f"(expected shape {specs[name][1]})"
    )
  # A tied checkpoint may still carry lm_head.weight (a copy of the embedding); it is not needed.
  unexpected = [
    n
    for n in files
    if n not in specs
    and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    and not (not cfg.qk_norm and n.endswith(_LLAMA_BUFFERS))
  ]
  if unexpected:
    raise ValueError(
      f"checkpoint {path!r} has {len(unexpected)} unexpected tensors, e.g. {unexpected[0]!r}"
    )
  params = {"layers": {}}
  by_file: dict = {}
  for name in specs:
    by_file.setdefault(files[name], []).append(name)
  for file, names in by_file.items():
    with _open(file) as f:
      for name in names:
        where, shape, transpose = specs[name]
        try:
          array = f.get_tensor(name)
        except SafetensorError as e:
          raise ValueError(f"{file}: tensor {name!r} unreadable ({e})") from None
        if tuple(array.shape) != shape:
          raise ValueError(
            f"tensor {name!r} in {file} has shape {tuple(array.shape)}, expected {shape}"
          )
        value = jnp.asarray(array.T if transpose else array, dtype=dtype or array.dtype)
        del array
        if where[0] == "layers":
          _, i, name = where
          stack = params["layers"].get(name)
          if stack is None:
            stack = jnp.zeros((cfg.num_hidden_layers, *value.shape), value.dtype)
          params["layers"][name] = _set_layer(stack, value, i)
        else:
          params[where[0]] = value
  return cfg, params


@functools.partial(jax.jit, donate_argnums=0)
def _set_layer(stack_La, value_a, i):
  return stack_La.at[i].set(value_a.astype(stack_La.dtype))


def _lookup(params, where):
  return params["layers"][where[2]][where[1]] if where[0] == "layers" else params[where[0]]


def _save_file(tensors: dict, file: str):
  """safetensors' writer creates files 0600; a checkpoint is shared like any other file (0644)."""
  save_file(tensors, file, metadata={"format": "pt"})
  os.chmod(file, 0o644)


def save_hf(
  path: str,
  cfg: Qwen3Config,
  params,
  max_shard_bytes: Optional[int] = None,
  generation_config: Optional[dict] = None,
):
  """Writes config.json and safetensors (sharded with an index when over max_shard_bytes)."""
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg.to_hf_dict(), f, indent=2)
  if generation_config is not None:
    with open(os.path.join(path, "generation_config.json"), "w") as f:
      json.dump(generation_config, f, indent=2)
  shards, current, size = [], {}, 0
  for name, (where, _, transpose) in hf_tensor_specs(cfg).items():
    array = np.asarray(_lookup(params, where))
    array = np.ascontiguousarray(array.T if transpose else array)
    if max_shard_bytes and current and size + array.nbytes > max_shard_bytes:
      shards.append(current)
      current, size = {}, 0
    current[name] = array
    size += array.nbytes
  shards.append(current)
  if len(shards) == 1:
    _save_file(shards[0], os.path.join(path, "model.safetensors"))
    return
  weight_map, total = {}, 0
  for k, shard in enumerate(shards):
    file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    _save_file(shard, os.path.join(path, file))
    weight_map.update({name: file for name in shard})
    total += sum(a.nbytes for a in shard.values())
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
