"""Calibrates a KV-budget schedule at threshold tau and writes schedule.json, surface.json and
calibration.png to config.out_dir.

  python experiments/calibrate_schedule.py --config=configs/calibrate.py \\
      [--config.stats.tau=0.9 ...]

configs/calibrate.py documents every field and a smoke run. Prompts are synthetic pointer chasing
(sparrow_jax.data.synthetic, config.task.min_hops..max_hops) or token ids from a .jsonl file
(config.prompts). config.calibration.alpha = "topk20" scores the reference code's top-20 lower bound
on alpha (what the paper's tau was measured with); config.calibration.on_policy samples each
candidate's rollouts under its own schedule instead of one set under the largest. A
config.model.preset model is randomly initialised (std config.model.init_std): a smoke run of the
pipeline, not a meaningful schedule. config.speculative.report also prints and writes
(speculative.json) per bin the budget and draft count that maximise the predicted throughput of
lossless (speculative) rollouts.
"""

import json
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

import sparrow_jax as sj
from sparrow_jax import records, schema
from sparrow_jax.data import synthetic
from sparrow_jax.mismatch import calibrate as cal


def read_prompts(path, num_prompts):
  """The first `num_prompts` prompts of a token-id jsonl file."""
  prompts = []
  with open(path) as f:
    for row, line in enumerate(f, 1):
      if not line.strip():
        continue
      item = json.loads(line)
      ids = item.get("prompt_ids") if isinstance(item, dict) else item
      if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
        raise ValueError(
          f"{path} row {row}: expected a non-empty JSON list of token ids or "
          f'{{"prompt_ids": [...]}}, got {line.strip()[:80]}'
        )
      prompts.append(ids)
      if len(prompts) == num_prompts:
        break
  if not prompts:
    raise ValueError(f"{path} holds no prompts")
  return prompts


def hf_token_ids(model_dir):
  """(eos_ids, pad_id) from generation_config.json / config.json, when the dir has them."""
  eos, pad = [], None
  for name in ("config.json", "generation_config.json"):  # the latter wins
    path = os.path.join(model_dir, name)
    if os.path.exists(path):
      with open(path) as f:
        d = json.load(f)
      if d.get("eos_token_id") is not None:
        eos = d["eos_token_id"] if isinstance(d["eos_token_id"], list) else [d["eos_token_id"]]
      pad = d.get("pad_token_id", pad)
  return eos, pad


def parse_ints(text, field):
  try:
    return [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise ValueError(f"config.{field} must be comma-separated integers, got {text!r}") from None


def load_model(m, seed):
  """(cfg, params, eos_ids, pad_id) of config.model: an HF dir, or a preset initialised at
  random."""
  if bool(m.hf_dir) == bool(m.preset):
    raise ValueError(
      f"set exactly one of config.model.hf_dir / config.model.preset; got "
      f"{m.hf_dir!r} / {m.preset!r}"
    )
  dtype = jnp.dtype(m.dtype)
  if m.hf_dir:
    cfg, params = sj.load_hf(m.hf_dir, dtype=dtype)
    eos_ids, pad_id = hf_token_ids(m.hf_dir)
    return cfg, params, eos_ids, pad_id if pad_id is not None else 0
  cfg = sj.Qwen3Config.preset(m.preset)
  return cfg, sj.init_params(cfg, jax.random.PRNGKey(seed), dtype, std=m.init_std), [], 0


def load_prompts(c, eos_ids, pad_id):
  """(prompts, eos_ids, pad_id): the synthetic task's (its EOS unless the model names one) or
  config.prompts' token ids."""
  if c.prompts != "synthetic":
    return read_prompts(c.prompts, c.num_prompts), eos_ids, pad_id
  task = synthetic.PointerChase(min_hops=c.task.min_hops, max_hops=c.task.max_hops)
  prompts = [list(p.prompt_ids) for p in task.sample(c.num_prompts, c.seed)]
  return prompts, eos_ids or [task.eos_id], task.pad_id


def speculative_report(c, result, cfg, sparse):
  """Per bin, the budget and draft count k that maximise predicted lossless throughput
  (`calibrate.speculative_plan` on the calibration's mean acceptance), printed and written to
  c.out_dir/speculative.json."""
  s = c.speculative
  plan = cal.speculative_plan(
    result.mean,
    result.candidates,
    cfg,
    sparse,
    bin_size=result.bin_size,
    ks=s.ks,
    rows=s.rows,
    hardware=s.hardware,
  )
  print(
    f"[calibrate] lossless (speculative) rollouts on {plan['hardware']}, {s.rows} rows, k in "
    f"{list(plan['ks'])}, from the mean acceptance per bin (k 0: dense decoding):"
  )
  for b, (topk, k, per_round, speedup) in enumerate(
    zip(plan["topk"], plan["k"], plan["tokens_per_round"], plan["speedup"])
  ):
    if k is None:
      print(f"[calibrate]   bin {b}: no tokens")
    else:
      print(
        f"[calibrate]   bin {b}: top-k {topk}, k {k}, {per_round:.2f} tokens a round, "
        f"{speedup:.2f}x dense predicted"
      )
  with open(os.path.join(c.out_dir, "speculative.json"), "w") as f:
    json.dump(plan, f, indent=1)
  return plan


def plot_calibration(path: str, result: cal.Calibration):
  """PNG: the schedule's percentile vs schedule bin for every candidate with the tau line and the
  chosen candidate marked (top), and the chosen top-k per bin (bottom)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  tail_CB, name = result.tail[result.quantile], cal.percentile_name(result.quantile)
  num_bins = tail_CB.shape[1]
  x_B = (np.arange(num_bins) + 0.5) * result.bin_size
  fig, (ax_tail, ax_k) = plt.subplots(
    2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
  )
  colors = matplotlib.colormaps["viridis"](np.linspace(0, 1, len(result.candidates)))
  for c, tail_B, color in zip(result.candidates, tail_CB, colors):
    ax_tail.plot(x_B, tail_B, marker=".", color=color, label=f"top-k {c}")
  pick_B = [result.candidates.index(v) for v in result.schedule.values]
  ax_tail.plot(x_B, tail_CB[pick_B, np.arange(num_bins)], "kx", markersize=9, label="chosen")
  ax_tail.axhline(result.tau, color="red", linestyle="--", label=f"tau = {result.tau:.2f}")
  ax_tail.set_ylabel(f"{name} acceptance rate")
  ax_tail.set_title(
    f"Calibration ({result.alpha} alpha, "
    f"{'on' if result.on_policy else 'off'}-policy rollouts): {name} per "
    f"{result.bin_size}-token bin of cached length"
  )
  ax_tail.legend(fontsize=6, ncol=3, loc="lower left")
  ax_k.stairs(
    result.schedule.values, np.arange(num_bins + 1) * result.bin_size, baseline=None, color="black"
  )
  ax_k.set_ylabel(f"chosen top-k pages\n(+{result.schedule.always_kept} always kept)")
  ax_k.set_xlabel("cached length (tokens)")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def calibrate(c):
  """Config -> calibration -> the three files in c.out_dir."""
  t0 = time.time()
  cfg, params, eos_ids, pad_id = load_model(c.model, c.seed)
  prompts, eos_ids, pad_id = load_prompts(c, parse_ints(c.eos_ids, "eos_ids") or eos_ids, pad_id)
  r = c.rollout
  sparse = schema.from_group(sj.SparseConfig, c, "rollout")
  cc = schema.from_group(cal.CalibrationConfig, c, "calibration", "stats")
  print(
    f"[calibrate] model {c.model.hf_dir or c.model.preset + ' (random init)'}, {len(prompts)} "
    f"prompts x {cc.repeats}, max_new_tokens {r.max_new_tokens}, "
    f"p{cc.quantile:g} >= tau {cc.tau} "
    f"({cc.alpha} alpha, {'on' if cc.on_policy else 'off'}-policy), bins of "
    f"{cc.bin_size} tokens, page size {r.page_size}, {r.page_score} page scores",
    flush=True,
  )
  result = cal.calibrate(
    params,
    cfg,
    prompts,
    jax.random.PRNGKey(c.seed + 1),
    max_new_tokens=r.max_new_tokens,
    calibration=cc,
    sparse=sparse,
    sampling=sj.Sampling(temperature=r.temperature, eos_ids=eos_ids, pad_id=pad_id),
  )

  os.makedirs(c.out_dir, exist_ok=True)
  with open(os.path.join(c.out_dir, "schedule.json"), "w") as f:
    f.write(result.schedule.to_json() + "\n")
  with open(os.path.join(c.out_dir, "surface.json"), "w") as f:
    items = cal.surface_dict(result).items()  # one key per line, lists kept on theirs
    f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in items) + "\n}\n")
  plot_calibration(os.path.join(c.out_dir, "calibration.png"), result)
  print(f"[calibrate] candidates (top-k pages): {list(result.candidates)}")
  print(
    f"[calibrate] tokens per bin: {result.count.max(0).tolist()}"
    f"{' (most over candidates)' if result.on_policy else ''}"
  )
  print(
    f"[calibrate] chosen top-k per bin: {list(result.schedule.values)} "
    f"(+{result.schedule.always_kept} always kept)"
  )
  plan = speculative_report(c, result, cfg, sparse) if c.speculative.report else None
  seconds = time.time() - t0
  print(
    f"[calibrate] wrote schedule.json, surface.json, calibration.png"
    f"{', speculative.json' if plan else ''} to {c.out_dir} ({seconds:.0f}s)"
  )
  if c.record:
    surface = cal.surface_dict(result)
    records.write_record(
      c.record,
      {
        **({"speculative": plan} if plan else {}),
        "model": c.model.hf_dir or c.model.preset,
        "prompts": len(prompts),
        "repeats": cc.repeats,
        "max_new_tokens": r.max_new_tokens,
        "page_score": sparse.page_score,
        "seconds": seconds,
        **{k: surface[k] for k in ("tau", "quantile", "alpha", "on_policy", "bin_size")},
        **{k: surface[k] for k in ("candidates", "count_bin", "chosen_topk", "always_kept")},
      },
    )
  return result


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  calibrate(flags.FLAGS.config)


if __name__ == "__main__":
  # Defined here, not at import: tests import this module beside other scripts defining --config.
  config_flags.DEFINE_config_file("config", "configs/calibrate.py", "experiment config")
  app.run(main)
