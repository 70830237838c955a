"""LoRA adapters for DistillSparse: active only in the sparse actor, never in the dense policy.

`LoRA.params` = {"layers": {"q": {"a": [L, in, r], "b": [L, r, out]}, ...}} on the targeted
projections, stacked over layers like the model's; `scale` = alpha / rank is static (not trained,
not decayed). B starts at zero so a fresh adapter leaves the model unchanged.
"""

import flax.struct
import jax
import jax.numpy as jnp

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@flax.struct.dataclass
class LoRA:
  params: dict
  scale: float = flax.struct.field(pytree_node=False, default=1.0)


def init_lora(
  base_params, key, rank: int = 8, alpha: float = 16.0, targets=TARGETS, dtype=jnp.float32
) -> LoRA:
  """Adapters on `targets` (default: all seven projections, as the reference's all-linear)."""
  bad = [t for t in targets if t not in TARGETS]
  if bad or not targets:
    raise ValueError(f"lora targets {list(targets)} invalid; choose from {TARGETS}")
  if rank <= 0:
    raise ValueError(f"lora rank must be positive, got {rank}")
  adapters = {}
  for k, name in zip(jax.random.split(key, len(targets)), targets):
    L, d_in, d_out = base_params["layers"][name].shape
    a = jax.random.normal(k, (L, d_in, rank), jnp.float32) / jnp.sqrt(d_in)
    adapters[name] = {"a": a.astype(dtype), "b": jnp.zeros((L, rank, d_out), dtype)}
  return LoRA(params={"layers": adapters}, scale=alpha / rank)


def project(x, w, lora_layer, name, scale):
  """x @ w, plus scale * (x @ a) @ b when projection `name` carries an adapter."""
  y = x @ w
  if lora_layer is not None and name in lora_layer:
    ad = lora_layer[name]
    y = y + (scale * ((x @ ad["a"].astype(x.dtype)) @ ad["b"].astype(x.dtype))).astype(y.dtype)
  return y


def merge(base_params, lora: LoRA):
  """Base params with the adapters folded in (w + scale * a @ b): the sparse actor as one model."""
  layers = dict(base_params["layers"])
  for name, ad in lora.params["layers"].items():
    w = layers[name]
    delta = jnp.einsum("lir,lro->lio", ad["a"], ad["b"]).astype(jnp.float32)
    layers[name] = (w + lora.scale * delta).astype(w.dtype)
  return dict(base_params, layers=layers)


def unmerge(merged_params, lora: LoRA):
  """Inverse of `merge` (up to rounding in low precision): merge the negated adapters."""
  negated = {n: {"a": ad["a"], "b": -ad["b"]} for n, ad in lora.params["layers"].items()}
  return merge(merged_params, lora.replace(params={"layers": negated}))
