"""experiments/bench_rollout.py: (b) decode tokens/s dense vs sparse, (c) our sampler vs tunix's,
(d) long-tail rollouts through the engine vs its static-batch setting.

  python experiments/bench_rollout.py --config=configs/bench_rollout.py \\
      [--config.decode.contexts=16384 --config.decode.dense_layers=0]
  python experiments/bench_rollout.py --config=configs/bench_rollout.py --config.parts=c \\
      --config.tunix.python=VENV/bin/python
  python experiments/bench_rollout.py --config=configs/bench_rollout.py --config.parts=b,c \\
      --config.tunix.python=VENV/bin/python --config.out=docs/results/decode_rollout.json
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.parts = "b"  # comma-separated: b (decode, dense vs sparse), c (vs tunix),
  # d (long-tail rollouts, engine vs static batch)
  c.batch = 4  # sequences decoded together, in both parts
  c.runs = 5  # timed calls per cell (median), after one warm-up call
  c.out = ""  # also write (b) and (c)'s figures here, one results record (JSON with the
  # command, commit, machine and date); "" = print only. (d) writes engine.record.

  c.decode = ml_collections.ConfigDict()  # (b): Qwen3-1.7B shapes, random weights, decode only
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

  c.tunix = ml_collections.ConfigDict()  # (c): tiny Qwen3, our dense sampler vs google-tunix's
  c.tunix.prompt = 64  # prompt tokens
  c.tunix.gen = (32, 160)  # the two generation lengths whose time difference is decode
  # google-tunix is not a project dependency. "" = run (c) in this Python if it imports tunix, else
  # print how to make a venv for it; a path (VENV/bin/python) = rerun (c) under that interpreter.
  c.tunix.python = ""

  # (d): long-tail rollouts through the engine and through its static-batch setting, same rows and
  # same pool memory. The pool holds `static_slots` rows at full length (what the static batch
  # allocates); the engine gives the same pages out as rows grow, so more rows fit: `slots` is set
  # near pool tokens / mean row tokens (here 8 x 2112 / 1088, about 16), so the pool, not the slot
  # count, is what limits it, and the reserve rarely has to preempt.
  c.engine = ml_collections.ConfigDict()
  c.engine.model = "default"  # default (the shipped tiny model's shape) | qwen3-1.7b
  c.engine.layers = 4  # layers kept of the qwen3-1.7b shape
  c.engine.prompts = 16  # GRPO groups
  c.engine.group_size = 8  # rows per group (their prompt is prefilled once)
  c.engine.prompt = 64  # prompt tokens
  c.engine.cutoff = 2048  # max completion tokens; lengths geometric with mean cutoff / 2
  c.engine.seed = 0  # the lengths and prompts
  c.engine.static_slots = 8  # rows of the static batch; the pool is their full length
  c.engine.slots = 16  # the engine's slots, over the same pool
  c.engine.chunk_steps = 32  # decode steps between scheduler passes (both settings)
  c.engine.drain_share = 0.5  # both settings decode slots x this once no more rows run
  # (EngineConfig.drain_slots); 0 = off
  c.engine.dense_layers = 1  # layers kept dense in the sparse runs
  c.engine.tau = 0.86  # the paper's Qwen3-1.7B budget table at this tau
  c.engine.dtype = "float32"  # params and pool dtype: float32 | bfloat16
  c.engine.pool_gb = 0.0  # pool size in GB; 0 = static_slots rows at full length
  c.engine.settings = ("static", "engine")  # which settings run (each dense and sparse)
  c.engine.record = ""  # write the results record here (JSON), e.g. docs/results/...

  return c
