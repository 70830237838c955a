"""The main job: `python -m sparrow_jax.train --config=configs/default.py [--config.FIELD=VALUE]`.

Every error in the command line or the config (an unknown field, a value of the wrong type or out
of range, a bad file or dataset, a workdir in use, sizes no device holds), a code sandbox that
cannot be built, or a write that fails (a full disk: a checkpoint, the metrics), ends the job with
one line naming it on stderr and exit status 2; `--verbose` (or SPARROW_VERBOSE=1) shows the
traceback instead, and the libraries' absl log lines, which are quiet by default.
SIGTERM saves a checkpoint at the end of the step under way and exits with status 0
(rl/trainer.py `Preemption`).
"""

import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "experiment config")
_VERBOSE = flags.DEFINE_bool("verbose", False, "show tracebacks of configuration errors")


def _verbose(argv=()) -> bool:
  return (
    bool(os.environ.get("SPARROW_VERBOSE"))
    or "--verbose" in argv
    or (flags.FLAGS.is_parsed() and _VERBOSE.value)
  )


def _library_log_level() -> int:
  """absl's verbosity (orbax logs through it): every file it writes at INFO and, when a write fails
  (a full disk), a stream of errors from its threads. By default only the run's own lines and its
  one-line error show; --verbose keeps the libraries' warnings and errors."""
  return logging.WARNING if _verbose() else logging.FATAL


def _fail(message: str) -> None:
  """The one line of a command-line or config error, exit status 2."""
  print(f"error: {' '.join(str(message).split())} (--verbose for the traceback)", file=sys.stderr)
  sys.exit(2)


def flag_error(argv, e: Exception) -> str:
  """A flag parsing error as one line naming the config field."""
  bad_value = re.match(r"flag --config\.([\w.]+)=(.*?): (.*)", str(e), re.S)
  if bad_value:  # absl: a value its field's type does not parse
    field, value, why = bad_value.groups()
    return f"config.{field} = {value!r} is invalid: {why}"
  if isinstance(e, (AttributeError, KeyError)):  # ml_collections: an override of no field
    name = str(e).strip("\"'")
    paths = [m.group(1) for m in (re.match(r"--config\.([\w.]+)(=|$)", a) for a in argv) if m]
    path = next((p for p in paths if name in p.split(".")), name)
    files = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    return f"config.{path} is not a field of {(files or ['configs/default.py'])[-1]}"
  return str(e)


def _parse_flags(argv):
  try:
    return flags.FLAGS(argv)
  except Exception as e:  # absl's flags.Error, or what config_flags raises for an unknown field
    if _verbose(argv):
      raise
    _fail(flag_error(argv, e))


def main(argv):
  del argv
  from sparrow_jax.rl import trainer  # here: a bad flag fails before jax and orbax import

  logging.set_verbosity(_library_log_level())
  try:
    trainer.train(_CONFIG.value)
  # OSError: a missing file, a sandbox that cannot be built; a checkpoint write that fails (a full
  # disk) raises tensorstore's ValueError
  except (ValueError, OSError) as e:
    if _verbose():
      raise
    _fail(e)


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
