"""Predicted sparse-rollout speedups from the eFLOPs cost model, beside the paper's measurements.

  python experiments/cost_report.py --config=configs/cost_report.py \\
      [--config.prompt_len=1024 --config.gen_len=32768 --config.measure=False]

Every sample is assumed to run to the generation cutoff (32K, as in the paper's speedup runs) from
a 1K-token prompt (AIME-like prompts with the chat template are a few hundred tokens; 1K is a round
upper value). Real rollouts stop earlier, which lowers the measured speedup, as do parameter reads,
prefill and kernel overheads that the model leaves out.
"""
from absl import app, flags
from ml_collections import config_flags

from sparrow_jax.mismatch import cost_model
from sparrow_jax.mismatch.schedule import KVSchedule

# Sparrow, rollout speedup at tau 0.86, 4x H200, 32K cutoff.
PAPER_SPEEDUP = {"qwen3-1.7b": 2.21, "qwen3-4b": 2.41, "qwen3-8b": 2.06, "qwen3-14b": 1.49}
PAGE_SIZES = (16, 32, 64, 128)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  config = flags.FLAGS.config
  hardware = dict(cost_model.HARDWARE)
  if config.measure:
    hardware[cost_model.THIS_MACHINE] = cost_model.measure_this_machine()
  print(f"prompt {config.prompt_len} tokens, generation {config.gen_len} tokens (all samples "
        f"reach it), {config.n_samples} samples per prompt, tau-{config.tau:.2f} schedules, page "
        "size 16, first 2 layers dense")
  for name, hw in hardware.items():
    print(f"  {name:14s} {hw.peak_flops / 1e12:9.3f} TFLOP/s {hw.mem_bandwidth / 1e9:8.1f} GB/s "
          f"I = {hw.intensity:6.1f} FLOP/byte  ({hw.dtype_bytes}-byte KV elements)")

  print("\nPredicted rollout speedup (dense / sparse eFLOPs)")
  header = " ".join(f"{h:>9.9s}" for h in hardware)
  print(f"{'model':11s} {'params':>7s} {'max pages':>9s} {header} {'paper (4x H200)':>16s}")
  for model, measured in PAPER_SPEEDUP.items():
    schedule = KVSchedule.paper(model, config.tau)
    cells = [cost_model.rollout_speedup(model, schedule, config.prompt_len, config.gen_len,
                                        config.n_samples, hw) for hw in hardware.values()]
    print(f"{model:11s} {cost_model.param_count(model) / 1e9:6.2f}B {schedule.max_pages:9d} "
          + " ".join(f"{c:8.2f}x" for c in cells) + f" {measured:15.2f}x")

  print("\nPage-size comparison on h200 at the same token budget (predicted speedup)")
  print(f"{'model':11s} " + " ".join(f"{'page ' + str(z):>9s}" for z in PAGE_SIZES))
  for model in PAPER_SPEEDUP:
    by_size = cost_model.page_size_comparison(model, KVSchedule.paper(model, config.tau),
                                              config.prompt_len, config.gen_len, PAGE_SIZES,
                                              config.n_samples, "h200")
    print(f"{model:11s} " + " ".join(f"{by_size[z]:8.2f}x" for z in PAGE_SIZES))
  print("Larger pages only save page scoring (one centroid per page) in this model; the paper "
        "picks 16 because at equal cost it keeps the acceptance tail higher.")


if __name__ == "__main__":
  # Defined here, not at import: tests import scripts beside others that define --config.
  config_flags.DEFINE_config_file("config", "configs/cost_report.py", "experiment config")
  app.run(main)
