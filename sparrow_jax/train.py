"""The main job: `python -m sparrow_jax.train --config=configs/default.py [--config.FIELD=VALUE]`.

A bad config value, file or dataset, or a code sandbox that cannot be built, ends the job with one
line naming it (exit status 2);
`--verbose` (or SPARROW_VERBOSE=1) shows the traceback instead.
"""
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from sparrow_jax.rl import trainer

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "experiment config")
_VERBOSE = flags.DEFINE_bool("verbose", False, "show tracebacks of configuration errors")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # orbax logs every file it writes at INFO
  try:
    trainer.train(_CONFIG.value)
  except (ValueError, OSError) as e:  # OSError: a missing file, a sandbox that cannot be built
    if _VERBOSE.value or os.environ.get("SPARROW_VERBOSE"):
      raise
    print(f"error: {e} (--verbose for the traceback)", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main)
