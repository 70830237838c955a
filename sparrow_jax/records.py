"""Results records: what an experiment measured, as JSON with its provenance (the command, the
commit, the machine and the date), so a figure on a docs page can be traced to the run that made
it."""

import datetime
import json
import os
import platform
import subprocess
import sys

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _commit() -> str:
  """HEAD's hash, marked -dirty when the tree has changes the record's figures may depend on."""
  git = lambda *args: subprocess.run(
    ["git", *args], cwd=ROOT, capture_output=True, text=True
  ).stdout.strip()
  head = git("rev-parse", "HEAD") or "unknown"
  return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> str:
  devices = jax.devices()
  return (
    f"{platform.machine()} {os.cpu_count()} cores, {devices[0].platform} x{len(devices)} "
    f"({devices[0].device_kind}), Python {platform.python_version()}, jax {jax.__version__}"
  )


# The tree the experiment starts from: a record written at its end names the code that ran, not
# edits made while it ran.
_COMMIT_AT_START = _commit()


def write_record(path: str, results: dict) -> dict:
  """Writes {command, commit, machine, date, results} to `path` (JSON) and returns it."""
  record = dict(
    command=" ".join(["python"] + [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]),
    commit=_COMMIT_AT_START,
    machine=machine(),
    date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    results=results,
  )
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(record, f, indent=1)
    f.write("\n")
  return record
