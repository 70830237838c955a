"""experiments/bench_rollout.py: (b) decode tokens/s dense vs sparse, (c) our sampler vs tunix's.

  python experiments/bench_rollout.py --config=configs/bench_rollout.py \\
      [--config.decode.contexts=16384 --config.decode.dense_layers=0]
  python experiments/bench_rollout.py --config=configs/bench_rollout.py --config.parts=c \\
      --config.tunix.python=VENV/bin/python
"""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.parts = "b"                      # comma-separated: b (decode, dense vs sparse), c (vs tunix)
  c.batch = 4                        # sequences decoded together, in both parts
  c.runs = 5                         # timed calls per cell (median), after one warm-up call

  c.decode = ml_collections.ConfigDict()  # (b): Qwen3-1.7B shapes, random weights, decode only
  c.decode.layers = 4                # decoder layers kept of the 1.7B shape (28 in the real model)
  c.decode.dense_layers = (2, 0)     # one sparse row each, with these first layers kept dense
  c.decode.vocab_size = 0            # 0 = 151936 * layers / 28 (the full model's LM-head share)
  c.decode.contexts = (16384, 32768)  # cached tokens per row before the timed steps (x 16)
  c.decode.steps = 8                 # decode steps per timed call
  c.decode.dtype = "float32"         # params and KV cache dtype: float32 | bfloat16

  c.tunix = ml_collections.ConfigDict()  # (c): tiny Qwen3, our dense sampler vs google-tunix's
  c.tunix.prompt = 64                # prompt tokens
  c.tunix.gen = (32, 160)            # the two generation lengths whose time difference is decode
  # google-tunix is not a project dependency. "" = run (c) in this Python if it imports tunix, else
  # print how to make a venv for it; a path (VENV/bin/python) = rerun (c) under that interpreter.
  c.tunix.python = ""
  return c
