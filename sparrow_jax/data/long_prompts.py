"""Long prompts from text that ships with the machine: files of a local directory (by default the
running interpreter's standard library) cut to an exact token count and wrapped in an instruction,
so a long-context workload is real text that anyone can rebuild offline.

  prompts = build_long_prompts(tokenizer, lengths=(4096, 8192), rows=2)
  prompts[0].tokens      # int32 [4096]: row 0 at the first length
  prompts[0].sources     # the files whose text is in it, relative to the source directory

Row r starts at the beginning of a file and takes whole files in sorted order until its body is
full, the last one cut; the next row starts at the file after the last one the longest prompt read,
so rows share no text and row r at a shorter length is its longer prompt's body cut shorter.
"""

import dataclasses
import glob
import os
import sysconfig

import numpy as np

INSTRUCTIONS = {
  "explain": "Explain what this code does.",
  "continue": "Continue this text from where it stops.",
}
_BODY = "\x00BODY\x00"  # stands for the text in the rendered chat template, which is then split


@dataclasses.dataclass(frozen=True)
class LongPrompt:
  length: int  # tokens in the prompt: template, instruction and text
  row: int  # which text of the source (row r of every length starts at the same file)
  tokens: np.ndarray  # int32 [length]
  sources: tuple  # files whose text is in the prompt, relative to the source directory, in order


def stdlib_dir() -> str:
  """The running interpreter's standard library: text every Python install ships."""
  return sysconfig.get_paths()["stdlib"]


def source_files(directory: str, pattern: str = "*.py") -> list:
  """The files of `directory` matching `pattern`, sorted by name. Not recursive: below the standard
  library lie site-packages, whose files depend on what is installed."""
  if not os.path.isdir(directory):
    raise ValueError(f"source directory {directory!r} does not exist or is not a directory")
  files = sorted(
    p for p in glob.glob(os.path.join(glob.escape(directory), pattern)) if os.path.isfile(p)
  )
  if not files:
    raise ValueError(f"source directory {directory!r} holds no file matching {pattern!r}")
  return files


def _read_text(path: str) -> str:
  try:
    with open(path, encoding="utf-8") as f:
      return f.read()
  except UnicodeDecodeError as e:
    raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def wrapper_ids(tokenizer, instruction: str, chat: bool, system: str = "") -> tuple:
  """(prefix, suffix) token ids around the text: the chat template's user turn holding the
  instruction and the text, ending at the assistant header (`chat`), or the instruction alone
  before the text. Encoded apart from the text, so the text can be cut at any token."""
  if instruction not in INSTRUCTIONS:
    raise ValueError(f"instruction must be one of {sorted(INSTRUCTIONS)}, got {instruction!r}")
  text = INSTRUCTIONS[instruction]
  if not chat:
    return list(tokenizer.encode(f"{text}\n\n")), []
  messages = [{"role": "system", "content": system}] if system else []
  messages.append({"role": "user", "content": f"{text}\n\n{_BODY}"})
  prefix, suffix = tokenizer.chat(messages).split(_BODY)
  return list(tokenizer.encode(prefix)), list(tokenizer.encode(suffix))


def _row_bodies(tokenizer, files, body_len: int, rows: int, directory: str, pattern: str):
  """`rows` bodies of body_len token ids each, with the files each drew from as [(file, tokens
  from it)], walking the files in order."""
  bodies, it = [], iter(files)
  for r in range(rows):
    ids, used = [], []
    while len(ids) < body_len:
      path = next(it, None)
      if path is None:
        raise ValueError(
          f"{directory!r} ({pattern!r}) holds too little text: row {r} of {rows} needs "
          f"{body_len} tokens of text and the files ran out after {len(ids)}; ask for fewer "
          "rows or shorter lengths, or name a larger source"
        )
      file_ids = tokenizer.encode(_read_text(path))
      take = min(len(file_ids), body_len - len(ids))
      if take:
        ids += file_ids[:take]
        used.append((os.path.relpath(path, directory), take))
    bodies.append((np.asarray(ids, np.int32), used))
  return bodies


def _sources_within(used, n: int) -> tuple:
  """The files whose tokens fall in the first n tokens of a body."""
  names, seen = [], 0
  for name, count in used:
    if seen >= n:
      break
    names.append(name)
    seen += count
  return tuple(names)


def build_long_prompts(
  tokenizer,
  lengths=(4096, 8192),
  rows: int = 1,
  directory: str = "",
  pattern: str = "*.py",
  instruction: str = "explain",
  chat: bool = True,
  system: str = "",
) -> list:
  """LongPrompts of exactly each of `lengths` tokens, `rows` per length (lengths outer), from the
  files of `directory` ("" = the standard library) matching `pattern`. `tokenizer` has
  `encode(text) -> ids`, and `chat(messages) -> text` when `chat` is set."""
  lengths = tuple(int(n) for n in lengths)
  if not lengths or rows < 1:
    raise ValueError(f"need lengths and rows >= 1, got lengths={lengths}, rows={rows}")
  directory = directory or stdlib_dir()
  prefix, suffix = wrapper_ids(tokenizer, instruction, chat, system)
  wrap = len(prefix) + len(suffix)
  if min(lengths) <= wrap:
    raise ValueError(
      f"lengths {lengths}: each must exceed the {wrap} tokens of the template and instruction"
    )
  files = source_files(directory, pattern)
  bodies = _row_bodies(tokenizer, files, max(lengths) - wrap, rows, directory, pattern)
  out = []
  for length in lengths:
    for r, (body, used) in enumerate(bodies):
      n = length - wrap
      tokens = np.concatenate(
        [np.asarray(prefix, np.int32), body[:n], np.asarray(suffix, np.int32)]
      )
      out.append(LongPrompt(length, r, tokens, _sources_within(used, n)))
  return out
