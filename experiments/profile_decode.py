"""Where a decode step's time goes, dense and sparse, from the XLA profiler's per-op timings, each
part beside the bytes it must read.

  python experiments/profile_decode.py --config=configs/profile_decode.py \\
      [--config.context=8192 --config.batch=16 --config.out=docs/results/decode_profile.json]

The step is experiments/bench_decode.py's (`decode_loop`: `steps` decode steps of the model over
per-layer caches filled with `context` random tokens a row; the cost of a step does not depend on
what the keys hold), on the real LM of configs/import_gguf.py by default, dense and with the sparse
policy of `schedule`. Each is compiled, called once to warm up, then called `runs` times inside
`jax.profiler.trace`. XLA:CPU records every op it runs (a thunk: a fusion, a dot, a gather, a
copy) with its HLO name; each name is looked up in the compiled HLO, whose metadata holds the
named scopes the model's decode step puts around each layer's cache append and attention
(`layerN/cache_append`, `layerN/attention`) and page selection around its scoring and top-k
(`page_selection`, `page_selection/page_scores`). An op is filed under:

  weight matmuls      a dot (or a fusion of one) outside every attention and append scope:
                      the projections, the MLP and the LM head, which read the weights
  norms, sampling     every other op outside those scopes: RMSNorm, RoPE, residuals, argmax
  cache append        writing the new token's key and value and its page's summary
  dense attention     attention of the dense layers (all layers when dense)
  page scoring        a sparse layer's page scores from the page summaries
  top-k selection     the rest of page selection: top-k, the kept ids' sort
  page gather         a sparse layer's gather of its selected pages' keys and values
  sparse attention    the rest of a sparse layer's attention: scores, softmax, weighted sum

Control flow (the loops, the switches) is not counted: its ops are. "unaccounted" is the step's
wall time (median call / steps) less the ops' sum: the host's dispatch and the runtime between ops.
Each part's bytes are what it must read at the timed steps' middle length (float32 unless
`dtype`), and its rate those bytes over its time, beside the machine's measured bandwidth.

With `out` set, the printed tables and the config are written there as one results record
(sparrow_jax/records.py), from which docs/make_results_pages.py makes
docs/results/decode_profile.md.
"""

import collections
import gzip
import json
import os
import re
import statistics
import tempfile
import time

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags

from experiments import bench_decode
from experiments.timing import interleaved_seconds
import sparrow_jax as sj
from sparrow_jax import records
from sparrow_jax.mismatch import cost_model
from sparrow_jax.model import qwen3
from sparrow_jax.rollout import sampler
from sparrow_jax.sparsity.schedule import BudgetTable, KVSchedule

_CONFIG = config_flags.DEFINE_config_file("config", None, "configs/profile_decode.py")
flags.mark_flags_as_required(["config"])

PARTS = (
  "weight matmuls",
  "norms, sampling",
  "cache append",
  "dense attention",
  "page selection",
  "page gather",
  "sparse attention",
  "loops and switches",
)
CONTROL_FLOW = ("while", "conditional", "call", "parameter", "tuple", "get-tuple-element")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? ([a-z][a-z\-]*)\(")  # name, opcode


def hlo_ops(hlo_text: str) -> dict:
  """{instruction name: (opcode, op_name metadata)} of a compiled module's HLO text (every
  computation's, fusion bodies too)."""
  ops = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if m:
      op_name = re.search(r'op_name="([^"]*)"', line)
      ops[m.group(1)] = (m.group(2), op_name.group(1) if op_name else "")
  return ops


def part_of(name: str, opcode: str, op_name: str, dense_layers: int) -> str:
  """The PARTS entry an op is filed under (module doc)."""
  if opcode in CONTROL_FLOW:
    return "loops and switches"
  layer = re.search(r"layer(\d+)/(attention|cache_append)", op_name)
  is_dot = opcode in ("dot", "convolution") or "dot" in name or name.startswith("ynn")
  if layer is None:
    return "weight matmuls" if is_dot else "norms, sampling"
  if layer.group(2) == "cache_append":
    return "cache append"
  if int(layer.group(1)) < dense_layers:
    return "dense attention"
  if "page_selection" in op_name:
    return "page selection"
  return "page gather" if opcode == "gather" or "gather" in name else "sparse attention"


def thunk_times(trace_dir: str, module: str) -> tuple:
  """({HLO op name: self seconds}, seconds some op of `module` ran) from the trace under trace_dir.
  A loop's or a switch's thunk encloses its body's thunks on its thread: its self time (its
  duration less its children's) is the runtime's own work. The busy seconds are the union of the
  thunks' intervals over every thread (the runtime runs independent ops on two threads at once,
  so self seconds add up to CPU time, not wall time)."""
  paths = [
    os.path.join(root, f)
    for root, _, files in os.walk(trace_dir)
    for f in files
    if f.endswith(".trace.json.gz")
  ]
  with gzip.open(max(paths, key=os.path.getmtime)) as f:
    events = [
      e
      for e in json.load(f)["traceEvents"]
      if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == module
    ]
  events.sort(key=lambda e: (e["tid"], e["ts"], -e["dur"]))
  self_us, stacks = collections.Counter(), collections.defaultdict(list)
  for e in events:
    stack = stacks[e["tid"]]
    while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
      stack.pop()
    self_us[e["args"]["hlo_op"]] += e["dur"]
    if stack:
      self_us[stack[-1]["args"]["hlo_op"]] -= e["dur"]
    stack.append(e)
  busy_us, end = 0.0, -float("inf")
  for e in sorted(events, key=lambda e: e["ts"]):
    start, stop = max(e["ts"], end), e["ts"] + e["dur"]
    busy_us += max(stop - start, 0.0)
    end = max(end, stop)
  return {name: us * 1e-6 for name, us in self_us.items()}, busy_us * 1e-6


def must_read(cfg, config, tokens, budget_tokens, dense_layers, n_params, dtype_bytes) -> dict:
  """Bytes per step each part must read at `tokens` cached tokens a row."""
  K, E, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
  B, sparse_layers = config.batch, L - dense_layers
  kv_token = 2 * K * E * dtype_bytes  # one layer's key and value
  pages = -(-tokens // 16)
  return {
    "weight matmuls": n_params * dtype_bytes,
    "dense attention": dense_layers * B * tokens * kv_token,
    "page selection": sparse_layers * B * pages * K * E * dtype_bytes,  # mean-key summaries
    "page gather": sparse_layers * B * budget_tokens * kv_token,
    "sparse attention": sparse_layers * B * budget_tokens * kv_token,  # the gathered copy
  }


def profile(config) -> dict:
  """Prints a table per mode and returns the record's figures."""
  dtype = jnp.dtype(config.dtype)
  cfg, params = sj.load_hf(os.path.expandvars(config.model_dir), dtype=dtype)
  n_params = cost_model.param_count(cfg)
  params, _ = jax.jit(qwen3.unstack_layers)(params)
  schedule = KVSchedule.parse(config.schedule, 16, field="config.schedule")
  sparse = sj.SparseConfig(page_size=16, dense_layers=config.dense_layers)
  hw = cost_model.measure_this_machine()
  caches = bench_decode.filled_cache(
    cfg, config.batch, config.context, config.steps, 16, dtype, jax.random.PRNGKey(1)
  )
  budget_np = sampler.budget_table(schedule, caches[0].max_len, sparse)
  max_selected = sampler.max_selected_pages(budget_np)
  budget = BudgetTable(jnp.asarray(budget_np))
  tokens = config.context + config.steps // 2
  budget_tokens = int(budget_np[tokens]) * 16
  token_B = jnp.zeros((config.batch,), jnp.int32)
  print(
    f"one decode step of {config.model_dir} ({cfg.num_hidden_layers} layers, {n_params / 1e6:.0f}M"
    f" params, {config.dtype}), batch {config.batch}, {config.context} cached tokens a row; sparse"
    f" = {config.schedule} ({budget_tokens} tokens a row, {config.dense_layers} dense layers); "
    f"{jax.default_backend()} x{os.cpu_count()} cores, {hw.mem_bandwidth / 1e9:.1f} GB/s measured"
  )
  state = {"caches": caches}
  del caches
  programs = {}
  for mode, sp in (("dense", None), ("sparse", sparse)):
    kwargs = dict(
      cfg=cfg, sparse=sp, max_selected=max_selected, steps=config.steps, context=config.context
    )
    compiled = bench_decode.decode_loop.lower(
      params, token_B, state["caches"], budget, **kwargs
    ).compile()

    def call(compiled=compiled):
      token, state["caches"] = compiled(params, token_B, state["caches"], budget)
      jax.block_until_ready(token)

    programs[mode] = (compiled, call, sp)
  walls = interleaved_seconds([call for _, call, _ in programs.values()], config.runs)
  modes = {}
  for (mode, (compiled, call, sp)), mode_walls in zip(programs.items(), walls):
    with tempfile.TemporaryDirectory() as trace_dir:
      jax.profiler.start_trace(trace_dir)  # one call: more overflows the profiler's buffers
      start = time.perf_counter()
      call()
      traced_s = time.perf_counter() - start
      jax.profiler.stop_trace()
      module = compiled.runtime_executable().hlo_modules()[0].name
      seconds, busy_s = thunk_times(trace_dir, module)
    ops = hlo_ops(compiled.as_text())
    dense_layers = cfg.num_hidden_layers if sp is None else sp.dense_layers
    parts = collections.Counter()
    for name, op_s in seconds.items():
      opcode, op_name = ops.get(name, ("?", ""))
      parts[part_of(name, opcode, op_name, dense_layers)] += op_s / config.steps
    step_s = statistics.median(mode_walls) / config.steps
    nbytes = must_read(cfg, config, tokens, budget_tokens, dense_layers, n_params, dtype.itemsize)
    rows = [
      dict(
        part=p,
        ms=parts[p] * 1e3,
        share=parts[p] / sum(parts.values()),
        mb=nbytes.get(p, 0) / 1e6,
        gbs=nbytes[p] / parts[p] / 1e9 if nbytes.get(p) and parts[p] > 0 else None,
      )
      for p in PARTS
      if parts[p] or nbytes.get(p)
    ]
    modes[mode] = dict(
      step_ms=step_s * 1e3,
      tok_s=config.batch / step_s,
      traced_step_ms=traced_s / config.steps * 1e3,
      cpu_ms=sum(r["ms"] for r in rows),
      idle_ms=(traced_s - busy_s) / config.steps * 1e3,  # no op of the step running
      rows=rows,
    )
    m = modes[mode]
    print(
      f"  {mode}: {m['step_ms']:.1f} ms a step ({m['tok_s']:.1f} tok/s); the traced call "
      f"{m['traced_step_ms']:.1f} ms a step, its ops {m['cpu_ms']:.1f} ms of CPU time (two "
      f"threads), no op running {m['idle_ms']:.1f} ms"
    )
    for r in rows:
      rate = f"{r['gbs']:6.1f} GB/s" if r["gbs"] else ""
      print(f"    {r['part']:18s} {r['ms']:8.2f} ms {r['share']:6.1%} {r['mb']:9.1f} MB {rate}")
  ratio = modes["sparse"]["tok_s"] / modes["dense"]["tok_s"]
  print(f"  sparse / dense: {ratio:.2f}x")
  return dict(
    model=os.path.basename(os.path.normpath(config.model_dir)),
    layers=cfg.num_hidden_layers,
    params=n_params,
    budget_tokens=budget_tokens,
    tokens=tokens,
    mem_bandwidth=hw.mem_bandwidth,
    cores=os.cpu_count(),
    modes=modes,
    ratio=ratio,
  )


def main(argv):
  del argv
  config = _CONFIG.value
  figures = profile(config)
  if config.out:
    records.write_record(config.out, dict(config=config.to_dict(), **figures))
    print(f"wrote {config.out}")


if __name__ == "__main__":
  app.run(main)
