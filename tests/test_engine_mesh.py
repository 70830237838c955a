"""The engine on 8 fake CPU devices (a 2 x 2 x 2 data, fsdp, tensor mesh: four row shards, each
with its own pool and slots, KV heads split in two) gives the rows of one device (a dense first
layer, sparse ones after it), through XLA and through the Pallas kernel under shard_map."""
import textwrap

from tests.test_sharding import run_on_fake_devices

SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    import sparrow_jax as sj
    from sparrow_jax.attention.select import SparseConfig
    from sparrow_jax.mismatch.schedule import KVSchedule
    from sparrow_jax.model import sharding
    from sparrow_jax.rollout import engine
    from tests.helpers import tiny_config
    assert len(jax.devices()) == 8, jax.devices()

    CFG = tiny_config(vocab_size=96, num_hidden_layers=3)
    params = sj.init_params(CFG, jax.random.PRNGKey(0), std=0.3)
    rng = np.random.RandomState(0)
    lens = np.repeat(rng.randint(5, 14, 6), 2).astype(np.int32)     # 6 groups of 2 rows
    prompt = np.repeat(rng.randint(1, 96, (6, 14)), 2, 0) * (np.arange(14)[None] < lens[:, None])
    max_new = rng.randint(4, 30, 12)

    def run(mesh, impl="xla"):  # layer 0 dense, layers 1-2 sparse: both read paths
      kw = dict(sparse=SparseConfig(page_size=4, dense_layers=1, attention_impl=impl),
                schedule=KVSchedule.fixed(4, page_size=4))
      with jax.set_mesh(mesh):
        placed = sharding.place(params, sharding.param_shardings(params, mesh,
                                                                 sharding.ROLLOUT_RULES))
        out, stats = engine.run(placed, CFG, prompt, lens, jax.random.PRNGKey(3),
                                max_new_tokens=max_new, group_size=2, eos_ids=(5,),
                                engine=engine.EngineConfig(num_slots=2, num_pages=40,
                                                           chunk_steps=6), **kw)
      return np.asarray(out.tokens), np.asarray(out.logprobs), stats

    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    one_device = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    tokens, logprobs, one = run(one_device)
    got_tokens, got_logprobs, eight = run(mesh)
    np.testing.assert_array_equal(got_tokens, tokens)
    np.testing.assert_allclose(got_logprobs, logprobs, atol=1e-5)
    # four devices' slots run at once: more rows in flight, fewer decode steps
    assert eight.rows_in_flight > 2 * one.rows_in_flight, (eight, one)
    pallas_tokens, _, _ = run(mesh, impl="pallas")
    np.testing.assert_array_equal(pallas_tokens, tokens)
    print("OK")
""")


def test_engine_on_a_2x2x2_mesh_equals_one_device():
  assert "OK" in run_on_fake_devices(SCRIPT)
