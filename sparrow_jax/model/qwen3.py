"""Qwen3 as pure functions over a params pytree.

params = {
  "embed": [V, D],
  "layers": {"attn_norm": [L, D], "q": [L, D, H*E], "k": [L, D, K*E], "v": [L, D, K*E],
             "q_norm": [L, E], "k_norm": [L, E], "o": [L, H*E, D], "mlp_norm": [L, D],
             # q_norm / k_norm only with cfg.qk_norm (Qwen3; Llama has none)
             "gate": [L, D, F], "up": [L, D, F], "down": [L, F, D]},   # stacked over layers
  "final_norm": [D],
  "lm_head": [D, V],                                       # only when embeddings are untied
}
Weights are stored input-major ([in, out], x @ w); `hf.py` transposes to and from torch's [out, in].
Layers are stacked and run as one `lax.scan`, so a 28-layer model compiles like a one-layer one,
and each layer is rematerialised in the backward pass (`REMAT_POLICIES`): what a train step holds
per layer is its input. The decode step is the exception: it unrolls its layers over per-layer
weights and caches (`decode_step`). Sparrow treats layers differently (the first `dense_layers`
stay dense): the attention function receives the layer index and decides.

Memory at length (`experiments/memory_report.py`): attention is blockwise (attention/blockwise.py,
never a [T, S] score matrix), prefill goes chunk by chunk into the paged cache, and `map_logits`
applies the LM head to sequence chunks, so no [T, V] logits array exists in training either.

The model knows Qwen3 and Llama (Qwen3 without the q/k norms: `Qwen3Config.qk_norm`). Attention
is the one pluggable piece: `forward` takes
`attention_fn(layer, q_BTKGE, k_BTKE, v_BTKE, mask_BT)` (layer: a traced int32) and `decode_step`
takes `attention_fn(layer, q_BKGE, cache, lengths_B)` (layer: a Python int); the sparsity policy
(which layers stay dense, which pages the others read) builds both in
sparrow_jax/sparsity/policy.py.
"""

import math
from typing import Callable, Optional

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np

from sparrow_jax import sharding
from sparrow_jax.attention import blockwise, flash, paged_cache, reference
from sparrow_jax.model import lora as lora_lib
from sparrow_jax.model.config import Qwen3Config

ACT_AXES = ("batch", "length", "act_embed")  # activations between layers: rows over data x fsdp


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
      attention_factor = mscale(factor, scaling["mscale"]) / mscale(
        factor, scaling["mscale_all_dim"]
      )
    else:
      attention_factor = mscale(factor)

  def correction_dim(rotations):
    return dim * math.log(original_max / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low = math.floor(correction_dim(scaling.get("beta_fast", 32)))
  high = math.ceil(correction_dim(scaling.get("beta_slow", 1)))
  if not scaling.get("truncate", True):
    low, high = (
      correction_dim(scaling.get("beta_fast", 32)),
      correction_dim(scaling.get("beta_slow", 1)),
    )
  low, high = max(low, 0), min(high, dim - 1)
  high = high + 0.001 if low == high else high
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  extrapolation = 1 - ramp
  inv = (inv_freq / factor) * (1 - extrapolation) + inv_freq * extrapolation
  return inv, attention_factor


def apply_rope(x_BTaE, positions_BT, cfg: Qwen3Config):
  """Rotary embedding in HF's rotate-half layout, computed in float32."""
  inv_freq, attention_factor = rope_inv_freq(cfg)
  angles_BTf = positions_BT[..., None].astype(jnp.float32) * inv_freq
  angles_BTE = jnp.concatenate([angles_BTf, angles_BTf], axis=-1)[:, :, None, :]
  cos, sin = jnp.cos(angles_BTE) * attention_factor, jnp.sin(angles_BTE) * attention_factor
  x = x_BTaE.astype(jnp.float32)
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos + rotated * sin).astype(x_BTaE.dtype)


def init_params(cfg: Qwen3Config, key, dtype=jnp.float32, std: float = 0.02):
  """Random params with HF's initializer (normal(0, 0.02) weights, unit norms)."""
  D, F, E = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
  H, K, V, L = (
    cfg.num_attention_heads,
    cfg.num_key_value_heads,
    cfg.vocab_size,
    cfg.num_hidden_layers,
  )
  shapes = {
    "q": (D, H * E),
    "k": (D, K * E),
    "v": (D, K * E),
    "o": (H * E, D),
    "gate": (D, F),
    "up": (D, F),
    "down": (F, D),
  }
  keys = jax.random.split(key, len(shapes) + 2)

  def normal(k, shape):
    return (std * jax.random.normal(k, shape, jnp.float32)).astype(dtype)

  layers = {name: normal(k, (L, *shape)) for k, (name, shape) in zip(keys, shapes.items())}
  layers.update(attn_norm=jnp.ones((L, D), dtype), mlp_norm=jnp.ones((L, D), dtype))
  if cfg.qk_norm:
    layers.update(q_norm=jnp.ones((L, E), dtype), k_norm=jnp.ones((L, E), dtype))
  params = {
    "embed": normal(keys[-2], (V, D)),
    "layers": layers,
    "final_norm": jnp.ones((D,), dtype),
  }
  if not cfg.tie_word_embeddings:
    params["lm_head"] = normal(keys[-1], (D, V))
  return params


def embed(params, tokens_BT, cfg: Qwen3Config):
  """Token embeddings; a token id outside [0, vocab) is an error (checked when concrete)."""
  if not isinstance(tokens_BT, jax.core.Tracer):  # numpy: a concrete array captured under jit too
    lo, hi = int(np.min(np.asarray(tokens_BT))), int(np.max(np.asarray(tokens_BT)))
    if lo < 0 or hi >= cfg.vocab_size:
      raise ValueError(
        f"token ids must lie in [0, {cfg.vocab_size}) (vocab_size); got min {lo}, max {hi}"
      )
  table_VD = sharding.constrain(params["embed"], ("lookup_vocab", "act_embed"))
  return jnp.take(table_VD, tokens_BT, axis=0)


def qkv(layer, x_BTD, positions_BT, cfg: Qwen3Config, lora_layer=None, lora_scale=1.0):
  """Projections -> per-head q/k RMSNorm (Qwen3; not with cfg.qk_norm off: Llama) -> RoPE.
  Returns q_BTHE, k_BTKE, v_BTKE."""
  B, T, _ = x_BTD.shape
  h_BTD = rms_norm(x_BTD, layer["attn_norm"], cfg.rms_norm_eps)
  proj = lambda name: lora_lib.project(h_BTD, layer[name], lora_layer, name, lora_scale)
  q = proj("q").reshape(B, T, cfg.num_attention_heads, cfg.head_dim)
  k = proj("k").reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
  v = proj("v").reshape(B, T, cfg.num_key_value_heads, cfg.head_dim)
  if cfg.qk_norm:
    q, k = (
      rms_norm(q, layer["q_norm"], cfg.rms_norm_eps),
      rms_norm(k, layer["k_norm"], cfg.rms_norm_eps),
    )
  q, k = apply_rope(q, positions_BT, cfg), apply_rope(k, positions_BT, cfg)
  return q, k, v


MLP_CHUNK = 4096  # positions per MLP chunk of a long row (see finish_layer)


def finish_layer(layer, x_BTD, attn_BTHE, cfg: Qwen3Config, lora_layer=None, lora_scale=1.0):
  """Output projection + residual, then the SwiGLU MLP + residual. Rows longer than MLP_CHUNK go
  through the MLP in chunks (`map_sequence`): its [T, F] intermediates and their gradients were
  the largest temporaries of a long-row train step (14B, 38K tokens: 2.7 GB per float32 [T, F]
  buffer, ten live at once; experiments/memory_report.py)."""
  B, T = x_BTD.shape[:2]
  proj = lambda h, name: lora_lib.project(h, layer[name], lora_layer, name, lora_scale)
  x_BTD = x_BTD + proj(attn_BTHE.reshape(B, T, -1).astype(x_BTD.dtype), "o")

  def mlp(x_BCD):
    h_BCD = rms_norm(x_BCD, layer["mlp_norm"], cfg.rms_norm_eps)
    return x_BCD + proj(jax.nn.silu(proj(h_BCD, "gate")) * proj(h_BCD, "up"), "down")

  return mlp(x_BTD) if T <= MLP_CHUNK else map_sequence(mlp, (x_BTD,), MLP_CHUNK)


def unembed(params, x_BTD, cfg: Qwen3Config):
  """Final norm and LM head; float32 logits."""
  h_BTD = rms_norm(x_BTD, params["final_norm"], cfg.rms_norm_eps)
  w_DV = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  return jnp.einsum("btd,dv->btv", h_BTD, w_DV, preferred_element_type=jnp.float32)


LOGITS_CHUNK = 512  # positions per LM-head chunk: [B, 512, 151936] f32 = 311 MB per row


def map_sequence(fn, arrays, chunk: int):
  """fn(*array_chunks) over chunks of `chunk` positions of [B, S, ...] arrays (the last one padded);
  fn returns a pytree of [B, C, ...] arrays, put back together as [B, S, ...]. The chunk body is a
  checkpointed scan step, so forward and backward hold one chunk's intermediates at a time."""
  B, S = arrays[0].shape[:2]
  c = min(chunk, S)
  n = -(-S // c)

  def to_chunks(x):
    x = jnp.pad(x, ((0, 0), (0, n * c - S)) + ((0, 0),) * (x.ndim - 2))
    return x.reshape(B, n, c, *x.shape[2:]).swapaxes(0, 1)

  _, ys = jax.lax.scan(
    jax.checkpoint(lambda _, xs: (None, fn(*xs))), None, tuple(map(to_chunks, arrays))
  )
  return jax.tree_util.tree_map(
    lambda y: y.swapaxes(0, 1).reshape(B, n * c, *y.shape[3:])[:, :S], ys
  )


def map_logits(params, cfg: Qwen3Config, fn, hiddens, args=(), chunk: int = LOGITS_CHUNK):
  """fn(logits_list, *arg_chunks) over sequence chunks of the final hidden states.

  hiddens: a tuple of [B, S, D] hidden states, each turned into float32 logits [B, C, V] per chunk
  of C positions; args: [B, S, ...] arrays cut the same way. fn returns a pytree of [B, C, ...]
  arrays, put back together as [B, S, ...]. Chunks are checkpointed (`map_sequence`), so the
  backward pass recomputes a chunk's logits instead of keeping them: no [B, S, V] array is held,
  forward or back.
  """
  k = len(hiddens)
  return map_sequence(
    lambda *xs: fn([unembed(params, h, cfg) for h in xs[:k]], *xs[k:]), (*hiddens, *args), chunk
  )


def default_positions(mask_BT):
  """Positions that skip left padding: the i-th valid token of a row has position i."""
  return jnp.maximum(jnp.cumsum(mask_BT.astype(jnp.int32), axis=1) - 1, 0)


def causal_attention(layer, q_BTKGE, k_BTKE, v_BTKE, mask_BT):
  """The default teacher-forced attention: causal over the valid (mask_BT) keys, by the backend's
  fused kernel (cuDNN, splash) or blockwise (attention/flash.py)."""
  del layer
  return flash.causal_attention(q_BTKGE, k_BTKE, v_BTKE, mask_BT)


AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]

# Remat per layer: "full" keeps each layer's input and recomputes the rest in the backward pass
# (the memory-bounded default; `remat_full`); "attention" also keeps the blockwise attention's
# output and log-sum-exp (one [B, T, H, E] and one [B, H, T] per layer more), so the backward runs
# the attention forward and the sparse page selection once instead of twice (the fused cuDNN and
# splash kernels name no such residuals: there it keeps what "full" keeps); "dots" keeps the weight
# matmuls' outputs (less recompute, more activations); "none" keeps everything autodiff wants.
REMAT_POLICIES = {
  "full": jax.checkpoint_policies.nothing_saveable,
  "attention": jax.checkpoint_policies.save_only_these_names("attention_out", "attention_lse"),
  "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
  "none": None,
}


def remat_full(layer_fn):
  """layer_fn(x, *args) rematerialised: its backward recomputes the forward from the input x,
  which is all it keeps (bfloat16 as integer bits, `paged_cache.to_stored`). The same as
  jax.checkpoint with nothing saveable, but the scan over layers stacks those inputs with integer
  writes: XLA CPU runs bfloat16 dynamic-update-slices in float32 and would hold two float32 copies
  of the bf16 stack, 4x its size (docs/memory.md; the sampler's cache avoids it the same way)."""

  def remat(x, *args):
    # The traced values layer_fn closes over (masks, budgets) become explicit inputs: a custom_vjp
    # backward may not close over tracers (jax.closure_convert hoists only float ones).
    closed, out_shape = jax.make_jaxpr(layer_fn, return_shape=True)(x, *args)
    out_tree = jax.tree_util.tree_structure(out_shape)

    def call(x, args, consts):
      out = jax_core.jaxpr_as_fun(jax_core.ClosedJaxpr(closed.jaxpr, consts))(
        *jax.tree_util.tree_leaves((x, *args))
      )
      return jax.tree_util.tree_unflatten(out_tree, out)

    consts = list(closed.consts)

    @jax.custom_vjp
    def fn(x, args, consts):
      return call(x, args, consts)

    def fwd(x, args, consts):
      return call(x, args, consts), (paged_cache.to_stored(x), args, consts)

    def bwd(residuals, g):
      stored, args, consts = residuals
      return jax.vjp(call, paged_cache.from_stored(stored, g.dtype), args, consts)[1](g)

    fn.defvjp(fwd, bwd)
    return fn(x, args, consts)

  return remat


def check_remat(remat: str) -> None:
  if remat not in REMAT_POLICIES:
    raise ValueError(f"remat must be one of {tuple(REMAT_POLICIES)}, got {remat!r}")


def _layer_xs(params, lora):
  """What a scan over layers reads per layer: (layer params, LoRA adapters or None, index), and
  the LoRA scale."""
  L = params["layers"]["q"].shape[0]
  return (
    params["layers"],
    None if lora is None else lora.params["layers"],
    jnp.arange(L, dtype=jnp.int32),
  ), (1.0 if lora is None else lora.scale)


def forward_hidden(
  params,
  tokens_BT,
  cfg: Qwen3Config,
  *,
  positions_BT=None,
  mask_BT=None,
  attention_fn: Optional[AttentionFn] = None,
  lora=None,
  remat: str = "full",
):
  """Teacher-forced pass up to the last hidden state x_BTD (before the final norm)."""
  check_remat(remat)
  B, T = tokens_BT.shape
  if mask_BT is None:
    mask_BT = jnp.ones((B, T), bool)
  mask_BT = mask_BT.astype(bool)
  if positions_BT is None:
    positions_BT = default_positions(mask_BT)
  attention_fn = attention_fn or causal_attention
  K, G, E = cfg.num_key_value_heads, cfg.group_size, cfg.head_dim
  xs, scale = _layer_xs(params, lora)

  def layer_fn(x_BTD, layer, lora_layer, i):
    q_BTHE, k_BTKE, v_BTKE = qkv(layer, x_BTD, positions_BT, cfg, lora_layer, scale)
    attn = attention_fn(i, q_BTHE.reshape(B, T, K, G, E), k_BTKE, v_BTKE, mask_BT)
    x_BTD = finish_layer(layer, x_BTD, attn.reshape(B, T, K * G, E), cfg, lora_layer, scale)
    return sharding.constrain(x_BTD, ACT_AXES)

  if remat == "full":
    layer_fn = remat_full(layer_fn)
  elif remat != "none":
    layer_fn = jax.checkpoint(layer_fn, policy=REMAT_POLICIES[remat])
  x_BTD = sharding.constrain(embed(params, tokens_BT, cfg), ACT_AXES)
  x_BTD, _ = jax.lax.scan(lambda x, layer_xs: (layer_fn(x, *layer_xs), None), x_BTD, xs)
  return x_BTD


def forward(
  params,
  tokens_BT,
  cfg: Qwen3Config,
  *,
  positions_BT=None,
  mask_BT=None,
  attention_fn: Optional[AttentionFn] = None,
  lora=None,
):
  """Teacher-forced logits_BTV (float32) of every position: for short rows and tests (training
  uses `forward_hidden` + `map_logits`). mask_BT marks real tokens (HF's attention_mask); positions
  default to skipping left padding. The sparse teacher-forced forward is `sparsity.policy.forward`
  (`sj.forward`), which passes its `attention_fn` here."""
  x_BTD = forward_hidden(
    params,
    tokens_BT,
    cfg,
    positions_BT=positions_BT,
    mask_BT=mask_BT,
    attention_fn=attention_fn,
    lora=lora,
  )
  return unembed(params, x_BTD, cfg)


def token_logprobs(logits_BTV, targets_BT, temperature: float = 1.0):
  """log softmax(logits / temperature)[target] per position."""
  logp_BTV = jax.nn.log_softmax(logits_BTV / temperature, axis=-1)
  return jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]


PREFILL_CHUNK = 512  # prompt tokens per prefill chunk (rounded to whole pages)


def prefill(
  params, prompt_BT, prompt_len_B, cfg: Qwen3Config, cache, *, lora=None, chunk: int = PREFILL_CHUNK
):
  """Dense pass over right-padded prompts that fills the cache, `chunk` tokens at a time (each
  chunk attends blockwise to the cache written so far, so memory is linear in the prompt). The
  first chunk has nothing cached before it: its attention is plain causal attention over its own
  keys, the backend's fused kernel (`flash.causal_attention`), which is all of a prompt that fits
  one chunk. Returns the logits_BV of each row's last prompt token (which predict the first
  generated token) and the cache."""
  B, T = prompt_BT.shape
  Z, K, G, E = cache.page_size, cfg.num_key_value_heads, cfg.group_size, cfg.head_dim
  C = min(-(-chunk // Z) * Z, -(-T // Z) * Z)
  n = -(-T // C)
  if n * C > cache.max_len:
    raise ValueError(
      f"the prompt padded to whole prefill chunks ({n * C} tokens) exceeds the "
      f"cache ({cache.max_len} tokens)"
    )
  tokens_BT = jnp.pad(prompt_BT, ((0, 0), (0, n * C - T)))
  valid_BS = jnp.arange(cache.max_len)[None] < prompt_len_B[:, None]
  xs, scale = _layer_xs(params, lora)

  def chunk_step(carry, c, first=False):
    cache, last_BD = carry
    start = c * C
    pos_BC = jnp.broadcast_to(start + jnp.arange(C, dtype=jnp.int32), (B, C))
    valid_BC = jax.lax.dynamic_slice_in_dim(valid_BS, start, C, axis=1)

    def layer_step(carry, xs):
      x_BCD, cache = carry
      layer, lora_layer, i = xs
      q_BCHE, k_BCKE, v_BCKE = qkv(layer, x_BCD, pos_BC, cfg, lora_layer, scale)
      cache = paged_cache.write_chunk(cache, i, start, k_BCKE, v_BCKE, valid_BC)
      q_BCKGE = q_BCHE.reshape(B, C, K, G, E)
      if first:
        attn = flash.causal_attention(q_BCKGE, k_BCKE, v_BCKE, valid_BC)
      else:
        attn = blockwise.attention(
          q_BCKGE, cache.keys(i), cache.values(i), valid_BS, q_offset=start
        )
      x_BCD = finish_layer(layer, x_BCD, attn.reshape(B, C, K * G, E), cfg, lora_layer, scale)
      return (sharding.constrain(x_BCD, ACT_AXES), paged_cache.constrain(cache)), None

    x_BCD = embed(params, jax.lax.dynamic_slice_in_dim(tokens_BT, start, C, axis=1), cfg)
    (x_BCD, cache), _ = jax.lax.scan(layer_step, (x_BCD, cache), xs)
    last = prompt_len_B - 1
    x_last_BD = jnp.take_along_axis(x_BCD, (last % C)[:, None, None], axis=1)[:, 0]
    return (cache, jnp.where((last // C == c)[:, None], x_last_BD, last_BD)), None

  last_BD = jnp.zeros((B, cfg.hidden_size), params["embed"].dtype)
  carry, _ = chunk_step((cache, last_BD), jnp.int32(0), first=True)
  (cache, last_BD), _ = jax.lax.scan(chunk_step, carry, jnp.arange(1, n, dtype=jnp.int32))
  cache = cache.replace(lengths=prompt_len_B.astype(jnp.int32))
  return unembed(params, last_BD[:, None], cfg)[:, 0], cache


DecodeAttentionFn = Callable[[int, jax.Array, paged_cache.PagedKVCache, jax.Array], jax.Array]


def dense_decode_fn(layer, q_BKGE, cache, lengths_B):
  """The default decode attention: every layer reads its whole cache (masked by length)."""
  return reference.dense_decode_attention(q_BKGE, cache.keys(0), cache.values(0), lengths_B)


def unstack_layers(params, lora=None):
  """(params, lora) with their stacked [L, ...] layers split into tuples of per-layer pytrees:
  what a decode loop should hand `decode_step`, split once before the loop. Inside a while loop
  XLA CPU copies a stacked layer's weights at every step, whether a scan slices them or a static
  index does (docs/decode_speed.md). Layers already split are kept as they are."""

  def split(tree):
    if isinstance(tree, tuple):
      return tree
    n = jax.tree_util.tree_leaves(tree)[0].shape[0]
    return tuple(jax.tree_util.tree_map(lambda x: x[i], tree) for i in range(n))

  params = dict(params, layers=split(params["layers"]))
  if lora is not None:
    lora = lora.replace(params=dict(lora.params, layers=split(lora.params["layers"])))
  return params, lora


def decode_step(
  params,
  token_B,
  cfg: Qwen3Config,
  caches,
  *,
  attention_fn: Optional[DecodeAttentionFn] = None,
  lora=None,
):
  """Appends one token per sequence and returns the next-token logits_BV and the caches.

  caches: one single-layer cache per layer (`paged_cache.split_layers`, or a page pool's
  `page_pool.layer_views`: anything with `lengths`, `append_token` and `constrain`). The layers
  run unrolled, each on its own cache buffer, which the step updates and reads in place: a decode
  loop carrying a stacked cache copied each layer's keys and values at every step.
  params (and lora) are best split by `unstack_layers` before the loop; stacked ones work too.
  attention_fn(layer, q_BKGE, cache, lengths_B) -> out_BKGE: layer a Python int, cache that
  layer's own cache (`cache.keys(0)`), whose newest token is already written (lengths_B tokens
  cached); dense by default, block-sparse from `sparsity.policy.decode_attention_fn`.
  """
  B = token_B.shape[0]
  K, G, E = cfg.num_key_value_heads, cfg.group_size, cfg.head_dim
  attention_fn = attention_fn or dense_decode_fn
  if not isinstance(params["layers"], tuple):
    params, lora = unstack_layers(params, lora)
  lora_layers = (None,) * len(caches) if lora is None else lora.params["layers"]
  scale = 1.0 if lora is None else lora.scale
  pos_B = caches[0].lengths
  lengths_B = pos_B + 1
  x_B1D = embed(params, token_B[:, None], cfg)
  new_caches = []
  for i, (layer, lora_layer, cache) in enumerate(zip(params["layers"], lora_layers, caches)):
    q_B1HE, k_B1KE, v_B1KE = qkv(layer, x_B1D, pos_B[:, None], cfg, lora_layer, scale)
    # Named scopes are metadata only: experiments/profile_decode.py files each op by them.
    with jax.named_scope(f"layer{i}/cache_append"):
      cache = cache.append_token(k_B1KE[:, 0], v_B1KE[:, 0], pos_B)
    with jax.named_scope(f"layer{i}/attention"):
      out_BKGE = attention_fn(i, q_B1HE[:, 0].reshape(B, K, G, E), cache, lengths_B)
    x_B1D = finish_layer(layer, x_B1D, out_BKGE.reshape(B, 1, K * G, E), cfg, lora_layer, scale)
    x_B1D = sharding.constrain(x_B1D, ACT_AXES)
    new_caches.append(cache.replace(lengths=lengths_B).constrain())
  return unembed(params, x_B1D, cfg)[:, 0], tuple(new_caches)


VerifyAttentionFn = Callable[[int, jax.Array, jax.Array, jax.Array, object, jax.Array], jax.Array]


def verify_step(
  params,
  tokens_BC,
  cfg: Qwen3Config,
  caches,
  *,
  attention_fn: VerifyAttentionFn,
  lora=None,
  at_B=None,
):
  """C tokens per sequence at positions lengths .. lengths + C - 1 in one pass (the dense
  verification of speculative decoding, and a tool's observation prefilled into a row that is
  under way): returns logits_BCV of the token after each and the new tokens' keys and values per
  layer ((k_BCKE, v_BCKE) each), which the caller writes once it knows how many to keep; the
  caches are read, not written.

  caches: one single-layer cache per layer (as `decode_step`'s), their `lengths` the tokens cached
  before the pass. attention_fn(layer, q_BCKGE, k_BCKE, v_BCKE, cache, lengths_B) -> out_BCKGE:
  each query over the cached tokens and causally over the C new ones
  (`sparsity.policy.pool_verify_attention_fn`). params and lora as `decode_step` takes them.
  at_B: one position of the C per row whose logits alone are wanted (logits_BV): the LM head then
  runs over B positions, not B x C (an observation's prefill samples after its last token only)."""
  B, C = tokens_BC.shape
  K, G, E = cfg.num_key_value_heads, cfg.group_size, cfg.head_dim
  if not isinstance(params["layers"], tuple):
    params, lora = unstack_layers(params, lora)
  lora_layers = (None,) * len(caches) if lora is None else lora.params["layers"]
  scale = 1.0 if lora is None else lora.scale
  lengths_B = caches[0].lengths
  pos_BC = lengths_B[:, None] + jnp.arange(C, dtype=lengths_B.dtype)
  x_BCD = embed(params, tokens_BC, cfg)
  new_kv = []
  for i, (layer, lora_layer, cache) in enumerate(zip(params["layers"], lora_layers, caches)):
    q_BCHE, k_BCKE, v_BCKE = qkv(layer, x_BCD, pos_BC, cfg, lora_layer, scale)
    out_BCKGE = attention_fn(i, q_BCHE.reshape(B, C, K, G, E), k_BCKE, v_BCKE, cache, lengths_B)
    x_BCD = finish_layer(layer, x_BCD, out_BCKGE.reshape(B, C, K * G, E), cfg, lora_layer, scale)
    x_BCD = sharding.constrain(x_BCD, ACT_AXES)
    new_kv.append((k_BCKE, v_BCKE))
  if at_B is not None:
    return unembed(params, jnp.take_along_axis(x_BCD, at_B[:, None, None], 1), cfg)[:, 0], tuple(
      new_kv
    )
  return unembed(params, x_BCD, cfg), tuple(new_kv)
