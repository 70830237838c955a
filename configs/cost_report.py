"""experiments/cost_report.py: predicted sparse-rollout speedups (eFLOPs cost model) vs the paper's.

  python experiments/cost_report.py --config=configs/cost_report.py [--config.measure=False]
"""
import ml_collections


def get_config():
  c = ml_collections.ConfigDict()
  c.prompt_len = 1024                # prompt tokens (AIME-like prompts are a few hundred)
  c.gen_len = 32768                  # generated tokens, every sample reaching them (paper's cutoff)
  c.n_samples = 8                    # samples per prompt (they share the prompt's pages)
  c.tau = 0.86                       # acceptance threshold of the paper's KV schedules
  c.measure = True                   # add a this_machine column (measures FLOP/s, bandwidth here)
  return c
