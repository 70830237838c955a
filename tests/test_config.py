"""Presets and config validation."""

import pytest

import sparrow_jax as sj
from sparrow_jax.model.config import PRESETS
from sparrow_jax.model.hf import hf_tensor_specs


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_parameter_count_matches_transformers(name):
  """Each preset's parameter count equals transformers' Qwen3ForCausalLM on the meta device."""
  import torch
  import transformers

  cfg = sj.Qwen3Config.preset(name)
  with torch.device("meta"):
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg.to_hf_dict()))
  theirs = sum(p.numel() for p in model.parameters())  # tied weights counted once
  ours = sum(int(__import__("math").prod(shape)) for _, shape, _ in hf_tensor_specs(cfg).values())
  assert ours == theirs


def test_published_sizes():
  counts = {
    name: sum(
      __import__("math").prod(s)
      for _, s, _ in hf_tensor_specs(sj.Qwen3Config.preset(name)).values()
    )
    for name in ("qwen3-0.6b", "qwen3-8b")
  }
  assert 0.55e9 < counts["qwen3-0.6b"] < 0.65e9
  assert 8.0e9 < counts["qwen3-8b"] < 8.4e9


def test_unknown_preset_lists_known():
  with pytest.raises(ValueError, match="qwen3-1.7b"):
    sj.Qwen3Config.preset("qwen3-70b")


def test_bad_fields_named():
  with pytest.raises(ValueError, match="num_key_value_heads"):
    sj.Qwen3Config(num_attention_heads=16, num_key_value_heads=3)
  with pytest.raises(ValueError, match="rope_type"):
    sj.Qwen3Config(rope_scaling=(("rope_type", "longrope"),))
  with pytest.raises(ValueError, match="model_type"):
    sj.Qwen3Config.from_hf_dict({"model_type": "llama"})
