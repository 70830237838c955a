"""experiments/bench_attention.py: one decode step of Qwen3-1.7B attention, dense vs block-sparse.

  python experiments/bench_attention.py --config=configs/bench_attention.py \\
      [--config.contexts=4096,16384 --config.select=False
       --config.out=docs/results/decode_attention.json]
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.contexts = (4096, 16384, 32768)  # cached tokens per row, one table row each (multiples of 16)
  c.budget = 2048  # sparse token budget (a multiple of the page size 16, >= 48)
  c.batch = 4  # rows (sequences) per decode step
  c.cache_tokens = 0  # slots preallocated per row (0: the largest context)
  c.impl = "auto"  # auto (GPU / TPU kernel on its platform, else xla) | xla |
  #                                    pallas | pallas_tpu (off their hardware: interpret mode)
  c.steps = 8  # decode steps per timed call (1 = the lone-call regime)
  c.runs = 7  # timed calls per cell (median), after one warm-up call
  c.dtype = "float32"  # q / k / v dtype: float32 | bfloat16
  c.select = True  # also time sparse+select (page selection + sparse attention)
  c.out = ""  # also write the table here, a results record (JSON with the command,
  #                                    commit, machine and date); "" = print only
  return c
