"""Qwen3 tokenizer and chat template over Hugging Face `tokenizers` (no transformers at run time).

`load_tokenizer(dir)` reads a checkpoint's tokenizer.json, plus tokenizer_config.json (pad/EOS
tokens) and generation_config.json (EOS ids that stop generation) when present.
"""

import dataclasses
import json
import os

import numpy as np
import tokenizers

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ROLES = ("system", "user", "assistant")


def _split_thinking(content):
  """(reasoning, answer) of an assistant message written as `<think>...</think>answer`."""
  if THINK_CLOSE not in content:
    return "", content
  reasoning, answer = content.split(THINK_CLOSE)[0], content.split(THINK_CLOSE)[-1]
  return reasoning.rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n"), answer.lstrip("\n")


def chat_template(messages, *, add_generation_prompt=True, enable_thinking=True) -> str:
  """Qwen3's chat format: `<|im_start|>role\\ncontent<|im_end|>\\n` per message.

  As in Qwen3's own template, assistant turns before the last user message lose their reasoning,
  later ones keep it in a <think> block; the generation prompt is `<|im_start|>assistant\\n`,
  followed by an empty think block when thinking is disabled (which makes the model answer
  directly).
  """
  last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
  parts = []
  for i, message in enumerate(messages):
    role, content = message.get("role"), message.get("content")
    if role not in ROLES or not isinstance(content, str):
      raise ValueError(
        f"chat message {i} needs role in {ROLES} and string content, got {message!r}"
      )
    if role == "assistant":
      reasoning, content = _split_thinking(content)
      if i > last_user and (reasoning or i == len(messages) - 1):
        reasoning = reasoning.strip("\n")
        content = f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{content}"
    parts.append(f"{IM_START}{role}\n{content}{IM_END}\n")
  if add_generation_prompt:
    parts.append(f"{IM_START}assistant\n")
    if not enable_thinking:
      parts.append(f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n")
  return "".join(parts)


def _read_json(path):
  if not os.path.exists(path):
    return {}
  try:
    with open(path) as f:
      data = json.load(f)
  except ValueError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from None
  if not isinstance(data, dict):
    raise ValueError(f"{path} must be a JSON object, got {type(data).__name__}")
  return data


def _token_text(value, where: str):
  """tokenizer_config stores special tokens as a string or as {"content": ...}."""
  text = value.get("content") if isinstance(value, dict) else value
  if text is not None and not isinstance(text, str):
    raise ValueError(f"{where} must be a token (a string or {{\"content\": ...}}), got {value!r}")
  return text


def _ids(value, where: str) -> tuple:
  """generation_config's token ids (an int or a list of ints) as a tuple; () when absent."""
  ids = () if value is None else tuple(value) if isinstance(value, list) else (value,)
  if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
    raise ValueError(f"{where} must be a token id >= 0 or a list of them, got {value!r}")
  return ids


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  tok: tokenizers.Tokenizer
  eos_ids: tuple  # any of these ends a generation
  pad_id: int

  @property
  def vocab_size(self) -> int:
    return self.tok.get_vocab_size(with_added_tokens=True)

  def token_id(self, token: str) -> int:
    token_id = self.tok.token_to_id(token)
    if token_id is None:
      raise ValueError(f"token {token!r} is not in the vocabulary")
    return token_id

  def encode(self, text: str) -> list[int]:
    # Qwen adds no BOS; special tokens written in the text (<|im_start|> ...) map to their ids.
    return self.tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids, skip_special_tokens: bool = False) -> str:
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def encode_batch(self, texts, length: int | None = None):
    """Right-padded (tokens_BT int32, lengths_B int32); T = `length` or the longest text."""
    ids = [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]
    lengths_B = np.array([len(x) for x in ids], np.int32)
    longest = int(lengths_B.max(initial=0))
    if length is None:
      length = longest
    elif longest > length:
      row = int(lengths_B.argmax())
      raise ValueError(f"text {row} has {longest} tokens, more than length={length}")
    tokens_BT = np.full((len(ids), length), self.pad_id, np.int32)
    for b, row_ids in enumerate(ids):
      tokens_BT[b, : len(row_ids)] = row_ids
    return tokens_BT, lengths_B

  def chat(self, messages, *, add_generation_prompt=True, enable_thinking=True) -> str:
    return chat_template(
      messages, add_generation_prompt=add_generation_prompt, enable_thinking=enable_thinking
    )


def load_tokenizer(path: str) -> Tokenizer:
  """Tokenizer of a checkpoint directory (or of a tokenizer.json path)."""
  directory = os.path.dirname(path) if path.endswith(".json") else path
  tok_path = os.path.join(directory, "tokenizer.json")
  if not os.path.isfile(tok_path):
    raise ValueError(f"no tokenizer: {tok_path} does not exist")
  try:
    tok = tokenizers.Tokenizer.from_file(tok_path)
  except Exception as e:  # the Rust side raises plain Exception subclasses
    raise ValueError(f"{tok_path} is not a valid tokenizer.json: {e}") from None
  config_path = os.path.join(directory, "tokenizer_config.json")
  generation_path = os.path.join(directory, "generation_config.json")
  config, generation = _read_json(config_path), _read_json(generation_path)

  def config_id(key):
    text = _token_text(config.get(key), f"{config_path} {key}")
    return None if text is None else tok.token_to_id(text)

  eos_ids = _ids(generation.get("eos_token_id"), f"{generation_path} eos_token_id")
  if not eos_ids and config_id("eos_token") is not None:
    eos_ids = (config_id("eos_token"),)
  if not eos_ids:
    raise ValueError(
      f"no EOS token in {directory}: need generation_config.json eos_token_id or "
      "tokenizer_config.json eos_token (a token of the vocabulary)"
    )
  pad_id = config_id("pad_token")
  if pad_id is None:
    pad_id = (_ids(generation.get("pad_token_id"), f"{generation_path} pad_token_id") or eos_ids)[0]
  return Tokenizer(tok=tok, eos_ids=tuple(int(i) for i in eos_ids), pad_id=int(pad_id))
