"""Hugging Face checkpoint I/O: round trips through transformers, sharding, bad input."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import sparrow_jax as sj
from tests.helpers import hf_logits, hf_model, tiny_config


@pytest.mark.slow
def test_save_load_roundtrip_through_transformers(tmp_path):
  cfg = tiny_config(tie_word_embeddings=False)
  params = sj.init_params(cfg, jax.random.PRNGKey(0), std=0.2)
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 20))
  model = hf_model(cfg, params)  # our save_hf -> transformers
  np.testing.assert_allclose(
    hf_logits(model, tokens), sj.forward(params, jnp.asarray(tokens), cfg), atol=1e-4
  )
  model.save_pretrained(tmp_path / "hf")  # transformers' own writer -> our loader
  cfg2, params2 = sj.load_hf(str(tmp_path / "hf"))
  assert cfg2 == cfg
  jax.tree_util.tree_map(np.testing.assert_array_equal, params2, params)


def test_sharded_checkpoint_and_dtype(tmp_path):
  cfg = tiny_config()
  params = sj.init_params(cfg, jax.random.PRNGKey(1))
  sj.save_hf(str(tmp_path), cfg, params, max_shard_bytes=20_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 1
  _, loaded = sj.load_hf(str(tmp_path), dtype=jnp.bfloat16)
  assert loaded["layers"]["down"][1].dtype == jnp.bfloat16
  np.testing.assert_allclose(np.asarray(loaded["embed"], np.float32), params["embed"], rtol=1e-2)


def test_config_reads_transformers_4_and_5_formats():
  v5 = tiny_config(rope_theta=12345.0).to_hf_dict()
  v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
  assert (
    sj.Qwen3Config.from_hf_dict(v4)
    == sj.Qwen3Config.from_hf_dict(v5)
    == tiny_config(rope_theta=12345.0)
  )
  v4_yarn = dict(v4, rope_scaling={"type": "yarn", "factor": 4.0})
  assert sj.Qwen3Config.from_hf_dict(v4_yarn).rope_scaling_dict == {
    "rope_type": "yarn",
    "factor": 4.0,
  }


def test_missing_config(tmp_path):
  with pytest.raises(FileNotFoundError, match="config.json"):
    sj.load_hf(str(tmp_path))


def test_wrong_shape_names_tensor(tmp_path):
  cfg = tiny_config()
  sj.save_hf(str(tmp_path), cfg, sj.init_params(cfg, jax.random.PRNGKey(0)))
  tensors = load_file(tmp_path / "model.safetensors")
  tensors["model.layers.1.mlp.up_proj.weight"] = np.zeros((3, 3), np.float32)
  save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight.*\(64, 32\)"):
    sj.load_hf(str(tmp_path))


def test_missing_and_unexpected_tensors(tmp_path):
  cfg = tiny_config()
  sj.save_hf(str(tmp_path), cfg, sj.init_params(cfg, jax.random.PRNGKey(0)))
  tensors = load_file(tmp_path / "model.safetensors")
  del tensors["model.norm.weight"]
  save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match=r"model.norm.weight.*\(32,\)"):
    sj.load_hf(str(tmp_path))
  tensors["model.norm.weight"] = np.ones(32, np.float32)
  tensors["model.extra.weight"] = np.ones(2, np.float32)
  save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(ValueError, match="model.extra.weight"):
    sj.load_hf(str(tmp_path))


def test_no_weights_file(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    sj.load_hf(str(tmp_path))


def test_saved_files_are_world_readable(tmp_path):
  cfg = tiny_config()
  sj.save_hf(str(tmp_path), cfg, sj.init_params(cfg, jax.random.PRNGKey(0)))
  for name in ("config.json", "model.safetensors"):
    assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name
