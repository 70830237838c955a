"""The real-run configs build, shard and trace at full size on their device counts (fake CPU
devices, nothing allocated or run): Qwen3-1.7B x 38K-token rows on 8, Qwen3-14B on 32."""

import textwrap

import pytest

from tests.test_sharding import run_on_fake_devices

SCRIPT = textwrap.dedent("""
    import importlib, jax
    from sparrow_jax.rl import build
    c = importlib.import_module("configs.{name}").get_config()
    c.model.hf_dir, c.model.preset = "", "{preset}"  # the model's shapes, no weights
    c.distributed.enabled = False  # one process holds every fake device
    lowered, shardings = build.lower_step(c)
    print("q", lowered.args_info[0][0].params["layers"]["q"].shape,
          shardings.params["layers"]["q"].spec)
    print("rows", lowered.args_info[0][1].tokens.shape)
""")


@pytest.mark.nightly
@pytest.mark.parametrize(
  "name, preset, devices, rows, q_shape",
  [
    ("qwen3_1p7b_polaris", "qwen3-1.7b", 8, 256, (28, 2048, 2048)),
    ("qwen3_14b_polaris", "qwen3-14b", 32, 512, (40, 5120, 5120)),
  ],
)
def test_real_config_lowers_at_full_size(name, preset, devices, rows, q_shape):
  out = run_on_fake_devices(SCRIPT.format(name=name, preset=preset), devices=devices)
  assert f"q {q_shape} P(None, 'fsdp', None)" in out  # FSDP over the model width
  assert f"rows ({rows}, 38912)" in out  # 1K prompt + the paper's 37K cutoff


@pytest.mark.parametrize("name", ["qwen3_1p7b_polaris", "qwen3_14b_polaris"])
def test_real_config_has_every_trainer_field(name):
  import importlib
  import json

  from configs import default
  from sparrow_jax.rl import run_config

  fields = lambda c: set(run_config._flat(json.loads(c.to_json_best_effort())))
  c = importlib.import_module(f"configs.{name}").get_config()
  assert fields(c) == fields(default.get_config())
