"""Measures the shipped tiny model on held-out pointer-chasing problems, dense and sparse.

  python experiments/measure_tiny.py --model assets/pointer_chase_tiny

1. Dense sampling at temperature 1.0 on `--n` held-out problems: mean per-step score and exact-answer
   accuracy (how much room RL has).
2. For each fixed KV budget in `--budgets` (pages of 16 tokens, the 3 always-kept pages included):
   block-sparse sampling on the first `--n_accept` problems, then the sampled sequences are re-scored
   by the dense and by the sparse teacher-forced forward (the logits the sparse sampler drew from), and
   alpha_t = sum_x min(p, q) gives mean / p5 / p1 of the per-token acceptance, overall and per position
   bin of `--bin_size` tokens, with the per-step score of those sparse samples.
3. Under the small budget `--small_budget`: the per-step score on all `--n` problems beside the dense
   one (same problems, same sampling key).
4. With `--schedule` (a calibrated KVSchedule JSON): the same acceptance figures under it, and whether
   p5 >= `--tau` holds in every position bin on these held-out problems.
Prints a table and writes the figures to <model>/measurements.json.
"""
import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import sparrow_jax as sj
from sparrow_jax.data import synthetic
from sparrow_jax.mismatch import acceptance
from sparrow_jax.mismatch.schedule import KVSchedule
from sparrow_jax.rollout.sampler import full_sequences


def prompts_batch(task, problems):
  lens = np.array([len(p.prompt_ids) for p in problems], np.int32)
  prompt_BT = np.full((len(problems), int(lens.max())), task.pad_id, np.int32)
  for b, p in enumerate(problems):
    prompt_BT[b, :lens[b]] = p.prompt_ids
  return prompt_BT, lens


def sample(params, cfg, task, problems, key, sparse, schedule, batch):
  """Rollouts for `problems` in batches -> (prompt_BT, prompt_len_B, tokens_BN, lengths_B) lists."""
  out = []
  for i in range(0, len(problems), batch):
    chunk = problems[i:i + batch]
    prompt_BT, lens_B = prompts_batch(task, chunk)
    rollout = sj.generate(params, cfg, prompt_BT, lens_B, jax.random.fold_in(key, i),
                          max_new_tokens=task.max_response_len + 8, temperature=1.0,
                          eos_ids=(task.eos_id,), sparse=sparse, schedule=schedule,
                          pad_id=task.pad_id)
    out.append((prompt_BT, lens_B, rollout))
  return out


def scores(task, problems, rollouts):
  rows = [np.asarray(r.tokens)[b] for _, _, r in rollouts for b in range(r.tokens.shape[0])]
  return task.reward(rows, problems), task.accuracy(rows, problems)


def alphas(params, cfg, rollouts, sparse, schedule, pad_id):
  """Per-token alpha between dense p and sparse q on the sampled completions, with positions."""
  dense_fwd = jax.jit(lambda s, m: sj.forward(params, s, cfg, mask_BT=m))
  sparse_fwd = jax.jit(lambda s, m, pl: sj.forward(params, s, cfg, mask_BT=m, sparse=sparse,
                                                   schedule=schedule, prompt_len_B=pl))
  alpha, mask, pos = [], [], []
  for prompt_BT, lens_B, rollout in rollouts:
    seq_BS, gen_BS = full_sequences(jnp.asarray(prompt_BT), jnp.asarray(lens_B), rollout, pad_id)
    S = seq_BS.shape[1]
    real_BS = jnp.arange(S)[None] < (jnp.asarray(lens_B) + rollout.lengths)[:, None]
    logits_p = dense_fwd(seq_BS, real_BS)
    logits_q = sparse_fwd(seq_BS, real_BS, jnp.asarray(lens_B))
    # Logits at position t predict token t + 1: score the positions whose next token was generated.
    pred_mask_BS = jnp.roll(gen_BS, -1, axis=1).at[:, -1].set(False)
    alpha.append(np.asarray(acceptance.acceptance_rate(logits_p, logits_q)).reshape(-1))
    mask.append(np.asarray(pred_mask_BS).reshape(-1))
    pos.append(np.broadcast_to(np.arange(S) + 1, seq_BS.shape).reshape(-1))  # predicted token's pos
  return np.concatenate(alpha), np.concatenate(mask), np.concatenate(pos)


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--model", default="assets/pointer_chase_tiny")
  p.add_argument("--n", type=int, default=256, help="held-out problems for the dense score")
  p.add_argument("--n_accept", type=int, default=64, help="problems per budget for acceptance")
  p.add_argument("--budgets", default="4,6,8,12,16,24", help="fixed KV budgets in pages")
  p.add_argument("--small_budget", type=int, default=8)
  p.add_argument("--dense_layers", type=int, default=1)
  p.add_argument("--schedule", default="", help="KVSchedule JSON to check on held-out problems")
  p.add_argument("--tau", type=float, default=0.86, help="p5 target of --schedule per bin")
  p.add_argument("--bin_size", type=int, default=128)
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--seed", type=int, default=1234, help="held-out task seed (training used 0)")
  p.add_argument("--hops", type=int, default=128, help="chain length H (128: ~880-token sequences)")
  p.add_argument("--out", default="", help="JSON path (default <model>/measurements.json)")
  args = p.parse_args()
  budgets = [int(b) for b in args.budgets.split(",")]
  cfg, params = sj.load_hf(args.model)
  task = synthetic.PointerChase(min_hops=args.hops, max_hops=args.hops, seed=args.seed)
  problems = task.sample(args.n, 0)
  key = jax.random.PRNGKey(args.seed)
  sparse = sj.SparseConfig(page_size=16, dense_layers=args.dense_layers)
  num_bins = -(-(task.max_prompt_len + task.max_response_len) // args.bin_size)
  t0 = time.time()

  dense = sample(params, cfg, task, problems, key, None, None, args.batch)
  dense_score, dense_acc = scores(task, problems, dense)
  resp_len = float(np.mean([float(jnp.mean(r.lengths)) for _, _, r in dense]))
  ctx_len = float(np.mean([len(p.prompt_ids) for p in problems])) + resp_len
  results = {"model": args.model, "n": args.n, "held_out_seed": args.seed,
             "hops": task.max_hops, "mean_prompt_len": ctx_len - resp_len,
             "mean_response_len": resp_len, "dense": {
                 "step_score": float(dense_score.mean()), "accuracy": float(dense_acc.mean()),
                 "step_score_stderr": float(dense_score.std() / np.sqrt(args.n))},
             "sparse": {"dense_layers": args.dense_layers, "page_size": 16,
                        "bin_size": args.bin_size, "budgets": {}}}
  print(f"dense  T=1.0  n={args.n}  per-step score {dense_score.mean():.3f}"
        f" (+-{results['dense']['step_score_stderr']:.3f})  accuracy {dense_acc.mean():.3f}  "
        f"context {ctx_len:.0f} tokens (response {resp_len:.0f})  [{time.time() - t0:.0f}s]",
        flush=True)

  def measure(schedule):
    """Sparse samples of the first --n_accept problems under `schedule`: scores and alpha tails."""
    sub = problems[:args.n_accept]
    rolls = sample(params, cfg, task, sub, key, sparse, schedule, args.batch)
    s_score, s_acc = scores(task, sub, rolls)
    a_N, m_N, pos_N = alphas(params, cfg, rolls, sparse, schedule, task.pad_id)
    st = {k: np.asarray(v).tolist() for k, v in acceptance.tail_stats(
        a_N, m_N, pos_N, bin_size=args.bin_size, num_bins=num_bins,
        page_size=sparse.page_size).items()}
    return {"step_score": float(s_score.mean()),
            "dense_step_score_same_problems": float(dense_score[:args.n_accept].mean()),
            "accuracy": float(s_acc.mean()), **{k: st[k] for k in (
                "mean", "p1", "p5", "p10", "p50", "frac_above_0999", "count", "p5_bin",
                "mean_bin", "count_bin")}}

  def bins(row):
    return " ".join("  -  " if c == 0 else f"{v:.2f}"
                    for v, c in zip(row["p5_bin"], row["count_bin"]))

  print(f"\n{'pages':>5} {'share':>6} {'score':>6} {'acc':>5} {'mean_a':>7} {'p5':>6} {'p1':>6}"
        f"  p5 per {args.bin_size}-token bin (from bin 0)")
  for pages in budgets:
    row = {"share_of_context": pages * 16 / ctx_len,
           **measure(KVSchedule.fixed(pages, page_size=16))}
    results["sparse"]["budgets"][str(pages)] = row
    print(f"{pages:5d} {row['share_of_context']:6.1%} {row['step_score']:6.3f} {row['accuracy']:5.2f}"
          f" {row['mean']:7.4f} {row['p5']:6.3f} {row['p1']:6.3f}  {bins(row)}  "
          f"[{time.time() - t0:.0f}s]", flush=True)

  if args.schedule:
    schedule = KVSchedule.parse(args.schedule, page_size=16, field="--schedule")
    row = measure(schedule)
    counted = [v for v, c in zip(row["p5_bin"], row["count_bin"]) if c > 0]
    row.update(schedule=args.schedule, tau=args.tau, min_p5_bin=min(counted),
               all_bins_at_tau=bool(min(counted) >= args.tau))
    results["calibrated"] = row
    print(f"\ncalibrated {args.schedule}: score {row['step_score']:.3f}  mean_a {row['mean']:.4f}  "
          f"p5 {row['p5']:.3f}  p5 per bin {bins(row)}  min {row['min_p5_bin']:.3f} "
          f"{'>=' if row['all_bins_at_tau'] else '<'} tau {args.tau}  [{time.time() - t0:.0f}s]",
          flush=True)

  schedule = KVSchedule.fixed(args.small_budget, page_size=16)
  small = sample(params, cfg, task, problems, key, sparse, schedule, args.batch)
  small_score, small_acc = scores(task, problems, small)
  diff = small_score - dense_score
  results["small_budget"] = {
      "pages": args.small_budget, "share_of_context": args.small_budget * 16 / ctx_len,
      "step_score": float(small_score.mean()), "accuracy": float(small_acc.mean()),
      "dense_step_score": float(dense_score.mean()), "score_drop": float(-diff.mean()),
      "score_drop_stderr": float(diff.std() / np.sqrt(args.n))}
  print(f"\nfixed {args.small_budget} pages ({results['small_budget']['share_of_context']:.1%} of "
        f"context), n={args.n}: per-step score {small_score.mean():.3f} vs dense "
        f"{dense_score.mean():.3f} (drop {-diff.mean():.3f} +- {diff.std() / np.sqrt(args.n):.3f}), "
        f"accuracy {small_acc.mean():.3f} vs {dense_acc.mean():.3f}  [{time.time() - t0:.0f}s]")
  results["seconds"] = round(time.time() - t0, 1)
  out = args.out or os.path.join(args.model, "measurements.json")
  with open(out, "w") as f:
    json.dump(results, f, indent=1)
  print(f"wrote {out}")


if __name__ == "__main__":
  main()
