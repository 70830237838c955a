"""Presets, config validation, and one set of defaults: the default config agrees with the library's
components except where it says why."""

import dataclasses

import pytest

from configs import calibrate, default
import sparrow_jax as sj
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.mismatch.calibrate import CalibrationConfig
from sparrow_jax.model.config import PRESETS
from sparrow_jax.model.hf import hf_tensor_specs
from sparrow_jax.rl import evaluate, step_schema
from sparrow_jax.rollout import engine
from sparrow_jax.rollout.sampler import Sampling


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
    sj.Qwen3Config.from_hf_dict({"model_type": "mistral"})


def departures(c, components) -> dict:
  """ "group.field" -> (config value, library default) where they differ, for the fields a config
  group shares with a library component."""
  departs = {}
  for group, library in components:
    for f in dataclasses.fields(library):
      if f.name in c[group] and c[group][f.name] != getattr(library, f.name):
        departs[f"{group}.{f.name}"] = (c[group][f.name], getattr(library, f.name))
  return departs


def test_default_config_agrees_with_the_library_defaults():
  """Each field the default config shares with a library component (the train step's, the sparsity
  config, sampling, the engine) has the library's default, or is listed, with why, in
  default.DEPARTS_FROM_LIBRARY."""
  steps = [(f.name, f.default_factory()) for f in dataclasses.fields(step_schema.StepConfig)]
  rollout = [("rollout", x) for x in (SparseConfig(), Sampling(), engine.EngineConfig())]
  evaluation = [("eval", evaluate.EvalConfig())]
  departs = departures(default.get_config(), steps + rollout + evaluation)
  assert set(departs) == set(default.DEPARTS_FROM_LIBRARY), departs
  assert all(default.DEPARTS_FROM_LIBRARY.values())  # each says why


def test_calibrate_config_agrees_with_the_library_defaults():
  """configs/calibrate.py's calibration and stats groups hold CalibrationConfig's fields, its
  rollout group the sparsity config's and sampling's: the library's defaults, or listed with why."""
  components = [("calibration", CalibrationConfig()), ("stats", CalibrationConfig())]
  components += [("rollout", SparseConfig()), ("rollout", Sampling())]
  departs = departures(calibrate.get_config(), components)
  assert set(departs) == set(calibrate.DEPARTS_FROM_LIBRARY), departs
  assert all(calibrate.DEPARTS_FROM_LIBRARY.values())
  assert set(calibrate.get_config().calibration) <= {
    f.name for f in dataclasses.fields(CalibrationConfig)
  }  # no field the library does not read


def test_step_config_reads_its_groups_and_names_the_bad_field():
  c = default.get_config()
  sc = step_schema.StepConfig.from_config(c)
  assert sc.rl.num_minibatches == 4 and sc.distill.kl_coef == 1.0 and sc.stats.num_bins == 7
  assert sc.rollout.group_size == c.rollout.group_size and sc.rl.kl_kind == "k3"  # not in config
  c.rl.eps_low = 1.5
  with pytest.raises(
    ValueError, match=r"^config.rl.eps_low = 1.5 is invalid: must lie in \[0, 1\)"
  ):
    step_schema.StepConfig.from_config(c)
  c = default.get_config()
  c.stats.bin_size = 100
  with pytest.raises(ValueError, match=r"^config.stats.bin_size = 100 is invalid: must be a"):
    step_schema.StepConfig.from_config(c)
