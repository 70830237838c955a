"""Calibrates a KV-budget schedule at threshold tau: by default the tau-0.86 schedule the shipped
tiny model trains with (quest page scores: assets/pointer_chase_tiny/calibration_quest/; the paper's
mean-key scores: .../calibration/; 16 prompts of 128 hops x 8 samples, minutes on a laptop CPU).
Model, task, rollout and stats fields mean what they mean in the trainer (configs/common.py), so the
schedule is calibrated for the setting that will use it.

  python experiments/calibrate_schedule.py --config=configs/calibrate.py \\
      --config.out_dir=assets/pointer_chase_tiny/calibration_quest   # the shipped schedule
  python experiments/calibrate_schedule.py --config=configs/calibrate.py \\
      --config.rollout.page_score=mean --config.out_dir=assets/pointer_chase_tiny/calibration
  python experiments/calibrate_schedule.py --config=configs/calibrate.py --config.model.hf_dir= \\
      --config.model.preset=tiny-untied --config.rollout.page_size=4 --config.stats.bin_size=32 \\
      --config.task.min_hops=8 --config.task.max_hops=16 --config.num_prompts=4 \\
      --config.calibration.repeats=4 --config.rollout.max_new_tokens=96 \\
      --config.out_dir=/tmp/calib  # a smoke run

The `calibration` group holds mismatch/calibrate.CalibrationConfig's fields (with stats' tau,
quantile and bin_size): its defaults are the library's, set here where this file departs from them.
"""

import ml_collections

from configs import common

# Where this config departs from the library's defaults (mismatch.calibrate.CalibrationConfig,
# attention.select.SparseConfig, rollout.sampler.Sampling), and why; tests/test_config.py checks
# that every other field they share agrees.
DEPARTS_FROM_LIBRARY = {
  "stats.bin_size": "the shipped model's rows of ~850 tokens: bins of 128, as it trains with",
  "rollout.dense_layers": "1 of the tiny model's 2 layers (the paper: 2 of 28)",
  "rollout.page_score": "quest: the shipped schedule is quest's (configs/default.py)",
}


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0  # synthetic prompt position, random init; sampling key seed + 1
  c.out_dir = "workdir/calibrate"  # schedule.json, surface.json and calibration.png go here
  c.record = ""  # also write the chosen table, its tokens and the time as a results record
  #                                    (JSON with the command, commit, machine and date); "" = none

  c.model = common.model()  # the shipped tiny model, or a random preset with its own
  #                                    vocabulary (a smoke run)
  c.model.init_std = 0.3  # preset init std: peaky enough attention for sparsity to matter

  c.prompts = "synthetic"  # "synthetic" (pointer chasing, task.min_hops..max_hops) or a
  #                                    .jsonl file, a JSON list of token ids or
  #                                    {"prompt_ids": [...]} a line
  c.task = common.task("min_hops", "max_hops")  # the synthetic prompts' chain lengths
  c.num_prompts = 16  # distinct prompts
  c.eos_ids = ""  # comma list; "" = from the model dir, else the synthetic task

  c.rollout = common.rollout(
    "max_new_tokens",
    "temperature",
    "page_size",
    "dense_layers",
    "attention_impl",
    "page_score",
  )  # how the rollouts are sampled and the pages scored

  c.stats = common.stats()  # tau and quantile: the tail target per bin (p5 >= 0.86);
  #                                    bin_size: the schedule's bins

  c.calibration = ml_collections.ConfigDict()
  c.calibration.alpha = "exact"  # exact: sum_x min(p, q) | topk20: the paper's top-20
  #                                    lower bound (what its tau was measured with; larger budgets)
  c.calibration.candidates = ()  # top-k pages, e.g. "(4, 8, 16)"; (): the paper's 18 values
  #                                    when the context holds them, else ~18 geometric values up
  #                                    to all of it
  c.calibration.repeats = 8  # samples per prompt (the paper: 8)
  c.calibration.sample_sparse = True  # rollouts sampled sparsely (the paper) or densely
  c.calibration.sample_topk = 0  # sparse rollouts' top-k pages (0 = the largest candidate)
  c.calibration.on_policy = False  # each candidate scores rollouts sampled under its own
  #                                    schedule (one generation per candidate: slower)
  c.calibration.batch_size = 8  # rows per teacher-forced pass
  c.calibration.generate_batch_size = 64  # rows per rollout batch
  c.calibration.candidates_per_pass = 1  # candidates vmapped together (memory grows with it)

  c.speculative = ml_collections.ConfigDict()  # lossless rollouts (calibrate.speculative_plan)
  c.speculative.report = False  # also print and write (speculative.json, the record) per
  #                                    bin the budget and draft count k that maximise predicted
  #                                    throughput, from each candidate's mean acceptance
  c.speculative.ks = (1, 2, 4, 8)  # draft tokens per round compared
  c.speculative.rows = 64  # rows decoding together, at each bin's middle length
  c.speculative.hardware = "h200"  # a cost_model.HARDWARE key or "this_machine"
  return c
