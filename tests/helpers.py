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


def write_tiny_hf_dir(directory, num_hidden_layers=3, corpus=()):
  """A random tiny Qwen3 with a small byte-level BPE tokenizer (Qwen special tokens, EOS
  <|im_end|>) as a Hugging Face dir: what load_hf + load_tokenizer read. Nothing downloaded."""
  import json
  import os

  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>",
                                                                 "<|im_end|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  text = ["user assistant system", "Please reason step by step, and put your final answer within "
          "\\boxed{}.", "What is 12 + 7 - 3 * 4? 0 1 2 3 4 5 6 7 8 9"] + list(corpus)
  tok.train_from_iterator(text, trainer)
  tok.add_tokens(["<think>", "</think>"])
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, f)
  cfg = tiny_config(vocab_size=tok.get_vocab_size(with_added_tokens=True),
                    num_hidden_layers=num_hidden_layers, max_position_embeddings=1024)
  sj.save_hf(str(directory), cfg, sj.init_params(cfg, jax.random.PRNGKey(0), std=0.2),
             generation_config={"eos_token_id": tok.token_to_id("<|im_end|>")})
  return cfg
