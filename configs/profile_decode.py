"""experiments/profile_decode.py: where one decode step's time goes, dense and sparse, on the real
LM (configs/import_gguf.py imports it) at long context.

  python experiments/profile_decode.py --config=configs/profile_decode.py \\
      [--config.out=docs/results/decode_profile.json]
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.model_dir = "$HOME/.cache/sparrow_jax/smollm2-135m-instruct"  # configs/import_gguf.py's
  c.schedule = "assets/real_lm/schedule.json"  # the sparse policy's table (calibrated on it)
  c.dense_layers = 2  # first layers kept dense, as the real-LM runs keep them
  c.context = 8192  # cached tokens a row before the profiled steps (a multiple of 16)
  c.batch = 16  # rows decoded together
  c.steps = 8  # decode steps a call
  c.runs = 3  # profiled calls per mode, after one warm-up call
  c.dtype = "float32"  # params and KV cache dtype (the CPU's fast one)
  c.out = ""  # also write the figures here as a results record ("" = print only)
  return c
