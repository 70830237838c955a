"""Calibrates a KV-budget schedule at threshold tau and writes schedule.json, surface.json and
calibration.png to --out_dir.

  python experiments/calibrate_schedule.py --model_dir DIR --tau 0.86 --out_dir runs/calib
  python experiments/calibrate_schedule.py --preset tiny-untied --dense_layers 1 --page_size 4 \\
      --bin_size 32 --num_prompts 4 --repeats 4 --max_new_tokens 96 --out_dir /tmp/calib  # smoke

Prompts: "synthetic" (pointer chasing, sparrow_jax.data.synthetic, --min_hops..--max_hops) or a
.jsonl file with one prompt per line, either a JSON list of token ids or {"prompt_ids": [...]}.
--alpha topk20 scores the reference code's top-20 lower bound on alpha (what the paper's tau was
measured with; larger budgets than exact alpha at the same tau). --on_policy samples each
candidate's rollouts under its own schedule instead of one set under the largest (one generation
per candidate: slower).
A --preset model is randomly initialised (std --init_std, peaky enough attention for sparsity to
matter): a smoke run of the pipeline, not a meaningful schedule.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import sparrow_jax as sj  # noqa: E402
from sparrow_jax.mismatch import calibrate as cal  # noqa: E402


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
        raise ValueError(f"{path} row {row}: expected a non-empty JSON list of token ids or "
                         f'{{"prompt_ids": [...]}}, got {line.strip()[:80]}')
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


def parse_ints(text, flag):
  try:
    return [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    raise ValueError(f"--{flag} must be comma-separated integers, got {text!r}") from None


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument("--model_dir", default="", help="Hugging Face Qwen3 dir (sj.load_hf)")
  p.add_argument("--preset", default="tiny-untied", help="random model when no --model_dir")
  p.add_argument("--init_std", type=float, default=0.3)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--prompts", default="synthetic", help='"synthetic" or a token-id .jsonl file')
  p.add_argument("--num_prompts", type=int, default=8)
  p.add_argument("--min_hops", type=int, default=8, help="synthetic prompts")
  p.add_argument("--max_hops", type=int, default=16, help="synthetic prompts")
  p.add_argument("--repeats", type=int, default=8, help="samples per prompt (the paper: 8)")
  p.add_argument("--max_new_tokens", type=int, default=256)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--eos_ids", default="", help="comma list; default from the model dir / task")
  p.add_argument("--tau", type=float, default=0.86)
  p.add_argument("--alpha", choices=tuple(cal.ALPHAS), default="exact",
                 help="exact: sum_x min(p, q); topk20: the paper's top-20 lower bound")
  p.add_argument("--bin_size", type=int, default=2048)
  p.add_argument("--page_size", type=int, default=16)
  p.add_argument("--dense_layers", type=int, default=2)
  p.add_argument("--candidates", default="",
                 help="comma list of top-k pages; default: the paper's 18 values when the context "
                      "holds them, else ~18 geometric values up to the whole context")
  p.add_argument("--sample", choices=("sparse", "dense"), default="sparse",
                 help="rollout policy (sparse: top-k --sample_topk, default the largest candidate)")
  p.add_argument("--sample_topk", type=int, default=None)
  p.add_argument("--on_policy", action="store_true",
                 help="each candidate scores rollouts sampled under its own schedule")
  p.add_argument("--batch_size", type=int, default=8, help="rows per teacher-forced pass")
  p.add_argument("--candidates_per_pass", type=int, default=1, help="candidates vmapped together")
  p.add_argument("--out_dir", required=True)
  args = p.parse_args(argv)

  t0 = time.time()
  eos_ids, pad_id = parse_ints(args.eos_ids, "eos_ids"), 0
  if args.model_dir:
    cfg, params = sj.load_hf(args.model_dir)
    hf_eos, hf_pad = hf_token_ids(args.model_dir)
    eos_ids, pad_id = eos_ids or hf_eos, hf_pad if hf_pad is not None else 0
  else:
    cfg = sj.Qwen3Config.preset(args.preset)
    params = sj.init_params(cfg, jax.random.PRNGKey(args.seed), std=args.init_std)
  if args.prompts == "synthetic":
    from sparrow_jax.data import synthetic
    task = synthetic.PointerChase(min_hops=args.min_hops, max_hops=args.max_hops)
    prompts = [list(pr.prompt_ids) for pr in task.sample(args.num_prompts, args.seed)]
    eos_ids, pad_id = eos_ids or [task.eos_id], task.pad_id
  else:
    prompts = read_prompts(args.prompts, args.num_prompts)
  candidates = parse_ints(args.candidates, "candidates") or None

  sparse = sj.SparseConfig(page_size=args.page_size, dense_layers=args.dense_layers)
  print(f"[calibrate] model {args.model_dir or args.preset + ' (random init)'}, {len(prompts)} "
        f"prompts x {args.repeats}, max_new_tokens {args.max_new_tokens}, tau {args.tau} "
        f"({args.alpha} alpha, {'on' if args.on_policy else 'off'}-policy), bins of "
        f"{args.bin_size} tokens, page size {args.page_size}", flush=True)
  result = cal.calibrate(
      params, cfg, prompts, jax.random.PRNGKey(args.seed + 1), max_new_tokens=args.max_new_tokens,
      tau=args.tau, candidates=candidates, repeats=args.repeats, bin_size=args.bin_size,
      sparse=sparse, sample_sparse=args.sample == "sparse", sample_topk=args.sample_topk,
      temperature=args.temperature, eos_ids=eos_ids, pad_id=pad_id, batch_size=args.batch_size,
      candidates_per_pass=args.candidates_per_pass, alpha=args.alpha, on_policy=args.on_policy)

  os.makedirs(args.out_dir, exist_ok=True)
  with open(os.path.join(args.out_dir, "schedule.json"), "w") as f:
    f.write(result.schedule.to_json() + "\n")
  with open(os.path.join(args.out_dir, "surface.json"), "w") as f:
    items = cal.surface_dict(result).items()  # one key per line, lists kept on theirs
    f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in items) + "\n}\n")
  cal.plot_calibration(os.path.join(args.out_dir, "calibration.png"), result)
  print(f"[calibrate] candidates (top-k pages): {list(result.candidates)}")
  print(f"[calibrate] tokens per bin: {result.count.max(0).tolist()}"
        f"{' (most over candidates)' if result.on_policy else ''}")
  print(f"[calibrate] chosen top-k per bin: {list(result.schedule.values)} "
        f"(+{result.schedule.always_kept} always kept)")
  print(f"[calibrate] wrote schedule.json, surface.json, calibration.png to {args.out_dir} "
        f"({time.time() - t0:.0f}s)")


if __name__ == "__main__":
  main()
