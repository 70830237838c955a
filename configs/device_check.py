"""experiments/device_check.py: the one-shot GPU / TPU check (kernels, attention, end-to-end
decode, the engine, training attention, exact mode).

python experiments/device_check.py [--out=device_check.json]   # on the accelerator, < 11 min
python experiments/device_check.py --smoke                      # tiny sizes, any backend (CI)
python experiments/device_check.py --config=configs/device_check.py:smoke --config.x=y # + overrides
python experiments/device_check.py --config.parts=exact         # some parts only
"""

import ml_collections

from configs import bench_engine, bench_exact


def get_config(arg: str = ""):
  smoke = arg == "smoke"
  c = ml_collections.ConfigDict()
  c.smoke = smoke  # tiny sizes (configs/device_check.py:smoke)
  # the parts run, in this order (tuning on a GPU only)
  c.parts = "kernels,attention,tuning,decode,engine,train_attention,exact"
  # (1) kernel == jnp twin, on the device (interpret mode off its hardware)
  c.kernel_context = 512 if smoke else 8192  # cache slots per row of the kernel checks
  # (2) attention only, dense vs sparse (experiments/bench_attention.py's measure)
  c.attention = ml_collections.ConfigDict()
  c.attention.contexts = (256, 512) if smoke else (4096, 16384, 32768)  # cached tokens per row
  c.attention.budget = 64 if smoke else 2048  # sparse tokens read per (row, KV head)
  c.attention.batch = 2 if smoke else 64  # rows per decode step
  c.attention.cache_tokens = 0  # slots per row (0: the largest context)
  c.attention.steps = 2 if smoke else 16  # decode steps per timed call
  c.attention.runs = 1 if smoke else 5  # timed calls per cell (median)
  c.attention.dtype = "bfloat16"  # cache dtype
  c.attention.impl = "auto"  # the platform's kernel (XLA off accelerators)
  c.attention.select = True  # also time page selection + sparse attention
  c.tuning_context = 32768  # (GPU) the Triton tuning alternatives are timed here
  # (3) end-to-end decode of a random Qwen3-1.7B, cache filled directly (no prefill)
  c.decode = ml_collections.ConfigDict()
  c.decode.layers = 2 if smoke else 28  # Qwen3-1.7B has 28
  c.decode.vocab_size = 1024 if smoke else 0  # 0: the real 151,936
  c.decode.batch = 2 if smoke else 16  # rows: 16 x 32K x 28 layers of bf16 KV = 60 GB
  c.decode.context = 256 if smoke else 32768 - 64  # cached tokens when decoding starts
  c.decode.steps = 4 if smoke else 64  # decode steps timed
  c.decode.runs = 1 if smoke else 3  # timed calls (median)
  c.decode.dense_layers = 1 if smoke else 2  # first layers kept dense in sparse decode (paper: 2)
  c.decode.tau = 0.86  # the paper's Qwen3-1.7B budget table at this tau
  # (4) the rollout engine on a long-tail workload (experiments/bench_engine.py): a random
  # Qwen3-1.7B, 32 rows of geometric lengths (mean 16K) capped at 32K, dense vs sparse tokens/s on
  # one device: what compares with the paper's 640 / 1,416 tokens/s per GPU (Table 2, 4 H200s).
  c.engine = bench_engine.get_config().engine
  c.engine.update(
    model="default" if smoke else "qwen3-1.7b",
    layers=28,
    dtype="bfloat16",
    prompts=2 if smoke else 4,
    group_size=2 if smoke else 8,
    prompt=64 if smoke else 1024,
    cutoff=128 if smoke else 32768,
    slots=4 if smoke else 32,
    chunk_steps=16 if smoke else 64,
    dense_layers=1 if smoke else 2,
    pool_gb=0.0 if smoke else 60.0,
    static_slots=2,
    settings=("engine",),
  )
  # (5) the dense training attention's gradient: the backend's fused kernel against blockwise
  c.train_attention = ml_collections.ConfigDict()
  c.train_attention.rows = 1  # rows per call
  c.train_attention.tokens = 256 if smoke else 32768  # row length of the timed calls
  c.train_attention.check_tokens = 256 if smoke else 2048  # row length of the equality check
  c.train_attention.runs = 1 if smoke else 3  # timed calls (median)
  # (6) exact mode at long context (experiments/bench_exact.py's part (1)): a random Qwen3-1.7B,
  # a pool filled at 32K cached tokens per row, dense vs speculate 2 / 4 vs the regime switch
  exact = bench_exact.get_config()
  c.exact = ml_collections.ConfigDict()
  c.exact.batch = 2 if smoke else 4  # rows: 4 x 32K x 28 layers of bf16 KV = 15.5 GB of pool
  c.exact.runs = 1 if smoke else 3  # timed calls per setting (median), interleaved
  c.exact.temperature = exact.temperature
  c.exact.drafts = exact.drafts  # speculate 2 and 4; auto chooses among them or dense
  c.exact.hardware = exact.hardware  # the roofline auto's plan is priced on
  c.exact.dtype = "float32" if smoke else "bfloat16"  # params and pool (CPU: bf16 doubles the time)
  c.exact.shapes = exact.shapes
  c.exact.shapes.update(
    layers=1 if smoke else 28,  # one layer: most of the smoke run is compiling
    vocab_size=1024 if smoke else 0,
    dense_layers=0 if smoke else 2,  # layers the drafts keep dense (paper: 2)
    contexts=(256,) if smoke else (32768,),
    steps=8 if smoke else 16,
  )
  return c
