"""Damaged or hostile GGUF files fail in one line: a valid tiny GGUF, written as tests/test_gguf.py
writes one, damaged seven ways (cut in its tensor data, cut in its header, a wrong magic, a tensor
count of 2**40, a zip renamed .gguf, an empty file, a tensor whose declared shape is bigger than
its data). `experiments/import_gguf.py` on each exits non-zero with one line naming the file and
what is wrong, no traceback, and writes nothing where its output dir would be."""

import io
import os
import struct
import subprocess
import sys
import zipfile

import jax
import pytest

import sparrow_jax as sj
from tests.helpers import ROOT, subprocess_env, tiny_config
from tests.test_gguf import _tiny_tokenizer, write_tiny_gguf

SHAPE_CHANGED = "blk.0.attn_q.weight"  # the tensor whose declared shape is enlarged (not the last)


@pytest.fixture(scope="module")
def valid(tmp_path_factory):
  """A one-layer quantized Llama GGUF -> its path, config and bytes, where its header ends, the
  tensor stored last, where SHAPE_CHANGED's dims lie in the header and what they are."""
  import gguf

  tokens, merges = _tiny_tokenizer()
  cfg = tiny_config(
    qk_norm=False,
    vocab_size=len(tokens),
    hidden_size=64,  # = heads x head dim; every width a multiple of the 32-value blocks
    intermediate_size=64,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
  )
  params = sj.init_params(cfg, jax.random.PRNGKey(0), std=0.2)
  path = str(tmp_path_factory.mktemp("gguf") / "valid.gguf")
  write_tiny_gguf(path, cfg, params, tokens, merges)
  reader = gguf.GGUFReader(path)
  last = max(reader.tensors, key=lambda t: t.data_offset).name
  t = next(t for t in reader.tensors if t.name == SHAPE_CHANGED)
  dims_at = t.field.offset + 8 + len(t.name.encode()) + 4  # after name length, name, n_dims
  with open(path, "rb") as f:
    data = f.read()
  assert last != SHAPE_CHANGED
  return {
    "path": path,
    "cfg": cfg,
    "data": data,
    "header": reader.data_offset,
    "last": last,
    "dims": (dims_at, list(t.shape)),
  }


def _zip_of(data: bytes) -> bytes:
  buffer = io.BytesIO()
  with zipfile.ZipFile(buffer, "w") as z:
    z.writestr("model.gguf", data)
  return buffer.getvalue()


def _patched(data: bytes, at: int, fmt: str, *values) -> bytes:
  out = bytearray(data)
  struct.pack_into(fmt, out, at, *values)
  return bytes(out)


def _larger_shape(data: bytes, valid) -> bytes:
  """SHAPE_CHANGED declares twice its rows: its bytes run into the next tensor's."""
  at, dims = valid["dims"]
  return _patched(data, at, f"<{len(dims)}Q", *dims[:-1], 2 * dims[-1])


# name -> (damage(valid bytes, fixture) -> bytes, fixture -> what the line says besides the file)
DAMAGES = {
  "truncated_data": (lambda d, v: d[:-100], lambda v: (v["last"], "past the end of the file")),
  "truncated_header": (lambda d, v: d[: v["header"] // 2], lambda v: ("past the end of the file",)),
  "wrong_magic": (lambda d, v: b"GGUG" + d[4:], lambda v: ("not a GGUF file",)),
  "tensor_count_2**40": (
    lambda d, v: _patched(d, 8, "<Q", 2**40),
    lambda v: ("GGUF.tensor_count = 1099511627776",),
  ),
  "zip_renamed": (lambda d, v: _zip_of(d), lambda v: ("not a GGUF file", "zip archive")),
  "empty": (lambda d, v: b"", lambda v: ("file is empty",)),
  "shape_larger_than_data": (_larger_shape, lambda v: (SHAPE_CHANGED, "runs into tensor")),
}


def _import(gguf_path, out_dir):
  cmd = [
    sys.executable,
    "experiments/import_gguf.py",
    "--config=configs/import_gguf.py",
    f"--config.gguf={gguf_path}",
    f"--config.out_dir={out_dir}",
  ]
  return subprocess.run(
    cmd, cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300
  )


@pytest.mark.slow
@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_gguf_fails_in_one_line_writing_nothing(valid, tmp_path, damage):
  make, named = DAMAGES[damage]
  path = str(tmp_path / f"{damage}.gguf")
  with open(path, "wb") as f:
    f.write(make(valid["data"], valid))
  out_parent = tmp_path / "out"
  result = _import(path, out_parent / "model")
  text = result.stdout + result.stderr
  lines = [line for line in text.splitlines() if line.strip()]
  assert result.returncode != 0, text[-3000:]
  assert "Traceback" not in text and len(lines) == 1, text[-3000:]
  assert path in lines[0], lines[0]
  for words in named(valid):
    assert words in lines[0].replace(path, ""), lines[0]
  assert not out_parent.exists() or os.listdir(out_parent) == [], os.listdir(out_parent)


@pytest.mark.slow
def test_valid_gguf_imports_through_the_script(valid, tmp_path):
  """The same command on the undamaged file succeeds: the output dir loads, and nothing else (no
  temporary dir) is left beside it."""
  out = tmp_path / "out" / "model"
  result = _import(valid["path"], out)
  assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
  cfg, _ = sj.load_hf(str(out))
  assert cfg == valid["cfg"]
  assert os.listdir(tmp_path / "out") == ["model"]
