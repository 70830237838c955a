"""experiments/bench_exact.py: exact mode (fixed draft counts and the regime switch) beside dense
and lossy sparse decoding, (1) at long context on a random Qwen3-1.7B-shaped model and (2) on the
shipped tiny model's own task, and (3), when enabled, on a real model's long prompts cut from
local text (the standard library's sources: docs/real_lm.md).

  python experiments/bench_exact.py --config=configs/bench_exact.py \\
      [--config.record=docs/results/speculative_rollout.json]
"""

import ml_collections

from configs import default, real_lm_rl


def get_config():
  c = ml_collections.ConfigDict()
  c.batch = 4  # (1): rows decoded together
  c.runs = 3  # timed calls per setting (median), interleaved, after one warm-up call
  c.temperature = 1.0  # (1)'s sampling temperature ((2) samples as the default job does)
  c.drafts = (2, 4)  # k of the fixed-k settings; the regime switch chooses among them or dense
  # The roofline the switch prices rounds on: this_machine (measured at start) or a cost_model
  # HARDWARE key
  c.hardware = "this_machine"
  c.record = ""  # write the results record here, e.g. docs/results/speculative_rollout.json

  # (1) long context: Qwen3-1.7B shapes cut in depth, random weights, random cached keys
  c.shapes = ml_collections.ConfigDict()
  c.shapes.layers = 2  # layers kept of the qwen3-1.7b shape
  c.shapes.dense_layers = 0  # layers the drafts keep dense (the verifier: all)
  c.shapes.vocab_size = 0  # 0 = 151936 * layers / 28 (the LM head's share of the full model)
  c.shapes.contexts = (16384, 32768)  # cached tokens per row; () = skip (1)
  c.shapes.steps = 16  # tokens per timed chunk (exact mode: the rounds drafting as many)
  c.shapes.tau = 0.86  # the paper's Qwen3-1.7B table at this tau (sparse rows, drafts)
  c.shapes.bin_size = 2048  # the switch's position bins

  # (2) a trained model's acceptance: the default job's model, task, prompts and cutoff
  c.trained = default.get_config()
  c.trained.enabled = True  # False = skip (2)
  c.trained.rollout.prompts_per_step = 2  # prompts (each group_size rows) of one rollout

  # (3) a real model on long prompts of real text (sparrow_jax/data/long_prompts.py): the real-LM
  # RL run's model dir, its calibrated table and sampling. Off by default: it needs a model dir
  # (experiments/import_gguf.py's output or any HF Qwen3 / Llama dir), which is refused in one
  # line when absent.
  c.long_prompts = real_lm_rl.get_config()
  c.long_prompts.enabled = False  # True = run (3)
  c.long_prompts.source_dir = ""  # the text's directory ("" = this interpreter's stdlib)
  c.long_prompts.pattern = "*.py"  # the directory's files read, sorted by name (not recursive)
  c.long_prompts.lengths = (4096, 8192)  # prompt tokens; every setting runs once per length
  c.long_prompts.rows = 2  # prompts per length, each from files of its own
  c.long_prompts.group_size = 1  # rows a prompt: more decode a batch at the same prefill (the
  #                                prompt's pages shared)
  c.long_prompts.instruction = "explain"  # data.long_prompts.INSTRUCTIONS: explain, continue
  c.long_prompts.chat = True  # the model's chat template (False: the instruction, then the text)
  c.long_prompts.system = ""  # the chat's system message ("" = none)
  c.long_prompts.rollout.max_new_tokens = 128  # new tokens per row after its long prompt
  c.long_prompts.stats.num_bins = 20  # the switch's bins must reach past the longest prompt
  return c
