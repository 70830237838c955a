"""forward under a mesh of 8 fake CPU devices equals the single-device logits."""
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    import sparrow_jax as sj
    from sparrow_jax.model import sharding
    from tests.helpers import tiny_config
    assert len(jax.devices()) == 8, jax.devices()
    cfg = tiny_config(vocab_size=96, num_attention_heads=4, num_key_value_heads=2)
    params = sj.init_params(cfg, jax.random.PRNGKey(0), std=0.2)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 96, (4, 16)))
    single = np.asarray(sj.forward(params, tokens, cfg))
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    sharded = sharding.shard_params(params, mesh)
    assert sharded["layers"]["q"].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor")
    tokens = jax.device_put(tokens, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(("data", "fsdp"), None)))
    out = jax.jit(sj.forward, static_argnums=2)(sharded, tokens, cfg)
    np.testing.assert_allclose(np.asarray(out), single, atol=1e-5)
    print("OK")
""")


def test_forward_on_8_fake_devices():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu",
             PYTHONPATH=root)
  result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=root, capture_output=True,
                          text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "OK" in result.stdout
