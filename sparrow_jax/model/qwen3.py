"""Qwen3 as pure functions over a params pytree.

params = {
  "embed": [V, D],
  "layers": [{"attn_norm": [D], "q": [D, H*E], "k": [D, K*E], "v": [D, K*E], "q_norm": [E],
              "k_norm": [E], "o": [H*E, D], "mlp_norm": [D], "gate": [D, F], "up": [D, F],
              "down": [F, D]}, ...],                       # one dict per layer (a Python list)
  "final_norm": [D],
  "lm_head": [D, V],                                       # only when embeddings are untied
}
Weights are stored input-major ([in, out], x @ w); `hf.py` transposes to and from torch's [out, in].
Layers are a Python list rather than a scanned stack because Sparrow treats layers differently (the
first `dense_layers` stay dense) and the unrolled graph is what a decode step compiles to anyway.

The model knows Qwen3 only. Attention is the one pluggable piece: `forward` takes
`attention_fn(layer_idx, q_BTKGE, k_BSKE, v_BSKE, allowed_BTS)` and `decode_step` takes
`attention_fn(layer_idx, q_BKGE, cache, lengths_B)`; the sparsity policy (which layers stay dense,
which pages the others read) builds both in sparrow_jax/attention/policy.py.
"""
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention import paged_cache, reference
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.model import lora as lora_lib


def rms_norm(x, weight, eps):
  """HF Qwen3RMSNorm: normalise in float32, cast back, then scale."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight * x32.astype(x.dtype)


def rope_inv_freq(cfg: Qwen3Config):
  """Inverse frequencies [E/2] and the attention scaling factor, for the config's rope type."""
  dim = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  scaling = cfg.rope_scaling_dict
  rope_type = scaling.get("rope_type", "default")
  if rope_type == "linear":
    return inv_freq / scaling["factor"], 1.0
  if rope_type == "yarn":
    return _yarn_inv_freq(cfg, inv_freq, scaling)
  return inv_freq, 1.0


def _yarn_inv_freq(cfg, inv_freq, scaling):
  """YaRN (Peng et al. 2023): interpolate low frequencies, keep high ones, blend in between."""
  dim, base, factor = cfg.head_dim, cfg.rope_theta, scaling["factor"]
  original_max = scaling.get("original_max_position_embeddings", cfg.max_position_embeddings)

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  attention_factor = scaling.get("attention_factor")
  if attention_factor is None:
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
      attention_factor = mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    else:
      attention_factor = mscale(factor)

  def correction_dim(rotations):
    return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low = math.floor(correction_dim(scaling.get("beta_fast", 32)))
  high = math.ceil(correction_dim(scaling.get("beta_slow", 1)))
  if not scaling.get("truncate", True):
    low, high = correction_dim(scaling.get("beta_fast", 32)), correction_dim(scaling.get("beta_slow", 1))
  low, high = max(low, 0), min(high, dim - 1)
  high = high + 0.001 if low == high else high
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp
  inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
  return inv, attention_factor


def apply_rope(x_BTNE, positions_BT, cfg: Qwen3Config):
  """Rotary embedding in HF's rotate-half layout, computed in float32."""
  inv_freq, attention_factor = rope_inv_freq(cfg)
  angles_BTf = positions_BT[..., None].astype(jnp.float32) * inv_freq
  angles_BTE = jnp.concatenate([angles_BTf, angles_BTf], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles_BTE) * attention_factor, jnp.sin(angles_BTE) * attention_factor
  x = x_BTNE.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos + rotated * sin).astype(x_BTNE.dtype)


def init_params(cfg: Qwen3Config, key, dtype=jnp.float32, std: float = 0.02):
  """Random params with HF's initializer (normal(0, 0.02) weights, unit norms)."""
  D, F, E = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  H, K, V = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size
  shapes = {"q": (D, H * E), "k": (D, K * E), "v": (D, K * E), "o": (H * E, D),
            "gate": (D, F), "up": (D, F), "down": (F, D)}
  keys = jax.random.split(key, cfg.num_hidden_layers + 2)

  def normal(k, shape):
    return (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

  layers = []
  for layer_key in keys[:-2]:
    ks = jax.random.split(layer_key, len(shapes))
    layer = {name: normal(k, shape) for k, (name, shape) in zip(ks, shapes.items())}
    layer.update(attn_norm=jnp.ones((D,), dtype), mlp_norm=jnp.ones((D,), dtype),
                 q_norm=jnp.ones((E,), dtype), k_norm=jnp.ones((E,), dtype))
    layers.append(layer)
  params = {"embed": normal(keys[-2], (V, D)), "layers": layers,
            "final_norm": jnp.ones((D,), dtype)}
  if not cfg.tie_word_embeddings:
    params["lm_head"] = normal(keys[-1], (D, V))
  return params


def embed(params, tokens_BT, cfg: Qwen3Config):
  """Token embeddings; a token id outside [0, vocab) is an error (checked when concrete)."""
  if not isinstance(tokens_BT, jax.core.Tracer):  # numpy: a concrete array captured under jit too
    lo, hi = int(np.min(np.asarray(tokens_BT))), int(np.max(np.asarray(tokens_BT)))
    if lo < 0 or hi >= cfg.vocab_size:
      raise ValueError(f"token ids must lie in [0, {cfg.vocab_size}) (vocab_size); "
                       f"got min {lo}, max {hi}")
  return jnp.take(params["embed"], tokens_BT, axis=0)


def qkv(layer, x_BTD, positions_BT, cfg: Qwen3Config, lora_layer=None, lora_scale=1.0):
  """Projections -> per-head q/k RMSNorm -> RoPE. Returns q_BTHE, k_BTKE, v_BTKE."""
  B, T, _ = x_BTD.shape
  h_BTD = rms_norm(x_BTD, layer["attn_norm"], cfg.rms_norm_eps)
  proj = lambda name: lora_lib.project(h_BTD, layer[name], lora_layer, name, lora_scale)
  q = proj("q").reshape(B, T, cfg.num_attention_heads, cfg.head_dim)
  k = proj("k").reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
  v = proj("v").reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
  q = apply_rope(rms_norm(q, layer["q_norm"], cfg.rms_norm_eps), positions_BT, cfg)
  k = apply_rope(rms_norm(k, layer["k_norm"], cfg.rms_norm_eps), positions_BT, cfg)
  return q, k, v


def finish_layer(layer, x_BTD, attn_BTHE, cfg: Qwen3Config, lora_layer=None, lora_scale=1.0):
  """Output projection + residual, then the SwiGLU MLP + residual."""
  B, T = x_BTD.shape[:2]
  proj = lambda h, name: lora_lib.project(h, layer[name], lora_layer, name, lora_scale)
  x_BTD = x_BTD + proj(attn_BTHE.reshape(B, T, -1).astype(x_BTD.dtype), "o")
  h_BTD = rms_norm(x_BTD, layer["mlp_norm"], cfg.rms_norm_eps)
  mlp_BTF = jax.nn.silu(proj(h_BTD, "gate")) * proj(h_BTD, "up")
  return x_BTD + proj(mlp_BTF, "down")


def unembed(params, x_BTD, cfg: Qwen3Config):
  """Final norm and LM head; float32 logits."""
  h_BTD = rms_norm(x_BTD, params["final_norm"], cfg.rms_norm_eps)
  w_DV = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  return jnp.einsum("btd,dv->btv", h_BTD, w_DV, preferred_element_type=jnp.float32)


def dense_attention(q_BTKGE, k_BSKE, v_BSKE, allowed_BTS):
  """Softmax attention in float32 over the allowed (query, key) pairs; a row with no allowed key
  (a padding query) gives zeros."""
  E = q_BTKGE.shape[-1]
  s_BKGTS = jnp.einsum("btkge,bske->bkgts", q_BTKGE, k_BSKE,
                       preferred_element_type=jnp.float32) / math.sqrt(E)
  allowed = allowed_BTS[:, None, None] if allowed_BTS.ndim == 3 else allowed_BTS[:, :, None]
  p_BKGTS = reference.masked_softmax(s_BKGTS, allowed)
  return jnp.einsum("bkgts,bske->btkge", p_BKGTS, v_BSKE.astype(jnp.float32))


def default_positions(mask_BT):
  """Positions that skip left padding: the i-th valid token of a row has position i."""
  return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=1) - 1, 0)


AttentionFn = Callable[[int, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def forward_hidden(params, tokens_BT, cfg: Qwen3Config, *, positions_BT=None, mask_BT=None,
                   attention_fn: Optional[AttentionFn] = None, lora=None):
  """Teacher-forced pass up to the last hidden state. Also returns each layer's (k, v) so that
  prefill can fill a cache from the same computation."""
  B, T = tokens_BT.shape
  if mask_BT is None:
    mask_BT = jnp.ones((B, T), bool)
  mask_BT = mask_BT.astype(bool)
  if positions_BT is None:
    positions_BT = default_positions(mask_BT)
  causal_TS = jnp.tril(jnp.ones((T, T), bool))
  allowed_BTS = causal_TS[None] & mask_BT[:, None, :]
  attention_fn = attention_fn or (lambda i, q, k, v, allowed: dense_attention(q, k, v, allowed))
  K, G, E = cfg.num_key_value_heads, cfg.group_size, cfg.head_dim

  x_BTD = embed(params, tokens_BT, cfg)
  kv_per_layer = []
  for i, layer in enumerate(params["layers"]):
    lora_layer, scale = lora_lib.layer(lora, i)
    q_BTHE, k_BTKE, v_BTKE = qkv(layer, x_BTD, positions_BT, cfg, lora_layer, scale)
    attn = attention_fn(i, q_BTHE.reshape(B, T, K, G, E), k_BTKE, v_BTKE, allowed_BTS)
    x_BTD = finish_layer(layer, x_BTD, attn.reshape(B, T, K * G, E), cfg, lora_layer, scale)
    kv_per_layer.append((k_BTKE, v_BTKE))
  return x_BTD, kv_per_layer


def forward(params, tokens_BT, cfg: Qwen3Config, *, positions_BT=None, mask_BT=None,
            attention_fn: Optional[AttentionFn] = None, lora=None):
  """Teacher-forced logits_BTV (float32). mask_BT marks real tokens (HF's attention_mask);
  positions default to skipping left padding. The sparse teacher-forced forward is
  `attention.policy.forward` (`sj.forward`), which passes its `attention_fn` here."""
  x_BTD, _ = forward_hidden(params, tokens_BT, cfg, positions_BT=positions_BT, mask_BT=mask_BT,
                            attention_fn=attention_fn, lora=lora)
  return unembed(params, x_BTD, cfg)


def token_logprobs(logits_BTV, targets_BT, temperature: float = 1.0):
  """log softmax(logits / temperature)[target] per position."""
  logp_BTV = jax.nn.log_softmax(logits_BTV / temperature, axis=-1)
  return jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]


def prefill(params, prompt_BT, prompt_len_B, cfg: Qwen3Config, cache, *, lora=None):
  """Dense pass over right-padded prompts that fills the cache. Returns the logits_BV of each row's
  last prompt token (which predict the first generated token) and the cache."""
  T = prompt_BT.shape[1]
  mask_BT = jnp.arange(T)[None] < prompt_len_B[:, None]
  x_BTD, kv_per_layer = forward_hidden(params, prompt_BT, cfg, mask_BT=mask_BT, lora=lora)
  for i, (k_BTKE, v_BTKE) in enumerate(kv_per_layer):
    cache = paged_cache.write_prefill(cache, i, k_BTKE, v_BTKE, mask_BT)
  cache = cache.replace(lengths=prompt_len_B.astype(jnp.int32))
  last_BD = jnp.take_along_axis(x_BTD, (prompt_len_B - 1)[:, None, None], axis=1)
  return unembed(params, last_BD, cfg)[:, 0], cache


DecodeAttentionFn = Callable[[int, jax.Array, paged_cache.PagedKVCache, jax.Array], jax.Array]


def dense_decode_fn(layer, q_BKGE, cache, lengths_B):
  """The default decode attention: every layer reads the whole cache (masked by length)."""
  return reference.dense_decode_attention(q_BKGE, cache.k[layer], cache.v[layer], lengths_B)


def decode_step(params, token_B, cfg: Qwen3Config, cache, *,
                attention_fn: Optional[DecodeAttentionFn] = None, lora=None):
  """Appends one token per sequence and returns the next-token logits_BV and the cache.

  attention_fn(layer, q_BKGE, cache, lengths_B) -> out_BKGE reads layer `layer` of the cache, whose
  newest token is already written (lengths_B tokens cached); dense by default, block-sparse from
  `attention.policy.decode_attention_fn`.
  """
  B = token_B.shape[0]
  K, G, E = cfg.num_key_value_heads, cfg.group_size, cfg.head_dim
  attention_fn = attention_fn or dense_decode_fn
  pos_B = cache.lengths
  lengths_B = pos_B + 1
  x_BTD = embed(params, token_B[:, None], cfg)
  for i, layer in enumerate(params["layers"]):
    lora_layer, scale = lora_lib.layer(lora, i)
    q_BTHE, k_BTKE, v_BTKE = qkv(layer, x_BTD, pos_B[:, None], cfg, lora_layer, scale)
    cache = paged_cache.append(cache, i, k_BTKE[:, 0], v_BTKE[:, 0], pos_B)
    out_BKGE = attention_fn(i, q_BTHE[:, 0].reshape(B, K, G, E), cache, lengths_B)
    x_BTD = finish_layer(layer, x_BTD, out_BKGE.reshape(B, 1, K * G, E), cfg, lora_layer, scale)
  cache = cache.replace(lengths=lengths_B)
  return unembed(params, x_BTD, cfg)[:, 0], cache
