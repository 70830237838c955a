"""The paper's mismatch study on a real pretrained LM: per-token acceptance alpha of block-sparse
attention against dense on long sampled responses, and the calibrated KV-budget table.

  python experiments/real_lm_mismatch.py --config=configs/real_lm_mismatch.py

1. Rollouts: config.num_prompts math prompts (config.prompts, the model's ChatML template with its
   system message and the project's \\boxed{} instruction) x config.repeats, sampled at
   rollout.temperature with the sparse sampler at top-k config.sample_topk (mean page scores), to
   rollout.max_new_tokens (config.stop_at_eos: whether a row ends at the model's EOS).
2. Every candidate top-k of config.candidates (mean page scores) and of config.quest_candidates
   (quest page scores) re-scores the rollouts teacher-forced (the pages the sparse sampler would
   read at each step), one dense pass per batch shared by all: per-token exact alpha
   (sum_x min(p, q)) and the reference code's top-20 lower bound, in one pass per candidate.
3. Statistics per candidate, overall and per position bin of stats.bin_size cached tokens (the
   binning of schedules and calibration, schedule.position_bin): mean, p1 / p5 / p10 / p50, the
   share of tokens with alpha > 0.999, an alpha histogram; the calibrated table at stats.tau
   (calibrate.choose_schedule) from the exact p5 and from the top-20 bound's, its pages read at
   each bin's last cached length; the paper's tables at the same lengths; per bin, the scored
   tokens that follow their row's first EOS.
Writes config.record (a results record; docs/results/real_lm_mismatch.md is generated from it) and
mismatch_*.png plots into config.plot_dir. config.recompute_from rewrites a record's derived fields
(tables, pages, post-EOS counts, the plot) from its stored statistics, without the model:

  python experiments/real_lm_mismatch.py \\
      --config.recompute_from=docs/results/real_lm_mismatch.json
"""

import functools
import json
import os
import time

from absl import app, flags
import jax
import jax.numpy as jnp
from ml_collections import config_flags
import numpy as np

import sparrow_jax as sj
from sparrow_jax import records
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.data.tasks import MATH_INSTRUCTION
from sparrow_jax.data.tokenizer import load_tokenizer
from sparrow_jax.mismatch import acceptance
from sparrow_jax.mismatch import calibrate as cal
from sparrow_jax.model import qwen3
from sparrow_jax.sparsity import policy
from sparrow_jax.sparsity import schedule as schedule_lib
from sparrow_jax.sparsity.schedule import BudgetTable, KVSchedule

ALPHA_KINDS = ("exact", "topk20")  # what each pass scores (calibrate.ALPHAS)
PAPER_MODELS = ("qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b")  # tau-0.86 tables compared
HIST_BUCKETS = 20


@functools.partial(jax.jit, static_argnames=("cfg", "sparse"))
def _alphas(
  params, tokens_BS, valid_BS, prompt_len_B, x_p_BSD, budget_L, temperature, *, cfg, sparse
):
  """[B, S, 2]: exact alpha and the top-20 bound between the dense logits (from x_p_BSD) and the
  sparse teacher-forced ones under the budget table budget_L, a sequence chunk at a time."""
  attention_fn = policy.teacher_forced_attention_fn(sparse, BudgetTable(budget_L), prompt_len_B)
  x_q_BSD = qwen3.forward_hidden(
    params, tokens_BS, cfg, mask_BT=valid_BS, attention_fn=attention_fn
  )

  def fn(logits):
    return jnp.stack(
      [cal.ALPHAS[k](logits[0], logits[1], temperature=temperature) for k in ALPHA_KINDS], -1
    )

  return qwen3.map_logits(params, cfg, fn, (x_p_BSD, x_q_BSD))


def read_prompts(path, n):
  rows = []
  with open(path) as f:
    for i, line in enumerate(f, 1):
      if line.strip():
        row = json.loads(line)
        if not isinstance(row.get("problem"), str):
          raise ValueError(f"{path} row {i}: needs a string 'problem', got keys {sorted(row)}")
        rows.append(row)
  if len(rows) < n:
    raise ValueError(f"config.num_prompts = {n}, but {path} holds {len(rows)} prompts")
  return rows[:n]


def _ints(text, field):
  try:
    values = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise ValueError(f"config.{field} must be comma-separated integers, got {text!r}") from None
  return cal._check_candidates(values, f"config.{field}")


def score_all(params, cfg, tokens_BS, gen_BS, prompt_len_B, runs, temperature, batch_size):
  """runs: [(name, SparseConfig, top-k)] -> {name: alpha [2, B, S]} and seconds per pass."""
  R, S = tokens_BS.shape
  valid_BS = (np.arange(S)[None] < prompt_len_B[:, None]) | gen_BS
  out = {name: np.zeros((len(ALPHA_KINDS), R, S), np.float32) for name, _, _ in runs}
  seconds, t0 = [], time.time()
  for b0 in range(0, R, batch_size):
    rows = np.arange(b0, min(b0 + batch_size, R))
    args = (jnp.asarray(tokens_BS[rows]), jnp.asarray(valid_BS[rows]))
    x_p_BSD = cal._dense_hidden(params, *args, cfg=cfg)
    for name, sparse, topk in runs:
      t = time.time()
      table = sampler_table(topk, sparse, S)
      a_BS2 = _alphas(
        params,
        *args,
        jnp.asarray(prompt_len_B[rows]),
        x_p_BSD,
        jnp.asarray(table),
        jnp.float32(temperature),
        cfg=cfg,
        sparse=sparse,
      )
      out[name][:, rows] = np.moveaxis(np.asarray(a_BS2), -1, 0)
      seconds.append(time.time() - t)
      print(
        f"[score] rows {rows[0]}-{rows[-1]} {name}: {seconds[-1]:.0f}s "
        f"({time.time() - t0:.0f}s in all)",
        flush=True,
      )
  return out, seconds


def sampler_table(topk, sparse, S):
  from sparrow_jax.rollout import sampler

  return sampler.budget_table(cal.candidate_schedule(topk, sparse), S, sparse)


def stats_of(alpha_BS, gen_BS, bin_size, page_size, num_bins, tau):
  mask_BS, cached_BS = cal.token_bins(gen_BS)
  st = acceptance.tail_stats(
    jnp.asarray(alpha_BS[:, :-1]),
    mask_BS,
    cached_BS,
    bin_size=bin_size,
    num_bins=num_bins,
    page_size=page_size,
    tau=tau,
  )
  keep = ("mean", "p1", "p5", "p10", "p50", "frac_above_0999", "frac_below_tau", "count")
  as_list = lambda x: np.asarray(x).tolist() if np.asarray(x).dtype.kind == "i" else _json(x)
  out = {k: as_list(st[k]) for k in keep}
  out.update({k + "_bin": as_list(st[k + "_bin"]) for k in keep})
  out["histogram"] = np.asarray(
    acceptance.alpha_histogram(alpha_BS[:, :-1], mask_BS, HIST_BUCKETS)
  ).tolist()
  return out


def _json(x):
  """Floats (a scalar or a list) for JSON: NaN (an empty bin) -> None."""
  x = np.asarray(x, np.float64)
  if x.ndim == 0:
    return None if np.isnan(x) else float(x)
  return [None if np.isnan(v) else float(v) for v in x]


def _floats(x):
  return np.asarray([np.nan if v is None else v for v in x], np.float64)


def bin_bounds(num_bins, page_size, bin_size):
  """The first and the last cached length of each position bin -> (first_B, last_B): position_bin
  counts a length's pages rounded up, so bin b holds the lengths whose pages fall in
  [b, b + 1) x bin_size / page_size, from b x bin_size - page_size + 1 to (b + 1) x bin_size -
  page_size."""
  b = np.arange(num_bins)
  return np.maximum(b * bin_size - page_size + 1, 0), (b + 1) * bin_size - page_size


def pages_at_bins(sched, num_bins, page_size, bin_size):
  """A schedule's pages read at each of our bins' last cached length (top-k + always-kept, capped
  at the cached pages: the bin's largest budget) and that as a share of the pages cached there ->
  (pages, share) lists. A table of our own bins reads the same pages over the whole bin below the
  cap; the paper's tables (2000-token bins) may step up inside one of ours."""
  last = bin_bounds(num_bins, page_size, bin_size)[1]
  pages = np.asarray(sched.budget_pages(jnp.asarray(last)))
  cached = np.maximum(-(-last // sched.page_size), 1)  # a one-page bin 0 ends at no cached page
  return pages.tolist(), (pages / cached).tolist()


def paper_pages(num_bins, bin_size, page_size):
  """The paper's tau-0.86 tables at each of our bins' last cached length: pages read and that as
  a share of the cached pages (pages_at_bins)."""
  out = {}
  for model in PAPER_MODELS:
    pages, share = pages_at_bins(KVSchedule.paper(model, 0.86), num_bins, page_size, bin_size)
    out[model] = {"pages": pages, "share": share}
  return out


def scored_counts(prompt_len_B, gen_len_B, first_eos_B, page_size, bin_size, num_bins):
  """Scored tokens per position bin and, of them, those after their row's first EOS (first_eos:
  its index among the row's generated tokens, -1: none) -> (count_bin, post_eos_bin) int lists.
  A right-padded row's generated tokens sit at prompt_len .. prompt_len + gen_len - 1 and each is
  binned at its own index (calibrate.token_bins); tokens past the last bin count in neither."""
  count, post = np.zeros(num_bins, np.int64), np.zeros(num_bins, np.int64)
  for p, n, e in zip(prompt_len_B, gen_len_B, first_eos_B):
    g = np.arange(int(n))
    bins = np.asarray(schedule_lib.position_bin(p + g, page_size, bin_size))
    inside = bins < num_bins
    count += np.bincount(bins[inside], minlength=num_bins)
    post += np.bincount(bins[inside & (e >= 0) & (g > e)], minlength=num_bins)
  return count.tolist(), post.tolist()


def stored_gen_lengths(r):
  """Each row's generated tokens, from a record's settings: max_new_tokens unless the row stopped
  at its first EOS (which the completion keeps)."""
  return [e + 1 if r["stop_at_eos"] and e >= 0 else r["max_new_tokens"] for e in r["first_eos"]]


def derived(r, gen_len_B):
  """The fields of a record's results that follow from its stored statistics and rows: the
  calibrated tables, the paper's pages, the post-EOS counts -> (fields, the mean-score / exact
  KVSchedule). Raises when the rows' lengths do not give the recorded tokens per bin."""
  page, bin_size, num_bins = r["page_size"], r["bin_size"], r["num_bins"]
  tables, schedule = choose_tables(
    r["stats"],
    r["candidates"],
    r["quest_candidates"],
    r["tau"],
    r["quantile"],
    page,
    bin_size,
    num_bins,
  )
  count, post = scored_counts(r["prompt_len"], gen_len_B, r["first_eos"], page, bin_size, num_bins)
  if count != list(r["count_bin"]):
    raise ValueError(
      f"rows' lengths {list(gen_len_B)} give {count} tokens per bin, not the "
      f"recorded {r['count_bin']}"
    )
  fields = {
    "tables": tables,
    "paper_tables": paper_pages(num_bins, bin_size, page),
    "post_eos_bin": post,
  }
  return fields, schedule


def plot(plot_dir, results):
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  s, bin_size = results["stats"], results["bin_size"]
  first, last = bin_bounds(results["num_bins"], results["page_size"], bin_size)
  mean_runs = [n for n in s if n.startswith("mean/")]
  colors = matplotlib.colormaps["viridis"](np.linspace(0, 0.9, len(mean_runs)))
  fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
  edges = np.linspace(0, 1, HIST_BUCKETS + 1)
  for name, color in zip(mean_runs, colors):
    h = np.asarray(s[name]["exact"]["histogram"], float)
    axes[0].stairs(h / max(h.sum(), 1), edges, color=color, label=name)
    p5 = _floats(s[name]["exact"]["p5_bin"])
    axes[1].plot(np.mean([first, last], 0), p5, marker="o", color=color, label=name)
  axes[0].set_yscale("log")
  axes[0].set_xlabel("exact alpha")
  axes[0].set_ylabel("share of tokens")
  axes[0].set_title("(F1) per-token alpha")
  axes[1].axhline(results["tau"], color="red", ls="--", label=f"tau {results['tau']}")
  axes[1].set_xlabel("cached length (tokens)")
  axes[1].set_ylabel("p5 of exact alpha")
  axes[1].set_title(f"(F2) p5 per {bin_size}-token bin, fixed budgets")
  axes[1].legend(fontsize=7)
  for kind, style in (("exact", "-"), ("topk20", ":")):  # each bin's pages over its own lengths
    axes[2].stairs(
      results["tables"][f"mean/{kind}"]["pages_bin"],
      np.append(first, last[-1] + 1),
      baseline=None,  # no edges down to 0 pages, off a log axis
      lw=1.5,
      ls=style,
      color="black",
      label=f"ours ({kind} alpha)",
    )
  for model, d in results["paper_tables"].items():
    axes[2].plot(last, d["pages"], marker=".", alpha=0.6, label=f"paper {model}")
  axes[2].set_xlabel("cached length (tokens)")
  axes[2].set_ylabel("pages read at the bin's last step (top-k + 3)")
  axes[2].set_yscale("log")
  axes[2].set_title(f"(F3) calibrated table, tau {results['tau']}")
  axes[2].legend(fontsize=7)
  fig.tight_layout()
  path = os.path.join(plot_dir, "mismatch.png")
  fig.savefig(path, dpi=90)
  plt.close(fig)
  return path


def choose_tables(st, cands, quest, tau, quantile, page, bin_size, num_bins):
  """The calibrated table per (page score, alpha kind) from the p5 surface of `st` (the record's
  "stats") -> ({name: table figures}, the KVSchedule of mean scores / exact alpha)."""
  tables, schedules = {}, {}
  for score, names in (("mean", cands), ("quest", quest)):
    for kind in ALPHA_KINDS:
      tail_Ub = np.array([_floats(st[f"{score}/{k}"][kind]["p5_bin"]) for k in names])
      sched = cal.choose_schedule(
        tail_Ub, names, tau, page_size=page, always_kept=3, bin_size=bin_size, quantile=quantile
      )
      pages, share = pages_at_bins(sched, num_bins, page, bin_size)
      tables[f"{score}/{kind}"] = {
        "topk_bin": list(sched.values),
        "pages_bin": pages,
        "share_bin": share,
        "meets_tau_bin": (np.nanmax(np.where(np.isnan(tail_Ub), -1, tail_Ub), 0) >= tau).tolist(),
      }
      schedules[f"{score}/{kind}"] = sched
  return tables, schedules["mean/exact"]


def write_schedule(path, schedule):
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    f.write(schedule.to_json() + "\n")
  print(f"wrote {path}: top-k per bin {list(schedule.values)}")


def from_record(c):
  """Re-chooses the tables from a record's p5 surface at config.stats.tau (no model runs) and
  writes the mean-score / exact-alpha one to config.schedule_out."""
  with open(c.from_record) as f:
    r = json.load(f)["results"]
  tables, schedule = choose_tables(
    r["stats"],
    r["candidates"],
    r["quest_candidates"],
    c.stats.tau,
    r["quantile"],
    r["page_size"],
    r["bin_size"],
    r["num_bins"],
  )
  for name, t in tables.items():
    print(f"table {name} at tau {c.stats.tau}: top-k per bin {t['topk_bin']}")
  if c.schedule_out:
    write_schedule(c.schedule_out, schedule)
  if c.plot_dir:
    r = dict(r, tables=tables, tau=c.stats.tau)
    r["paper_tables"] = paper_pages(r["num_bins"], r["bin_size"], r["page_size"])
    print(f"wrote {plot(c.plot_dir, r)}")
  return tables


def recompute(c):
  """Writes config.record: the record config.recompute_from with its derived fields (`derived`)
  and the plot made again from its stored statistics (no model runs). Its machine and date stay
  the measurement's; command and commit become this run's, the rollouts' own kept in
  results["measured_by"]."""
  with open(c.recompute_from) as f:
    old = json.load(f)
  r = old["results"]
  fields, _ = derived(r, stored_gen_lengths(r))
  r = dict(r, **fields)
  r.setdefault("measured_by", {"command": old["command"], "commit": old["commit"]})
  if c.plot_dir:
    os.makedirs(c.plot_dir, exist_ok=True)
    r["plot"] = os.path.relpath(plot(c.plot_dir, r), records.ROOT)
  record = dict(old, command=records.command(), commit=records.commit_at_start(), results=r)
  with open(c.record, "w") as f:
    json.dump(record, f, indent=1)
    f.write("\n")
  for name, t in r["tables"].items():
    print(f"table {name}: top-k per bin {t['topk_bin']}, pages per bin {t['pages_bin']}")
  print(f"wrote {c.record}")
  return record


def run(c) -> dict:
  page, bin_size, tau = c.rollout.page_size, c.stats.bin_size, c.stats.tau
  schedule_lib.position_bin(0, page, bin_size)  # whole pages a bin, before anything runs
  cands, quest = _ints(c.candidates, "candidates"), _ints(c.quest_candidates, "quest_candidates")
  if c.stats.quantile != 5:
    raise ValueError(f"config.stats.quantile = {c.stats.quantile}: this study reports p5 (5)")
  if c.sample_topk < 1:
    raise ValueError(f"config.sample_topk must be >= 1, got {c.sample_topk}")
  t_start = time.time()
  cfg, params = sj.load_hf(c.model.hf_dir, dtype=jnp.dtype(c.model.dtype))
  tok = load_tokenizer(c.model.hf_dir)
  rows = read_prompts(c.prompts, c.num_prompts)
  texts = [
    tok.chat(
      [
        {"role": "system", "content": c.system},
        {"role": "user", "content": f"{r['problem']}\n\n{MATH_INSTRUCTION}"},
      ]
    )
    for r in rows
  ]
  prompts = [tok.encode(t) for t in texts]
  prompt_BT, prompt_len_B = cal.pad_prompts(prompts, tok.pad_id)
  prompt_BT, prompt_len_B = np.repeat(prompt_BT, c.repeats, 0), np.repeat(prompt_len_B, c.repeats)
  mean_sparse = SparseConfig(
    page_size=page,
    dense_layers=c.rollout.dense_layers,
    attention_impl=c.rollout.attention_impl,
    page_score="mean",
  )
  quest_sparse = SparseConfig(
    page_size=page,
    dense_layers=c.rollout.dense_layers,
    attention_impl=c.rollout.attention_impl,
    page_score="quest",
  )
  sampling = sj.Sampling(
    temperature=c.rollout.temperature,
    eos_ids=tok.eos_ids if c.stop_at_eos else (),
    pad_id=tok.pad_id,
  )
  t0 = time.time()
  tokens_BS, gen_BS = cal._rollouts(
    params,
    cfg,
    prompt_BT,
    prompt_len_B,
    jax.random.PRNGKey(c.seed),
    cal.candidate_schedule(c.sample_topk, mean_sparse, bin_size),
    mean_sparse,
    max_new_tokens=c.rollout.max_new_tokens,
    sampling=sampling,
    calibration=cal.CalibrationConfig(generate_batch_size=len(prompt_len_B)),
  )
  gen_seconds = time.time() - t0
  R, S = tokens_BS.shape
  # where each row first wrote one of the model's EOS ids (-1: never), in generated tokens
  first_eos = []
  for b in range(R):
    gen = tokens_BS[b, prompt_len_B[b] :][gen_BS[b, prompt_len_B[b] :]]
    hits = np.nonzero(np.isin(gen, tok.eos_ids))[0]
    first_eos.append(int(hits[0]) if hits.size else -1)

  runs = [(f"mean/{k}", mean_sparse, k) for k in cands] + [
    (f"quest/{k}", quest_sparse, k) for k in quest
  ]
  alphas, pass_seconds = score_all(
    params, cfg, tokens_BS, gen_BS, prompt_len_B, runs, c.rollout.temperature, c.batch_size
  )
  num_bins = -(-S // bin_size)
  st = {
    name: {
      k: stats_of(a[i], gen_BS, bin_size, page, num_bins, tau) for i, k in enumerate(ALPHA_KINDS)
    }
    for name, a in alphas.items()
  }
  mask_BS = np.asarray(cal.token_bins(gen_BS)[0])
  bound = {}
  for name, a in alphas.items():
    exact, top = a[0][:, :-1][mask_BS], a[1][:, :-1][mask_BS]
    bound[name] = {
      "share_bound_le_exact": float(np.mean(top <= exact + 1e-5)),
      "mean_gap": float(np.mean(exact - top)),
      "max_gap": float(np.max(exact - top)),
    }
  count_bin = st[runs[0][0]]["exact"]["count_bin"]
  results = {
    "model": c.model.hf_dir,
    "model_config": cfg.to_hf_dict(),
    "prompts": c.prompts,
    "num_prompts": c.num_prompts,
    "repeats": c.repeats,
    "rows": int(R),
    "prompt_len": prompt_len_B.tolist(),
    "max_new_tokens": c.rollout.max_new_tokens,
    "stop_at_eos": bool(c.stop_at_eos),
    "generated_tokens": int(gen_BS.sum()),
    "first_eos": first_eos,
    "temperature": c.rollout.temperature,
    "sample_topk": c.sample_topk,
    "page_size": page,
    "dense_layers": c.rollout.dense_layers,
    "bin_size": bin_size,
    "num_bins": num_bins,
    "count_bin": count_bin,
    "tau": tau,
    "quantile": c.stats.quantile,
    "candidates": list(cands),
    "quest_candidates": list(quest),
    "stats": st,
    "bound": bound,
    "generate_seconds": round(gen_seconds, 1),
    "pass_seconds": [round(s, 1) for s in pass_seconds],
  }
  fields, schedule = derived(results, gen_BS.sum(1))
  results.update(fields, seconds=round(time.time() - t_start, 1))
  tables = results["tables"]
  for name in st:
    e = st[name]["exact"]
    print(
      f"{name:>10}: mean {e['mean']:.4f} p5 {e['p5']:.3f} p1 {e['p1']:.3f} "
      f">0.999 {e['frac_above_0999']:.3f}  p5/bin {np.round(_floats(e['p5_bin']), 3)}"
    )
  for name, t in tables.items():
    print(f"table {name}: top-k per bin {t['topk_bin']}")
  if c.plot_dir:
    os.makedirs(c.plot_dir, exist_ok=True)
    results["plot"] = os.path.relpath(plot(c.plot_dir, results), records.ROOT)
  records.write_record(c.record, results)
  print(f"wrote {c.record} ({results['seconds']:.0f}s)")
  if c.schedule_out:
    write_schedule(c.schedule_out, schedule)
  return results


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  c = flags.FLAGS.config
  if c.recompute_from:
    recompute(c)
  else:
    from_record(c) if c.from_record else run(c)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "configs/real_lm_mismatch.py", "experiment config")
  app.run(main)
