"""Results records: what an experiment measured, as JSON with its provenance (the command, the
commit, the machine and the date), so a figure on a docs page can be traced to the run that made
it."""

import datetime
import json
import os
import platform
import re
import resource
import subprocess
import sys
import sysconfig

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _commit() -> str:
  """HEAD's hash, marked -dirty when the tree has changes the record's figures may depend on."""
  git = lambda *args: subprocess.run(
    ["git", *args], cwd=ROOT, capture_output=True, text=True
  ).stdout.strip()
  head = git("rev-parse", "HEAD") or "unknown"
  return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def _cpu_model() -> str:
  """The CPU's model name (Linux), which XLA's CPU code generation, and so float results, follow."""
  try:
    with open("/proc/cpuinfo") as f:
      names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
  except OSError:
    names = []
  return names[0] if names else platform.processor() or "unknown CPU"


def machine() -> str:
  devices = jax.devices()
  return (
    f"{platform.machine()} {os.cpu_count()} cores ({_cpu_model()}), {devices[0].platform} "
    f"x{len(devices)} ({devices[0].device_kind}), Python {platform.python_version()}, "
    f"jax {jax.__version__}"
  )


# The tree the experiment starts from: a record written at its end names the code that ran, not
# edits made while it ran.
_COMMIT_AT_START = _commit()


def commit_at_start() -> str:
  """The commit this process started from (`_commit`)."""
  return _COMMIT_AT_START


def command() -> str:
  """This process's command line as typed: `python -m MODULE ...`, or `python SCRIPT ...` with the
  script relative to the repository."""
  spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # None for a script
  program = ["-m", spec.name] if spec is not None else [os.path.relpath(sys.argv[0], ROOT)]
  return " ".join(["python", *program, *sys.argv[1:]])


def peak_rss_gib() -> float:
  """This process's peak resident memory so far, GiB (Linux counts ru_maxrss in KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# A record is read on other machines: its paths name these places, not this machine's directories
# (the checkout first: it may lie under the home directory; paths under it become relative).
_PLACES = (
  (ROOT + os.sep, ""),
  (ROOT, "."),
  (sysconfig.get_paths()["stdlib"], "$STDLIB"),
  (os.path.expanduser("~"), "$HOME"),
)


def portable(value):
  """`value` (JSON: dicts, lists, strings, numbers) with each path under the checkout made
  relative to it, and the standard library and home directories named $STDLIB and $HOME."""
  if isinstance(value, dict):
    return {k: portable(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [portable(v) for v in value]
  if isinstance(value, str):
    for place, name in _PLACES:  # a whole directory name: /root, not /rootfs
      whole = "" if place.endswith(os.sep) else r"(?![\w.-])"
      value = re.sub(re.escape(place) + whole, lambda _: name, value)
  return value


def write_record(path: str, results: dict) -> dict:
  """Writes {command, commit, machine, date, results} to `path` (JSON) and returns it, its paths
  `portable`."""
  record = dict(
    command=portable(command()),
    commit=commit_at_start(),
    machine=machine(),
    date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    results=portable(results),
  )
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
    f.write("\n")
  return record
