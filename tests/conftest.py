"""Test setup: float32 everywhere on the CPU unless JAX_PLATFORMS says otherwise, and
`run_experiment`, which runs an experiment script the way its docstring does, and `small_run`, one
short single-device training run that the resume and the mesh tests compare against.

No sys.path edit: tests/ is a package (tests/__init__.py), so pytest's default "prepend" import
mode puts its parent, the repo root, on sys.path, and `configs`, `experiments` and `tests.helpers`
import from there (`sparrow_jax` and `kernels` are installed by `pip install -e .`)."""

import os
import subprocess
import sys
import tempfile

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per test session, inherited by every subprocess: a resumed or
# repeated run (and a test that builds a step another test built) loads its executables instead
# of compiling them again (CI time).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="sparrow_jax_jit_"))
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from tests.helpers import TEST_XLA_FLAGS  # noqa: E402  (jax reads XLA_FLAGS at its first use)

os.environ.setdefault("XLA_FLAGS", TEST_XLA_FLAGS)


@pytest.fixture
def run_experiment():
  """run(script, config, overrides) runs `python experiments/<script>.py
  --config=configs/<config>.py --config.<key>=<value> ...` in a subprocess from the repo root on
  the CPU and returns its stdout; a non-zero exit fails the test with the output's tail."""

  def run(script, config, overrides, timeout=300):
    cmd = [sys.executable, f"experiments/{script}.py", f"--config=configs/{config}.py"]
    cmd += [f"--config.{key}={value}" for key, value in overrides.items()]
    proc = subprocess.run(
      cmd,
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=timeout,
      env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout

  return run


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
  """The workdir of a finished 4-step SMALL run on one device."""
  workdir = tmp_path_factory.mktemp("small_run")
  from tests.helpers import launch_small

  proc = launch_small(workdir)
  out = proc.communicate(timeout=600)[0]
  assert proc.returncode == 0, out[-3000:]
  assert "step 4/4" in out
  return workdir
