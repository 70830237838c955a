"""The results pages of docs/results/ are what docs/make_results_pages.py makes of the committed
records, and every record names its command, commit, machine and date."""

import glob
import json
import os
import re
import subprocess
import sys
import sysconfig

from sparrow_jax.records import write_record
from tests.helpers import ROOT


def test_results_pages_regenerate_from_the_records():
  result = subprocess.run(
    [sys.executable, "docs/make_results_pages.py", "--check"],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert result.returncode == 0, result.stdout + result.stderr


def test_every_record_has_its_provenance():
  records = glob.glob(os.path.join(ROOT, "docs", "results", "*.json"))
  assert records
  for path in records:
    record = json.load(open(path))
    assert {"command", "commit", "machine", "date", "results"} <= set(record), path
    assert record["command"].startswith("python experiments/"), path


def test_readme_quotes_the_default_runs_record():
  """The main command's cost in the README is the recorded run's, rounded as the README has it."""
  with open(os.path.join(ROOT, "docs", "results", "embedded_default_run.json")) as f:
    summary = json.load(f)["results"]["runs"]["default"]["summary"]
  minutes = f"{summary['time_s']['total'] / 60:.1f}"
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  assert f"**{minutes} minutes and {summary['peak_rss_gib']:.2f} GiB peak RSS**" in readme
  default_row = next(line for line in readme.splitlines() if line.startswith("| `default.py` |"))
  assert default_row.endswith(f"| {minutes} min |")


# One machine's own directories (home, checkout). A record or page names a model dir, venv or run
# dir as the docs' commands do ($HOME/..., VENV/..., the /tmp scratch dirs of configs such as
# configs/triton_stats.py), so that its command runs on any machine.
MACHINE_DIRS = ("/root/", "/home/", "/Users/", "/work/")


def _results_files() -> list:
  """The records (JSON) and pages (markdown) of docs/results/."""
  return sorted(glob.glob(os.path.join(ROOT, "docs", "results", "*.json"))) + sorted(
    glob.glob(os.path.join(ROOT, "docs", "results", "*.md"))
  )


def test_no_record_or_page_names_a_machine_directory():
  found = [
    (os.path.basename(path), d)
    for path in _results_files()
    for d in MACHINE_DIRS
    if d in open(path).read()
  ]
  assert not found


def test_a_record_written_names_no_machine_directory(tmp_path):
  """A script's results may hold the paths it read (a model dir, a source dir, the checkout's
  files): the record names them by place ($HOME, $STDLIB, relative to the checkout)."""
  paths = [
    os.path.expanduser("~/.cache/sparrow_jax/model"),
    sysconfig.get_paths()["stdlib"],
    os.path.join(ROOT, "docs", "results", "x.json"),
  ]
  record = write_record(str(tmp_path / "r.json"), dict(paths=paths, n=3))
  assert record["results"] == dict(
    paths=["$HOME/.cache/sparrow_jax/model", "$STDLIB", "docs/results/x.json"], n=3
  )
  assert json.loads((tmp_path / "r.json").read_text())["results"] == record["results"]


def test_every_script_a_record_or_page_names_exists():
  named = {
    (os.path.basename(path), script)
    for path in _results_files()
    for script in re.findall(r"experiments/\w+\.py", open(path).read())
  }
  missing = sorted((f, s) for f, s in named if not os.path.exists(os.path.join(ROOT, s)))
  assert not missing
