"""Memory at the paper's scale, from XLA's buffer assignment: nothing is allocated.

  python experiments/memory_report.py --config=configs/memory_report.py \\
      [--config.models=qwen3-1.7b --config.lengths=8192,38912 --config.parts=train]

Each jitted function is lowered with `jax.ShapeDtypeStruct` inputs at full width and depth and
compiled for this machine's backend; `compiled.memory_analysis()` gives the bytes of its arguments
and of its temporaries (everything XLA allocates besides arguments and outputs) per device. Parts:
  train          the fused RL step with DistillSparse (GRPO + TIS + LoRA), `train_rows` rows of
                 `length` tokens (prompt_len of them prompt), Adam states in the params' dtype;
                 with `length_buckets`, also the temporaries of the step whose passes run at the
                 smallest bucket holding their rows (rl.length_buckets): a length's own row is
                 the memory at that bucket.
  sampler        the rollout as the trainer runs it by default: `sampler_rows` rows sampled sparsely
                 to `length` tokens by the engine's full batch (every row in a slot, a pool that
                 holds them at full length, each group's prompt prefilled once into it): the decode
                 chunk and the group prefill, against the pool (KV) + params they must hold.
  calibrate      one calibration pass (the sparse teacher-forced pass of one candidate against the
                 dense hidden states) over `calibrate_rows` rows.
  engine         the rollout engine's decode chunk (rollout/engine.py) over a pool of
                 `engine_pool_gb` GB and `engine_slots` slots whose page tables reach `length`
                 tokens: arguments (pool, weights, slots) and temporaries, the pool's pages, and
                 the rows in flight the pool holds (cost_model.roofline_engine_rate, mean length
                 `engine_mean_len_frac` x the cutoff) against the static batch's rows at full
                 length in the same memory.
  layout         one device of each side of a run's layout (docs/many_devices.md): the train step
                 (part train) on the trainer's mesh and the engine's decode chunk (part engine) on
                 one rollout device, its weights whole. `rollout_devices` = 0 (colocated): every
                 device does both, so during the rollout it holds the engine's buffers and the
                 train state besides; n: the first n devices only roll out, the mesh is over the
                 rest (the device count is n + the mesh's), as `mesh.rollout_devices` = n.
                 `layouts` compiles several layouts in one run (the engine once for all). Each
                 side is written to `out` as soon as it compiles; a side the compiler refuses for
                 memory is kept as not fitting, with the bytes the compiler says it needs and its
                 error text, and an engine refused at `engine_pool_gb` is compiled again at each
                 of `engine_fallback_pools` until one fits.
  compile_time   seconds to lower + compile the train step at full depth vs `compile_time_layers`.
  calibrate_run  a real p5 pass over one `run_len`-token row of a `run_model`-shaped model with
                 random weights on this CPU: wall time and peak RSS.
On the CPU backend (`target` cpu) float32 copies of bfloat16 weights and buffers inflate the
figures; `--config.target=v5p:2x2x1` (a TPU topology; needs jax[tpu], docs/kernels.md) compiles
train and sampler for compile-only TPU devices and reports the TPU compiler's buffer assignment.

Per device on a mesh (`--config.mesh=DATA,FSDP,TENSOR`, on that many fake CPU devices):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/memory_report.py \
      --config=configs/memory_report.py --config.mesh=1,8,1 --config.train_rows=8 ...
train and sampler are then compiled as the trainer runs them: state and batch on the sharding
rules (sharding.py), the rollout's weights gathered over fsdp (sharding.ROLLOUT_RULES), each
device prefilling and decoding only its own groups.
"""

import contextlib
import dataclasses
import re
import time

from absl import app, flags
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from ml_collections import config_flags
import numpy as np
import optax

import sparrow_jax as sj
from sparrow_jax import records, sharding
from sparrow_jax.attention import page_pool
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.mismatch import calibrate, cost_model
from sparrow_jax.model import lora as lora_lib
from sparrow_jax.rl import memory, step_schema
from sparrow_jax.rl import train_step as ts
from sparrow_jax.rollout import engine, programs, sampler
from sparrow_jax.sparsity.schedule import BudgetTable, KVSchedule

GB = 1e9
SPARSE = SparseConfig(page_size=16, sink_pages=1, local_pages=2, dense_layers=2)  # the paper's
SDS = jax.ShapeDtypeStruct
SAMPLING = sampler.Sampling(
  eos_ids=(0,), num_top_logprobs=step_schema.TOP_K
)  # the trainer's top-20 kept


def _model(name, dtype, layers=None):
  cfg = sj.Qwen3Config.preset(name)
  if layers:
    cfg = dataclasses.replace(cfg, num_hidden_layers=layers)
  params = jax.eval_shape(lambda: sj.init_params(cfg, jax.random.PRNGKey(0), dtype=dtype))
  lora = jax.eval_shape(lambda p: lora_lib.init_lora(p, jax.random.PRNGKey(1)), params)
  return cfg, params, lora


def _analysis(compiled):
  m = compiled.memory_analysis()
  return {
    "args_gb": m.argument_size_in_bytes / GB,
    "temp_gb": m.temp_size_in_bytes / GB,
    "out_gb": m.output_size_in_bytes / GB,
    "alias_gb": m.alias_size_in_bytes / GB,
  }


def _budget(schedule, model, length):
  """The abstract BudgetTable of a schedule at `length` (its cap from the real table) and the
  table."""
  spec = schedule.format(model=model)
  table = sampler.budget_table(
    KVSchedule.parse(spec, SPARSE.page_size, "config.schedule"), length, SPARSE
  )
  return BudgetTable(SDS((length + 1,), jnp.int32), sampler.max_selected_pages(table)), table


def _devices(target: str) -> list:
  """This process's devices, or the chips of a compile-only TPU topology."""
  if target == "cpu":
    return jax.devices()
  from jax.experimental import topologies

  return list(topologies.get_topology_desc(target, "tpu").devices)


def make_mesh(spec: str, target: str = "cpu", rollout_devices: int = 0):
  """The trainer's (data, fsdp, tensor) mesh: the devices after the first `rollout_devices` (which
  only roll out, `sharding.split_devices`'s split of one process), this process's or the chips of
  a compile-only TPU topology."""
  data, fsdp, tensor = (int(n) for n in spec.split(","))
  n = data * fsdp * tensor
  devices = _devices(target)
  need = (
    f"config.mesh = {spec!r} with config.rollout_devices = {rollout_devices} needs "
    f"{n + rollout_devices} devices"
  )
  if target != "cpu":
    if len(devices) < n + rollout_devices:
      raise ValueError(f"{need}, config.target = {target!r} has {len(devices)} chips")
    return sharding.make_mesh(data, fsdp, tensor, devices=devices[rollout_devices:][:n])
  if n + rollout_devices != len(devices):
    raise ValueError(
      f"{need}, this process has {len(devices)}: set XLA_FLAGS=--xla_force_host_platform_device_"
      f"count={n + rollout_devices} (fake CPU devices)"
    )
  return sharding.make_mesh(data, fsdp, tensor, devices=sharding.split_devices(rollout_devices)[0])


def _on(tree, shardings):
  """ShapeDtypeStructs placed on `shardings` (what the jitted function is lowered for)."""
  return jax.tree_util.tree_map(lambda x, s: SDS(x.shape, x.dtype, sharding=s), tree, shardings)


def train_step(model, length, c, dtype, mesh, layers=None, length_buckets=()):
  cfg, params, lora = _model(model, dtype, layers)
  sc = step_schema.StepConfig(
    rl=step_schema.RLConfig(
      micro_batches=c.micro_batches,
      num_minibatches=c.train_minibatches,
      length_buckets=length_buckets,
    ),
    distill=step_schema.DistillConfig(enabled=c.distill),
    stats=step_schema.StatsConfig(bin_size=2048, num_bins=20),
    rollout=step_schema.RolloutConfig(group_size=c.train_rows, page_size=SPARSE.page_size),
  )
  opt, lora_opt = optax.adamw(1e-6), optax.adam(1e-5) if c.distill else None
  lora = lora if c.distill else None
  state = jax.eval_shape(
    lambda p, lo: step_schema.init_state(
      p, opt, lo, lora_opt, keep_behaviour=c.off_policy_steps > 0
    ),
    params,
    lora,
  )
  state_shardings = step_schema.state_sharding(state, mesh, opt, lora_opt)
  batch = step_schema.Batch.abstract(c.train_rows, length)
  step = ts.make_train_step(cfg, sc, opt, lora_opt, SPARSE, state_shardings)
  budget = _budget(c.schedule, model, length)[0]
  start = time.time()
  with jax.set_mesh(mesh):
    compiled = step.lower(state, batch, budget).compile()
  return dict(
    _analysis(compiled),
    compile_s=time.time() - start,
    state_gb=memory.device_bytes(state, state_shardings) / GB,
  )


def sampler_memory(model, length, c, dtype, mesh):
  """The rollout as the trainer runs it by default (`engine.full_batch`: every row of a device in a
  slot, a pool that holds them at full length): the group prefill into the pool (`programs.prefill`)
  and the decode chunk, compiled on the mesh with the weights gathered over fsdp."""
  cfg, params, lora = _model(model, dtype, c.layers or None)
  rules = sharding.ROLLOUT_RULES  # the trainer's rollout weights: gathered over fsdp
  params = _on(params, sharding.param_shardings(params, mesh, rules))
  lora = _on(lora, sharding.lora_shardings(lora, mesh, rules))
  Z, T, G = SPARSE.page_size, c.prompt_len, c.sampler_group
  budget, table = _budget(c.schedule, model, -(-length // Z) * Z)  # eager: off the mesh
  with jax.set_mesh(mesh):
    R = page_pool.row_shards()
    config = engine.full_batch(c.sampler_rows // R, G, length, SPARSE)
    pool = jax.eval_shape(
      lambda: page_pool.init_pool(cfg, config.num_pages, Z, dtype, SPARSE.page_score)
    )
    rows = lambda shape, dt=jnp.int32: SDS(shape, dt, sharding=sharding.rows(mesh))
    groups = R * max(1, config.num_slots // G)  # what one insert prefills, across devices
    insert = programs.prefill.lower(
      params,
      lora,
      pool,
      rows((groups, T)),
      rows((groups,)),
      rows((groups, T // Z)),
      rows((groups, G)),
      SDS((2,), jnp.uint32),
      cfg=cfg,
      sampling=SAMPLING,
    ).compile()
    S, PR = R * config.num_slots, -(-length // Z)
    slots = dict(
      token=rows((S,)),
      length=rows((S,)),
      n_gen=rows((S,)),
      max_new=rows((S,)),
      row=rows((S,)),
      active=rows((S,), bool),
      page_table=rows((S, PR)),
    )
    decode = programs.decode_chunk.lower(
      params,
      lora,
      pool,
      budget,
      SDS((2,), jnp.uint32),
      slots,
      cfg=cfg,
      steps=c.engine_chunk,
      sparse=SPARSE,
      sampling=SAMPLING,
    ).compile()
  out = _analysis(decode)
  insert = _analysis(insert)
  per_device = lambda x: np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
  on_mesh = lambda axes, x: SDS(
    x.shape, x.dtype, sharding=NamedSharding(mesh, sharding.spec(axes, x.shape, mesh))
  )
  kv = sum(
    per_device(on_mesh(page_pool.POOL_AXES, x)) for x in pool.k_stored + pool.v_stored
  ) + sum(per_device(on_mesh(page_pool.SUMMARY_AXES, x)) for x in pool.summaries)
  param_bytes = sum(per_device(x) for x in jax.tree_util.tree_leaves(params))
  out.update(
    insert_args_gb=insert["args_gb"],
    insert_temp_gb=insert["temp_gb"],
    kv_gb=kv / GB,
    params_gb=param_bytes / GB,
    ratio=(
      max(out["args_gb"] + out["temp_gb"], insert["args_gb"] + insert["temp_gb"])
      * GB
      / (kv + param_bytes)
    ),
  )
  return out


def engine_memory(model, length, c, dtype, device=None):
  """The engine's decode chunk compiled over a pool of engine_pool_gb GB on one device: the
  default backend's, or `device` (a compile-only TPU chip too)."""
  cfg, params, _ = _model(model, dtype, c.layers or None)
  pages = engine.pages_for_bytes(
    cfg, c.engine_pool_gb * GB, SPARSE.page_size, dtype, SPARSE.page_score
  )
  pool = jax.eval_shape(
    lambda: page_pool.init_pool(cfg, pages, SPARSE.page_size, dtype, SPARSE.page_score)
  )
  S, PR = c.engine_slots, -(-length // SPARSE.page_size)
  ints = lambda *shape: SDS(shape, jnp.int32)
  slots = dict(
    token=ints(S),
    length=ints(S),
    n_gen=ints(S),
    max_new=ints(S),
    row=ints(S),
    active=SDS((S,), bool),
    page_table=ints(S, PR),
  )
  budget, table = _budget(c.schedule, model, PR * SPARSE.page_size)
  args = (params, None, pool, budget, SDS((2,), jnp.uint32), slots)
  one = None if device is None else sharding.make_mesh(1, 1, 1, devices=[device])
  if one is not None:
    args = _on(args, jax.tree_util.tree_map(lambda _: sharding.replicated(one), args))
  with contextlib.nullcontext() if one is None else jax.set_mesh(one):
    compiled = programs.decode_chunk.lower(
      *args, cfg=cfg, steps=c.engine_chunk, sparse=SPARSE, sampling=SAMPLING
    ).compile()
  out = _analysis(compiled)
  gen = length - c.prompt_len
  static_rows = pages * SPARSE.page_size // length
  _, rows = cost_model.roofline_engine_rate(
    model,
    None,
    c.prompt_len,
    gen,
    slots=S,
    pool_tokens=pages * SPARSE.page_size,
    mean_len_frac=c.engine_mean_len_frac,
  )
  out.update(
    pool_pages=pages,
    pool_gb=pages * page_pool.page_bytes(cfg, SPARSE.page_size, dtype, SPARSE.page_score) / GB,
    static_rows=static_rows,
    rows_in_flight=rows,
    total_gb=out["args_gb"] + out["temp_gb"],
  )
  return out


# The TPU compiler's refusals for memory, e.g. "the total memory required for HLO temporaries
# (101.30G) exceeds available HBM (95.74G)" or "Used 101.30G of 95.74G hbm": sizes as tsl's
# human-readable bytes, whose K/M/G/T are powers of 1024.
_REFUSALS = (
  re.compile(
    r"required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds available HBM \(([\d.]+)([KMGT])\)"
  ),
  re.compile(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm"),
)


def _human_bytes(number: str, unit: str) -> float:
  return float(number) * 1024 ** ("KMGT".index(unit) + 1)


def refusal(text: str):
  """A compiler error's text as a side that does not fit: the bytes it needs and the device's (GB
  = 1e9; None where the text names none), the text kept; None if it is not about memory."""
  if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
    return None
  for pattern in _REFUSALS:
    m = pattern.search(text)
    if m:
      needs, hbm = _human_bytes(m[1], m[2]) / GB, _human_bytes(m[3], m[4]) / GB
      return dict(fits=False, needs_gb=needs, hbm_gb=hbm, error=text[:2000])
  return dict(fits=False, needs_gb=None, hbm_gb=None, error=text[:2000])


def _side(compile_side):
  """`compile_side()`'s figures marked as fitting, or the compiler's refusal for memory."""
  try:
    return dict(compile_side(), fits=True)
  except jax.errors.JaxRuntimeError as e:
    out = refusal(str(e))
    if out is None:
      raise
    return out


def layouts(c) -> list:
  """The layouts to compile: `layouts`' "n:data,fsdp,tensor:micro_batches:off_policy_steps" each
  ("/" between them), or the one of rollout_devices, mesh, micro_batches and off_policy_steps."""
  if not c.layouts:
    return [
      dict(
        rollout_devices=c.rollout_devices,
        mesh=c.mesh,
        micro_batches=c.micro_batches,
        off_policy_steps=c.off_policy_steps,
      )
    ]
  out = []
  for spec in c.layouts.split("/"):
    n, mesh, micro, off = spec.split(":")
    out.append(
      dict(rollout_devices=int(n), mesh=mesh, micro_batches=int(micro), off_policy_steps=int(off))
    )
  return out


def layout_name(layout) -> str:
  n = layout["rollout_devices"]
  return f"split{n}" if n else "colocated"


def _with(c, **fields):
  """A copy of config `c` with `fields` set (one layout's train settings)."""
  out = c.copy_and_resolve_references()
  out.update(fields)
  return out


def engine_pools(c) -> list:
  """The engine's pools to compile, GB: engine_pool_gb, then engine_fallback_pools in turn."""
  return [c.engine_pool_gb] + [float(g) for g in c.engine_fallback_pools.split(",") if g]


def layout_summary(fig) -> dict:
  """Per layout, a trainer device's and a rollout device's GB at each engine pool and whether each
  fits a device: a refused side needs what the compiler said; a colocated rollout device adds the
  train state to the engine, checked against the device's memory where a refusal named it."""
  engines = fig.get("engine", {})
  hbm = next((s["hbm_gb"] for s in _sides(fig) if s.get("hbm_gb")), None)
  out = {}
  for name, lay in fig.items():
    if name == "engine":
      continue
    train = lay["train"]
    state = train.get("state_gb", 0.0) if not lay["rollout_devices"] else 0.0
    rollout = {}
    for pool, eng in engines.items():
      if not eng["fits"]:
        needs = eng["needs_gb"] and eng["needs_gb"] + state
        rollout[pool] = dict(gb=None, needs_gb=needs, fits=False)
      elif lay["rollout_devices"] or train["fits"]:
        gb = eng["total_gb"] + state
        rollout[pool] = dict(gb=gb, fits=None if hbm is None else bool(gb <= hbm))
    trainer = (
      dict(gb=train["args_gb"] + train["temp_gb"], fits=True)
      if train["fits"]
      else dict(gb=None, needs_gb=train["needs_gb"], fits=False)
    )
    out[name] = dict(trainer_device=trainer, rollout_device=rollout)
  return dict(hbm_gb=hbm, layouts=out)


def _sides(fig) -> list:
  return [lay["train"] for name, lay in fig.items() if name != "engine"] + list(
    fig.get("engine", {}).values()
  )


def layout_memory(model, length, c, dtype, save):
  """One device of each side of each layout, each side kept in the figures (and `save()`d) as
  soon as it is compiled: the trainer's (the train step on the layout's mesh) and the rollout's
  (the engine on the first device, weights whole; one compile serves every layout). Colocated
  (rollout_devices 0) the same device is both, and while it rolls out it keeps the train state
  (params, Adam states and the rest, sharded over the mesh) beside the engine's weights, pool and
  temporaries. The engine at engine_pool_gb, and if that does not fit a device the fallback pools
  in turn until one does."""
  fig = {}
  for lay in layouts(c):
    mesh = make_mesh(lay["mesh"], c.target, lay["rollout_devices"])
    lc = _with(c, micro_batches=lay["micro_batches"], off_policy_steps=lay["off_policy_steps"])
    train = _side(lambda: train_step(model, length, lc, dtype, mesh))
    fig[layout_name(lay)] = dict(
      lay,
      trainer_devices=int(mesh.size),
      train_rows=c.train_rows,
      train_minibatches=c.train_minibatches,
      train=train,
    )
    _print_side(f"{layout_name(lay)} train", train)
    save(fig)
  fig["engine"] = {}
  for pool in engine_pools(c):
    eng = _side(
      lambda: engine_memory(
        model, length, _with(c, engine_pool_gb=pool), dtype, _devices(c.target)[0]
      )
    )
    fig["engine"][f"{pool:g}"] = dict(eng, pool_asked_gb=pool)
    _print_side(f"engine, pool {pool:g} GB", eng)
    save(fig)
    if eng["fits"]:
      break
  return fig


def _print_side(name, side):
  if side["fits"]:
    gb = side["args_gb"] + side["temp_gb"]
    print(
      f"  {name}: {side['args_gb']:.2f} args + {side['temp_gb']:.2f} temps = {gb:.2f} GB "
      f"per device",
      flush=True,
    )
  else:
    print(
      f"  {name}: does not fit, the compiler needs {side['needs_gb'] or 0:.2f} GB of "
      f"{side['hbm_gb'] or 0:.2f} GB ({side['error'][:200]})",
      flush=True,
    )


def calibrate_memory(model, length, c, dtype):
  cfg, params, _ = _model(model, dtype, c.layers or None)
  B, S = c.calibrate_rows, length
  tokens, valid = SDS((B, S), jnp.int32), SDS((B, S), bool)
  x_p = SDS((B, S, cfg.hidden_size), dtype)
  compiled = calibrate._sparse_alpha.lower(
    params,
    tokens,
    valid,
    SDS((B,), jnp.int32),
    x_p,
    SDS((1, S + 1), jnp.int32),
    SDS((), jnp.float32),
    cfg=cfg,
    sparse=SPARSE,
    alpha="exact",
  ).compile()
  return _analysis(compiled)


def calibrate_run(c):
  """A real p5 pass over one long row: random weights, random tokens (memory and time only)."""
  cfg = sj.Qwen3Config.preset(c.run_model)
  # initialised before the RSS is read (dispatch is asynchronous)
  params = jax.block_until_ready(sj.init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.float32))
  S, T = c.run_len, c.prompt_len
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (1, S)).astype(np.int32)
  gen_mask = np.arange(S)[None] >= T
  rss_before = records.peak_rss_gib()
  start = time.time()
  p5 = calibrate.tail_surface(
    params,
    cfg,
    tokens,
    gen_mask,
    np.array([T]),
    (61,),
    SPARSE,
    num_bins=S // 2048,
    calibration=calibrate.CalibrationConfig(batch_size=1),
  )[5]
  return {
    "model": c.run_model,
    "tokens": S,
    "seconds": time.time() - start,
    "peak_rss_gib": records.peak_rss_gib(),
    "rss_before_gib": rss_before,
    "p5_bin0": float(p5[0, 0]),
  }


def _table(report, part, measure, models, lengths, columns):
  """Measures every (model, length), prints a row each, and keeps the figures in `report`."""
  print(
    f"{'model / tokens per row':34s} " + " ".join(f"{name:>9s}" for name, _ in columns), flush=True
  )
  for model in models:
    for n in lengths:
      fig = measure(model, n)
      report[f"{part}/{model}/{n}"] = fig
      print(
        f"{model + ' ' + str(n):34s} " + " ".join(f"{fig[k]:9.2f}" for _, k in columns), flush=True
      )
    if part == "train" and len(lengths) > 1:
      t = {n: report[f"train/{model}/{n}"]["temp_gb"] for n in lengths}
      print(
        f"  temps({lengths[-1]}) / temps({lengths[0]}) = {t[lengths[-1]] / t[lengths[0]]:.2f}"
        f" for {lengths[-1] / lengths[0]:.2f}x the tokens",
        flush=True,
      )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  c = flags.FLAGS.config
  dtype = jnp.dtype(c.dtype)
  models = [m for m in c.models.split(",") if m]
  lengths = [int(n) for n in c.lengths.split(",") if n]
  parts = set(c.parts.split(","))
  unknown = parts - {
    "train",
    "sampler",
    "calibrate",
    "engine",
    "layout",
    "compile_time",
    "calibrate_run",
  }
  if unknown:
    raise ValueError(f"config.parts: unknown part(s) {sorted(unknown)}")
  on_target = {"train", "sampler", "layout"}
  if c.target != "cpu" and parts - on_target:
    raise ValueError(
      f"config.target = {c.target!r} compiles the parts train and sampler (on the mesh) "
      f"and layout; {sorted(parts - on_target)} run on this machine's backend"
    )
  if (c.rollout_devices or c.layouts) and parts != {"layout"}:
    raise ValueError(
      f"config.rollout_devices = {c.rollout_devices} / config.layouts = {c.layouts!r} split the "
      f"devices for the part layout only; got parts {sorted(parts)}"
    )
  # with config.layouts each layout has its mesh (the part layout alone runs)
  mesh = None if c.layouts else make_mesh(c.mesh, c.target, c.rollout_devices)
  if "layout" in parts:
    for lay in layouts(c):  # a wrong mesh fails now, not after the first compile
      make_mesh(lay["mesh"], c.target, lay["rollout_devices"])
  report = {"config": c.to_dict()}
  backend = jax.default_backend() if c.target == "cpu" else f"compile-only TPU {c.target}"
  print(
    f"backend {backend}, params/KV {c.dtype}, GB = 1e9 bytes, per device of "
    + ("each layout's mesh" if c.layouts else f"the mesh (data, fsdp, tensor) = ({c.mesh})"),
    flush=True,
  )
  if "train" in parts:
    print(f"\ntrain step + DistillSparse, {c.train_rows} rows ({c.micro_batches} micro-batches)")

    buckets = tuple(int(n) for n in c.length_buckets.split(",") if n)

    def measure_train(model, n):
      fig = dict(train_step(model, n, c, dtype, mesh))
      if buckets:  # the step with each pass at the smallest bucket holding its rows
        fig["bucketed_temp_gb"] = train_step(model, n, c, dtype, mesh, length_buckets=buckets)[
          "temp_gb"
        ]
      return dict(fig, total_gb=fig["args_gb"] + fig["temp_gb"])

    _table(
      report,
      "train",
      measure_train,
      models,
      lengths,
      (
        ("args", "args_gb"),
        ("temps", "temp_gb"),
        ("args+tmp", "total_gb"),
        ("compile s", "compile_s"),
      )
      + ((("bucketed temps", "bucketed_temp_gb"),) if buckets else ()),
    )
  if "sampler" in parts:
    print(
      f"\nrollout (the engine's full batch), {c.sampler_rows} rows in groups of "
      f"{c.sampler_group}, prompt {c.prompt_len}: the decode chunk's args and temps, the group "
      "prefill's temps, the pool (KV) and weights; ratio = the larger program's (args + temps)"
      " / (KV + params)"
    )
    _table(
      report,
      "sampler",
      lambda m, n: sampler_memory(m, n, c, dtype, mesh),
      models,
      lengths,
      (
        ("args", "args_gb"),
        ("temps", "temp_gb"),
        ("prefill", "insert_temp_gb"),
        ("KV", "kv_gb"),
        ("params", "params_gb"),
        ("ratio", "ratio"),
      ),
    )
  if "calibrate" in parts:
    print(f"\ncalibration pass, {c.calibrate_rows} row(s), one candidate")
    _table(
      report,
      "calibrate",
      lambda m, n: calibrate_memory(m, n, c, dtype),
      models,
      lengths,
      (("args", "args_gb"), ("temps", "temp_gb")),
    )
  if "engine" in parts:
    print(
      f"\nengine decode chunk ({c.engine_chunk} steps), {c.engine_slots} slots, pool "
      f"{c.engine_pool_gb:g} GB; rows: the static batch's at full length in that pool, the "
      f"engine's in flight at mean length {c.engine_mean_len_frac:g} x the cutoff"
    )
    _table(
      report,
      "engine",
      lambda m, n: engine_memory(m, n, c, dtype),
      models,
      lengths,
      (
        ("args", "args_gb"),
        ("temps", "temp_gb"),
        ("args+tmp", "total_gb"),
        ("pool GB", "pool_gb"),
        ("static", "static_rows"),
        ("engine", "rows_in_flight"),
      ),
    )
  if "layout" in parts:
    print(
      f"\nlayout: train {c.train_rows} rows, {c.train_minibatches} minibatch(es), distill "
      f"{c.distill}; rollout: the engine, {c.engine_slots} slots, pool {c.engine_pool_gb:g} GB "
      f"(else {c.engine_fallback_pools or 'none'}), weights whole; GB per device",
      flush=True,
    )
    for model in models:
      for n in lengths:
        key = f"layout/{model}/{n}"
        print(f"{model} {n}", flush=True)

        def save(fig, key=key):
          # each side as soon as it is compiled: a later side refused or killed keeps the rest
          report[key] = dict(fig, summary=layout_summary(fig))
          if c.out:
            records.write_record(c.out, report)

        save(layout_memory(model, n, c, dtype, save))
  if "compile_time" in parts:
    m, n = c.compile_time_model, c.compile_time_len
    few = train_step(m, n, c, dtype, mesh, layers=c.compile_time_layers)["compile_s"]
    full = train_step(m, n, c, dtype, mesh)["compile_s"]
    report["compile_time"] = {
      "model": m,
      "tokens": n,
      "layers": c.compile_time_layers,
      "few_s": few,
      "full_s": full,
      "ratio": full / few,
    }
    print(
      f"\ncompile time of the train step, {m} at {n} tokens: {c.compile_time_layers} layers "
      f"{few:.1f}s, all {sj.Qwen3Config.preset(m).num_hidden_layers} {full:.1f}s "
      f"(ratio {full / few:.2f})",
      flush=True,
    )
  if "calibrate_run" in parts:
    fig = calibrate_run(c)
    report["calibrate_run"] = fig
    print(
      f"\ncalibration run, {fig['model']}-shaped (random float32 weights), one "
      f"{fig['tokens']}-token row, one candidate: {fig['seconds']:.0f}s, peak RSS "
      f"{fig['peak_rss_gib']:.2f} GiB (before the pass, weights made: "
      f"{fig['rss_before_gib']:.2f} GiB)",
      flush=True,
    )
  if c.out:
    records.write_record(c.out, report)


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/memory_report.py", "experiment config")
  app.run(main)
