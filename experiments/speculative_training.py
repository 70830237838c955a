"""Exact mode's training test (docs/rollout_engine.md, written before its runs): trains the default
job with rollout.speculate = k on each seed, scores each exported policy as the threshold sweep
does (experiments/tau_sweep.py: trainer workdirs, the same held-out evaluation and per-run
figures), and compares the mean held-out score with the shipped dense runs' mean - std (ddof 1)
over the same seeds. Also per run: the KV read (drafts and verification), rollout tokens/s and its
ratio to the same seed's dense run, draft acceptance, accepted tokens per round and the TIS weight.

  python experiments/speculative_training.py --config=configs/speculative_training.py \\
      [--config.seeds=2 --config.record=docs/results/speculative_training.json]
"""

import json
import os

from absl import app, flags, logging
import ml_collections
from ml_collections import config_flags
import numpy as np

from experiments import tau_sweep
from sparrow_jax import records as results_records

EXTRA = ("rollout/accepted_per_round", "rollout/draft_acceptance", "tis/weight_mean")


def run_config(c, seed: int) -> ml_collections.ConfigDict:
  rc = ml_collections.ConfigDict(c.train.to_dict())
  rc.workdir = os.path.join(c.sweep_dir, f"speculate_seed{seed}")
  rc.seed = seed
  return rc


def run_record(c, rc) -> dict:
  """The sweep's per-run figures plus the exact mode's (means over the run's steps)."""
  record = tau_sweep.run_record(rc.workdir, c.window, c.train.stats.tau)
  rows = tau_sweep.read_metrics(rc.workdir)
  for name in EXTRA:
    record[name.replace("/", "_")] = float(np.mean(tau_sweep.series(rows, name)))
  return record


def verdict(spec: dict, dense: dict, seeds) -> dict:
  """The written rule: passed if the speculative mean held-out score is at least dense mean - std;
  inconclusive unless every seed finished."""
  line = dense["heldout_score"]["mean"] - dense["heldout_score"]["std"]
  mean = spec["heldout_score"]["mean"]
  if len(spec["seeds"]) < len(seeds):
    result = "inconclusive"
  else:
    result = "passed" if mean >= line else "failed"
  return dict(
    line=line, dense_mean=dense["heldout_score"]["mean"], speculative_mean=mean, verdict=result
  )


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  logging.set_verbosity(logging.WARNING)
  c = flags.FLAGS.config
  seeds = tau_sweep.parse_list(c.seeds, "seeds", int)
  with open(c.dense) as f:
    base = json.load(f)
  dense_seeds = base["settings"]["dense"]["seeds"]
  if not set(seeds) <= set(dense_seeds):
    raise ValueError(f"config.seeds = {c.seeds!r}: config.dense holds dense seeds {dense_seeds}")
  runs = {}
  for seed in seeds:
    rc = run_config(c, seed)
    tau_sweep.train_and_evaluate(c, rc)
    run = run_record(c, rc)
    dense = base["runs"][f"dense_seed{seed}"]
    run["measured_speedup"] = run["rollout_tokens_per_s"] / dense["rollout_tokens_per_s"]
    runs[f"speculate_seed{seed}"] = run
  fields = tau_sweep.FIELDS + tuple(n.replace("/", "_") for n in EXTRA)
  spec = dict(
    name="speculate",
    speculate=c.train.rollout.speculate,
    seeds=seeds,
    **{f: tau_sweep._mean_std([r.get(f) for r in runs.values()]) for f in fields},
  )
  results = dict(
    config=json.loads(c.to_json_best_effort()),
    settings={"dense": base["settings"]["dense"], "speculate": spec},
    runs=runs,
    verdict=verdict(spec, base["settings"]["dense"], dense_seeds),
  )
  print(json.dumps(results["verdict"], indent=1))
  for name, run in runs.items():
    print(name, {k: run[k] for k in ("heldout_score", "kv_read", "rollout_tokens_per_s")})
  if c.record:
    results_records.write_record(c.record, results)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "configs/speculative_training.py", "experiment config")
  app.run(main)
