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
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
ROLES = ("system", "user", "assistant", "tool")
# Qwen3's system block when tools are offered (its template's text, character for character).
TOOLS_HEAD = (
  "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
  "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_TAIL = (
  "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
  "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
  '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def _split_thinking(content):
  """(reasoning, answer) of an assistant message written as `<think>...</think>answer`."""
  if THINK_CLOSE not in content:
    return "", content
  reasoning, answer = content.split(THINK_CLOSE)[0], content.split(THINK_CLOSE)[-1]
  return reasoning.rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n"), answer.lstrip("\n")


def to_json(value) -> str:
  """JSON as Hugging Face's chat templates write it (their `tojson`: json.dumps, non-ASCII kept)."""
  return json.dumps(value, ensure_ascii=False)


def tool_call_text(name: str, arguments) -> str:
  """One tool call as Qwen3 writes it; `arguments` a dict, or JSON text kept as it is."""
  args = arguments if isinstance(arguments, str) else to_json(arguments)
  return f'{TOOL_CALL_OPEN}\n{{"name": "{name}", "arguments": {args}}}\n{TOOL_CALL_CLOSE}'


def _is_tool_response(message) -> bool:
  content = message["content"]
  return content.startswith(TOOL_RESPONSE_OPEN) and content.endswith(TOOL_RESPONSE_CLOSE)


def _last_query(messages) -> int:
  """The last user message that is a question, not tool responses written as a user turn (Qwen3's
  `last_query_index`: assistant turns after it keep their reasoning); the last message if none."""
  queries = [i for i, m in enumerate(messages) if m["role"] == "user" and not _is_tool_response(m)]
  return queries[-1] if queries else len(messages) - 1


def _assistant(messages, i, last_query) -> str:
  """An assistant turn's content: reasoning kept after the last query (always on the last
  message), then its structured `tool_calls` if any (each {"name", "arguments"}, or wrapped as
  {"function": {...}})."""
  message = messages[i]
  reasoning, content = _split_thinking(message["content"])
  for k, call in enumerate(message.get("tool_calls") or ()):
    call = call.get("function", call)
    # Qwen3 separates a call from the answer text before it, not from a reasoning block.
    content += ("\n" if k or content else "") + tool_call_text(call["name"], call["arguments"])
  if i > last_query and (reasoning or i == len(messages) - 1):
    reasoning = reasoning.strip("\n")
    content = f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{content}"
  return content


def _system_block(messages, tools) -> str:
  """The leading system turn: with tools, the system message (if first) followed by Qwen3's tool
  list, one JSON object a line."""
  system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
  if not tools:
    return "" if system is None else f"{IM_START}system\n{system}{IM_END}\n"
  listed = "".join("\n" + to_json(tool) for tool in tools)
  head = "" if system is None else system + "\n\n"
  return f"{IM_START}system\n{head}{TOOLS_HEAD}{listed}{TOOLS_TAIL}{IM_END}\n"


def _check(messages):
  for i, message in enumerate(messages):
    if message.get("role") not in ROLES or not isinstance(message.get("content"), str):
      raise ValueError(
        f"chat message {i} needs role in {ROLES} and string content, got {message!r}"
      )


def chat_template(messages, *, add_generation_prompt=True, enable_thinking=True, tools=None) -> str:
  """Qwen3's chat format: `<|im_start|>role\\ncontent<|im_end|>\\n` per message.

  As in Qwen3's own template, assistant turns before the last user question lose their reasoning,
  later ones keep it in a <think> block; `tool` messages become one user turn per run of them, each
  response wrapped in <tool_response> tags (a user message already written that way is not a
  question); `tools` (JSON schemas) go into the system turn; the generation prompt is
  `<|im_start|>assistant\\n`, followed by an empty think block when thinking is disabled (which
  makes the model answer directly).
  """
  _check(messages)
  last_query, parts = _last_query(messages), [_system_block(messages, tools)]
  for i, message in enumerate(messages):
    role, content = message["role"], message["content"]
    if role == "system" and i == 0:
      continue
    if role == "tool":
      first, last = i == 0 or messages[i - 1]["role"] != "tool", i + 1 == len(messages)
      parts.append(f"{IM_START}user" if first else "")
      parts.append(f"\n{TOOL_RESPONSE_OPEN}\n{content}\n{TOOL_RESPONSE_CLOSE}")
      parts.append(IM_END + "\n" if last or messages[i + 1]["role"] != "tool" else "")
      continue
    if role == "assistant":
      content = _assistant(messages, i, last_query)
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

  def chat(self, messages, *, add_generation_prompt=True, enable_thinking=True, tools=None) -> str:
    return chat_template(
      messages,
      add_generation_prompt=add_generation_prompt,
      enable_thinking=enable_thinking,
      tools=tools,
    )


def train_bpe(texts, vocab_size: int, added=()) -> tokenizers.Tokenizer:
  """A byte-level BPE trained on `texts` (a tiny model's own vocabulary, nothing downloaded), with
  Qwen's special tokens <|endoftext|> (0), <|im_start|> (1), <|im_end|> (2) and the `added` tokens
  (matched whole in any text, as Qwen3's <think> and <tool_call> are). Deterministic in its
  arguments."""
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size,
    special_tokens=["<|endoftext|>", IM_START, IM_END],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
  )
  tok.train_from_iterator(list(texts), trainer)
  tok.add_tokens(list(added))
  return tok


def save_tokenizer(tok: tokenizers.Tokenizer, directory: str) -> None:
  """`tok` as a model dir's tokenizer.json, with <|im_end|> its EOS and <|endoftext|> its pad
  (tokenizer_config.json), as `load_tokenizer` reads them."""
  os.makedirs(directory, exist_ok=True)
  tok.save(os.path.join(directory, "tokenizer.json"))
  with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": IM_END, "pad_token": "<|endoftext|>"}, f)


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
