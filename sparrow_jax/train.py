"""The main job: `python -m sparrow_jax.train --config=configs/default.py [--config.FIELD=VALUE]`."""
from absl import app, logging
from ml_collections import config_flags

from sparrow_jax.rl import trainer

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "experiment config")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  trainer.train(_CONFIG.value)


if __name__ == "__main__":
  app.run(main)
