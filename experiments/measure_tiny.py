"""Measures the shipped tiny model on held-out pointer-chasing problems, dense and sparse.

  python experiments/measure_tiny.py --config=configs/measure_tiny.py [--config.num_problems=64 ...]

1. Dense sampling at config.rollout.temperature on config.num_problems held-out problems (task seed
   config.seed): mean per-step score and exact-answer accuracy (how much room RL has).
2. For each fixed KV budget in config.budgets (pages of config.rollout.page_size tokens, the 3
   always-kept pages included): block-sparse sampling on the first config.num_accept problems, then
   the sampled sequences are re-scored by the dense and by the sparse teacher-forced forward (the
   logits the sparse sampler drew from), and alpha_t = sum_x min(p, q) gives mean / p5 / p1 of the
   per-token acceptance, overall and per position bin of config.stats.bin_size tokens, with the
   per-step score of those sparse samples.
3. Under config.small_budget pages: the per-step score on all problems beside the dense one (same
   problems, same sampling key).
4. With config.rollout.schedule (the calibrated KVSchedule; "" skips it): the same acceptance
   figures under it, and whether p5 >= config.stats.tau holds in every position bin on these
   held-out problems.
Prints a table and writes the figures to config.out (default <model.hf_dir>/measurements.json) as a
results record (sparrow_jax/records.py).
"""

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
from sparrow_jax.mismatch import acceptance
from sparrow_jax.mismatch import calibrate as cal
from sparrow_jax.rl import build
from sparrow_jax.rollout.sampler import full_sequences
from sparrow_jax.sparsity.schedule import KVSchedule


def sample(params, cfg, task, problems, key, sparse, schedule, c):
  """Rollouts for `problems` in batches -> (prompt_BT, prompt_len_B, rollout) list."""
  out = []
  for i in range(0, len(problems), c.batch_size):
    prompt_BT, lens_B = cal.pad_prompts(
      [p.prompt_ids for p in problems[i : i + c.batch_size]], task.pad_id
    )
    rollout = sj.generate(
      params,
      cfg,
      prompt_BT,
      lens_B,
      jax.random.fold_in(key, i),
      max_new_tokens=task.max_response_len + 8,
      sampling=sj.Sampling(
        temperature=c.rollout.temperature, eos_ids=(task.eos_id,), pad_id=task.pad_id
      ),
      sparse=sparse,
      schedule=schedule,
    )
    out.append((prompt_BT, lens_B, rollout))
  return out


def scores(task, problems, rollouts):
  rows = [np.asarray(r.tokens)[b] for _, _, r in rollouts for b in range(r.tokens.shape[0])]
  return task.reward(rows, problems), task.accuracy(rows, problems)


def alphas(params, cfg, rollouts, sparse, schedule, pad_id, temperature):
  """Per-token alpha between dense p and sparse q on the sampled completions, with the mask of
  generated tokens and each one's cached length (calibrate.token_bins: what the bins are of)."""
  dense_fwd = jax.jit(lambda s, m: sj.forward(params, s, cfg, mask_BT=m))
  sparse_fwd = jax.jit(
    lambda s, m, pl: sj.forward(
      params, s, cfg, mask_BT=m, sparse=sparse, schedule=schedule, prompt_len_B=pl
    )
  )
  alpha, mask, cached = [], [], []
  for prompt_BT, lens_B, rollout in rollouts:
    seq_BS, gen_BS = full_sequences(prompt_BT, lens_B, rollout, pad_id)
    valid_BS = (jnp.arange(seq_BS.shape[1])[None] < lens_B[:, None]) | gen_BS
    alpha_BS = acceptance.acceptance_rate(
      dense_fwd(seq_BS, valid_BS), sparse_fwd(seq_BS, valid_BS, lens_B), temperature
    )
    mask_BS, cached_len_BS = cal.token_bins(gen_BS)  # alpha_BS[:, :-1] scores tokens 1..S-1
    alpha.append(np.asarray(alpha_BS[:, :-1]).reshape(-1))
    mask.append(np.asarray(mask_BS).reshape(-1))
    cached.append(np.asarray(cached_len_BS).reshape(-1))
  return np.concatenate(alpha), np.concatenate(mask), np.concatenate(cached)


def load(c):
  """(task, cfg, params) of the config, checked before anything runs."""
  if c.task.name != synthetic.PointerChase.name:
    raise ValueError(
      f"config.task.name = {c.task.name!r}: only {synthetic.PointerChase.name!r} "
      "is measured here (per-step score and exact-answer accuracy)"
    )
  if not (c.out or c.model.hf_dir):
    raise ValueError(
      "config.out is required with config.model.preset (the default writes to "
      "<model.hf_dir>/measurements.json)"
    )
  task = build.make_task(c)
  cfg, params, _ = build.load_model(c, task)
  return task, cfg, params


def measure(c) -> dict:
  """Config -> the figures of the module docstring, printed and written to the results JSON."""
  budgets = [int(b) for b in c.budgets.split(",")]
  task, cfg, params = load(c)
  r, page = c.rollout, c.rollout.page_size
  n, n_accept, bin_size, tau = c.num_problems, c.num_accept, c.stats.bin_size, c.stats.tau
  problems = task.sample(n, 0)
  key = jax.random.PRNGKey(c.seed)
  sparse = schema.from_group(sj.SparseConfig, c, "rollout")
  num_bins = -(-(task.max_prompt_len + task.max_response_len) // bin_size)
  t0 = time.time()

  dense = sample(params, cfg, task, problems, key, None, None, c)
  dense_score, dense_acc = scores(task, problems, dense)
  resp_len = float(np.mean([float(jnp.mean(roll.lengths)) for _, _, roll in dense]))
  ctx_len = float(np.mean([len(p.prompt_ids) for p in problems])) + resp_len
  results = {
    "model": c.model.hf_dir or c.model.preset,
    "n": n,
    "held_out_seed": c.seed,
    "hops": task.max_hops,
    "mean_prompt_len": ctx_len - resp_len,
    "mean_response_len": resp_len,
    "dense": {
      "step_score": float(dense_score.mean()),
      "accuracy": float(dense_acc.mean()),
      "step_score_stderr": float(dense_score.std() / np.sqrt(n)),
    },
    "sparse": {
      "dense_layers": r.dense_layers,
      "page_size": page,
      "bin_size": bin_size,
      "budgets": {},
    },
  }
  print(
    f"dense  T={r.temperature}  n={n}  per-step score {dense_score.mean():.3f}"
    f" (+-{results['dense']['step_score_stderr']:.3f})  accuracy {dense_acc.mean():.3f}  "
    f"context {ctx_len:.0f} tokens (response {resp_len:.0f})  [{time.time() - t0:.0f}s]",
    flush=True,
  )

  def measure_under(schedule):
    """Sparse samples of the first num_accept problems under `schedule`: scores and alpha tails."""
    sub = problems[:n_accept]
    rolls = sample(params, cfg, task, sub, key, sparse, schedule, c)
    s_score, s_acc = scores(task, sub, rolls)
    a_N, m_N, pos_N = alphas(params, cfg, rolls, sparse, schedule, task.pad_id, r.temperature)
    st = {
      k: np.asarray(v).tolist()
      for k, v in acceptance.tail_stats(
        a_N, m_N, pos_N, bin_size=bin_size, num_bins=num_bins, page_size=page
      ).items()
    }
    return {
      "step_score": float(s_score.mean()),
      "dense_step_score_same_problems": float(dense_score[:n_accept].mean()),
      "accuracy": float(s_acc.mean()),
      **{
        k: st[k]
        for k in (
          "mean",
          "p1",
          "p5",
          "p10",
          "p50",
          "frac_above_0999",
          "count",
          "p5_bin",
          "mean_bin",
          "count_bin",
        )
      },
    }

  def bins(row):
    return " ".join(
      "  -  " if count == 0 else f"{v:.2f}" for v, count in zip(row["p5_bin"], row["count_bin"])
    )

  print(
    f"\n{'pages':>5} {'share':>6} {'score':>6} {'acc':>5} {'mean_a':>7} {'p5':>6} {'p1':>6}"
    f"  p5 per {bin_size}-token bin (from bin 0)"
  )
  for pages in budgets:
    row = {
      "share_of_context": pages * page / ctx_len,
      **measure_under(KVSchedule.fixed(pages, page_size=page)),
    }
    results["sparse"]["budgets"][str(pages)] = row
    print(
      f"{pages:5d} {row['share_of_context']:6.1%} {row['step_score']:6.3f} {row['accuracy']:5.2f}"
      f" {row['mean']:7.4f} {row['p5']:6.3f} {row['p1']:6.3f}  {bins(row)}  "
      f"[{time.time() - t0:.0f}s]",
      flush=True,
    )

  if r.schedule:
    row = measure_under(KVSchedule.parse(r.schedule, page, field="config.rollout.schedule"))
    counted = [v for v, count in zip(row["p5_bin"], row["count_bin"]) if count > 0]
    row.update(
      schedule=r.schedule,
      tau=tau,
      min_p5_bin=min(counted),
      all_bins_at_tau=bool(min(counted) >= tau),
    )
    results["calibrated"] = row
    print(
      f"\ncalibrated {r.schedule}: score {row['step_score']:.3f}  mean_a {row['mean']:.4f}  "
      f"p5 {row['p5']:.3f}  p5 per bin {bins(row)}  min {row['min_p5_bin']:.3f} "
      f"{'>=' if row['all_bins_at_tau'] else '<'} tau {tau}  [{time.time() - t0:.0f}s]",
      flush=True,
    )

  small = sample(
    params, cfg, task, problems, key, sparse, KVSchedule.fixed(c.small_budget, page_size=page), c
  )
  small_score, small_acc = scores(task, problems, small)
  diff = small_score - dense_score
  results["small_budget"] = {
    "pages": c.small_budget,
    "share_of_context": c.small_budget * page / ctx_len,
    "step_score": float(small_score.mean()),
    "accuracy": float(small_acc.mean()),
    "dense_step_score": float(dense_score.mean()),
    "score_drop": float(-diff.mean()),
    "score_drop_stderr": float(diff.std() / np.sqrt(n)),
  }
  print(
    f"\nfixed {c.small_budget} pages ({results['small_budget']['share_of_context']:.1%} of "
    f"context), n={n}: per-step score {small_score.mean():.3f} vs dense "
    f"{dense_score.mean():.3f} (drop {-diff.mean():.3f} +- {diff.std() / np.sqrt(n):.3f}), "
    f"accuracy {small_acc.mean():.3f} vs {dense_acc.mean():.3f}  [{time.time() - t0:.0f}s]"
  )
  results["seconds"] = round(time.time() - t0, 1)
  out = c.out or os.path.join(c.model.hf_dir, "measurements.json")
  records.write_record(out, results)
  print(f"wrote {out}")
  return results


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  measure(flags.FLAGS.config)


if __name__ == "__main__":
  # Defined here, not at import: tests import this module beside other scripts defining --config.
  config_flags.DEFINE_config_file("config", "configs/measure_tiny.py", "experiment config")
  app.run(main)
