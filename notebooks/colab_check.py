"""Runs a notebook's code cells the way Colab would, to check its install cell from a clean venv.

  python3 -m venv /tmp/cv && /tmp/cv/bin/pip install ipython   # Colab's kernel has IPython
  mkdir /tmp/cv_run && cd /tmp/cv_run && SPARROW_REPO=/path/to/this/repo MPLBACKEND=Agg \
      SPARROW_SWEEP_DIR=... /tmp/cv/bin/python /path/to/notebooks/colab_check.py tau_sweep.ipynb

`google.colab` is importable (empty modules, so the notebooks take their Colab branch) and
get_ipython() runs `!` commands in a shell and `%pip` with this interpreter's pip. Run from an
empty directory: the install cell must clone SPARROW_REPO and pip-install its requirements into
the venv before anything else imports. Prints "NOTEBOOK OK <path>" when every cell ran.
"""
import importlib
import json
import os
import subprocess
import sys
import tempfile

import builtins


class ColabShell:
  """What the notebooks ask of get_ipython(): shell commands and the %pip magic."""

  def system(self, cmd):
    subprocess.run(cmd, shell=True, check=True)

  def run_line_magic(self, name, line):
    if name != "pip":
      raise NotImplementedError(f"%{name}: only %pip is provided")
    subprocess.run([sys.executable, "-m", "pip", *line.split()], check=True)


def fake_colab() -> None:
  """An importable google.colab (and google.colab.output, which jax imports under Colab) as a
  namespace package beside site-packages' google, so google.protobuf still resolves."""
  root = tempfile.mkdtemp()
  os.makedirs(os.path.join(root, "google", "colab"))
  for name in ("__init__.py", "output.py"):
    open(os.path.join(root, "google", "colab", name), "w").close()
  sys.path.insert(0, root)
  importlib.import_module("google.colab")  # now in sys.modules: the notebooks' Colab test


def main(path):
  fake_colab()
  builtins.get_ipython = ColabShell
  namespace = {}
  with open(path) as f:
    cells = json.load(f)["cells"]
  for cell in cells:
    if cell["cell_type"] == "code":
      exec("".join(cell["source"]), namespace)  # noqa: S102 (our own notebook)
  print("NOTEBOOK OK", path)


if __name__ == "__main__":
  main(os.path.abspath(sys.argv[1]))
