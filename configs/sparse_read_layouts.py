"""experiments/sparse_read_layouts.py: ways to read a sparse layer's selected pages on this CPU, at
one layer of the real LM at the decode profile's setting (configs/profile_decode.py).

  python experiments/sparse_read_layouts.py --config=configs/sparse_read_layouts.py \\
      [--config.out=docs/results/decode_profile_layouts.json]
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.batch = 16  # rows
  c.kv_heads = 3  # SmolLM2-135M's
  c.group = 3  # query heads a KV head
  c.head_dim = 64
  c.context = 8192  # cached tokens a row
  c.pages = 67  # pages of 16 a (row, head) reads: the real-LM table's budget at 8K
  c.runs = 15  # timed calls per layout (median), interleaved, after one warm-up call each
  c.out = ""  # also write the figures here as a results record ("" = print only)
  return c
