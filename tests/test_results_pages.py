"""The results pages of docs/results/ are what docs/make_results_pages.py makes of the committed
records, and every record names its command, commit, machine and date."""

import glob
import json
import os
import subprocess
import sys

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
