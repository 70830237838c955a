"""Writes the results pages of docs/results/ from the committed results records (JSON written by the
experiments, sparrow_jax/records.py), so no figure on a page is copied by hand.

  python docs/make_results_pages.py            # rewrite the pages
  python docs/make_results_pages.py --check    # exit 1 if a committed page differs (tests run it)
"""

import glob
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "docs", "results")


def _provenance(record) -> str:
  return (
    f"`{record['command']}`  \n"
    f"commit `{record['commit'][:12]}`, {record['machine']}, {record['date']}"
  )


def engine_page(records) -> str:
  """docs/results/rollout_engine.md from experiments/bench_engine.py's engine_long_tail_*.json
  records."""
  lines = [
    "# Rollout engine vs static batch (measured)",
    "",
    "Long-tail rollouts (`experiments/bench_engine.py`): per-row lengths drawn from "
    "a geometric law with mean half the cutoff, forced with per-row `max_new_tokens`, run on "
    "the same rows and the same pool memory by the static batch (`EngineConfig(static=True)`:"
    " every row's pages at full length, admission only into an empty batch; finished rows "
    "stop costing) and by the engine (slots refilled between chunks, pages taken as rows "
    "grow). Once few rows are left, both decode only their first `drain_slots` slots "
    "(`EngineConfig.drain_slots`, the rows moved there). tok/s counts the tokens the rollout "
    "keeps over wall time; occupancy = decoded tokens kept / (slots decoded x decode "
    "steps). The commands that make these records: "
    "[rollout_engine.md](../rollout_engine.md#engine-vs-static-batch-measured).",
    "",
  ]
  for record in records:
    r = record["results"]
    c = r["config"]
    lines += [
      f"## {r['model']} shape, cutoff {c['cutoff']}, {c['prompts']} x {c['group_size']} rows",
      "",
      _provenance(record),
      "",
      f"Pool: {r['pool_pages']} pages of 16 tokens for every setting; "
      f"{r['total_tokens']} tokens in all; drain_slots = {c['drain_share']} x slots.",
      "",
      "| attention | setting | slots | tok/s | rows in flight | occupancy | preempted | "
      "peak pages |",
      "|---|---|---|---|---|---|---|---|",
    ]
    for name, run in r["runs"].items():
      attention, setting = name.split("/")
      lines.append(
        f"| {attention} | {setting} | {run['slots']} | {run['tokens_per_s']:.1f} | "
        f"{run['rows_in_flight']:.2f} | {run['occupancy']:.2f} | "
        f"{run['preemptions']} | {run['peak_pages']} |"
      )
    lines += [""] + [f"- {name}: **{value:.2f}x**" for name, value in r["ratios"].items()] + [""]
  return "\n".join(lines)


def tpu_compile_page(records) -> str:
  """docs/results/tpu_compile_check.md from experiments/tpu_compile_check.py's record."""
  lines = [
    "# TPU kernels: compile-only checks (measured)",
    "",
    "The paged decode kernel compiled by the real XLA:TPU / Mosaic compiler for compile-only "
    "TPU devices on a CPU host (`jax.experimental.topologies`, libtpu installed; nothing "
    "runs). Its page ids and logical ids are scalar-prefetch operands in SMEM (1 MiB): "
    "`default` is the kernel's budget, which runs a batch as calls over row chunks; "
    "`unlimited` is one call for the whole batch; `dispatch` is "
    "`policy.paged_decode_attention(impl=\"auto\")` as the engine calls it.",
    "",
  ]
  for record in records:
    c = record["results"]["config"]
    lines += [
      _provenance(record),
      "",
      f"{c['kv_heads']} KV heads x {c['group']} query heads of {c['head_dim']}, pages of "
      f"{c['page_size']} tokens, {c['context']} tokens a row (dense: every page; sparse: "
      f"{c['sparse_pages']} pages), bf16.",
      "",
      "| topology | chip | rows | case | pages | SMEM budget | calls | result |",
      "|---|---|---|---|---|---|---|---|",
    ]
    for r in record["results"]["calls"]:
      error = r["error"][:120].replace("|", "/")  # a table cell
      result = "compiles" if r["compiled"] else f"fails: `{error}`"
      lines.append(
        f"| {r['topology']} | {r['device_kind']} | {r['batch']} | {r['case']} | "
        f"{r['pages']} | {r['smem_budget']} | {r['calls']} | {result} |"
      )
    lines.append("")
    if "train" in record["results"]:
      lines += [
        f"Dense training attention: the gradient of `flash.causal_attention` over "
        f"{c['train_rows']} row(s) of {c['train_tokens']} tokens, bf16, as one layer of the train "
        "step runs it: impl `auto` (what the model runs: splash on TPU) and `blockwise` (the jnp "
        "path, for comparison).",
        "",
        "| topology | chip | impl | result | splash kernels in the program | temps (GB) |",
        "|---|---|---|---|---|---|",
      ]
      for r in record["results"]["train"]:
        error = r["error"][:120].replace("|", "/")
        result = "compiles" if r["compiled"] else f"fails: `{error}`"
        temps = "-" if r["temp_gb"] is None else f"{r['temp_gb']:.2f}"
        lines.append(
          f"| {r['topology']} | {r['device_kind']} | {r['impl']} | {result} | {r['splash']} | "
          f"{temps} |"
        )
      lines.append("")
  return "\n".join(lines)


def _memory_tables(records) -> list:
  """Each memory_report record's provenance, setting and a row per (part, model, length)."""
  lines = []
  for record in records:
    lines += [_provenance(record), ""]
    if any("/" in key for key in record["results"]):  # a table of compiled parts
      lines += _memory_rows(record)
    run = record["results"].get("calibrate_run")
    if run:
      lines += [
        f"calibrate_run: a real p5 pass on this CPU over one {run['tokens']}-token row of a "
        f"{run['model']}-shaped model (random float32 weights, all layers, one candidate): "
        f"**{run['seconds'] / 60:.1f} min**, peak RSS **{run['peak_rss_gib']:.2f} GiB** "
        f"(peak RSS before the pass, once the random weights were made: "
        f"{run['rss_before_gib']:.2f} GiB).",
        "",
      ]
  return lines


def _memory_rows(record) -> list:
  """A memory_report record's setting and a row per (part, model, length)."""
  c = record["results"]["config"]
  lines = [
    f"Target {c['target']}, mesh (data, fsdp, tensor) = ({c['mesh']}), {c['dtype']}; "
    f"train: {c['train_rows']} rows in {c['micro_batches']} micro-batches; sampler: "
    f"{c['sampler_rows']} rows in groups of {c['sampler_group']}, prompt "
    f"{c['prompt_len']}, decode chunks of {c['engine_chunk']} steps"
    + (f"; bucketed: length buckets {c['length_buckets']}" if c.get("length_buckets") else "")
    + ". GB = 1e9 bytes, per device.",
    "",
    "| part | model | tokens a row | args | temps | args + temps | prefill temps | KV | params "
    "| bucketed temps |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for key, fig in record["results"].items():
    if "/" not in key:  # config, calibrate_run
      continue
    part, model, tokens = key.split("/")
    cell = lambda name: f"{fig[name]:.2f}" if name in fig else "-"
    lines.append(
      f"| {part} | {model} | {tokens} | {cell('args_gb')} | {cell('temp_gb')} | "
      f"**{fig['args_gb'] + fig['temp_gb']:.2f}** | {cell('insert_temp_gb')} | "
      f"{cell('kv_gb')} | {cell('params_gb')} | {cell('bucketed_temp_gb')} |"
    )
  return lines + [""]


_MEMORY_PARTS = (
  "train: the fused GRPO + TIS + DistillSparse step, weights and Adam states sharded over fsdp. "
  "sampler: the engine's full batch, each group's prompt prefilled into the pool (prefill temps) "
  "and the decode chunk (args hold the pool, KV, and the weights gathered over fsdp, params). "
  "bucketed temps: the train step's with `rl.length_buckets` (the record's `length_buckets`), its "
  "passes at the smallest bucket that holds their rows (docs/configuration.md#length-buckets)."
)


def memory_page(records) -> str:
  """docs/results/memory_tpu.md from experiments/memory_report.py's records for a TPU target."""
  intro = [
    "# Memory on TPU, from the TPU compiler (measured)",
    "",
    "`experiments/memory_report.py` with `--config.target` set to a TPU topology lowers and "
    "compiles the train step and the rollout for compile-only TPU devices on a CPU host "
    "(libtpu's XLA:TPU compiler; nothing is allocated) and reads "
    "`compiled.memory_analysis()`: per device, the arguments and the temporaries (all XLA "
    "allocates besides arguments and outputs). " + _MEMORY_PARTS,
    "",
  ]
  return "\n".join(intro + _memory_tables(records))


def memory_cpu_page(records) -> str:
  """docs/results/memory_cpu.md from experiments/memory_report.py's records for this CPU."""
  intro = [
    "# Memory at the paper's scale on the CPU backend (compiled, not run)",
    "",
    "`experiments/memory_report.py` lowers and compiles each jitted function with "
    "`jax.ShapeDtypeStruct` inputs at full width and depth and reads XLA's buffer assignment "
    "(`compiled.memory_analysis()`; nothing is allocated). On the CPU backend XLA keeps float32 "
    "copies of bfloat16 weights (it has no bfloat16 matmul), which the TPU compiler does not "
    "([memory_tpu.md](memory_tpu.md)); what the figures mean: [memory.md](../memory.md). "
    + _MEMORY_PARTS,
    "",
  ]
  return "\n".join(intro + _memory_tables(records))


def triton_page(records) -> str:
  """docs/results/triton_sm90.md from experiments/triton_stats.py's record."""
  lines = [
    "# GPU decode kernel: Triton compile stats for sm_90 (compiled, not run)",
    "",
    "The Pallas decode kernel (`kernels/sparse_decode.py`) lowered for CUDA on a CPU host; the "
    "Triton module its custom call carries is compiled for sm_90 by the open-source `triton` "
    "wheel (`triton.compile` to PTX), and each ptxas the wheel bundles assembles the PTX with "
    "`-v`. Registers are per thread (255 at most); spill stores / loads are the bytes of the "
    "local-memory spill instructions ptxas emitted (its static count, not traffic); stack is the "
    "per-thread stack frame; shared is the dynamic shared memory a launch requests (Triton's "
    "`metadata.shared`) plus any static. \"in TUNING\": the table entries the kernel runs "
    "(`sparse_decode.tuning`); the other rows are the bfloat16 alternatives "
    "`experiments/device_check.py` times. On a GPU, XLA compiles the same module with the Triton "
    "inside jaxlib and the CUDA toolkit's ptxas, so these figures are a proxy for its build.",
    "",
  ]
  for record in records:
    r = record["results"]
    c, tools = r["config"], r["toolchain"]
    versions = " / ".join(tools["ptxas"])
    lines += [
      _provenance(record),
      "",
      f"triton {tools['triton']}, {tools['gpu_name']}, PTX ISA {c['ptx_version'] / 10:.1f}; "
      f"{c['batch']} rows, {c['kv_heads']} KV heads x {c['group']} query heads of "
      f"{c['head_dim']}, pages of {c['page_size']} tokens, {c['budget']} tokens read per (row, "
      f"KV head) of a {c['context']}-token row. Figures by ptxas {versions} (shared: "
      "one value when they agree).",
      "",
      "| cache | block tokens | dot | warps | stages | in TUNING | grid | registers | "
      "spill stores (B) | spill loads (B) | stack (B) | shared (B) |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in r["variants"]:
      head = (
        f"| {v['dtype']} | {v['block_tokens']} | {v['use_dot']} | {v['num_warps']} | "
        f"{v['num_stages']} | {'yes' if v['in_table'] else ''} | "
        f"{' x '.join(str(n) for n in v['grid'])} |"
      )
      figs = [v["ptxas"][t] for t in tools["ptxas"] if t in v["ptxas"]]
      if v["error"] or any(f["error"] for f in figs):
        error = (v["error"] or next(f["error"] for f in figs if f["error"]))[:120]
        lines.append(f"{head} fails: `{error.replace('|', '/')}` | | | | |")
        continue
      cell = lambda key: " / ".join(str(f[key]) for f in figs)
      bold = lambda key: f"**{cell(key)}**" if any(f[key] for f in figs) else cell(key)
      shared = list(dict.fromkeys(str(v["shared"] + f["static_smem"]) for f in figs))
      lines.append(
        f"{head} {cell('registers')} | {bold('spill_stores')} | {bold('spill_loads')} | "
        f"{cell('stack')} | {' / '.join(shared)} |"
      )
    lines.append("")
  return "\n".join(lines)


def quantile_page(records) -> str:
  """docs/results/quantile_sweep.md from tau_sweep's record of configs/quantile_sweep.py: the test
  of docs/threshold_sweep.md ("Which tail predicts training"), decided by `quantile_verdict`."""
  lines = [
    "# Which tail predicts training: the quantile test (measured)",
    "",
    "The embedded default job (`configs/default.py`, 40 steps) with dense rollouts and with quest "
    "tables calibrated from one surface to hold a percentile of exact alpha at tau, on seeds the "
    "threshold sweep did not use; each trained policy scored on 128 held-out problems x 2 dense "
    "samples. The rule was written before the runs "
    "([threshold_sweep.md](../threshold_sweep.md#which-tail-predicts-training-the-test-written-"
    "before-its-runs)): the line is dense's mean held-out score less its std over seeds (ddof 1); "
    "confirmed if a p1 table reading at most 0.95 of the dense KV scores at least the line while "
    "the p5 table is below it; refuted if every such p1 table is below the line, or the p5 table "
    "is above it too.",
    "",
  ]
  for record in records:
    r = record["results"]
    seeds = next(iter(r["settings"].values()))["seeds"]
    lines += [
      _provenance(record),
      "",
      f"Seeds {', '.join(map(str, seeds))}; mean +- std over them. KV read: pages read over pages "
      "cached (layer 0 dense). p1 / p5: exact alpha's 1st / 5th percentile, mean over the steps "
      f"/ the last {r['config']['window']}.",
      "",
      "| setting | holds | KV read | p1 | p5 | held-out score | held-out exact |",
      "|---|---|---|---|---|---|---|",
    ]
    cell = lambda d: "-" if d is None or d["mean"] is None else f"{d['mean']:.3f} +- {d['std']:.3f}"
    for name, v in r["settings"].items():
      holds = "-" if v["kind"] == "dense" else f"p{v['quantile']:g} >= {v['tau']:g}"
      lines.append(
        f"| {name} | {holds} | {v['kv_read']['mean']:.3f} | {v['p1']['mean']:.3f} | "
        f"{v['p5']['mean']:.3f} | {cell(v['heldout_score'])} | {cell(v['heldout_accuracy'])} |"
      )
    verdict = r["verdict"]
    if verdict:
      lines += [
        "",
        f"The line: {verdict['dense_mean']:.3f} - {verdict['dense_std']:.3f} = "
        f"{verdict['line']:.3f}. **Verdict: {verdict['verdict']}.**",
      ]
    lines.append("")
  return "\n".join(lines)


def _flat(d, prefix="") -> dict:
  """A nested config dict as {"a.b": value}."""
  out = {}
  for k, v in d.items():
    if isinstance(v, dict):
      out.update(_flat(v, f"{prefix}{k}."))
    else:
      out[f"{prefix}{k}"] = v
  return out


def _shipped_runs(name) -> dict:
  """The per-run figures of a shipped sweep (assets/pointer_chase_tiny/<name>/sweep.json)."""
  with open(os.path.join(ROOT, "assets", "pointer_chase_tiny", name, "sweep.json")) as f:
    return json.load(f)["runs"]


def mask_page(records) -> str:
  """docs/results/mask_sweep.md from tau_sweep's record of configs/mask_sweep.py (the masked p5
  table) beside the quantile sweep's record (dense and the unmasked table, not rerun): the test of
  docs/threshold_sweep.md ("Does mismatch masking recover training?")."""
  with open(os.path.join(RESULTS, "quantile_sweep.json")) as f:
    base = json.load(f)
  lines = [
    "# Does mismatch masking recover training? (measured)",
    "",
    "The embedded default job (`configs/default.py`, 40 steps) at the quantile sweep's quest table "
    "holding p5 >= 0.86, with token masking (`rl.mask_alpha_below`: a completion token whose exact "
    "alpha is under it leaves the dense policy loss), on the quantile sweep's seeds; each trained "
    "policy scored on 128 held-out problems x 2 dense samples. Dense and the unmasked table are "
    "the quantile sweep's runs ([quantile_sweep.md](quantile_sweep.md)), not rerun. The rule was "
    "written before the runs ([threshold_sweep.md](../threshold_sweep.md#does-mismatch-masking-"
    "recover-training-the-test-written-before-its-runs)): the line is dense's mean held-out score "
    "less its std over seeds (ddof 1); recovers if the masked table's mean held-out score is at "
    "least the line, does not recover otherwise.",
    "",
  ]
  b = base["results"]["settings"]
  dense, plain = b["dense"], b["quest0.86"]
  base_runs, masked_runs = _shipped_runs("quantile_sweep"), _shipped_runs("mask_sweep")
  for record in records:
    r = record["results"]
    (name, masked), *others = r["settings"].items()
    assert not others and masked["tau"] == plain["tau"] and masked["quantile"] == plain["quantile"]
    seeds = masked["seeds"]
    assert seeds == plain["seeds"] == dense["seeds"]
    below = r["config"]["train"]["rl"]["mask_alpha_below"]
    old, new = _flat(base["results"]["config"]["train"]), _flat(r["config"]["train"])
    changed = [f"`{k}` {old[k]} -> {new[k]}" for k in sorted(old) if old[k] != new.get(k)]
    added = [f"`{k}` = {new[k]}" for k in sorted(set(new) - set(old))]
    lines += [
      f"Masked runs: {_provenance(record)}",
      "",
      f"Dense and unmasked: {_provenance(base)}",
      "",
      "Trainer config of the masked runs against the quantile sweep's: "
      + (", ".join(changed) or "no value changed")
      + "; fields added since, at these values: "
      + (", ".join(added) or "none")
      + ".",
      "",
      f"Seeds {', '.join(map(str, seeds))}; mean +- std over them. Masked: the share of completion "
      "tokens under the threshold, mean over steps. KV read: pages read over pages cached (layer "
      "0 dense). p1 / p5: exact alpha's 1st / 5th percentile, mean over the steps / the last "
      f"{r['config']['window']}.",
      "",
      "| setting | mask alpha below | masked | KV read | p1 | p5 | held-out score "
      "| held-out exact |",
      "|---|---|---|---|---|---|---|---|",
    ]
    cell = lambda d: "-" if d is None or d["mean"] is None else f"{d['mean']:.3f} +- {d['std']:.3f}"
    rows = [("dense", "-", dense), ("quest0.86", "-", plain), (f"{name} masked", below, masked)]
    for label, threshold, v in rows:
      lines.append(
        f"| {label} | {threshold} | {cell(v.get('mask_token_frac'))} | "
        f"{v['kv_read']['mean']:.3f} | {v['p1']['mean']:.3f} | {v['p5']['mean']:.3f} | "
        f"{cell(v['heldout_score'])} | {cell(v['heldout_accuracy'])} |"
      )
    lines += [
      "",
      "Per seed: held-out score, and the first step's mean reward (its rollout comes before any "
      "update, so masking cannot change it: equal values say the masked runs' code rolls out what "
      "the quantile sweep's did).",
      "",
      "| seed | dense | quest0.86 | masked | step-1 reward, quest0.86 | step-1 reward, masked |",
      "|---|---|---|---|---|---|",
    ]
    for seed in seeds:
      d, u = (base_runs[f"{run}_seed{seed}"] for run in ("dense", "quest0.86"))
      m = masked_runs[f"{name}_seed{seed}"]
      lines.append(
        f"| {seed} | {d['heldout_score']:.3f} | {u['heldout_score']:.3f} | "
        f"{m['heldout_score']:.3f} | {u['reward_curve'][0]:.4f} | {m['reward_curve'][0]:.4f} |"
      )
    line = dense["heldout_score"]["mean"] - dense["heldout_score"]["std"]
    mean = masked["heldout_score"]["mean"]
    diff = mean - plain["heldout_score"]["mean"]
    stds = (masked["heldout_score"]["std"], plain["heldout_score"]["std"])
    lines += [
      "",
      f"The line: {dense['heldout_score']['mean']:.3f} - {dense['heldout_score']['std']:.3f} = "
      f"{line:.3f}; the masked mean: {mean:.3f}. "
      f"**Verdict: {'recovers' if mean >= line else 'does not recover'}.** Masked less unmasked "
      f"mean: {diff:+.3f}, {'more' if abs(diff) > max(stds) else 'not more'} than both stds "
      f"({stds[0]:.3f} masked, {stds[1]:.3f} unmasked).",
      "",
    ]
  return "\n".join(lines)


def _sweep_cell(d, digits=3) -> str:
  """mean +- std of a sweep figure; "-" where the setting did not record it."""
  if d is None or d["mean"] is None:
    return "-"
  return f"{d['mean']:.{digits}f} +- {d['std']:.{digits}f}"


def _sweep_mean(v, field, digits=3) -> str:
  return "-" if not v.get(field) or v[field]["mean"] is None else f"{v[field]['mean']:.{digits}f}"


def _sweep_row(names, v) -> str:
  """One table row: the settings `names` that share one run (taus that pick the same table)."""
  label = names[0]
  if len(names) > 1:
    label = "tau " + " / ".join(n[len("tau") :] for n in names) + " (one run)"
  bins = [x for x in v["p5_bin"]["mean"] if x is not None]
  under = [x for x in v["under_tau_bin"]["mean"] if x is not None]
  lowest = f"{min(bins):.3f}" if bins else "-"
  steps_under = f"{min(under):.0%}-{max(under):.0%}" if under else "-"
  cells = [
    label,
    v["schedule"] or "all pages",
    f"{_sweep_cell(v['reward_first'])} -> {_sweep_cell(v['reward_last'])}",
    _sweep_cell(v["heldout_score"]),
    _sweep_cell(v["heldout_accuracy"], 2),
    f"{v['length_first']['mean']:.0f} -> {v['length_last']['mean']:.0f}",
    f"{_sweep_mean(v, 'p5')} ({lowest})",
    steps_under,
    _sweep_mean(v, "p1"),
    _sweep_mean(v, "kv_read"),
    _sweep_mean(v, "predicted_speedup", 2),
    _sweep_mean(v, "measured_speedup", 2),
  ]
  return "| " + " | ".join(cells) + " |"


def threshold_sweep_page(records) -> str:
  """docs/results/threshold_sweep.md from tau_sweep's record of the shipped threshold sweep
  (configs/tau_sweep.py, reported from assets/pointer_chase_tiny/tau_sweep/sweep.json)."""
  lines = [
    "# The threshold sweep (measured)",
    "",
    "The embedded default job (`configs/default.py`, 40 steps) under dense rollouts, calibrated "
    "tables at several tau, fixed budgets, closed loops and quest page scores; each trained "
    "policy scored on held-out problems with dense samples. What the columns mean and what the "
    "sweep shows: [threshold_sweep.md](../threshold_sweep.md).",
    "",
  ]
  for record in records:
    r = record["results"]
    window = r["config"]["window"]
    seeds = next(iter(r["settings"].values()))["seeds"]
    lines += [
      _provenance(record),
      "",
      f"Seeds {', '.join(map(str, seeds))}; mean +- std over them. Reward and length over the "
      f"first / last {window} steps; p5 over the last {window} (its lowest bin in brackets); "
      "steps under tau: per bin the share of steps whose p5 fell under tau, lowest-highest over "
      "the bins; p1: mean over the steps; KV read: pages read over pages cached; predicted: the "
      "cost model's speedup on an H200; measured: rollout tokens/s over the same seed's dense run "
      "on the CPU the runs shared with other runs (not a benchmark: "
      "[decode_speed.md](../decode_speed.md)).",
      "",
      "| setting | schedule | reward first -> last | held-out score | held-out exact | length "
      "first -> last | p5 (lowest bin) | steps under tau | p1 | KV read | predicted x | "
      "measured x |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by_run = {}
    for name, v in r["settings"].items():
      by_run.setdefault(v["run"], []).append(name)
    lines += [_sweep_row(names, r["settings"][names[0]]) for names in by_run.values()]
    lines.append("")
  return "\n".join(lines)


def _cost_setting(r) -> list:
  """The settings line of a cost_report record: what every table of the page assumes."""
  c, a = r["config"], r["assumptions"]
  lines = [
    f"tau {c['tau']:g} (the published schedules; pages of 16 tokens, the first 2 layers dense, "
    f"mean-key page scores), prompt {c['prompt_len']} tokens, cutoff "
    f"{c['gen_len']} tokens, {c['n_samples']} samples per prompt. Roofline on {a['hardware']} "
    f"({a['peak_tflops']:.0f} TFLOP/s, {a['bandwidth_gbs']:.0f} GB/s), one device: "
    f"{c['batch_per_device']:g} rows start together; response lengths geometric with mean "
    f"{c['mean_len_frac']:g} x cutoff = {a['mean_tokens']:.0f} tokens, the "
    f"{a['cut_share']:.0%} still running cut at the cutoff; page selection "
    f"{'counted' if c['page_selection'] else 'left out'}. Error = predicted / measured - 1.",
  ]
  if c["gen_len"] != r["paper_cutoff"]:
    lines.append(
      f"The measured speedups are at a {r['paper_cutoff']}-token cutoff: the errors compare "
      "different settings."
    )
  return lines


def _cost_comparison(r) -> list:
  f = r["comparison"]
  lines = [
    "## Predicted vs measured",
    "",
    "| model | params | eFLOPs (paper's model) | roofline | measured (paper, 4x H200) | "
    "peak GB / device |",
    "|---|---|---|---|---|---|",
  ]
  for model, m in f["models"].items():
    lines.append(
      f"| {model} | {m['params_b']:.2f}B | {m['eflops']:.2f}x ({m['eflops_error']:+.0%}) | "
      f"{m['roofline']:.2f}x ({m['roofline_error']:+.0%}) | {m['measured']:.2f}x | "
      f"{m['peak_gb']:.0f} |"
    )
  within = ", ".join(f"{name} {n} of {len(f['models'])}" for name, n in f["within"].items())
  a = r["absolute_rate"]
  gpus = a["gpus"]
  return lines + [
    "",
    f"Within {f['aim']:.0%} of the measured speedup: **{within}**. Peak GB: weights + the "
    "largest KV the running rows hold at once (an H200 has 141 GB).",
    "",
    f"Absolute rate, {a['model']}, generated tokens/s per GPU: roofline dense "
    f"{a['roofline_dense']:.0f}, sparse {a['roofline_sparse']:.0f}; measured "
    f"{a['measured_dense'] / gpus:.0f}, {a['measured_sparse'] / gpus:.0f} (the paper: "
    f"{a['measured_dense']} and {a['measured_sparse']} on {gpus} GPUs), so the real rollouts "
    f"run at **{a['share_dense']:.0%}** (dense) and **{a['share_sparse']:.0%}** (sparse) of "
    "the roofline.",
    "",
  ]


def _cost_sensitivity(r) -> list:
  f, c = r["sensitivity"], r["config"]
  mark = lambda value, configured: f"{value:g}{'*' if value == configured else ''}"
  means = [f"mean {mark(m, c['mean_len_frac'])}" for m in f["mean_len_fracs"]]
  batches = [f"rows {mark(b, c['batch_per_device'])}" for b in f["batches"]]
  heads = means + batches + ["no selection"]
  lines = [
    "## Roofline speedup as its assumptions change",
    "",
    "Mean response length / cutoff, rows per device, and page selection left out, one at a "
    "time (* = the configured value, the table above).",
    "",
    "| model | " + " | ".join(heads) + " |",
    "|---" * (len(heads) + 1) + "|",
  ]
  for model, m in f["models"].items():
    cells = [f"{s:.2f}x" for s in m["by_mean"] + m["by_batch"] + [m["no_selection"]]]
    lines.append(f"| {model} | " + " | ".join(cells) + " |")
  return lines + [""]


def _cost_engine(r) -> list:
  f, c, a = r["engine"], r["config"], r["absolute_rate"]
  rate = lambda m, s, n: m[s][n]["tokens_per_s"]
  lines = [
    "## Static batch vs engine",
    "",
    f"Roofline on {c['roofline_hardware']}, one device in steady state, {c['pool_gb']:g} GB of "
    "KV pool: the static batch allocates every row at the cutoff (finished rows stop costing, "
    f"the batch waits for its longest); the engine ({c['engine_slots']} slots) refills slots "
    "and takes pages as rows grow. Generated tokens/s per device (rows in flight).",
    "",
    "| model | static dense | static sparse | engine dense | engine sparse | engine / static "
    "(dense, sparse) | sparse / dense (static, engine) |",
    "|---|---|---|---|---|---|---|",
  ]
  for model, m in f.items():
    cell = lambda s, n: f"{rate(m, s, n):.0f} ({m[s][n]['rows']:.1f})"
    ratio = lambda a, b: f"{rate(m, *a) / rate(m, *b):.2f}x"
    lines.append(
      f"| {model} | {cell('static', 'dense')} | {cell('static', 'sparse')} | "
      f"{cell('engine', 'dense')} | {cell('engine', 'sparse')} | "
      f"{ratio(('engine', 'dense'), ('static', 'dense'))}, "
      f"{ratio(('engine', 'sparse'), ('static', 'sparse'))} | "
      f"{ratio(('static', 'sparse'), ('static', 'dense'))}, "
      f"{ratio(('engine', 'sparse'), ('engine', 'dense'))} |"
    )
  m, gpus = f[a["model"]], a["gpus"]
  return lines + [
    "",
    f"{a['model']} per GPU, measured by the paper ({gpus}x H200): dense "
    f"{a['measured_dense'] / gpus:.0f}, sparse {a['measured_sparse'] / gpus:.0f} tok/s; "
    f"predicted static {rate(m, 'static', 'dense'):.0f} / {rate(m, 'static', 'sparse'):.0f}, "
    f"engine {rate(m, 'engine', 'dense'):.0f} / {rate(m, 'engine', 'sparse'):.0f}.",
    "",
  ]


def _cost_hardware(r) -> list:
  f, p = r["eflops_by_hardware"], r["page_sizes"]
  names = list(f["hardware"])
  lines = [
    "## eFLOPs model per hardware",
    "",
    "Every sample to the cutoff; I = peak FLOP/s / bandwidth, the FLOPs a byte moved costs.",
    "",
    "| hardware | TFLOP/s | GB/s | I (FLOP/byte) | KV element bytes |",
    "|---|---|---|---|---|",
  ]
  for name, hw in f["hardware"].items():
    lines.append(
      f"| {name} | {hw['peak_tflops']:.3f} | {hw['bandwidth_gbs']:.1f} | "
      f"{hw['intensity']:.1f} | {hw['dtype_bytes']} |"
    )
  lines += [
    "",
    "| model | max pages | " + " | ".join(names) + " |",
    "|---" * (len(names) + 2) + "|",
  ]
  for model, m in f["models"].items():
    cells = " | ".join(f"{m['speedups'][name]:.2f}x" for name in names)
    lines.append(f"| {model} | {m['max_pages']} | {cells} |")
  lines += [
    "",
    "## Page sizes",
    "",
    "eFLOPs speedup on h200 at the same token budget, rounded up to whole pages.",
    "",
    "| model | " + " | ".join(f"page {z}" for z in p["page_sizes"]) + " |",
    "|---" * (len(p["page_sizes"]) + 1) + "|",
  ]
  for model, by_size in p["models"].items():
    lines.append(f"| {model} | " + " | ".join(f"{s:.2f}x" for s in by_size) + " |")
  return lines + [""]


def _cost_speculative(r) -> list:
  f, c = r["speculative"], r["config"]
  heads = [f"k = {k}" for k in f["ks"]]
  lines = [
    "## Lossless (speculative) rollouts",
    "",
    f"The engine's roofline as above ({c['roofline_hardware']}, {c['pool_gb']:g} GB of KV pool, "
    f"{c['engine_slots']} slots), each round k sparse draft steps under the published table and "
    "one dense verification pass over the k + 1 new positions (`cost_model."
    "roofline_speculative_rate`); every row is then sampled from the dense policy. Drafts are "
    "accepted independently at the mean per-token acceptance alpha, so a round yields "
    "(1 - alpha^(k+1)) / (1 - alpha) tokens. Alpha: the lower bound on the mean that the tables' "
    f"p{f['quantile']:g} >= tau {c['tau']:g} implies ((1 - {f['quantile']:g}%) x tau), and the "
    "mean acceptances Sparrow reports for a collapsing and a stable sparse run "
    "(`configs/cost_report.py`); none is measured on these models here. Each cell: speedup over "
    "the dense engine (tokens per round); lossy: the sparse engine's speedup (the table above).",
    "",
    "| model | alpha | alpha from | lossy | " + " | ".join(heads) + " |",
    "|---" * (len(heads) + 4) + "|",
  ]
  for model, m in f["models"].items():
    for a in m["by_alpha"]:
      cells = [
        f"{a['by_k'][str(k)]['speedup']:.2f}x ({a['by_k'][str(k)]['tokens_per_round']:.2f})"
        for k in f["ks"]
      ]
      lines.append(
        f"| {model} | {a['alpha']:.3f} | {a['source']} | {m['lossy_speedup']:.2f}x | "
        + " | ".join(cells)
        + " |"
      )
  return lines + [""]


def cost_model_page(records) -> str:
  """docs/results/cost_model.md from experiments/cost_report.py's record."""
  lines = [
    "# Predicted rollout speedups: cost models vs the paper (predicted)",
    "",
    "`experiments/cost_report.py` prices dense and sparse rollouts of the paper's four models "
    "with two analytic models, the paper's eFLOPs model (`cost_model.rollout_speedup`) and a "
    "roofline time model of one device's batch (`cost_model.roofline_speedup`), beside the "
    "speedups Sparrow measured (4x H200, AIME24 x 8 samples, 32K cutoff). Nothing here is "
    "timed; the assumptions and why the models differ are in "
    "[cost_model.md](../cost_model.md).",
    "",
  ]
  for record in records:
    r = record["results"]
    lines += [_provenance(record), "", *_cost_setting(r), ""]
    lines += _cost_comparison(r) + _cost_sensitivity(r) + _cost_engine(r)
    lines += (_cost_speculative(r) if "speculative" in r else []) + _cost_hardware(r)
  return "\n".join(lines)


def decode_attention_page(records) -> str:
  """docs/results/decode_attention.md from experiments/bench_attention.py's record."""
  lines = [
    "# Sparse decode attention on CPU (measured)",
    "",
    "`experiments/bench_attention.py`: one decode step of attention only, Qwen3-1.7B attention "
    "shapes, every row in one preallocated cache. dense (fair): each row's cached tokens only "
    "([the fair dense baseline](../kernels.md#fair-dense-baseline)); whole cache: dense attention "
    "over the whole preallocated cache, masked by length; sparse: the budget's pages, selection "
    "not timed; sparse + selection: page selection and sparse attention. ms per decode step, "
    "GB/s = bytes each step must read / time. ratio = dense (fair) / the column; min ratio "
    "divides the fastest calls; selection share = page selection's part of the sparse + "
    "selection step. What the figures mean: [decode_speed.md](../decode_speed.md).",
    "",
  ]
  for record in records:
    r = record["results"]
    c, shape = r["config"], r["shape"]
    lines += [
      _provenance(record),
      "",
      f"{r['backend']} x{r['cores']} cores, impl {c['impl']}, {c['dtype']}, batch {c['batch']}, "
      f"cache {r['cache_tokens']} tokens a row, {shape['query_heads']} query / "
      f"{shape['kv_heads']} KV heads, head dim {shape['head_dim']}, budget {c['budget']} tokens "
      f"({c['budget'] // r['page_size']} pages of {r['page_size']}); median of {c['runs']} "
      f"calls of {c['steps']} steps; 1-min load average at start {r['load_average']:.1f}.",
      "",
      "| context | dense (fair) | GB/s | whole cache | sparse | GB/s | ratio | min ratio | "
      "whole cache / sparse | sparse + selection | ratio | selection share |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
      select = (
        f"{row['select_ms']:.3f} | {row['select_ratio']:.1f}x | "
        f"{1 - row['sparse_ms'] / row['select_ms']:.0%}"
        if "select_ms" in row
        else "- | - | -"
      )
      lines.append(
        f"| {row['context']} | {row['dense_ms']:.3f} | {row['dense_gbs']:.1f} | "
        f"{row['whole_cache_ms']:.3f} | {row['sparse_ms']:.3f} | {row['sparse_gbs']:.1f} | "
        f"**{row['ratio']:.1f}x** | {row['min_ratio']:.1f}x | {row['whole_cache_ratio']:.1f}x | "
        f"{select} |"
      )
    lines.append("")
  return "\n".join(lines)


def _decode_section(r, config) -> list:
  """bench_decode: end-to-end decode, dense vs sparse, beside the cost model's prediction."""
  c, hw, batch, runs = config["decode"], r["hardware"], config["batch"], config["runs"]
  read_s = r["params"] * hw["dtype_bytes"] / hw["mem_bandwidth"]
  lines = [
    "## End-to-end decode",
    "",
    f"{r['backend']} x{r['cores']} cores, {c['dtype']}: Qwen3-1.7B shapes truncated to "
    f"{r['layers']} layers, vocab {r['vocab_size']}, {r['params'] / 1e6:.0f}M params, random "
    f"weights; batch {batch}; sparse = the paper's tau-0.86 Qwen3-1.7B table, pages of 16, the "
    f"first `dense layers` dense; tok/s = batch x steps / median of {runs} calls of "
    f"{c['steps']} steps ({r['seconds']:.0f} s in all). This machine: "
    f"{hw['peak_flops'] / 1e9:.0f} GFLOP/s, {hw['mem_bandwidth'] / 1e9:.1f} GB/s (I = "
    f"{hw['intensity']:.1f} FLOP/byte), KV {hw['dtype_bytes']} bytes an element; reading the "
    f"weights once takes {read_s:.3f} s at that bandwidth, what \"+ weight reads\" adds to each "
    "step of both costs.",
    "",
    "| context | budget | dense layers | dense tok/s | sparse tok/s | measured | cost model | "
    "+ weight reads |",
    "|---|---|---|---|---|---|---|---|",
  ]
  for row in r["rows"]:
    lines.append(
      f"| {row['context']} | {row['budget']} | {row['dense_layers']} of {r['layers']} | "
      f"{row['dense_tok_s']:.2f} | {row['sparse_tok_s']:.2f} | **{row['ratio']:.2f}x** | "
      f"{row['cost_model']:.2f}x | {row['with_weights']:.2f}x |"
    )
  return lines + [""] + _split_table(r.get("split", []))


def _split_table(split) -> list:
  """Where a step's time goes (bench_decode.step_split), and the rate each part reads at."""
  if not split:
    return []
  lines = [
    "Where a step's time goes, from the same calls and two stand-ins for attention (none: the "
    "rest of the step, weights, cache appends and sampling; page selection alone), at the timed "
    "steps' middle; GB/s = the bytes a part must read / its time (the weights; a dense layer's K "
    "and V; a sparse layer's budget of K and V and every page's mean key), beside the one "
    "bandwidth the cost model prices every byte at:",
    "",
    "| context | rest of a step (ms) | weights GB/s | dense layer (ms) | GB/s | sparse layer (ms) "
    "| GB/s | of it page selection (ms) | cost model GB/s |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for part in split:
    lines.append(
      f"| {part['context']} | {part['rest_ms']:.1f} | {part['weights_gbs']:.1f} | "
      f"{part['dense_layer_ms']:.1f} | {part['dense_gbs']:.1f} | {part['sparse_layer_ms']:.1f} | "
      f"{part['sparse_gbs']:.1f} | {part['select_ms']:.1f} | {part['model_gbs']:.1f} |"
    )
  return lines + [""]


TUNIX_AIM = 1.3  # the decode speed against tunix docs/decode_speed.md aims for


def _tunix_section(r) -> list:
  """bench_tunix: our dense sampler against google-tunix's, and the weight-read roofline."""
  m, v, (short, long) = r["model"], r["versions"], r["gen"]
  tunix_step = r["samplers"]["tunix generate.Sampler"]["step_ms"]
  aim_step = tunix_step / TUNIX_AIM
  met = r["ours_over_tunix"] >= TUNIX_AIM
  lines = [
    "## Against tunix",
    "",
    f"google-tunix {v['tunix']} (jax {v['jax']}, Python {v['python']}), dense decode of a tiny "
    f"Qwen3 ({m['layers']} layers, width {m['hidden_size']}, {m['heads']} / {m['kv_heads']} "
    f"heads, vocab {m['vocab_size']}, float32, random weights shared by both), batch "
    f"{r['batch']}, prompt {r['prompt']}, greedy; decode tok/s = batch x ({long} - {short}) / "
    f"(time({long}) - time({short})), medians of {r['runs']} calls. Reading the "
    f"{r['weight_bytes'] / 1e6:.1f} MB of weights once takes {r['weight_read_ms']:.2f} ms "
    "(measured), the floor of a decode step at this batch.",
    "",
    f"| sampler | {short} tokens (s) | {long} tokens (s) | decode tok/s | ms per step | "
    "x the weight read |",
    "|---|---|---|---|---|---|",
  ]
  for name, s in r["samplers"].items():
    lines.append(
      f"| {name} | {s['short_s']:.3f} | {s['long_s']:.3f} | {s['tok_s']:.1f} | "
      f"{s['step_ms']:.2f} | {s['per_read']:.2f}x |"
    )
  split, read = r["step_split"], r["weight_read_ms"]
  ours_step = r["samplers"]["sparrow_jax sj.generate"]["step_ms"]
  return lines + [
    "",
    "Our step split, from the same calls with the engine's paged attention replaced (ms per "
    "step, x the weight read):",
    "",
    "| our step | no attention | the page gather alone in its place |",
    "|---|---|---|",
    f"| {ours_step:.2f} ({ours_step / read:.2f}x) | {split['no attention']:.2f} "
    f"({split['no attention'] / read:.2f}x) | {split['page gather alone']:.2f} "
    f"({split['page gather alone'] / read:.2f}x) |",
    "",
    f"Ours / tunix: **{r['ours_over_tunix']:.2f}x**; same greedy tokens: {r['same_tokens']}/"
    f"{r['tokens']}. {TUNIX_AIM:g}x tunix needs a step of {aim_step:.2f} ms, "
    f"{aim_step / r['weight_read_ms']:.2f}x the weight read: {'met' if met else 'not met'}.",
    "",
  ]


def decode_rollout_page(records) -> str:
  """docs/results/decode_rollout.md from the decode_rollout*.json records of
  experiments/bench_decode.py and experiments/bench_tunix.py (one record may hold both)."""
  lines = [
    "# Sparse decode end to end on CPU, and against tunix (measured)",
    "",
    "`experiments/bench_decode.py`: decode steps of a truncated Qwen3-1.7B-shaped model from a "
    "filled cache, the sampler's fair dense decode against its sparse decode, with the cost "
    "model's prediction for the same setting (\"+ weight reads\" adds one read of the weights a "
    "step, which a small batch on a CPU pays); and `experiments/bench_tunix.py`: our dense "
    "sampler against google-tunix's on one tiny model. What the figures mean, and the commands "
    "that make them: [decode_speed.md](../decode_speed.md).",
    "",
  ]
  for record in records:
    r = record["results"]
    lines += [_provenance(record), ""]
    if "decode" in r:
      lines += _decode_section(r["decode"], r["config"])
    if "tunix" in r:
      lines += _tunix_section(r["tunix"])
  return "\n".join(lines)


def _cells(values, digits=3) -> str:
  """A per-bin list as one cell ("-": a bin without tokens)."""
  return " ".join("-" if v is None else f"{v:.{digits}f}" for v in values)


def _calibration_table(records) -> list:
  """experiments/calibrate_schedule.py --config.record records: the table each picked."""
  lines = [
    "## Calibration",
    "",
    "`experiments/calibrate_schedule.py --config.record`: the schedule calibrated on the "
    "calibration prompts' rollouts, per page score; \"shipped\" says whether it is the table "
    "in `assets/pointer_chase_tiny/` that the configs use (if not, the shipped table follows). A "
    "re-run picks another budget most easily in a bin with few tokens, whose p5 rests on a few "
    "alphas that a code change or another CPU type's last-bit float differences "
    "([configuration.md](../configuration.md#repeating-a-run)) can move.",
    "",
  ]
  shipped_dir = {"mean": "calibration", "quest": "calibration_quest"}
  for record in records:
    r = record["results"]
    shipped_path = os.path.join(
      ROOT, "assets", "pointer_chase_tiny", shipped_dir[r["page_score"]], "schedule.json"
    )
    with open(shipped_path) as f:
      shipped = json.load(f)["values"]
    lines += [
      _provenance(record),
      "",
      "| page score | rule | alpha | rollouts | top-k per bin (+ always kept) | generated tokens"
      " per bin | shipped | minutes |",
      "|---|---|---|---|---|---|---|---|",
      f"| {r['page_score']} | p{r['quantile']:g} >= {r['tau']} | {r['alpha']}"
      f"{', on-policy' if r['on_policy'] else ''} | {r['prompts']} x {r['repeats']} | "
      f"{' '.join(map(str, r['chosen_topk']))} (+{r['always_kept']}) | "
      f"{' '.join(map(str, r['count_bin']))} | "
      f"{'yes' if r['chosen_topk'] == shipped else 'no: ' + ' '.join(map(str, shipped))} "
      f"| {r['seconds'] / 60:.1f} |",
      "",
    ]
  return lines


def _heldout_tables(records) -> list:
  """experiments/measure_tiny.py records: dense and sparse acceptance on held-out problems."""
  lines = [
    "## Held-out problems",
    "",
    "`experiments/measure_tiny.py`: dense sampling on held-out problems, then the first of them "
    "sampled under fixed budgets and under the calibrated schedule, each token's exact alpha "
    "against the dense policy. Budgets count pages of 16 tokens, the always-kept ones included; "
    "layer 0 is dense. Step score: the task's per-step reward; accuracy: exact answers.",
    "",
  ]
  for record in records:
    r = record["results"]
    d, small, cal = r["dense"], r["small_budget"], r["calibrated"]
    lines += [
      f"### {cal['schedule']}",
      "",
      _provenance(record),
      "",
      f"{r['n']} problems of {r['hops']} hops (seed {r['held_out_seed']}): prompts of "
      f"{r['mean_prompt_len']:.0f} tokens and sampled responses of {r['mean_response_len']:.0f} "
      f"on average. Dense: step score **{d['step_score']:.3f} +- {d['step_score_stderr']:.3f}**, "
      f"accuracy {d['accuracy']:.3f}. At {small['pages']} pages: step score "
      f"{small['step_score']:.3f} (drop {small['score_drop']:.3f} +- "
      f"{small['score_drop_stderr']:.3f}). The rows below sample the first problems again "
      f"(dense step score on them {cal['dense_step_score_same_problems']:.3f}).",
      "",
      "| budget | share of context | step score | accuracy | mean alpha | p5 | p1 | p5 per "
      "128-token bin (from bin 3) |",
      "|---|---|---|---|---|---|---|---|",
    ]
    rows = [(f"fixed {k}", v) for k, v in r["sparse"]["budgets"].items()]
    for name, row in rows + [("calibrated", cal)]:
      share = f"{row['share_of_context']:.2f}" if "share_of_context" in row else "-"
      p5_bin = [None if n == 0 else v for v, n in zip(row["p5_bin"], row["count_bin"])]
      lines.append(
        f"| {name} | {share} | {row['step_score']:.3f} | {row['accuracy']:.3f} | "
        f"{row['mean']:.3f} | {row['p5']:.3f} | {row['p1']:.4f} | {_cells(p5_bin[3:])} |"
      )
    lines += [
      "",
      f"The calibrated schedule's lowest bin: p5 {cal['min_p5_bin']:.3f}, "
      f"{'at or above' if cal['all_bins_at_tau'] else 'under'} tau {cal['tau']}.",
      "",
    ]
  return lines


_RUN_FIGURES = (  # (label, the cell from a run's figures)
  ("steps", lambda r: f"{r['steps']}"),
  ("wall time (min)", lambda r: f"{r['summary']['time_s']['total'] / 60:.1f}"),
  ("first step, with compilation (s)", lambda r: f"{r['summary']['time_s']['first_step']:.0f}"),
  (
    "rollouts / train steps (s)",
    lambda r: "{rollout:.0f} / {train_step:.0f}".format(**r["summary"]["time_s"]),
  ),
  ("median train step (s)", lambda r: f"{r['train_step_median_s']:.1f}"),
  ("peak RSS (GiB)", lambda r: f"{r['summary']['peak_rss_gib']:.2f}"),
  ("reward, first / last window", lambda r: f"{r['reward_first']:.3f} / {r['reward_last']:.3f}"),
  ("exact p5, first / last window", lambda r: f"{r['p5_first']:.3f} / {r['p5']:.3f}"),
  ("exact p5, median step", lambda r: f"{r['p5_median']:.3f}"),
  ("exact p1, mean step", lambda r: "-" if r["p1"] is None else f"{r['p1']:.3f}"),
  ("p5 per bin, first window", lambda r: _cells(r["p5_bin_first"][3:])),
  ("p5 per bin, last window", lambda r: _cells(r["p5_bin"][3:])),
  ("steps with p5 under tau, per bin", lambda r: _cells(r["under_tau_bin"][3:], 2)),
  ("tokens under tau, per bin", lambda r: _cells(r["below_tau_bin"][3:])),
  ("KV read (of dense)", lambda r: f"{r['kv_read']:.3f}"),
  (
    "engine occupancy / rows in flight",
    lambda r: f"{r['occupancy']:.2f} / {r['rows_in_flight']:.1f}",
  ),
  (
    "held-out score / accuracy",
    lambda r: (
      "-"
      if r["heldout_score"] is None
      else f"{r['heldout_score']:.3f} / {r['heldout_accuracy']:.3f}"
    ),
  ),
)


def _run_report_tables(record) -> list:
  """experiments/run_report.py's record: a column per run, a row per figure; the evaluations."""
  r = record["results"]
  runs, window = r["runs"], r["config"]["window"]
  lines = [_provenance(record), ""]
  if runs:
    lines += [
      f"Windows of {window} steps; per-bin figures from 128-token bin 3 (the first generated "
      f"tokens) on; tau {r['config']['tau']}.",
      "",
      "| | " + " | ".join(runs) + " |",
      "|---" * (len(runs) + 1) + "|",
    ]
    lines += [
      f"| {label} | " + " | ".join(cell(v) for v in runs.values()) + " |"
      for label, cell in _RUN_FIGURES
    ]
    lines += [""]
    lines += [
      f"- {name}: `{v['summary']['command']}`, commit `{v['summary']['commit'][:12]}`, "
      f"{v['summary']['machine']}"
      for name, v in runs.items()
    ]
    lines += [""]
  if r["evals"]:
    lines += [
      "| policy | model dir | problems x samples | step score | accuracy | response length | "
      "truncated |",
      "|---|---|---|---|---|---|---|",
    ]
    for name, e in r["evals"].items():
      m = e["metrics"]
      lines.append(
        f"| {name} | `{e['model_dir']}` | {e['num_problems']} x {e['samples']} | "
        f"{m['mean@1']:.3f} | {m['pass@1']:.3f} | {m['response_length/mean']:.0f} | "
        f"{m['truncated_fraction']:.2f} |"
      )
    lines.append("")
  return lines


def embedded_default_page(records) -> str:
  """docs/results/embedded_default.md from the embedded_*.json records: calibration
  (calibrate_schedule), held-out acceptance (measure_tiny), the default run (run_report)."""
  lines = [
    "# The embedded default: calibration, held-out acceptance and the default run (measured)",
    "",
    "The shipped tiny model (`assets/pointer_chase_tiny`) on 128-hop pointer chasing; what the "
    "figures mean: [embedded_default.md](../embedded_default.md).",
    "",
  ]
  script = lambda record: os.path.basename(record["command"].split()[1])
  lines += _calibration_table([r for r in records if script(r) == "calibrate_schedule.py"])
  lines += _heldout_tables([r for r in records if script(r) == "measure_tiny.py"])
  lines += ["## The default run", ""]
  for record in records:
    if script(record) == "run_report.py":
      lines += _run_report_tables(record)
  return "\n".join(lines)


def multi_turn_page(records) -> str:
  """docs/results/multi_turn.md from experiments/run_report.py's record of the multi-turn default
  run (configs/multi_turn.py)."""
  lines = [
    "# Multi-turn runs (measured)",
    "",
    "`configs/multi_turn.py`: GRPO on `env:pointer_chase` (4 hops, a lookup tool call a hop) with "
    "the tiny model of `assets/pointer_chase_turns_tiny`, rollouts in exact mode; "
    "`configs/real_lm_multi_turn.py`: a few steps of GRPO on `env:python_math` with the real LM; "
    "what they run: [multi_turn.md](../multi_turn.md).",
    "",
  ]
  for record in records:
    lines += [_provenance(record), ""]
    for name, r in record["results"]["runs"].items():
      curve, t = r["reward_curve"], r["summary"]["time_s"]
      windows = [curve[i : i + 10] for i in range(0, len(curve), 10)]
      means = " | ".join(f"{sum(w) / len(w):.3f}" for w in windows)
      lines += [
        f"{name}: `{r['summary']['command']}`, {r['steps']} steps in {t['total'] / 60:.1f} min "
        f"(first step, with compilation, {t['first_step']:.0f} s; rollouts {t['rollout']:.0f} s, "
        f"train steps {t['train_step']:.0f} s), peak RSS {r['summary']['peak_rss_gib']:.2f} GiB.",
        "",
        "| steps | "
        + " | ".join(f"{10 * i + 1}-{10 * i + len(w)}" for i, w in enumerate(windows))
        + " |",
        "|---" * (len(windows) + 1) + "|",
        f"| mean reward | {means} |",
        *_env_rows(r.get("env")),
        "",
        f"Exact p5 {r['p5_first']:.3f} (first 10 steps) -> {r['p5']:.3f} (last 10); the drafts "
        f"read {r['kv_read']:.3f} of the dense KV.",
        "",
      ]
  return "\n".join(lines)


ENV_ROWS = (  # the env/* tags a multi-turn page shows, a step's mean over each 10-step window
  ("env/turns/mean", "turns a row", ".2f"),
  ("env/tool_calls", "tool calls a step", ".1f"),
  ("env/bad_calls", "malformed calls a step", ".1f"),
  ("env/tool_errors", "tool errors a step", ".1f"),
  ("env/tool_timeouts", "tool timeouts a step", ".1f"),
  ("env/observation_share", "observation share", ".2f"),
)


def _env_rows(env) -> list:
  """A run's tool use by 10-step window, rows of its reward table (run_report's `env`; none for
  a record without it)."""
  rows = []
  for tag, label, fmt in ENV_ROWS if env else ():
    values = env[tag]
    windows = [values[i : i + 10] for i in range(0, len(values), 10)]
    rows.append(f"| {label} | " + " | ".join(format(sum(w) / len(w), fmt) for w in windows) + " |")
  return rows


def distill_sparse_page(records) -> str:
  """docs/results/distill_sparse.md from run_report's record of the runs with and without it."""
  lines = [
    "# DistillSparse at a fixed budget (measured)",
    "",
    "The default job at `rollout.schedule = fixed:32` with mean page scores, with and without "
    "DistillSparse; the commands and what the figures mean: "
    "[distill_sparse.md](../distill_sparse.md).",
    "",
  ]
  for record in records:
    lines += _run_report_tables(record)
  return "\n".join(lines)


def _fmt(v, digits=3) -> str:
  return "-" if v is None or v != v else f"{v:.{digits}f}"


def _verdict(holds: bool, yes: str, no: str) -> str:
  return f"**appears**: {yes}" if holds else f"**does not appear**: {no}"


def _bin_lengths(b: int, page_size: int, bin_size: int) -> str:
  """The cached lengths schedule.position_bin puts in bin b, 'first-last': a length's pages
  rounded up, so a bin starts page_size - 1 tokens before its multiple of bin_size."""
  return f"{max(b * bin_size - page_size + 1, 0)}-{(b + 1) * bin_size - page_size}"


def _paper_topk(r) -> dict:
  """The paper's tau-0.86 top-k tables (2K-token bins) of the models the record compares with."""
  from sparrow_jax.sparsity.schedule import KVSchedule

  return {m: list(KVSchedule.paper(m, 0.86).values) for m in r["paper_tables"]}


def real_lm_mismatch_page(records) -> str:
  """docs/results/real_lm_mismatch.md from experiments/real_lm_mismatch.py's record: the paper's
  findings (F1-F3, the top-20 bound, quest vs mean) on a real LM, each with a verdict computed
  from the figures."""
  lines = ["# Mismatch study on a real LM (measured)", ""]
  for record in records:
    r = record["results"]
    st, bins, bs = r["stats"], r["num_bins"], r["bin_size"]
    counted = [b for b in range(bins) if r["count_bin"][b] > 0]
    mean_runs = [f"mean/{k}" for k in r["candidates"]]
    cfg = r["model_config"]
    lines += [_provenance(record), ""]
    if r.get("measured_by"):  # derived fields recomputed after the rollouts, by the command above
      m = r["measured_by"]
      lines += [
        f"Rollouts and their statistics: `{m['command']}`, commit `{m['commit'][:12]}`; the "
        "figures derived from them (pages per bin, post-EOS counts, the plot) recomputed by the "
        "command above.",
        "",
      ]
    lines += [
      f"Model `{r['model']}` ({cfg['architectures'][0]}, {cfg['num_hidden_layers']} layers, "
      f"{cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} KV heads, head dim "
      f"{cfg['head_dim']}). {r['num_prompts']} prompts of `{r['prompts']}` x {r['repeats']} = "
      f"{r['rows']} rows, temperature {r['temperature']}, {r['max_new_tokens']} new tokens a "
      f"row ({'ending at EOS' if r['stop_at_eos'] else 'not stopped at EOS'}; "
      f"{r['generated_tokens']} generated tokens scored), sampled sparsely at top-k "
      f"{r['sample_topk']} (mean scores). Page size {r['page_size']}, the first "
      f"{r['dense_layers']} layers dense, bins of {bs} cached tokens (tokens per bin: "
      f"{r['count_bin']}). Budgets are top-k pages + 3 always kept. Where each row first wrote "
      f"EOS (generated tokens, -1 = never): {r['first_eos']}. Generation "
      f"{r['generate_seconds']:.0f} s, scoring passes {sum(r['pass_seconds']):.0f} s, all "
      f"{r['seconds']:.0f} s.",
      "",
      "## (F1) alpha is skewed to 1: mean vs tail (exact alpha)",
      "",
      "| budget | mean | p50 | p10 | p5 | p1 | share > 0.999 | share < tau |",
      "|---|---|---|---|---|---|---|---|",
    ]
    for name in st:
      e = st[name]["exact"]
      lines.append(
        f"| {name} | {_fmt(e['mean'], 4)} | {_fmt(e['p50'], 4)} | {_fmt(e['p10'])} | "
        f"{_fmt(e['p5'])} | {_fmt(e['p1'])} | {_fmt(e['frac_above_0999'])} | "
        f"{_fmt(e['frac_below_tau'])} |"
      )
    high = [n for n in mean_runs if st[n]["exact"]["frac_above_0999"] >= 0.5]
    gaps = [st[n]["exact"]["mean"] - st[n]["exact"]["p5"] for n in mean_runs]
    tau = r["tau"]
    # the mean hides the tail where it passes tau and p5 does not: a mean-based choice would
    # take a budget whose tail fails
    hidden = [n for n in mean_runs if st[n]["exact"]["mean"] >= tau > st[n]["exact"]["p5"]]
    lines += [
      "",
      "- most tokens within 1e-3 of 1: "
      + _verdict(
        len(high) == len(mean_runs),
        "at every mean-score budget most tokens have alpha > 0.999.",
        f"most tokens have alpha > 0.999 at {len(high)} of {len(mean_runs)} mean-score budgets "
        "(the paper: most tokens, even when training collapses).",
      ),
      "- the mean hides the tail: "
      + _verdict(
        bool(hidden),
        f"at {len(hidden)} of {len(mean_runs)} mean-score budgets ({', '.join(hidden)}) the "
        f"mean meets tau {tau} while p5 is under it; the mean exceeds p5 by {min(gaps):.3f} to "
        f"{max(gaps):.3f}.",
        f"at no mean-score budget does the mean meet tau {tau} while p5 is under it; the mean "
        f"exceeds p5 by {min(gaps):.3f} to {max(gaps):.3f}.",
      ),
      "",
      f"## (F2) p5 by position bin under fixed budgets (exact alpha, bins of {bs} tokens)",
      "",
      "Bins hold the cached lengths schedule.position_bin gives them (a length's pages rounded "
      "up), shown per column.",
      "",
      "| budget | "
      + " | ".join(f"bin {b} ({_bin_lengths(b, r['page_size'], bs)})" for b in counted)
      + " |",
      "|---|" + "---|" * len(counted),
    ]
    for name in st:
      p5 = st[name]["exact"]["p5_bin"]
      lines.append(f"| {name} | " + " | ".join(_fmt(p5[b]) for b in counted) + " |")
    if "post_eos_bin" in r:
      post, count = r["post_eos_bin"], r["count_bin"]
      lines.append(
        "| *share of tokens after their row's first EOS* | "
        + " | ".join(f"{post[b] / count[b]:.0%}" for b in counted)
        + " |"
      )
    first, last = counted[0], counted[-1]
    falling = [
      n for n in mean_runs if st[n]["exact"]["p5_bin"][last] < st[n]["exact"]["p5_bin"][first]
    ]
    lines += [
      "",
      _verdict(
        len(falling) > len(mean_runs) / 2,
        f"p5 in the last bin is below the first bin's at {len(falling)} of {len(mean_runs)} "
        "mean-score budgets.",
        f"p5 in the last bin is below the first bin's at only {len(falling)} of "
        f"{len(mean_runs)} mean-score budgets.",
      ),
      "",
    ]
    if "post_eos_bin" in r:
      post, count = r["post_eos_bin"], r["count_bin"]
      lines += [
        f"{sum(post) / sum(count):.0%} of the scored tokens follow their row's first EOS "
        f"({'the rows end there' if r['stop_at_eos'] else 'the rows run past it'}): "
        f"{post[first] / count[first]:.0%} in the first measured bin, "
        f"{post[last] / count[last]:.0%} in the last (the table's last row).",
        "",
      ]
    lines += [
      f"## (F3) calibrated table at tau {r['tau']} (p{r['quantile']:g} per bin)",
      "",
      "Pages read at each bin's last cached length (top-k + 3, capped at the pages cached "
      "there: the bin's largest budget), and that as a share of those cached pages; the paper's "
      "tau-0.86 tables (2000-token bins, Qwen3) at the same lengths, which may step up inside "
      "one of our bins. A bin whose every candidate stays under tau takes the largest (marked "
      "*).",
      "",
      "| table | " + " | ".join(f"bin {b}" for b in range(bins)) + " |",
      "|---|" + "---|" * bins,
    ]
    for name, t in r["tables"].items():
      cells = [
        "no tokens" if not n else f"{p} ({c:.0%}){'' if ok else '*'}"
        for p, c, ok, n in zip(t["pages_bin"], t["share_bin"], t["meets_tau_bin"], r["count_bin"])
      ]
      score, kind = name.split("/")
      lines.append(f"| ours: {score} scores, {kind} alpha | " + " | ".join(cells) + " |")
    for model, d in r["paper_tables"].items():
      cells = [f"{p} ({c:.0%})" for p, c in zip(d["pages"], d["share"])]
      lines.append(f"| paper {model} | " + " | ".join(cells) + " |")
    exact = r["tables"]["mean/exact"]["pages_bin"]
    rising = exact[last] > exact[first]
    span_k = (last - first) * bs / 1024
    slope = (exact[last] - exact[first]) / span_k if span_k else float("nan")
    lines += [
      "",
      _verdict(
        rising,
        f"the exact-alpha table (mean scores) rises from {exact[first]} to {exact[last]} pages "
        "over the measured bins.",
        f"the exact-alpha table (mean scores) stays at {exact[first]} -> {exact[last]} pages "
        "over the measured bins.",
      ),
      "",
      "Per unit of context: ours adds "
      f"{slope:.1f} pages per 1K tokens between the first and the last measured bin; the "
      "paper's tables add, from their first to their last 2K bin (pages per 1K tokens): "
      + ", ".join(
        f"{m} {(t[-1] - t[0]) / ((len(t) - 1) * 2):.1f}" for m, t in _paper_topk(r).items()
      )
      + ".",
      "",
      "## The top-20 bound against exact alpha",
      "",
      "| budget | share of tokens bound <= exact | mean gap | max gap | p5 exact | p5 bound |",
      "|---|---|---|---|---|---|",
    ]
    for name, b in r["bound"].items():
      lines.append(
        f"| {name} | {_fmt(b['share_bound_le_exact'], 4)} | {_fmt(b['mean_gap'], 4)} | "
        f"{_fmt(b['max_gap'])} | {_fmt(st[name]['exact']['p5'])} | "
        f"{_fmt(st[name]['topk20']['p5'])} |"
      )
    lines += [
      "",
      "## Quest vs mean page scores at equal KV (exact alpha)",
      "",
      "| top-k | mean p5 | quest p5 | mean p1 | quest p1 | mean: mean alpha | quest: mean alpha |",
      "|---|---|---|---|---|---|---|",
    ]
    better = 0
    for k in r["quest_candidates"]:
      m, q = st.get(f"mean/{k}"), st[f"quest/{k}"]
      if m is None:
        continue
      m, q = m["exact"], q["exact"]
      better += q["p5"] > m["p5"]
      lines.append(
        f"| {k} | {_fmt(m['p5'])} | {_fmt(q['p5'])} | {_fmt(m['p1'])} | {_fmt(q['p1'])} | "
        f"{_fmt(m['mean'], 4)} | {_fmt(q['mean'], 4)} |"
      )
    lines += [
      "",
      f"Quest's p5 is above mean's at {better} of {len(r['quest_candidates'])} budgets.",
      "",
    ]
    if r.get("plot"):
      lines += [f"![mismatch plots](../../{r['plot']})", ""]
  return "\n".join(lines)


def decode_profile_page(records) -> str:
  """docs/results/decode_profile.md from experiments/profile_decode.py's record (where a decode
  step's time goes) and experiments/sparse_read_layouts.py's (the ways of reading the pages)."""
  lines = ["# Where a decode step's time goes on this CPU (measured)", ""]
  for record in records:
    r, config = record["results"], record["results"]["config"]
    lines += [_provenance(record), ""]
    if "modes" in r:
      lines += [
        f"`{config['model_dir']}` ({r['layers']} layers, {r['params'] / 1e6:.0f}M params, "
        f"{config['dtype']}), batch {config['batch']}, {config['context']} cached tokens a row "
        f"(random keys and values); sparse = `{config['schedule']}`, {r['budget_tokens']} tokens "
        f"a row, the first {config['dense_layers']} layers dense. A step's time is the median of "
        f"{config['runs']} interleaved calls of {config['steps']} steps: dense "
        f"{r['modes']['dense']['tok_s']:.1f} tok/s, sparse {r['modes']['sparse']['tok_s']:.1f} "
        f"tok/s, **{r['ratio']:.2f}x**. The parts are one more (profiled) call's XLA ops, each "
        "filed by the named scopes of the decode step (experiments/profile_decode.py): CPU time, "
        "which adds up over the runtime's two threads to more than the wall time; MB = the bytes "
        "the part must read a step, GB/s = those bytes over its time; the machine's measured "
        f"bandwidth is {r['mem_bandwidth'] / 1e9:.1f} GB/s.",
        "",
        "| part | dense ms | share | MB | GB/s | sparse ms | share | MB | GB/s |",
        "|---|---|---|---|---|---|---|---|---|",
      ]
      dense = {row["part"]: row for row in r["modes"]["dense"]["rows"]}
      for row in r["modes"]["sparse"]["rows"]:
        d = dense.get(row["part"])
        cell = lambda x: (
          f"{x['ms']:.1f} | {x['share']:.0%} | {x['mb']:.0f} | "
          + (f"{x['gbs']:.1f}" if x["gbs"] else "-")
          if x
          else "- | - | - | -"
        )
        lines.append(f"| {row['part']} | {cell(d)} | {cell(row)} |")
      for mode in ("dense", "sparse"):
        m = r["modes"][mode]
        lines.append("")
        lines.append(
          f"{mode}: the profiled call took {m['traced_step_ms']:.1f} ms a step (untraced: "
          f"{m['step_ms']:.1f}); its ops {m['cpu_ms']:.1f} ms of CPU time; no op running "
          f"{m['idle_ms']:.1f} ms a step."
        )
    else:
      lines += [
        f"One sparse layer's page reads at the profile's setting: batch {config['batch']}, "
        f"{config['kv_heads']} KV heads x {config['group']} queries, head dim "
        f"{config['head_dim']}, {config['context']} cached tokens, {config['pages']} pages of 16 "
        f"a (row, head); every way gives the reference's output (to float tolerance); median of "
        f"{config['runs']} interleaved calls (experiments/sparse_read_layouts.py).",
        "",
        "| way of reading | ms | MB | GB/s |",
        "|---|---|---|---|",
      ]
      for row in r["rows"]:
        lines.append(f"| {row['layout']} | {row['ms']:.2f} | {row['mb']:.1f} | {row['gbs']:.1f} |")
    lines.append("")
  return "\n".join(lines)


def real_lm_decode_page(records) -> str:
  """docs/results/real_lm_decode.md from bench_decode records run with decode.model_dir."""
  lines = [
    "# Real-LM decode speed on this CPU (measured)",
    "",
    "`experiments/bench_decode.py` with `decode.model_dir` (the command: "
    "[real_lm.md](../real_lm.md#decode-speed-with-the-real-weights)).",
    "",
  ]
  for record in records:
    r = record["results"]["decode"]
    lines += [
      _provenance(record),
      "",
      f"Model `{r['model_dir']}` ({r['layers']} layers, vocab {r['vocab_size']}, "
      f"{r['params'] / 1e6:.0f}M params, its real weights); schedule `{r['schedule']}`; batch "
      f"{record['results']['config']['batch']}; random cached keys and values at each context "
      "(decode cost does not depend on them).",
      "",
      "| context | budget (tokens) | dense layers | dense tok/s | sparse tok/s | ratio | "
      "cost model | + weights |",
      "|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
      lines.append(
        f"| {row['context']} | {row['budget']} | {row['dense_layers']} | "
        f"{row['dense_tok_s']:.2f} | {row['sparse_tok_s']:.2f} | {row['ratio']:.2f}x | "
        f"{row['cost_model']:.2f}x | {row['with_weights']:.2f}x |"
      )
    lines.append("")
  return "\n".join(lines)


def speculative_rollout_page(records) -> str:
  """docs/results/speculative_rollout.md from experiments/bench_exact.py's record."""
  lines = [
    "# Exact mode vs dense and lossy sparse decoding (measured)",
    "",
    "`experiments/bench_exact.py`: tokens/s of each setting, its calls interleaved with the "
    "others' in one run. (1) the engine's decode programs over one page pool at a fixed context "
    "of random cached keys, random weights of the Qwen3-1.7B shape cut in depth; (2) whole "
    "rollouts of the shipped tiny model on its own task (a trained model's acceptance). dense: "
    "every layer reads every cached page; dense again: the same call a second time, the spread "
    "of this machine between identical calls; sparse: the schedule's pages (lossy: rows are the "
    "sparse policy's); speculateK: exact mode, K sparse drafts and one dense verification a "
    "round; auto: the regime switch (`rollout.speculate = \"auto\"`), its plan (drafts per "
    "position bin, 0 = dense decoding) priced as the trainer's switch prices it: the measured "
    "seconds per round of dense decoding and of each speculateK (the roofline giving only how "
    "prices change with length) at the acceptance measured on the speculateK rows. Exact rows "
    "are the dense policy's samples. accepted / round counts the tokens a row-round emits; draft "
    "acceptance is accepted over judged drafts. Decode alone (whole rollouts of long prompts): "
    "the rows' tokens after the first over the decode chunks' seconds; its host share, the part "
    "of those seconds outside the chunks' programs (the engine's scheduling between chunks).",
    "",
  ]
  for record in records:
    r = record["results"]
    c = r["config"]
    parts = []
    if c["shapes"]["contexts"]:
      parts.append(
        f"(1) {c['shapes']['layers']} layers, {c['shapes']['dense_layers']} kept dense by the "
        f"drafts, batch {c['batch']}, {c['shapes']['steps']} tokens a timed chunk, temperature "
        f"{c['temperature']}, the paper's tau-{c['shapes']['tau']} table"
      )
    if c["trained"]["enabled"]:
      t = c["trained"]
      parts.append(
        f"(2) `{t['model']['hf_dir']}`, {t['rollout']['prompts_per_step']} prompts x "
        f"{t['rollout']['group_size']} rows of up to {t['rollout']['max_new_tokens']} tokens"
      )
    if c.get("long_prompts", {}).get("enabled"):
      lp = c["long_prompts"]
      parts.append(
        f"(3) `{lp['model']['hf_dir']}` (real weights), {lp['rows']} prompts a length x "
        f"{lp.get('group_size', 1)} rows each (rows "
        f"`longN`: N prompt tokens) of {lp['instruction']} + real text (the files of "
        f"`long_prompts` in the record), {lp['rollout']['max_new_tokens']} new tokens a row, "
        f"temperature {lp['rollout']['temperature']}, its table `{lp['rollout']['schedule']}`"
      )
    lines += [
      _provenance(record),
      "",
      f"{'; '.join(parts)}. The switch priced rounds on {r['hardware']['name']}; median of "
      f"{c['runs']} calls.",
      "",
      "| shape | setting | tok/s | vs dense | decode alone tok/s | vs dense | host share of decode "
      "| accepted / round | draft acceptance | plan |",
      "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
      fmt = lambda key, f: "-" if row.get(key) is None else format(row[key], f)
      cells = [str(row["context"]), row["setting"], f"{row['tokens_per_s']:.1f}"]
      cells += [f"{row['vs_dense']:.2f}x", fmt("decode_tokens_per_s", ".1f")]
      cells += [fmt("decode_vs_dense", ".2f"), fmt("decode_host_share", ".2f")]
      cells += [fmt("accepted_per_round", ".2f")]
      cells += [fmt("draft_acceptance", ".3f"), " ".join(map(str, row.get("plan_k_bin", ["-"])))]
      lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *_exact_verdict(r["rows"]), ""]
  return "\n".join(lines)


def _exact_verdict(rows) -> list:
  """The switch against the targets: >= dense at every shape (within the dense-again spread), and
  >= 1.25x dense where lossy sparse is >= 2x."""
  out = []
  for shape in dict.fromkeys(row["context"] for row in rows):
    at = [row for row in rows if row["context"] == shape]
    # rows with a decode-alone rate (whole rollouts of long prompts) are judged on it: their
    # prefill is the same dense pass in every setting
    key = "decode_vs_dense" if all("decode_vs_dense" in row for row in at) else "vs_dense"
    by = {row["setting"]: row[key] for row in at}
    noise = abs(1 - by.get("dense again", 1.0))
    auto, sparse = by["auto"], by["sparse"]
    never_slower = "met" if auto >= 1 - noise else "missed"
    line = (
      f"- {shape}{' (decode alone)' if key == 'decode_vs_dense' else ''}: auto {auto:.2f}x "
      f"dense, the dense-again spread {noise:.2f}: never slower than dense {never_slower}"
    )
    if key == "decode_vs_dense":
      best = max((s for s in by if s.startswith("speculate")), key=by.get)
      line += (
        f"; the best fixed k, {best}, {by[best]:.2f}x dense: 1.4x "
        + ("met" if by[best] >= 1.4 else "missed")
        + f"; auto within the spread of it: {'met' if auto >= by[best] - noise else 'missed'}"
      )
    if sparse >= 2:
      line += f"; lossy sparse {sparse:.2f}x, so the 1.25x target: "
      line += "met" if auto >= 1.25 else "missed"
    out.append(line + ".")
    # what a round buys: tokens it emits against its cost in dense steps (its rate is
    # accepted_per_round / round seconds, dense's 1 / step seconds)
    rounds = [
      f"{row['setting']} a round costs {row['accepted_per_round'] / by[row['setting']]:.2f} dense "
      f"steps and emits {row['accepted_per_round']:.2f} tokens"
      for row in rows
      if row["context"] == shape and row["setting"].startswith("speculate")
    ]
    out.append(f"  - {'; '.join(rounds)}.")
  return out


def multi_turn_workload_page(records) -> str:
  """docs/results/multi_turn_workload.md from experiments/bench_multiturn.py's record."""
  lines = [
    "# A multi-turn workload dominated by observations: dense, sparse, exact, slow tools "
    "(measured)",
    "",
  ]
  for record in records:
    r, config = record["results"], record["results"]["config"]
    env = config["run"]["env"]
    lines += [
      _provenance(record),
      "",
      f"`{config['run']['task']['name']}` ({env['hops']} hops, each lookup the hop's line among "
      f"{env['decoys']} others) with the multi-turn default's tiny model "
      f"`{config['run']['model']['hf_dir']}`, {r['rows_count']} rows of up to "
      f"{config['run']['rollout']['max_new_tokens']} tokens, sparse = "
      f"`{config['run']['rollout']['schedule']}`; median of {config['runs']} interleaved calls "
      "(experiments/bench_multiturn.py). Model tok/s counts the model's own tokens over the whole "
      "call; decode alone over the decode chunks' seconds. KV reads are (page, layer) reads a "
      f"model token. Slow tools: each lookup of the odd rows takes {config['slow_tool_s']} s "
      "longer; the stalled bound is the fast call plus the slowest row's calls x that delay, what "
      "a batch that stopped for each call would take at least.",
      "",
      "| setting | s | model tok/s | vs dense | decode alone tok/s | vs dense | KV reads / token "
      "| vs dense | observation share | tool calls | draft acceptance | stalled bound (s) |",
      "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
      acc = row["draft_acceptance"]
      lines.append(
        f"| {row['setting']} | {row['seconds']:.1f} | {row['tokens_per_s']:.1f} | "
        f"{row['vs_dense']:.2f}x | {row['decode_tokens_per_s']:.1f} | "
        f"{row['decode_vs_dense']:.2f}x | {row['kv_reads_per_token']:.1f} | "
        f"{row['kv_read_vs_dense']:.2f}x | {row['observation_share']:.2f} | {row['tool_calls']} | "
        + ("-" if acc is None else f"{acc:.3f}")
        + " | "
        + (f"{row['stalled_bound_s']:.1f}" if "stalled_bound_s" in row else "-")
        + " |"
      )
    lines.append("")
  return "\n".join(lines)


def async_rl_page(records) -> str:
  """docs/results/async_rl.md from experiments/bench_async.py's record."""
  lines = [
    "# On-policy vs one step off vs partial rollouts (measured)",
    "",
    "`experiments/bench_async.py`: each job trained for the same steps from scratch with "
    "`rl.off_policy_steps` = 0 (sync) and 1 (one step off: the next step's rollouts, sampled and "
    "graded in a thread, overlap the update), and one step off with `rollout.partial_groups` "
    "(partial rollouts: a step trains on the first groups to end, the rest go on next step), on "
    "the trainer's own devices. step: the mean wall time of a step (`perf/step_s`) after the "
    "first, which compiles; speed: sync's step time over the setting's; trainer idle: the share "
    "of a step the trainer waited for rollouts (`perf/rollout_wait_s`); update: the train step's "
    "own time; length: the trained rows' mean and longest response (mean over steps); carried: "
    "rows cut at an earlier step's end and finished later (`rollout/rows_carried`); lag: "
    "the mean age in steps of the weights that sampled a trained token (`rollout/token_lag/mean`) "
    "and the oldest (`rollout/token_lag/max`, mean over steps); carry bound: "
    "`rollout.max_carry_steps` where rows are carried (0: none); "
    "stale alpha: the mean `acceptance_stale/mean` (the sampling weights' dense policy against "
    "the current one); sync again repeats the first setting, the spread of this machine between "
    "identical runs.",
    "",
  ]

  def mean(row, key):  # over the steps after the first; None where the run logs no such metric
    values = [s[key] for s in row["steps"][1:] if key in s]
    return sum(values) / len(values) if values else None

  for record in records:
    r = record["results"]
    lines += [_provenance(record), ""]
    for job in dict.fromkeys(row.get("job", "default") for row in r["rows"]):
      rows = [row for row in r["rows"] if row.get("job", "default") == job]
      config = r["config"].get(job) or r["config"]["job"]
      ro, task = config["rollout"], config["task"]
      lines += [
        f"**{job}**: `configs/default.py` with {task['min_hops']}-{task['max_hops']} hop chains "
        f"({ro['prompts_per_step']} prompts x {ro['group_size']} rows of up to "
        f"{ro['max_new_tokens']} tokens, rollout.speculate = {ro['speculate']}), "
        f"{r['config']['steps']} steps a run.",
        "",
        "| setting | step (s) | speed | trainer idle | update (s) | length mean / max | carried "
        "| lag mean / max | carry bound | last reward | stale alpha |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
      ]
      for row in rows:
        cells = [
          row["setting"],
          f"{row['step_s']:.2f}",
          f"{rows[0]['step_s'] / row['step_s']:.2f}x",
          f"{100 * row['idle_share']:.0f}%",
          f"{row['train_step_s']:.2f}",
          f"{mean(row, 'response_length/mean'):.0f} / {mean(row, 'response_length/max'):.0f}"
          if mean(row, "response_length/max") is not None
          else "-",
        ]
        carried, lag = mean(row, "rollout/rows_carried"), mean(row, "rollout/token_lag/mean")
        lag_max = mean(row, "rollout/token_lag/max")
        cells += [
          "-" if carried is None else f"{carried:.1f}",
          "-"
          if lag is None
          else f"{lag:.2f} / {lag_max:.1f}"
          if lag_max is not None
          else f"{lag:.2f}",
          str(row["max_carry_steps"])
          if row.get("partial_groups") and "max_carry_steps" in row
          else "-",
        ]
        stale = mean(row, "acceptance_stale/mean")
        cells += [
          f"{row['steps'][-1]['reward/mean']:.3f}",
          "-" if stale is None else f"{stale:.4f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
      lines += ["", *_length_bias(rows, mean), ""]
  return "\n".join(lines)


def _length_bias(rows, mean) -> list:
  """The trained rows' mean length of each setting that carries rows against the first (sync)
  setting's: how much shorter the rows a step trains are when long rows train later."""
  base = mean(rows[0], "response_length/mean")
  carrying = [row for row in rows if row.get("partial_groups")]
  if not carrying or base is None:
    return []
  parts = [
    f"{row['setting']} {mean(row, 'response_length/mean'):.0f} "
    f"({mean(row, 'response_length/mean') / base:.2f}x)"
    for row in carrying
  ]
  return [
    f"Length bias: trained mean response length, {rows[0]['setting']} {base:.0f} against "
    + ", ".join(parts)
    + "."
  ]


def real_lm_rl_page(records) -> str:
  """docs/results/real_lm_rl.md from run_report's record of short RL runs on the real LM: what a
  step costs here, and so whether a run fits."""
  lines = ["# RL steps on the real LM (measured)", ""]
  for record in records:
    lines += [_provenance(record), ""]
    lines += [
      "| run | steps | wall time (s) | first step, with compilation (s) | rollouts, all steps (s) "
      "| train steps, all steps (s) | median train step after the first (s) | reward per step |",
      "|---|---|---|---|---|---|---|---|",
    ]
    for name, v in record["results"]["runs"].items():
      t = v["summary"]["time_s"]
      lines.append(
        f"| {name} | {v['steps']} | {t['total']:.0f} | {t['first_step']:.0f} | "
        f"{t['rollout']:.0f} | {t['train_step']:.0f} | {v['train_step_median_s']:.0f} | "
        f"{_cells(v['reward_curve'])} |"
      )
    lines += [""]
    lines += [
      f"- {name}: `{v['summary']['command']}`, commit `{v['summary']['commit'][:12]}`"
      for name, v in record["results"]["runs"].items()
    ]
    lines.append("")
  return "\n".join(lines)


def speculative_training_page(records) -> str:
  """docs/results/speculative_training.md from experiments/speculative_training.py's record."""
  record = records[0]
  r = record["results"]
  v = r["verdict"]
  dense, spec = r["settings"]["dense"], r["settings"]["speculate"]
  lines = [
    "# Exact mode's training test (measured)",
    "",
    "The default job with `rollout.speculate = "
    f"{spec['speculate']}` against the shipped dense runs of the same seeds; the rule was "
    "written before the runs ([rollout_engine.md](../rollout_engine.md#the-training-test-written"
    "-before-its-runs)): passed if the speculative mean held-out score is at least dense mean - "
    "dense std (ddof 1), failed if below, inconclusive unless every seed finished.",
    "",
    _provenance(record),
    "",
    f"Seeds {', '.join(map(str, spec['seeds']))}; mean +- std over them.",
    "",
    "| setting | held-out score | held-out exact | KV read | rollout tok/s | reward, last |",
    "|---|---|---|---|---|---|",
  ]
  for name, d in (("dense", dense), ("speculate", spec)):
    lines.append(
      f"| {name} | {_sweep_cell(d['heldout_score'])} | {_sweep_cell(d['heldout_accuracy'])} | "
      f"{_sweep_cell(d['kv_read'])} | {_sweep_cell(d['rollout_tokens_per_s'], 0)} | "
      f"{_sweep_cell(d['reward_last'])} |"
    )
  lines += [
    "",
    "| run | held-out score | KV read | tok/s vs dense | accepted / round | draft acceptance | "
    "TIS weight |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, run in r["runs"].items():
    lines.append(
      f"| {name} | {run['heldout_score']:.3f} | {run['kv_read']:.3f} | "
      f"{run['measured_speedup']:.2f}x | {run['rollout_accepted_per_round']:.2f} | "
      f"{run['rollout_draft_acceptance']:.3f} | {run['tis_weight_mean']:.4f} |"
    )
  lines += [
    "",
    f"The line: {v['dense_mean']:.3f} - {dense['heldout_score']['std']:.3f} = {v['line']:.3f}. "
    f"**Verdict: {v['verdict']}.**",
    "",
  ]
  return "\n".join(lines)


def train_step_buckets_page(records) -> str:
  """docs/results/train_step_buckets.md from experiments/bench_train_step.py's record."""
  lines = [
    "# The train step with length buckets (measured)",
    "",
    "`experiments/bench_train_step.py` times the fused train step on one batch of long-tailed "
    "rows (random weights and tokens, completion lengths geometric with mean cutoff / 2, capped "
    "at the cutoff) at the full row length and with `rl.length_buckets` "
    "([configuration.md](../configuration.md#length-buckets)), the two interleaved call by call; "
    "median seconds per step.",
    "",
  ]
  for record in records:
    r, c = record["results"], record["results"]["config"]
    m = r["model"]
    lines += [
      _provenance(record),
      "",
      f"{m['layers']} layers, width {m['width']}, vocab {m['vocab']} ({c['model']} shape); "
      f"{c['prompts'] * c['group_size']} rows of {c['prompt'] + c['cutoff']} tokens (prompt "
      f"{c['prompt']}), {r['completion_tokens']} completion tokens; {c['num_minibatches']} "
      f"update(s) x {c['micro_batches']} micro-batches; buckets {tuple(c['length_buckets'])}, "
      f"the micro-batches ran at {r['micro_batch_buckets']}.",
      "",
      "| setting | s a step | completion tokens/s |",
      "|---|---|---|",
    ]
    for name, t in r["times"].items():
      lines.append(f"| {name} | {t['seconds']:.3f} | {t['tokens_per_s']:,.0f} |")
    lines += ["", f"Bucketed / full speed: **{r['speedup']:.2f}x**.", ""]
  return "\n".join(lines)


def _async_cell(f) -> str:
  """A priced step: seconds, the split's R when it has one, the speedup against on-policy."""
  r = f" (R = {f['rollout_devices']})" if f["rollout_devices"] else ""
  return f"{f['step_s']:.0f} s{r}, **{f['speedup']:.2f}x**"


def async_pricing_page(records) -> str:
  """docs/results/async_pricing.md from experiments/price_async.py's record."""
  lines = [
    "# On-policy vs one step off on the paper's workload (predicted)",
    "",
    "`experiments/price_async.py` prices one RL step of the paper's 1.7B config on the roofline "
    "of `sparrow_jax/mismatch/cost_model.py` ([cost_model.md](../cost_model.md)): the rollout "
    "(dense, or sparse under the published tau table), the update (its passes at the expected row "
    "of the length distribution) and the weights' transfer to the rollout, in four layouts "
    "([async_rl.md](../async_rl.md)): on-policy on all N devices (the baseline), one step off on "
    "the same devices (nothing overlaps: one device runs one program at a time), and R devices "
    "rolling out while N - R train, on-policy and one step off (the slower side plus the "
    "transfer), R swept. Nothing here is timed; the script's docstring lists what is left out. "
    "Speedup = the on-policy colocated step / the layout's; as configured: the splits the config "
    "runs (whole groups on every rollout device, a backward pass's rows even over the trainers).",
    "",
  ]
  for record in records:
    r = record["results"]
    c = r["config"]
    lines += [
      _provenance(record),
      "",
      f"{c['model']} ({r['params_b']:.2f}B), {c['devices']} x {c['hardware']} "
      f"({r['peak_tflops']:.0f} TFLOP/s, {r['bandwidth_gbs']:.0f} GB/s HBM, {c['link_gbs']:g} GB/s "
      f"link), {c['prompts_per_step']} x {c['group_size']} rows a step, prompt {c['prompt_len']}, "
      f"cutoff {c['gen_len']}, geometric response lengths of mean {r['mean_response']:.0f} tokens. "
      f"Derated: the rollout at {c['decode_share_dense']:.0%} (dense) / "
      f"{c['decode_share_sparse']:.0%} (sparse) of its roofline, the update at "
      f"{c['train_mfu']:.0%} MFU.",
      "",
    ]
    for kind, b in r["balance"].items():
      lines.append(
        f"- {kind} rollouts: the rollout is **{b['rollout_share']:.0%}** of the on-policy step at "
        f"the roofline; the two sides would balance at R = {b['r_star']:.2f} of {c['devices']} "
        "if both scaled linearly with their devices."
      )
    if r["paper_rollout_share"] is not None:
      lines.append(
        f"- the paper's rollout and step speedups of sparse over dense imply a rollout share of "
        f"{r['paper_rollout_share']:.0%} of its dense step."
      )
    lines += [
      "",
      "| scenario | rollouts | on-policy, colocated | one step off, colocated | on-policy, split "
      "(best R) | one step off, split (best R) | one step off, split (as configured) |",
      "|---|---|---|---|---|---|---|",
    ]
    for scenario, by_kind in r["scenarios"].items():
      for kind, f in by_kind.items():
        conf = f["one step off, split"]["best_configured"]
        cells = [
          scenario,
          kind,
          _async_cell(f["on-policy, colocated"]),
          _async_cell(f["one step off, colocated"]),
          _async_cell(f["on-policy, split"]["best"]),
          _async_cell(f["one step off, split"]["best"]),
          _async_cell(conf) if conf else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    step = lambda by_kind, kind: by_kind[kind]["on-policy, colocated"]["step_s"]
    lines += [
      "",
      "Sparse over dense rollouts, the on-policy colocated step (the paper's RL step speedup): "
      + ", ".join(
        f"{scenario} **{step(by_kind, 'dense') / step(by_kind, 'sparse'):.2f}x**"
        for scenario, by_kind in r["scenarios"].items()
      )
      + ".",
      "",
      "One step off on rollout devices of their own, every R (rollout / update / weights, "
      "seconds; peak: weights + the largest KV the busiest rollout device holds, against "
      f"{c['hbm_gb']:g} GB):",
      "",
      "| scenario | rollouts | R | rollout | update | weights | step | speedup | as configured | "
      "peak GB |",
      "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for scenario, by_kind in r["scenarios"].items():
      for kind, f in by_kind.items():
        for g in f["one step off, split"]["sweep"]:
          cells = [
            scenario,
            kind,
            str(g["rollout_devices"]),
            f"{g['rollout_s']:.0f}",
            f"{g['update_s']:.0f}",
            f"{g['weights_s']:.3f}",
            f"{g['step_s']:.0f}",
            f"{g['speedup']:.2f}x",
            "yes" if g["runs_as_configured"] else "no",
            f"{g['rollout_peak_gb']:.0f}",
          ]
          lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
  return "\n".join(lines)


def _layout_gb(side, hbm) -> str:
  """A device's GB, or why it does not fit: the compiler's refusal, or more than the device has."""
  if side["gb"] is None:
    needs = side.get("needs_gb")
    return "does not fit" + (f" (needs {needs:.1f})" if needs else "")
  if side["fits"] is False:
    return f"{side['gb']:.1f}: does not fit (over {hbm:.1f})"
  if hbm and side["gb"] > hbm:  # one program the compiler accepted: its sum overstates its peak
    return f"{side['gb']:.1f} (over {hbm:.1f}, compiled)"
  return f"{side['gb']:.1f}"


def _layout_engine(eng) -> str:
  """The engine's arguments + temporaries (its pool), or the compiler's refusal."""
  if not eng["fits"]:
    needs = eng.get("needs_gb")
    return "refused" + (f", needs {needs:.1f}" if needs else "")
  return f"{eng['args_gb'] + eng['temp_gb']:.1f} ({eng['pool_gb']:.1f})"


def _layout_settings(i, c) -> str:
  return (
    f"record {i}: {c['target']}, {c['dtype']}, distill {c['distill']}, engine "
    f"{c['engine_slots']} slots, chunks of {c['engine_chunk']} steps"
  )


def _layout_rows(i, key, fig) -> list:
  """A table row per layout and engine pool of one (model, length) of a layout record."""
  _, model, tokens = key.split("/")
  summary = fig["summary"]
  hbm = summary["hbm_gb"]
  rows = []
  for name, lay in fig.items():
    if name in ("engine", "summary"):
      continue
    n, sides = lay["rollout_devices"], summary["layouts"][name]
    state = lay["train"].get("state_gb")
    for pool, eng in fig.get("engine", {}).items():
      cells = [
        f"{n} rollout + {lay['trainer_devices']} train" if n else "colocated",
        str(i),
        f"({lay['mesh']})",
        f"{lay['train_rows']} ({lay['train_minibatches']} x {lay['micro_batches']})",
        str(lay["off_policy_steps"]),
        model,
        tokens,
        "" if state is None else f"{state:.1f}",
        f"{pool} GB",
        _layout_engine(eng),
        f"**{_layout_gb(sides['trainer_device'], hbm)}**",
        f"**{_layout_gb(sides['rollout_device'][pool], hbm)}**"
        if pool in sides["rollout_device"]
        else "",
      ]
      rows.append("| " + " | ".join(cells) + " |")
  return rows


def _layout_refusals(records) -> list:
  """The compiler's words for each side it refused."""
  out = []
  for i, record in enumerate(records, 1):
    for key, fig in record["results"].items():
      if not key.startswith("layout/"):
        continue
      sides = [
        (f"{name} train step", lay["train"])
        for name, lay in fig.items()
        if name not in ("engine", "summary")
      ]
      sides += [(f"engine, pool {pool} GB", eng) for pool, eng in fig.get("engine", {}).items()]
      out += [
        f"- record {i}, {key[7:]}, {name}: `{s['error']}`" for name, s in sides if not s["fits"]
      ]
  return out


def memory_layout_page(records) -> str:
  """docs/results/memory_layout.md from experiments/memory_report.py's layout records: memory per
  device of each side of a run, colocated and with rollout devices of their own."""
  lines = [
    "# Memory per device: colocated vs rollout devices of their own (compiled, not run)",
    "",
    "`experiments/memory_report.py --config.parts=layout` compiles, at full width and depth, the "
    "train step on each layout's trainer mesh and the engine's decode chunk on one rollout device "
    "(its weights whole, its page pool), and reads `compiled.memory_analysis()` per device "
    "(nothing is allocated; GB = 1e9 bytes). Colocated (rollout devices 0), every device trains "
    "and rolls out: while it rolls out it keeps the train state (params, Adam states, sharded "
    "over the mesh) beside the engine's weights, pool and temporaries, so the rollout device "
    "column adds the state to the engine. With n rollout devices of their own the trainer's mesh "
    "is the rest of the devices and each side holds only its own ([many_devices.md](../many_"
    "devices.md#laying-out-rollout-and-trainer-devices)). trainer device = the step's arguments "
    "(state and batch) + temporaries; engine = the decode chunk's arguments (weights, pool, "
    "slots) + temporaries. Where the compiler refuses a side for memory, the side does not fit "
    "and its cell gives the bytes the compiler says it needs (its words below, its G = 2^30 "
    "bytes, converted to GB); the engine is then compiled again over smaller pools until one "
    "fits. A compiled program whose arguments + temporaries exceed the device's memory is marked "
    "compiled: the compiler, which refuses what does not fit, accepted it, so that sum overstates "
    "its peak. A colocated rollout device is a sum over two programs (the engine and the state "
    "the trainer keeps), checked against the device's memory.",
    "",
    "| layout | record | trainer mesh (data, fsdp, tensor) | train rows (minibatches x "
    "micro-batches) | off policy | model | tokens a row | state | engine pool | engine (pool) | "
    "trainer device | rollout device |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  notes = []
  for i, record in enumerate(records, 1):
    notes.append(f"{i}. {_provenance(record)}")
    for key, fig in record["results"].items():
      if key.startswith("layout/"):
        lines += _layout_rows(i, key, fig)
  hbm = sorted(
    {
      f"{f['summary']['hbm_gb']:.1f}"
      for r in records
      for k, f in r["results"].items()
      if k.startswith("layout/") and f["summary"]["hbm_gb"]
    }
  )
  lines += [
    "",
    "A device's memory, as the compiler's refusals name it: "
    + (", ".join(hbm) + " GB." if hbm else "not named (no side was refused)."),
    "",
    "Targets and settings: "
    + "; ".join(_layout_settings(i, r["results"]["config"]) for i, r in enumerate(records, 1))
    + ".",
    "",
  ]
  refusals = _layout_refusals(records)
  if refusals:
    lines += ["The compiler's refusals:", ""] + refusals + [""]
  return "\n".join(lines + notes + [""])


PAGES = {
  "rollout_engine.md": ("engine_long_tail_*.json", engine_page),
  "memory_tpu.md": ("memory_tpu_*.json", memory_page),
  "memory_cpu.md": ("memory_cpu*.json", memory_cpu_page),
  "tpu_compile_check.md": ("tpu_compile_check.json", tpu_compile_page),
  "triton_sm90.md": ("triton_sm90.json", triton_page),
  "quantile_sweep.md": ("quantile_sweep.json", quantile_page),
  "mask_sweep.md": ("mask_sweep.json", mask_page),
  "threshold_sweep.md": ("threshold_sweep.json", threshold_sweep_page),
  "cost_model.md": ("cost_model.json", cost_model_page),
  "decode_attention.md": ("decode_attention.json", decode_attention_page),
  "decode_rollout.md": ("decode_rollout*.json", decode_rollout_page),
  "embedded_default.md": ("embedded_*.json", embedded_default_page),
  "distill_sparse.md": ("distill_sparse.json", distill_sparse_page),
  "real_lm_mismatch.md": ("real_lm_mismatch.json", real_lm_mismatch_page),
  "real_lm_decode.md": ("real_lm_decode.json", real_lm_decode_page),
  "decode_profile.md": ("decode_profile*.json", decode_profile_page),
  "real_lm_rl.md": ("real_lm_rl.json", real_lm_rl_page),
  "speculative_rollout.md": ("speculative_rollout*.json", speculative_rollout_page),
  "multi_turn.md": ("multi_turn_run*.json", multi_turn_page),
  "multi_turn_workload.md": ("multi_turn_workload.json", multi_turn_workload_page),
  "async_rl.md": ("async_rl*.json", async_rl_page),
  "speculative_training.md": ("speculative_training.json", speculative_training_page),
  "train_step_buckets.md": ("train_step_buckets.json", train_step_buckets_page),
  "async_pricing.md": ("async_pricing.json", async_pricing_page),
  "memory_layout.md": ("memory_layout_*.json", memory_layout_page),
}


# The directories records name as the docs' commands do (no machine's own path), and what they are.
PATH_NOTES = {
  "$HOME/.cache/sparrow_jax/smollm2-135m-instruct": "the model dir `experiments/import_gguf.py` "
  "writes by default ([real_lm.md](../real_lm.md))",
  "VENV/bin/python": "the Python of a venv with google-tunix "
  "([decode_speed.md](../decode_speed.md#against-another-jax-library))",
}


def _path_notes(text) -> str:
  """A closing line saying what each of PATH_NOTES' directories in `text` is ("" if none)."""
  notes = [f"`{path}` is {what}" for path, what in PATH_NOTES.items() if path in text]
  return "Directories: " + "; ".join(notes) + ".\n" if notes else ""


def pages() -> dict:
  out = {}
  for page, (pattern, render) in PAGES.items():
    paths = sorted(glob.glob(os.path.join(RESULTS, pattern)))
    records = [json.load(open(p)) for p in paths]
    if records:
      text = render(records)
      notes = _path_notes(text)
      out[page] = text.rstrip("\n") + "\n\n" + notes if notes else text
  return out


def main(argv):
  stale = []
  for page, text in pages().items():
    path = os.path.join(RESULTS, page)
    if "--check" in argv:
      if not os.path.exists(path) or open(path).read() != text:
        stale.append(page)
    else:
      with open(path, "w") as f:
        f.write(text)
      print(f"wrote {os.path.relpath(path, ROOT)}")
  if stale:
    print(f"stale results pages (run python docs/make_results_pages.py): {stale}")
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
