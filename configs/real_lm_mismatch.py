"""The paper's mismatch study on a real pretrained LM (SmolLM2-135M-Instruct, imported from GGUF):
long temperature-1 responses to shipped math prompts, exact per-token alpha under fixed KV budgets
with the mean and the quest page scores, the top-20 bound beside it, and the calibrated table.
Sized for a 2-core CPU (docs/real_lm.md); the model dir comes from experiments/import_gguf.py.

  python experiments/import_gguf.py --config=configs/import_gguf.py --config.fetch=True
  python experiments/real_lm_mismatch.py --config=configs/real_lm_mismatch.py
  python experiments/real_lm_mismatch.py --config=configs/real_lm_mismatch.py \\
      --config.num_prompts=2 --config.repeats=1 --config.rollout.max_new_tokens=256 \\
      --config.stats.bin_size=64 --config.candidates=2,8 --config.quest_candidates=8 \\
      --config.record=/tmp/mismatch.json --config.plot_dir=/tmp   # a smoke run
"""

import os

import ml_collections

from configs import common

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "sparrow_jax")  # model.gguf.DEFAULT_CACHE


def get_config():
  c = ml_collections.ConfigDict()
  c.seed = 0  # sampling key
  c.model = common.model(
    "hf_dir", "dtype", hf_dir=os.path.join(CACHE, "smollm2-135m-instruct")
  )  # the imported real LM (configs/import_gguf.py's out_dir)
  c.prompts = "assets/real_lm/math_prompts.jsonl"  # {"problem", "answer"} rows (source: its README)
  c.num_prompts = 8  # the first prompts of the file
  c.repeats = 1  # samples per prompt (the paper: 8; the CPU's time decides here)
  c.system = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # the
  #                                    model's own chat template's default system message
  c.stop_at_eos = False  # False: every row runs to max_new_tokens (past the model's
  #                                    <|im_end|>, which it writes within a few hundred tokens), so
  #                                    every position bin is measured on the same rows
  c.rollout = common.rollout(
    "max_new_tokens",
    "temperature",
    "page_size",
    "dense_layers",
    "attention_impl",
    max_new_tokens=2048,
    dense_layers=2,
  )  # dense_layers: the paper's 2 (of 30 here)
  c.candidates = "4,8,16,32,64"  # fixed top-k budgets, pages (+3 always kept), mean scores
  c.quest_candidates = "8,32"  # the budgets also scored with quest page scores (equal KV)
  c.sample_topk = 64  # rollouts are sampled sparsely at this top-k (the paper: the largest)
  c.stats = common.stats("tau", "quantile", "bin_size", bin_size=512)  # bins of 512 cached
  #                                    tokens: ~2.2K-token rows give 5 bins
  c.batch_size = 4  # rows per teacher-forced pass (its LM-head chunks: 4 x 512 x 49152 floats)
  c.record = (
    "docs/results/real_lm_mismatch.json"  # the results record (docs/results/real_lm_mismatch.md)
  )
  c.schedule_out = "assets/real_lm/schedule.json"  # the mean-score, exact-alpha table at tau
  #                                    (KVSchedule JSON: configs/real_lm_rl.py, the decode bench)
  c.from_record = ""  # a record of this study: only re-choose the tables from its p5 surface
  #                                    at stats.tau and write schedule_out (no model runs)
  c.recompute_from = ""  # a record of this study: rewrite its derived fields (tables' pages,
  #                                    the paper's, post-EOS counts) and the plot from its stored
  #                                    statistics into config.record (no model runs)
  c.plot_dir = "assets/real_lm"  # mismatch_*.png go here ("" = no plots)
  return c
