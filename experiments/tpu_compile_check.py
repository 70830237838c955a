"""The TPU kernels compiled for compile-only TPU devices: does every decode call the engine makes
fit the chip (SMEM above all), and does the policy's dense training attention (splash, forward and
backward) compile at the paper's row length, without a TPU?

  pip install "jax[tpu]==<this jax's version>"   # libtpu: the real XLA:TPU and Mosaic compilers
  python experiments/tpu_compile_check.py --config=configs/tpu_compile_check.py \\
      [--config.record=docs/results/tpu_compile_check.json]

`jax.experimental.topologies.get_topology_desc` gives compile-only devices of a TPU topology;
inputs placed on one of them (ShapeDtypeStructs with its sharding) make `jit(...).lower().compile()`
run the TPU compiler here. The kernel is compiled with interpret=False at each SMEM budget (its
default, which splits a batch into row chunks, and unlimited: one call), and the engine's dispatch
`policy.paged_decode_attention(impl="auto")`, which picks the Mosaic kernel when lowered for TPU
(`impl="pallas_tpu"` would pick interpret mode from this CPU backend and check nothing).
`jax.export` is no substitute: it lowers without compiling, so an SMEM overflow passes it. For
each topology, batch and page list (dense: every page of the context; sparse: the paper's budget):
compiled or the compiler's error.
"""

import functools

from absl import app, flags
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import config_flags

from kernels import sparse_decode_tpu
from sparrow_jax import records, sharding
from sparrow_jax.attention import flash
from sparrow_jax.sparsity import policy

UNLIMITED = 1 << 40


def _one_device(device):
  """(a one-device (data, fsdp, tensor) mesh of `device`, a ShapeDtypeStruct maker placing arrays
  on it)."""
  mesh = sharding.make_mesh(devices=[device])
  on = NamedSharding(mesh, PartitionSpec())
  return mesh, lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=on)


def compile_call(device, B, N, c, smem_bytes):
  """(compiled?, the first line of the compiler's error or "", row chunks) for one decode call:
  the kernel at SMEM budget `smem_bytes`, or the engine's dispatch (smem_bytes None)."""
  K, G, E, Z = c.kv_heads, c.group, c.head_dim, c.page_size
  X = B * (c.context // Z) + 1  # every row's pages and the trash page, per KV head
  _, sds = _one_device(device)
  args = (
    sds((B, K, G, E), jnp.bfloat16),
    sds((K * X, Z, E), jnp.bfloat16),
    sds((K * X, Z, E), jnp.bfloat16),
    sds((B, K, N), jnp.int32),
    sds((B, K, N), jnp.int32),
    sds((B, K), jnp.int32),
    sds((B,), jnp.int32),
  )
  block = sparse_decode_tpu.default_pages_per_block(N, Z)
  budget = sparse_decode_tpu.SMEM_PREFETCH_BYTES if smem_bytes is None else smem_bytes
  chunks = -(-B // sparse_decode_tpu.rows_per_call(B, K, -(-N // block) * block, budget))
  fn = (
    functools.partial(policy.paged_decode_attention, impl="auto")
    if smem_bytes is None
    else functools.partial(
      sparse_decode_tpu.paged_decode_attention, interpret=False, smem_bytes=smem_bytes
    )
  )
  try:
    jax.jit(fn).lower(*args).compile()
    return True, "", chunks
  except Exception as e:  # the compiler's verdict is the measurement
    return False, str(e).strip().splitlines()[0][:300], chunks


def compile_train_attention(device, c, impl):
  """(compiled?, error or "", splash in the program?, temporaries in GB) for the gradient of the
  model's dense teacher-forced attention (`flash.causal_attention` by `impl`: "auto" is what the
  model runs) over c.train_rows rows of c.train_tokens tokens, as a train step's layer runs it.
  Traced under the TPU mesh, so what is decided at trace time (the blockwise path's bf16 operands)
  is decided for the TPU."""
  K, G, E, B, T = c.kv_heads, c.group, c.head_dim, c.train_rows, c.train_tokens
  mesh, sds = _one_device(device)
  args = (
    sds((B, T, K, G, E), jnp.bfloat16),
    sds((B, T, K, E), jnp.bfloat16),
    sds((B, T, K, E), jnp.bfloat16),
    sds((B, T), jnp.bool_),
  )
  attention = functools.partial(flash.causal_attention, impl=impl)
  loss = lambda q, k, v, mask: jnp.sum(attention(q, k, v, mask).astype(jnp.float32))
  try:
    with jax.set_mesh(mesh):
      compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
  except Exception as e:  # the compiler's verdict is the measurement
    return False, str(e).strip().splitlines()[0][:300], False, None
  temp_gb = compiled.memory_analysis().temp_size_in_bytes / 1e9
  return True, "", "tpu_custom_call" in compiled.as_text(), temp_gb


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  from jax.experimental import topologies

  c = flags.FLAGS.config
  budgets = {
    "default": sparse_decode_tpu.SMEM_PREFETCH_BYTES,
    "unlimited": UNLIMITED,
    "dispatch": None,
  }
  rows = []
  print(
    f"{'topology':14s} {'kind':14s} {'B':>4s} {'pages':>6s} {'smem budget':>12s} "
    f"{'calls':>5s}  result"
  )
  for name in c.topologies.split(","):
    device = topologies.get_topology_desc(name, "tpu").devices[0]
    for B in (int(b) for b in c.batches.split(",")):
      for case, N in (("dense", c.context // c.page_size), ("sparse", c.sparse_pages)):
        for budget in c.smem_bytes.split(","):
          ok, error, chunks = compile_call(device, B, N, c, budgets[budget])
          rows.append(
            dict(
              topology=name,
              device_kind=device.device_kind,
              batch=B,
              case=case,
              pages=N,
              smem_budget=budget,
              calls=chunks,
              compiled=ok,
              error=error,
            )
          )
          print(
            f"{name:14s} {device.device_kind:14s} {B:4d} {N:6d} {budget:>12s} {chunks:5d}  "
            f"{'compiles' if ok else 'FAILS: ' + error[:90]}",
            flush=True,
          )
  train = []
  print(f"\ntrain attention (grad), {c.train_rows} x {c.train_tokens} tokens:")
  for name in c.topologies.split(","):
    device = topologies.get_topology_desc(name, "tpu").devices[0]
    for impl in ("auto", "blockwise"):
      ok, error, splash, temp_gb = compile_train_attention(device, c, impl)
      train.append(
        dict(
          topology=name,
          device_kind=device.device_kind,
          impl=impl,
          compiled=ok,
          error=error,
          splash=splash,
          temp_gb=temp_gb,
        )
      )
      result = (
        f"compiles, splash {splash}, temps {temp_gb:.2f} GB" if ok else "FAILS: " + error[:90]
      )
      print(f"{name:14s} {device.device_kind:14s} {impl:10s} {result}", flush=True)
  if c.record:
    records.write_record(c.record, {"config": c.to_dict(), "calls": rows, "train": train})


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "configs/tpu_compile_check.py", "experiment config")
  app.run(main)
