"""experiments/bench_engine.py: long-tail rollouts through the rollout engine vs its static-batch
setting, dense and sparse, same rows and same pool memory.

  python experiments/bench_engine.py --config=configs/bench_engine.py \\
      [--config.engine.record=docs/results/engine_long_tail_default.json]
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  # The settings sit under `engine`: configs/device_check.py takes the group whole for its engine
  # part. The pool holds `static_slots` rows at full length (what the static batch allocates); the
  # engine gives the same pages out as rows grow, so more rows fit: `slots` is set near pool tokens
  # / mean row tokens (here 8 x 2112 / 1088, about 16), so the pool, not the slot count, is what
  # limits it, and the reserve rarely has to preempt.
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
