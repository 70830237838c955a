"""The GPU decode kernel (kernels/sparse_decode.py) compiled for sm_90 without a GPU: registers per
thread, spills and shared memory of every tuning variant, from Triton's compiler and ptxas.

  python3 -m venv /tmp/tritonvenv && /tmp/tritonvenv/bin/pip install triton==3.9.0
  python experiments/triton_stats.py --config=configs/triton_stats.py \\
      --config.triton_python=/tmp/tritonvenv/bin/python \\
      [--config.record=docs/results/triton_sm90.json]

Route: the kernel is lowered for "cuda" here (`jit(...).trace(...).lower(lowering_platforms=
("cuda",))`; Pallas' Triton lowering needs no GPU and assumes sm_90 when none is present). The
StableHLO holds one `__gpu$xla.gpu.triton` custom call whose backend config carries the Triton
module as MLIR bytecode (`ir`) with num_warps and num_stages; the bytecode is parsed with jaxlib's
Triton dialect (`jaxlib.triton.dialect`) and printed as text (.ttir). A separate
Python with the `triton` wheel (its own venv: the wheel is a compiler, unrelated to jax) compiles
each .ttir for GPUTarget("cuda", arch, 32) to PTX (`triton.compile`; the compiled kernel's
metadata.shared is the dynamic shared memory a launch requests), then each ptxas the wheel bundles
assembles the PTX for sm_<arch>a with -v, whose log gives registers per thread, stack frame and
spill stores / loads in bytes.

What this is and is not: on a GPU, XLA compiles the same Triton module with the Triton build inside
jaxlib and the CUDA toolkit's ptxas, whose passes may differ from the wheel's; these figures are the
open-source Triton release's compilation of the kernel's exact IR, a proxy for what jaxlib builds.
"""

import dataclasses
import functools
import json
import os
import re
import subprocess
import tempfile

from absl import app, flags
import jax
from jax.extend.mlir import ir
import jax.numpy as jnp
from jaxlib.triton import dialect as triton_dialect
from ml_collections import config_flags

from kernels import sparse_decode
from sparrow_jax import records

TRITON_CALL = "__gpu$xla.gpu.triton"

# Run by c.triton_python (stdlib and triton only): argv[1] a JSON job file, argv[2] the JSON answer.
WORKER = r"""
import json, os, subprocess, sys, tempfile
job = json.load(open(sys.argv[1]))
tmp = tempfile.mkdtemp()
os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "cache")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import compiler as nvidia
arch = job["arch"]
gpu_name = nvidia.sm_arch_from_capability(arch)
tools = [knobs.nvidia.ptxas, knobs.nvidia.ptxas_blackwell]
answer = dict(
  triton=triton.__version__, gpu_name=gpu_name, ptxas=[t.version for t in tools], kernels=[]
)
for i, kernel in enumerate(job["kernels"]):
  src = os.path.join(tmp, f"k{i}.ttir")
  with open(src, "w") as f:
    f.write(kernel["ttir"])
  options = dict(
    num_warps=kernel["num_warps"], num_stages=kernel["num_stages"], ptx_version=job["ptx_version"]
  )
  try:
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
  except Exception as e:
    answer["kernels"].append(dict(error=(str(e).strip().splitlines() or [repr(e)])[0][:300]))
    continue
  ptx = os.path.join(tmp, f"k{i}.ptx")
  with open(ptx, "w") as f:
    f.write(compiled.asm["ptx"])
  logs = {}
  for tool in tools:
    run = subprocess.run(
      [tool.path, "-v", f"--gpu-name={gpu_name}", ptx, "-o", ptx + ".cubin"],
      capture_output=True,
      text=True,
    )
    logs[tool.version] = run.stdout + run.stderr
  answer["kernels"].append(dict(shared=compiled.metadata.shared, ptxas_logs=logs, error=""))
json.dump(answer, open(sys.argv[2], "w"))
"""


def variants(c):
  """[(dtype name, Tuning, in the table?)]: the kernel's table entries for bfloat16 and float32 at
  this group size (`sparse_decode.tuning`, what the kernel runs), then the bfloat16 alternatives
  the device check times (`sparse_decode.tuning_alternatives`)."""
  table = [
    (name, sparse_decode.tuning(jnp.dtype(name), c.group)) for name in ("bfloat16", "float32")
  ]
  out = [(name, t, True) for name, t in table]
  return out + [("bfloat16", t, False) for t in sparse_decode.tuning_alternatives()]


def _custom_calls(op):
  for region in op.regions:
    for block in region.blocks:
      for child in block.operations:
        if child.operation.name == "stablehlo.custom_call":
          if ir.StringAttr(child.attributes["call_target_name"]).value == TRITON_CALL:
            yield child
        yield from _custom_calls(child.operation)


def triton_module(c, dtype, tuning):
  """(the Triton module as text, its launch: name, num_warps, num_stages, grid) of the kernel's one
  pallas_call, lowered for cuda at the config's shapes."""
  B, K, G, E, Z = c.batch, c.kv_heads, c.group, c.head_dim, c.page_size
  N = c.budget // Z
  X = K * (B * (c.context // Z) + 1)  # every row's pages and a trash page, per KV head
  shapes = [
    ((B, K, G, E), dtype),
    ((X, Z, E), dtype),
    ((X, Z, E), dtype),
    ((B, K, N), jnp.int32),
    ((B, K, N), jnp.int32),
    ((B, K), jnp.int32),
    ((B,), jnp.int32),
  ]
  fn = functools.partial(sparse_decode.paged_decode_attention, config=tuning, interpret=False)
  args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  module = lowered.compiler_ir("stablehlo")
  [call] = list(_custom_calls(module.operation))
  config = ir.DictAttr(call.attributes["mhlo.backend_config"])
  with ir.Context() as context:  # jaxlib's Triton dialect reads the bytecode
    triton_dialect.register_dialect(context)
    triton = ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes)
    text = triton.operation.get_asm(enable_debug_info=False)
  integer = lambda key: ir.IntegerAttr(config[key]).value
  launch = dict(
    name=ir.StringAttr(config["name"]).value,
    num_warps=integer("num_warps"),
    num_stages=integer("num_stages"),
    grid=[integer("grid_x"), integer("grid_y"), integer("grid_z")],
  )
  return text, launch


PTXAS_REGS = re.compile(r"Used (\d+) registers")
PTXAS_SPILLS = re.compile(
  r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict:
  """registers (per thread), stack, spill_stores, spill_loads, static_smem (bytes) from a
  `ptxas -v` log of one entry function; error (its first fatal line) when it did not assemble."""
  regs, spills = PTXAS_REGS.search(log), PTXAS_SPILLS.search(log)
  if not regs or not spills:
    fatal = [line.strip() for line in log.splitlines() if "fatal" in line or "error" in line]
    return dict(error=(fatal or [log.strip()[:300] or "no ptxas output"])[0][:300])
  smem = PTXAS_SMEM.search(log)
  return dict(
    registers=int(regs.group(1)),
    stack=int(spills.group(1)),
    spill_stores=int(spills.group(2)),
    spill_loads=int(spills.group(3)),
    static_smem=int(smem.group(1)) if smem else 0,
    error="",
  )


def compile_with_triton(python: str, arch: int, ptx_version: int, kernels: list) -> dict:
  """The worker's answer for [{ttir, num_warps, num_stages}], run by `python` (triton installed)."""
  with tempfile.TemporaryDirectory() as tmp:
    job, answer = os.path.join(tmp, "job.json"), os.path.join(tmp, "answer.json")
    with open(job, "w") as f:
      json.dump(dict(arch=arch, ptx_version=ptx_version, kernels=kernels), f)
    run = subprocess.run([python, "-c", WORKER, job, answer], capture_output=True, text=True)
    if run.returncode:
      raise RuntimeError(f"{python} could not compile with triton:\n{run.stderr[-3000:]}")
    with open(answer) as f:
      return json.load(f)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  c = flags.FLAGS.config
  if not os.path.exists(c.triton_python):
    raise app.UsageError(
      f"--config.triton_python={c.triton_python} does not exist: make a venv with "
      "`pip install triton==3.9.0` (see this file's docstring)"
    )
  cases, kernels = variants(c), []
  for dtype, tuning, _ in cases:
    text, launch = triton_module(c, jnp.dtype(dtype), tuning)
    kernels.append(dict(ttir=text, **launch))
  answer = compile_with_triton(c.triton_python, c.arch, c.ptx_version, kernels)
  rows = []
  print(f"triton {answer['triton']}, {answer['gpu_name']}, ptxas {' / '.join(answer['ptxas'])}")
  print(
    f"{'dtype':9s} {'block':>5s} {'dot':5s} {'warps':>5s} {'stages':>6s} {'table':5s} "
    f"{'ptxas':>6s} {'regs':>4s} {'spill st/ld':>11s} {'stack':>5s} {'shared':>7s}"
  )
  for (dtype, tuning, in_table), kernel, compiled in zip(cases, kernels, answer["kernels"]):
    row = dict(
      dtype=dtype,
      **dataclasses.asdict(tuning),
      in_table=in_table,
      grid=kernel["grid"],
      error=compiled["error"],
      shared=compiled.get("shared"),
      ptxas={version: parse_ptxas(log) for version, log in compiled.get("ptxas_logs", {}).items()},
    )
    rows.append(row)
    head = (
      f"{dtype:9s} {tuning.block_tokens:5d} {str(tuning.use_dot):5s} {tuning.num_warps:5d} "
      f"{tuning.num_stages:6d} {str(in_table):5s}"
    )
    if row["error"]:
      print(f"{head} FAILS: {row['error'][:90]}")
    for version, fig in row["ptxas"].items():
      if fig["error"]:
        print(f"{head} {version:>6s} FAILS: {fig['error'][:80]}")
        continue
      spills = f"{fig['spill_stores']}/{fig['spill_loads']}"
      print(
        f"{head} {version:>6s} {fig['registers']:4d} {spills:>11s} {fig['stack']:5d} "
        f"{row['shared'] + fig['static_smem']:7d}",
        flush=True,
      )
  if c.record:
    toolchain = dict(triton=answer["triton"], gpu_name=answer["gpu_name"], ptxas=answer["ptxas"])
    records.write_record(
      c.record, {"config": c.to_dict(), "toolchain": toolchain, "variants": rows}
    )


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "configs/triton_stats.py", "experiment config")
  app.run(main)
