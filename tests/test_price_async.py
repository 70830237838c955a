"""experiments/price_async.py: the rules its pricing of sync against one step off must keep."""

import os
import subprocess
import sys

import pytest

from configs import price_async as price_config
from experiments import price_async
from tests.helpers import ROOT


def _config():
  """The paper workload's config at a shorter cutoff (the rules do not depend on it)."""
  c = price_config.get_config()
  c.gen_len = 4096
  return c


@pytest.fixture(scope="module")
def priced():
  c = _config()
  return {kind: price_async.price(c, kind == "sparse", "roofline") for kind in ("dense", "sparse")}


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_one_step_off_on_its_own_devices_overlaps_and_pays_the_sync(priced, kind):
  """One step off on rollout devices of their own: the slower side plus the weights' transfer,
  never the two sides one after the other; on the same devices nothing overlaps."""
  for f in priced[kind]["one step off, split"]["sweep"]:
    assert f["step_s"] == pytest.approx(max(f["rollout_s"], f["update_s"]) + f["weights_s"])
    assert f["weights_s"] > 0
  on, off = priced[kind]["on-policy, colocated"], priced[kind]["one step off, colocated"]
  assert off["step_s"] >= on["rollout_s"] + on["update_s"]
  assert on["speedup"] == 1.0


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_the_split_picked_beats_the_others_tried(priced, kind):
  for layout in ("on-policy, split", "one step off, split"):
    fig = priced[kind][layout]
    assert all(fig["best"]["step_s"] <= f["step_s"] for f in fig["sweep"])
    configured = [f for f in fig["sweep"] if f["runs_as_configured"]]
    assert fig["best_configured"]["runs_as_configured"]
    assert all(fig["best_configured"]["step_s"] <= f["step_s"] for f in configured)


def test_only_splits_with_whole_groups_and_even_backward_rows_run_as_configured():
  c = _config()  # 32 groups, 8 rows per backward pass, 8 devices
  assert [r for r in range(1, 8) if price_async.runs_as_configured(c, r)] == [4]


@pytest.mark.nightly
def test_documented_command_writes_its_record(tmp_path):
  out = tmp_path / "async_pricing.json"
  result = subprocess.run(
    [
      sys.executable,
      "experiments/price_async.py",
      "--config=configs/price_async.py",
      "--config.gen_len=2048",
      f"--config.out={out}",
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env={**os.environ, "JAX_PLATFORMS": "cpu"},
  )
  assert result.returncode == 0, result.stderr[-2000:]
  assert out.exists() and "best R" in result.stdout
