"""Qwen3 / Llama architecture config: the fields of a Hugging Face Qwen3 or Llama config.json that
change the math. Qwen3 is Llama plus per-head q/k RMSNorm; `qk_norm=False` is the Llama flavour.

Frozen (hashable) so it can be a static argument of `jax.jit`.
"""

import dataclasses
import math
from typing import Any

_ROPE_TYPES = ("default", "linear", "yarn")
_MODEL_TYPES = ("qwen3", "llama")  # model_type -> qk_norm: Qwen3 has the per-head norms, Llama not
_ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
# config.json keys whose non-default values change the math in ways the model does not implement:
# key -> the values that are fine (the model's math). A key absent from the dict is fine too.
_UNSUPPORTED_UNLESS = {
  "attention_bias": (False, None),
  "mlp_bias": (False, None),
  "hidden_act": ("silu", None),
  "pretraining_tp": (1, None),
  "use_sliding_window": (False, None),
  "num_experts": (0, None),
  "num_local_experts": (0, None),
  "num_experts_per_tok": (0, None),
  "moe_intermediate_size": (0, None),
}


@dataclasses.dataclass(frozen=True)
class Qwen3Config:
  vocab_size: int = 151936
  hidden_size: int = 2048  # D
  intermediate_size: int = 6144  # F
  num_hidden_layers: int = 28  # L
  num_attention_heads: int = 16  # H
  num_key_value_heads: int = 8  # K
  head_dim: int = 128  # E (Qwen3 decouples it from hidden_size / heads)
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  tie_word_embeddings: bool = True
  max_position_embeddings: int = 40960
  # HF rope scaling as a sorted tuple of (key, value) pairs so the config stays hashable; () = none.
  rope_scaling: tuple = ()
  qk_norm: bool = True  # per-head RMSNorm of q and k before RoPE (Qwen3); False: Llama

  def __post_init__(self):
    for name in (
      "vocab_size",
      "hidden_size",
      "intermediate_size",
      "num_hidden_layers",
      "num_attention_heads",
      "num_key_value_heads",
      "head_dim",
      "max_position_embeddings",
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"Qwen3Config.{name} must be a positive int, got {value!r}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
        f"Qwen3Config.num_attention_heads ({self.num_attention_heads}) must be a multiple of "
        f"num_key_value_heads ({self.num_key_value_heads})"
      )
    if self.head_dim % 2:
      raise ValueError(f"Qwen3Config.head_dim must be even for RoPE, got {self.head_dim}")
    rope_type = self.rope_scaling_dict.get("rope_type", "default")
    if rope_type not in _ROPE_TYPES:
      raise ValueError(
        f"Qwen3Config.rope_scaling rope_type {rope_type!r} is not supported; "
        f"supported: {_ROPE_TYPES}"
      )
    self._check_numbers()

  def _check_numbers(self):
    """The float fields a number in range (a string eps fails inside the first forward, a negative
    one or a rope_theta <= 0 trains into NaN), the flag a bool, a rope scaling its factor."""
    positive = {"rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta}
    if self.rope_scaling_dict.get("rope_type", "default") != "default":
      positive["rope_scaling factor"] = self.rope_scaling_dict.get("factor")
    for name, value in positive.items():
      if not _is_number(value) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"Qwen3Config.{name} must be a finite number > 0, got {value!r}")
    if not isinstance(self.tie_word_embeddings, bool):
      raise ValueError(
        f"Qwen3Config.tie_word_embeddings must be true or false, got {self.tie_word_embeddings!r}"
      )

  @property
  def rope_scaling_dict(self) -> dict:
    return dict(self.rope_scaling)

  @property
  def group_size(self) -> int:
    """G: query heads per KV head."""
    return self.num_attention_heads // self.num_key_value_heads

  @property
  def kv_width(self) -> int:
    """K * E, the width of one layer's keys (or values) per token."""
    return self.num_key_value_heads * self.head_dim

  @classmethod
  def preset(cls, name: str) -> "Qwen3Config":
    if name not in PRESETS:
      raise ValueError(f"unknown Qwen3 preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name]

  @property
  def model_type(self) -> str:
    """The HF model_type this config reads and writes as."""
    return "qwen3" if self.qk_norm else "llama"

  @classmethod
  def from_hf_dict(cls, d: dict) -> "Qwen3Config":
    """Reads a Qwen3 or Llama config dict, transformers 4.x (`rope_theta` top level) or 5.x
    (`rope_parameters`). Keys whose values the model does not implement (attention or MLP bias,
    another activation, mixture of experts, sliding windows, a rope type other than default /
    linear / yarn) raise an error naming the key."""
    if not isinstance(d, dict):
      raise ValueError(f"a config.json is a JSON object, got {type(d).__name__}")
    model_type = d.get("model_type", "qwen3")
    if model_type not in _MODEL_TYPES:
      raise ValueError(
        f"config model_type is {model_type!r}; supported model types: {list(_MODEL_TYPES)}"
      )
    for key, fine in _UNSUPPORTED_UNLESS.items():
      if key in d and d[key] not in fine:
        raise ValueError(
          f"config {key} = {d[key]!r} is not supported (supported: "
          f"{[v for v in fine if v is not None] or 'absent'})"
        )
    missing = [
      k
      for k in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
      )
      if k not in d
    ]
    if missing:
      raise ValueError(f"config.json lacks required fields {missing}")
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
    if "type" in rope and "rope_type" not in rope:  # transformers 4.x spelling
      rope["rope_type"] = rope.pop("type")
    if rope.get("rope_type", "default") == "default":
      rope = {}
    num_heads = d["num_attention_heads"]
    return cls(
      vocab_size=d["vocab_size"],
      hidden_size=d["hidden_size"],
      intermediate_size=d["intermediate_size"],
      num_hidden_layers=d["num_hidden_layers"],
      num_attention_heads=num_heads,
      num_key_value_heads=d.get("num_key_value_heads") or num_heads,
      head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
      rms_norm_eps=d.get("rms_norm_eps", 1e-6),
      rope_theta=float(rope_theta),
      tie_word_embeddings=d.get("tie_word_embeddings", False),
      max_position_embeddings=d.get("max_position_embeddings", 40960),
      rope_scaling=tuple(sorted(rope.items())),
      qk_norm=model_type == "qwen3",
    )

  def to_hf_dict(self) -> dict:
    rope_parameters: dict[str, Any] = {"rope_theta": self.rope_theta, "rope_type": "default"}
    rope_parameters.update(self.rope_scaling_dict)
    out = {
      "architectures": [_ARCHITECTURES[self.model_type]],
      "model_type": self.model_type,
      "vocab_size": self.vocab_size,
      "hidden_size": self.hidden_size,
      "intermediate_size": self.intermediate_size,
      "num_hidden_layers": self.num_hidden_layers,
      "num_attention_heads": self.num_attention_heads,
      "num_key_value_heads": self.num_key_value_heads,
      "head_dim": self.head_dim,
      "hidden_act": "silu",
      "rms_norm_eps": self.rms_norm_eps,
      "rope_theta": self.rope_theta,  # transformers 4.x reads this ...
      "rope_parameters": rope_parameters,  # ... and 5.x this.
      "tie_word_embeddings": self.tie_word_embeddings,
      "max_position_embeddings": self.max_position_embeddings,
      "attention_bias": False,
      "attention_dropout": 0.0,
    }
    if self.qk_norm:
      out["use_sliding_window"] = False
    else:
      out.update(mlp_bias=False, pretraining_tp=1)
    return out


def _is_number(value) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _qwen3(hidden, inter, layers, heads, tie, kv=8, head_dim=128, vocab=151936) -> Qwen3Config:
  return Qwen3Config(
    vocab_size=vocab,
    hidden_size=hidden,
    intermediate_size=inter,
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=kv,
    head_dim=head_dim,
    tie_word_embeddings=tie,
  )


# Published Qwen3 dense models (config.json of Qwen/Qwen3-*), plus tiny presets for tests and demos.
PRESETS: dict[str, Qwen3Config] = {
  "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tie=True),
  "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, tie=True),
  "qwen3-4b": _qwen3(2560, 9728, 36, 32, tie=True),
  "qwen3-8b": _qwen3(4096, 12288, 36, 32, tie=False),
  "qwen3-14b": _qwen3(5120, 17408, 40, 40, tie=False),
  "tiny": _qwen3(64, 128, 2, 4, tie=True, kv=2, head_dim=16, vocab=256),
  "tiny-untied": _qwen3(64, 128, 3, 4, tie=False, kv=1, head_dim=16, vocab=256),
}
