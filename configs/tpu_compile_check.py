"""experiments/tpu_compile_check.py: the TPU decode kernel and the dense training attention
compiled for compile-only TPU devices on this CPU (the real XLA:TPU / Mosaic compiler, nothing run),
at Qwen3-1.7B's head shapes.

  pip install "jax[tpu]==$(python -c 'import jax; print(jax.__version__)')"   # libtpu, ~0.7 GB
  python experiments/tpu_compile_check.py --config=configs/tpu_compile_check.py
"""

import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.topologies = "v5e:2x2,v6e:2x2,v5p:2x2x1"  # jax.experimental.topologies names; one chip is used
  c.batches = "16,64"  # rows per decode call (slots on one chip)
  c.context = 32768  # tokens cached per row: dense lists all of its pages
  c.sparse_pages = 256  # pages a sparse call lists: max_selected of the paper's
  #                                    tau-0.86 Qwen3-1.7B table at 32K
  c.kv_heads = 8  # Qwen3-1.7B: 8 KV heads of 128 dims, 2 query heads each
  c.head_dim = 128
  c.group = 2
  c.page_size = 16
  c.smem_bytes = "default,unlimited,dispatch"  # the kernel's SMEM budget per call: its default
  #                                    (row chunks), unlimited (one call for the whole batch), and
  #                                    dispatch: policy.paged_decode_attention(impl="auto") as the
  #                                    engine calls it
  c.train_rows = 1  # the train step's dense attention (gradient): rows of
  c.train_tokens = 38912  # tokens (1K prompt + 37K response, as configs/memory_report.py)
  c.record = ""  # write the results record (JSON) here ("" = print only)
  return c
