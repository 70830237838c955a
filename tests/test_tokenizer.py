"""Tokenizer wrapper and Qwen3 chat template, on a small BPE tokenizer built here (nothing
downloaded)."""

import json

import numpy as np
import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from sparrow_jax.data.tokenizer import chat_template, load_tokenizer

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
  "hello world",
  "what is 2+2? the answer is \\boxed{4}",
  "user assistant system think",
  "Please reason step by step",
]


def _write_tokenizer(directory, tokenizer_config=None, generation_config=None):
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=320, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  tok.train_from_iterator(CORPUS, trainer)
  tok.add_tokens(["<think>", "</think>"])  # Qwen3: added, not special (they survive decoding)
  tok.save(str(directory / "tokenizer.json"))
  for name, content in (
    ("tokenizer_config.json", tokenizer_config),
    ("generation_config.json", generation_config),
  ):
    if content is not None:
      (directory / name).write_text(json.dumps(content))
  return tok


def _write_dir(directory, tokenizer_config, generation_config):
  _write_tokenizer(directory, tokenizer_config, generation_config)
  return directory


@pytest.fixture
def qwen_dir(tmp_path):
  tok = _write_tokenizer(
    tmp_path,
    {"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}},
    {"eos_token_id": [2, 0], "do_sample": True},
  )
  assert [tok.token_to_id(t) for t in SPECIAL] == [0, 1, 2]
  return tmp_path


def test_encode_decode_round_trip_with_special_tokens(qwen_dir):
  tok = load_tokenizer(str(qwen_dir))
  text = "<|im_start|>user\nhéllo wörld ∑ 2+2<|im_end|>\n<think>\nx\n</think>\n\n"
  ids = tok.encode(text)
  assert ids[0] == tok.token_id("<|im_start|>") == 1
  assert tok.encode("<think>") == [tok.token_id("<think>")]
  assert tok.decode(ids) == text
  assert (
    tok.decode(ids, skip_special_tokens=True) == "user\nhéllo wörld ∑ 2+2\n<think>\nx\n</think>\n\n"
  )


def test_eos_from_generation_config_and_pad_from_tokenizer_config(qwen_dir):
  tok = load_tokenizer(str(qwen_dir / "tokenizer.json"))
  assert tok.eos_ids == (2, 0)
  assert tok.pad_id == 0
  assert tok.vocab_size == tok.tok.get_vocab_size(with_added_tokens=True)


def test_eos_int_form_and_fallbacks(tmp_path):
  (tmp_path / "a").mkdir()
  tok = load_tokenizer(
    str(_write_dir(tmp_path / "a", {"eos_token": "<|im_end|>"}, {"eos_token_id": 0}))
  )
  assert tok.eos_ids == (0,) and tok.pad_id == 0  # no pad token: first EOS
  (tmp_path / "b").mkdir()
  tok = load_tokenizer(str(_write_dir(tmp_path / "b", {"eos_token": "<|im_end|>"}, None)))
  assert tok.eos_ids == (2,) and tok.pad_id == 2
  (tmp_path / "c").mkdir()
  with pytest.raises(ValueError, match="no EOS token"):
    load_tokenizer(str(_write_dir(tmp_path / "c", None, None)))


def test_missing_or_bad_tokenizer_json_names_the_path(tmp_path):
  with pytest.raises(ValueError, match=str(tmp_path / "tokenizer.json")):
    load_tokenizer(str(tmp_path))
  (tmp_path / "tokenizer.json").write_text("{not json")
  with pytest.raises(ValueError, match="not a valid tokenizer.json"):
    load_tokenizer(str(tmp_path))


def test_encode_batch_right_pads_int32(qwen_dir):
  tok = load_tokenizer(str(qwen_dir))
  texts = ["hello", "hello world, what is 2+2?", ""]
  tokens_BT, lengths_B = tok.encode_batch(texts)
  assert tokens_BT.dtype == np.int32 and lengths_B.dtype == np.int32
  assert tokens_BT.shape == (3, int(lengths_B.max()))
  for b, text in enumerate(texts):
    ids = tok.encode(text)
    assert lengths_B[b] == len(ids)
    assert tokens_BT[b, : len(ids)].tolist() == ids
    assert (tokens_BT[b, len(ids) :] == tok.pad_id).all()
  tokens_BT, _ = tok.encode_batch(texts, length=40)
  assert tokens_BT.shape == (3, 40)
  with pytest.raises(ValueError, match="text 1 has"):
    tok.encode_batch(texts, length=2)


def test_chat_template_generation_prompt_and_thinking_switch():
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
  head = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
  assert chat_template(messages) == head + "<|im_start|>assistant\n"
  assert chat_template(messages, enable_thinking=False) == (
    head + "<|im_start|>assistant\n<think>\n\n</think>\n\n"
  )
  assert chat_template(messages, add_generation_prompt=False) == head


def test_chat_template_drops_reasoning_of_earlier_turns():
  messages = [
    {"role": "user", "content": "a?"},
    {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA"},
    {"role": "user", "content": "b?"},
    {"role": "assistant", "content": "<think>\nso\n</think>\n\nB"},
  ]
  assert chat_template(messages, add_generation_prompt=False) == (
    "<|im_start|>user\na?<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
    "<|im_start|>user\nb?<|im_end|>\n<|im_start|>assistant\n<think>\nso\n</think>\n\nB<|im_end|>\n"
  )


def test_chat_template_rejects_bad_messages(qwen_dir):
  with pytest.raises(ValueError, match="message 0"):
    chat_template([{"role": "robot", "content": "hi"}])
  tok = load_tokenizer(str(qwen_dir))
  with pytest.raises(ValueError, match="not in the vocabulary"):
    tok.token_id("<|nope|>")
