"""Long prompts from local text (sparrow_jax/data/long_prompts.py), on a small byte-level BPE built
here (nothing downloaded): exact lengths, the same tokens on every call, the files named, and
errors that name what is wrong; then the real standard library of this interpreter."""

import os

import numpy as np
import pytest

from sparrow_jax.data import long_prompts
from sparrow_jax.data.tokenizer import Tokenizer, train_bpe


@pytest.fixture(scope="module")
def tok():
  bpe = train_bpe(["def return import self user assistant system"], vocab_size=300)
  return Tokenizer(tok=bpe, eos_ids=(2,), pad_id=0)


def _write_texts(directory, count=6, lines=40):
  os.makedirs(directory, exist_ok=True)
  for i in range(count):
    body = "".join(f"def f{i}_{j}(x):\n  return x + {j}\n" for j in range(lines))
    (directory / f"m{i}.py").write_text(body)
  (directory / "notes.txt").write_text("not matched by *.py")


def test_prompts_have_the_exact_lengths_and_the_same_tokens_every_time(tok, tmp_path):
  _write_texts(tmp_path)
  build = lambda: long_prompts.build_long_prompts(
    tok, lengths=(120, 200), rows=2, directory=str(tmp_path)
  )
  got, again = build(), build()
  assert [(p.length, p.row) for p in got] == [(120, 0), (120, 1), (200, 0), (200, 1)]
  assert [len(p.tokens) for p in got] == [120, 120, 200, 200]
  assert all(p.tokens.dtype == np.int32 for p in got)
  for a, b in zip(got, again):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.sources == b.sources
  prefix, suffix = long_prompts.wrapper_ids(tok, "explain", chat=True)
  for p in got:  # the chat template's user turn around the text, ending at the assistant header
    assert list(p.tokens[: len(prefix)]) == prefix and list(p.tokens[-len(suffix) :]) == suffix
  assert tok.decode(suffix).endswith("<|im_start|>assistant\n")
  assert "Explain what this code does." in tok.decode(prefix)
  short0, short1, long0, long1 = got
  body = lambda p, n: p.tokens[len(prefix) : len(prefix) + n]
  n = 120 - len(prefix) - len(suffix)
  np.testing.assert_array_equal(body(short0, n), body(long0, n))  # a row's text, cut shorter
  # rows start at a file's beginning and share no file; files come in sorted order
  assert long0.sources[0] == "m0.py" and long1.sources[0] not in long0.sources
  assert sorted(long0.sources + long1.sources) == list(long0.sources + long1.sources)
  assert set(short0.sources) <= set(long0.sources) and "notes.txt" not in long0.sources
  start = tok.decode(body(long1, 8))
  assert (tmp_path / long1.sources[0]).read_text().startswith(start)


def test_the_plain_form_is_the_instruction_then_the_text(tok, tmp_path):
  _write_texts(tmp_path, count=2)
  (p,) = long_prompts.build_long_prompts(
    tok, lengths=(64,), directory=str(tmp_path), instruction="continue", chat=False
  )
  text = tok.decode(p.tokens)
  assert len(p.tokens) == 64 and text.startswith("Continue this text from where it stops.\n\n")
  assert "<|im_start|>" not in text and "def f0_0(x):" in text


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (dict(lengths=(100000,)), "holds too little text: row 0 of 1 needs"),
    (dict(lengths=(600,), rows=5), "holds too little text: row 1 of 5"),
    (dict(directory="/no/such/dir"), "'/no/such/dir' does not exist"),
    (dict(pattern="*.rst"), "holds no file matching '*.rst'"),
    (dict(instruction="summarise"), "instruction must be one of ['continue', 'explain']"),
    (dict(lengths=(5,)), "lengths (5,): each must exceed the"),
    (dict(rows=0), "rows=0"),
  ],
)
def test_bad_values_are_named(tok, tmp_path, kwargs, message):
  _write_texts(tmp_path, count=2, lines=20)
  kwargs = dict(dict(lengths=(64,), directory=str(tmp_path)), **kwargs)
  with pytest.raises(ValueError) as e:
    long_prompts.build_long_prompts(tok, **kwargs)
  assert message in str(e.value)
  if "too little" in message:
    assert str(tmp_path) in str(e.value)


def test_a_file_that_is_not_utf8_is_named(tok, tmp_path):
  (tmp_path / "a.py").write_bytes(b"x = '\xff\xfe'\n")
  with pytest.raises(ValueError, match=r"a\.py is not UTF-8 text"):
    long_prompts.build_long_prompts(tok, lengths=(64,), directory=str(tmp_path))


def test_the_standard_library_gives_real_prompts(tok):
  """The default source: this interpreter's own standard library, top-level *.py in sorted order."""
  got = long_prompts.build_long_prompts(tok, lengths=(200, 400), rows=2)
  assert [len(p.tokens) for p in got] == [200, 200, 400, 400]
  stdlib = long_prompts.stdlib_dir()
  first = sorted(f for f in os.listdir(stdlib) if f.endswith(".py"))[0]
  assert got[0].sources[0] == first
  for p in got:
    assert all(os.path.isfile(os.path.join(stdlib, f)) for f in p.sources)
  assert got[1].sources[0] not in got[2].sources  # row 1 starts past all that row 0 read
