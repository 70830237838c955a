"""experiments/bench_decode.py: decode tokens/s, dense vs sparse, of Qwen3-1.7B shapes cut in depth
(or a model dir), from a filled cache.

  python experiments/bench_decode.py --config=configs/bench_decode.py \\
      [--config.decode.contexts=16384 --config.decode.dense_layers=0]
  python experiments/bench_decode.py --config=configs/bench_decode.py \\
      --config.out=docs/results/decode_rollout.json
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.batch = 4  # sequences decoded together
  c.runs = 5  # timed calls per cell (median), after one warm-up call
  c.out = ""  # also write the figures here, one results record (JSON with the command, commit,
  # machine and date); "" = print only

  # The model and the timed steps sit under `decode`, where the results records' config holds them
  # (docs/make_results_pages.py reads them there).
  c.decode = ml_collections.ConfigDict()
  c.decode.layers = 4  # decoder layers kept of the 1.7B shape (28 in the real model)
  c.decode.dense_layers = (2, 0)  # one sparse row each, with these first layers kept dense
  c.decode.vocab_size = 0  # 0 = 151936 * layers / 28 (the full model's LM-head share)
  c.decode.contexts = (16384, 32768)  # cached tokens per row before the timed steps (x 16)
  c.decode.steps = 8  # decode steps per timed call
  c.decode.dtype = "float32"  # params and KV cache dtype: float32 | bfloat16
  c.decode.model_dir = ""  # an HF dir (e.g. the real LM of configs/import_gguf.py): its config
  # and real weights instead of the truncated 1.7B shapes (decode.layers, decode.vocab_size unused)
  c.decode.schedule = "paper:qwen3-1.7b:0.86"  # the sparse rows' KVSchedule (a rollout.schedule
  # spec: fixed:PAGES, paper:MODEL:TAU or a schedule JSON)
  return c
