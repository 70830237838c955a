"""GGUF import: a tiny Llama GGUF written with the `gguf` package's writer (F32 / F16 / Q8_0 / Q4_0
/ Q4_1 tensors, llama.cpp's Q/K permutation) -> HF dir: weights round trip, logits equal
transformers' own GGUF loader, tokenizer equal to transformers' GGUF tokenizer. With the real
SmolLM2 file present (`experiments/import_gguf.py --config.fetch=True` puts it in the cache), our
logits equal transformers' GGUF model on a ChatML prompt."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparrow_jax as sj
from sparrow_jax.data.tokenizer import load_tokenizer
from sparrow_jax.model import gguf as gguf_lib
from sparrow_jax.model.hf import hf_tensor_specs
from tests.helpers import tiny_config

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
STRINGS = [
  "héllo wörld, naïve café: 日本語 テキスト 🎉🚀 Ωμέγα",
  "def f(x):\n    return x**2  # square\n\tif a != b: pass\r\n}",
  "12345 + 3.14159 = -0.5e10; 007 2024-01-31 1,000,000",
  "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
  "  two  spaces\n\n\nnewlines   trailing ",
  "Please reason step by step, and put your final answer within \\boxed{}.",
]
# Per tensor kind, the GGUF type it is stored as: every supported quantization appears.
QTYPES = {
  "attn_q": "Q8_0",
  "attn_k": "Q4_0",
  "attn_v": "Q4_1",
  "attn_output": "F16",
  "ffn_gate": "Q8_0",
  "ffn_up": "Q4_1",
  "ffn_down": "Q4_0",
  "token_embd": "Q8_0",
}


def _tiny_tokenizer():
  """A small byte-level BPE trained here (digits split, as llama.cpp's "smollm" pre-tokenizer)."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False),
    ]
  )
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=420, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(
    STRINGS[1:] * 3 + ["the answer is boxed", "user assistant system"], trainer
  )
  model = json.loads(tok.to_str())["model"]
  vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
  merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
  return [t for t, _ in vocab], merges


def write_tiny_gguf(path, cfg, params, tokens, merges, quantized=True):
  """Our params as llama.cpp lays them out: GGUF names, Q/K rows permuted, optional quantization."""
  import gguf

  w = gguf.GGUFWriter(path, "llama")
  w.add_block_count(cfg.num_hidden_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_attention_heads)
  w.add_head_count_kv(cfg.num_key_value_heads)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_vocab_size(cfg.vocab_size)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  w.add_token_list(tokens)
  w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
  w.add_token_merges(merges)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_pad_token_id(0)
  w.add_chat_template(
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
  )
  to_gguf = {v: k for k, v in gguf_lib._GLOBAL_NAMES.items()}
  for hf_name, (where, _, transpose) in hf_tensor_specs(cfg).items():
    array = np.asarray(
      params["layers"][where[2]][where[1]] if where[0] == "layers" else params[where[0]], np.float32
    )
    array = np.ascontiguousarray(array.T if transpose else array)  # torch [out, in]
    if where[0] == "layers":
      kind = {v: k for k, v in gguf_lib._LAYER_NAMES.items()}[
        hf_name.split(".", 3)[3][: -len(".weight")]
      ]
      name = f"blk.{where[1]}.{kind}.weight"
    else:
      kind = to_gguf[hf_name].split(".")[0]
      name = to_gguf[hf_name]
    if kind == "attn_q":  # llama.cpp's permute (convert_hf_to_gguf.py)
      array = _permute(array, cfg.num_attention_heads)
    elif kind == "attn_k":
      array = _permute(array, cfg.num_key_value_heads)
    qtype = gguf.GGMLQuantizationType[QTYPES.get(kind, "F32") if quantized else "F32"]
    if qtype == gguf.GGMLQuantizationType.F32:
      w.add_tensor(name, array)
    elif qtype == gguf.GGMLQuantizationType.F16:
      w.add_tensor(name, array.astype(np.float16))
    else:
      w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def _permute(w_OI, n_head):
  return (
    w_OI.reshape(n_head, 2, w_OI.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(w_OI.shape)
  )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  tokens, merges = _tiny_tokenizer()
  cfg = tiny_config(
    qk_norm=False,
    vocab_size=len(tokens),
    hidden_size=192,  # = heads x head dim, as GGUF readers assume; every width a multiple of
    intermediate_size=96,  # the 32-value quantization blocks
    num_attention_heads=6,
    num_key_value_heads=2,  # G = 3, as SmolLM2
    head_dim=32,
    rope_theta=1e5,
    rms_norm_eps=1e-5,
  )
  params = sj.init_params(cfg, jax.random.PRNGKey(0), std=0.2)
  root = tmp_path_factory.mktemp("gguf")
  out = {"cfg": cfg, "params": params, "root": root}
  for quantized in (False, True):
    path = str(root / f"tiny_{'q' if quantized else 'f32'}.gguf")
    write_tiny_gguf(path, cfg, params, tokens, merges, quantized=quantized)
    gguf_lib.gguf_to_hf(path, str(root / f"hf_{'q' if quantized else 'f32'}"))
    out["q" if quantized else "f32"] = path
  return out


@pytest.mark.slow
def test_f32_round_trip_is_exact(tiny):
  cfg, params = sj.load_hf(str(tiny["root"] / "hf_f32"))
  assert cfg == tiny["cfg"]
  jax.tree_util.tree_map(np.testing.assert_array_equal, params, tiny["params"])


def test_quantized_round_trip_equals_gguf_dequantize(tiny):
  """Each quantized tensor loads as the `gguf` package dequantizes it (unpermuted), within its
  quantization error of the original."""
  import gguf

  _, params = sj.load_hf(str(tiny["root"] / "hf_q"))
  original = tiny["params"]["layers"]["q"][1]
  got = np.asarray(params["layers"]["q"][1])
  reader = gguf.GGUFReader(tiny["q"])
  t = next(t for t in reader.tensors if t.name == "blk.1.attn_q.weight")
  assert t.tensor_type.name == "Q8_0"
  want = gguf_lib._unpermute(gguf.quants.dequantize(t.data, t.tensor_type), 6).T
  np.testing.assert_array_equal(got, want)
  for name, tol in (("q", 0.01), ("k", 0.15), ("v", 0.1), ("o", 1e-3), ("down", 0.15)):
    err = np.abs(np.asarray(params["layers"][name]) - np.asarray(tiny["params"]["layers"][name]))
    assert 0 < err.max() < tol, name  # quantized (not exact), and close
  assert not np.array_equal(got, original)


@pytest.mark.parametrize("kind", ["f32", "q"])
def test_logits_equal_transformers_gguf_loader(tiny, kind):
  """transformers' own GGUF loader (which undoes the Q/K permutation its own way) gives the logits
  of our import."""
  import torch
  import transformers

  path = tiny[kind]
  model = transformers.AutoModelForCausalLM.from_pretrained(
    os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
  ).eval()
  cfg, params = sj.load_hf(str(tiny["root"] / f"hf_{kind}"))
  tokens = np.random.RandomState(3).randint(0, cfg.vocab_size, (2, 40))
  with torch.no_grad():
    want = model(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(sj.forward(params, jnp.asarray(tokens), cfg), want, atol=1e-4)


def test_tokenizer_equals_transformers_gguf_tokenizer(tiny):
  import transformers

  path = tiny["f32"]
  theirs = transformers.AutoTokenizer.from_pretrained(
    os.path.dirname(path), gguf_file=os.path.basename(path)
  )
  ours = load_tokenizer(str(tiny["root"] / "hf_f32"))
  assert ours.eos_ids == (2,) and ours.pad_id == 0
  for text in STRINGS:
    ids = ours.encode(text)
    assert ids == theirs(text, add_special_tokens=False)["input_ids"], text
    assert ours.decode(ids) == text
  assert ours.encode("<|im_end|>") == [2]  # specials stay whole
  config = json.loads((tiny["root"] / "hf_f32" / "tokenizer_config.json").read_text())
  assert config["eos_token"] == "<|im_end|>" and "<|im_start|>" in config["chat_template"]


def test_unsupported_input_is_named(tiny, tmp_path):
  import gguf

  with pytest.raises(ValueError, match="general.architecture"):
    gguf_lib.config_from_metadata({"general.architecture": "mamba"}, "x.gguf", False)
  meta = {"general.architecture": "llama", "llama.rope.scaling.type": "yarn"}
  with pytest.raises(ValueError, match="llama.rope.scaling.type"):
    gguf_lib.config_from_metadata(meta, "x.gguf", False)
  with pytest.raises(ValueError, match="tokenizer.ggml.model"):
    gguf_lib.build_tokenizer({"tokenizer.ggml.model": "llama"}, "x.gguf")
  with pytest.raises(ValueError, match="blk.0.ffn_gate_exps"):
    gguf_lib.hf_name("blk.0.ffn_gate_exps.weight")
  with pytest.raises(FileNotFoundError, match="no GGUF"):
    gguf_lib.gguf_to_hf(str(tmp_path / "absent.gguf"), str(tmp_path / "out"))
  assert gguf.GGMLQuantizationType.Q4_K.name not in gguf_lib.DEQUANTIZED_TYPES


REAL = gguf_lib.smollm2_gguf_path()


@pytest.mark.skipif(
  not os.path.isfile(REAL),
  reason=f"the real SmolLM2 GGUF is not at {REAL} (python experiments/import_gguf.py "
  "--config=configs/import_gguf.py --config.fetch=True gets it; tests use no network)",
)
def test_real_smollm2_logits_equal_transformers(tmp_path):
  import torch
  import transformers

  out = str(tmp_path / "smollm2")
  cfg = gguf_lib.gguf_to_hf(REAL, out)
  assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim) == (30, 9, 64)
  hf_tok = transformers.AutoTokenizer.from_pretrained(
    os.path.dirname(REAL), gguf_file=os.path.basename(REAL)
  )
  messages = [{"role": "user", "content": "What is 12 * 7? Put the answer in \\boxed{}."}]
  text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
  ours_tok = load_tokenizer(out)
  ids = ours_tok.encode(text)
  assert ids == hf_tok(text, add_special_tokens=False)["input_ids"]
  for s in STRINGS:
    assert ours_tok.encode(s) == hf_tok(s, add_special_tokens=False)["input_ids"], s
  model = transformers.AutoModelForCausalLM.from_pretrained(
    os.path.dirname(REAL), gguf_file=os.path.basename(REAL), dtype=torch.float32
  ).eval()
  with torch.no_grad():
    want = model(torch.tensor([ids])).logits.numpy()
  _, params = sj.load_hf(out)
  got = np.asarray(sj.forward(params, jnp.asarray([ids]), cfg))
  # 30 float32 layers summed in other orders (and the tests' XLA flags): logits of magnitude up
  # to ~40 agree to 2e-4.
  np.testing.assert_allclose(got, want, atol=2e-4, rtol=0)
