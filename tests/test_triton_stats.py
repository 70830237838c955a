"""experiments/triton_stats.py without the triton wheel: its variants are the kernel's table entries
and device_check's alternatives, the Triton module comes out of the cuda lowering as text with the
tuning's launch, and ptxas -v logs parse (the compile itself needs the wheel: see its docstring)."""

import jax.numpy as jnp

from configs import triton_stats as triton_stats_config
from experiments import triton_stats
from kernels import sparse_decode

LOG_SPILLS = """ptxas info    : 11 bytes gmem
ptxas info    : Compiling entry function 'sparse_decode' for 'sm_90a'
ptxas info    : Function properties for sparse_decode
    8 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 128 registers, used 1 barriers, 8 bytes cumulative stack size
"""
LOG_SMEM = """ptxas info    : Function properties for k
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 1024 bytes smem, 384 bytes cmem[0]
"""


def test_parse_ptxas():
  assert triton_stats.parse_ptxas(LOG_SPILLS) == dict(
    registers=128, stack=8, spill_stores=8, spill_loads=4, static_smem=0, error=""
  )
  assert triton_stats.parse_ptxas(LOG_SMEM)["static_smem"] == 1024
  fatal = "ptxas k.ptx, line 5; fatal   : Unsupported .version 9.4; current version is '8.8'\n"
  assert triton_stats.parse_ptxas(fatal)["error"].startswith("ptxas k.ptx, line 5; fatal")


def test_variants_are_the_table_then_the_device_check_alternatives():
  c = triton_stats_config.get_config()
  found = triton_stats.variants(c)
  table = [(d, sparse_decode.tuning(jnp.dtype(d), c.group), True) for d in ("bfloat16", "float32")]
  assert found[:2] == table
  assert [t for _, t, _ in found[2:]] == sparse_decode.tuning_alternatives()
  assert all(d == "bfloat16" and not in_table for d, _, in_table in found[2:])
  assert (
    table[0][1] not in sparse_decode.tuning_alternatives()
  )  # the table's entry is compiled once


def test_triton_module_comes_out_of_the_cuda_lowering():
  c = triton_stats_config.get_config()
  tuning = sparse_decode.TUNING["bfloat16"]
  text, launch = triton_stats.triton_module(c, jnp.dtype("bfloat16"), tuning)
  assert "tt.func public @sparse_decode" in text
  assert ("tt.dot" in text) == tuning.use_dot
  assert launch["num_warps"] == tuning.num_warps and launch["num_stages"] == tuning.num_stages
  assert launch["name"] == "sparse_decode" and len(launch["grid"]) == 3
