"""Shared test helpers: tiny configs and a transformers twin of our params."""
import tempfile

import jax
import numpy as np

import sparrow_jax as sj


def tiny_config(**overrides):
  base = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
  base.update(overrides)
  return sj.Qwen3Config(**base)


def hf_model(cfg, params):
  """transformers' Qwen3ForCausalLM (torch, float32) loaded from our save_hf output."""
  import torch
  import transformers
  path = tempfile.mkdtemp()
  sj.save_hf(path, cfg, jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params))
  return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logits(model, tokens_BT, mask_BT=None, positions_BT=None):
  import torch
  kwargs = {}
  if mask_BT is not None:
    kwargs["attention_mask"] = torch.tensor(np.asarray(mask_BT, np.int64))
  if positions_BT is not None:
    kwargs["position_ids"] = torch.tensor(np.asarray(positions_BT, np.int64))
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens_BT, np.int64)), **kwargs).logits.numpy()
