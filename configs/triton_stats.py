"""experiments/triton_stats.py: the GPU decode kernel's Triton IR compiled for sm_90 on this CPU
(Triton's own compiler and its bundled ptxas, nothing run): registers, spills and shared memory of
every tuning variant, at Qwen3-1.7B's head shapes.

  python3 -m venv /tmp/tritonvenv && /tmp/tritonvenv/bin/pip install triton==3.9.0
  python experiments/triton_stats.py --config=configs/triton_stats.py \\
      --config.triton_python=/tmp/tritonvenv/bin/python
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.triton_python = "/tmp/tritonvenv/bin/python"  # a Python with `triton` installed (its own
  #                                    venv: triton pins no jax, the project's venv needs none)
  c.arch = 90  # compute capability compiled for (H100 / H200: sm_90, as sm_90a)
  c.ptx_version = 88  # PTX ISA of the emitted PTX: 8.8 (CUDA 12.9) is read by both ptxas the
  #                                    triton wheel bundles (CUDA 12.9 and its newer sm_90+ one)
  c.batch = 16  # rows per decode call
  c.context = 32768  # tokens cached per row: sizes the page pool the kernel indexes
  c.budget = 2048  # sparse tokens a (row, KV head) reads: the pages listed per call
  c.kv_heads = 8  # Qwen3-1.7B: 8 KV heads of 128 dims, 2 query heads each
  c.head_dim = 128
  c.group = 2
  c.page_size = 16
  c.record = ""  # write the results record (JSON) here ("" = print only)
  return c
