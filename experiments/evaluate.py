"""Evaluate a policy: mean@k and pass@k on a math / code task, dense or sparse generation
(sparrow_jax.rl.evaluate; configs/evaluate.py documents every field).

  python experiments/evaluate.py --config=configs/evaluate.py [--config.model.hf_dir=DIR ...]
"""

from absl import app, flags
from ml_collections import config_flags

from sparrow_jax.rl import evaluate


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}: settings go in --config.FIELD=VALUE")
  evaluate.evaluate(flags.FLAGS.config)


if __name__ == "__main__":
  config_flags.DEFINE_config_file("config", "configs/evaluate.py", "experiment config")
  app.run(main)
