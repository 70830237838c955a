"""The engine on many devices gives the rows of one device: 8 fake CPU devices (a 2 x 2 x 2 data,
fsdp, tensor mesh: four row shards, each with its own pool and slots, KV heads split in two; the
Pallas kernel under shard_map on this mesh: tests/test_sharding.py), and 2 processes x 2 devices
(CPU collectives, a local coordinator), each scheduling only its own rows. A dense first layer,
sparse ones after it."""

import textwrap

import numpy as np
import pytest

from tests.helpers import run_two_processes
from tests.test_sharding import run_on_fake_devices

SETUP = textwrap.dedent("""
    import jax, numpy as np
    import sparrow_jax as sj
    from sparrow_jax.attention.select import SparseConfig
    from sparrow_jax.sparsity.schedule import KVSchedule
    from sparrow_jax import sharding
    from sparrow_jax.rollout import engine
    from tests.helpers import tiny_config

    CFG = tiny_config(vocab_size=96, num_hidden_layers=3)
    params = sj.init_params(CFG, jax.random.PRNGKey(0), std=0.3)
    rng = np.random.RandomState(0)
    lens = np.repeat(rng.randint(5, 14, 6), 2).astype(np.int32)     # 6 groups of 2 rows
    prompt = np.repeat(rng.randint(1, 96, (6, 14)), 2, 0) * (np.arange(14)[None] < lens[:, None])
    max_new = rng.randint(4, 30, 12)

    def run(mesh, rows=slice(None)):  # layer 0 dense, layers 1-2 sparse
      kw = dict(sparse=SparseConfig(page_size=4, dense_layers=1),
                schedule=KVSchedule.fixed(4, page_size=4))
      with jax.set_mesh(mesh):
        placed = sharding.place(params, sharding.param_shardings(params, mesh,
                                                                 sharding.ROLLOUT_RULES))
        requests = engine.Requests(prompt[rows], lens[rows], max_new[rows], group_size=2,
                                   first_row=rows.start or 0)
        out, stats = engine.run(placed, CFG, requests, jax.random.PRNGKey(3),
                                sampling=sj.Sampling(eos_ids=(5,)),
                                engine=engine.EngineConfig(num_slots=2, num_pages=40,
                                                           chunk_steps=6), **kw)
      return np.asarray(out.tokens), np.asarray(out.logprobs), stats
""")

MESH = SETUP + textwrap.dedent("""
    assert len(jax.devices()) == 8, jax.devices()
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    one_device = sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    tokens, logprobs, one = run(one_device)
    got_tokens, got_logprobs, eight = run(mesh)
    np.testing.assert_array_equal(got_tokens, tokens)
    np.testing.assert_allclose(got_logprobs, logprobs, atol=1e-5)
    # four devices' slots run at once: more rows in flight, fewer decode steps
    assert eight.rows_in_flight > 2 * one.rows_in_flight, (eight, one)
    np.savez(sys.argv[1], tokens=tokens, logprobs=logprobs)
    print("OK")
""")

PROCESS = (
  textwrap.dedent("""
    import sys, jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{sys.argv[2]}", 2, int(sys.argv[3]))
""")
  + SETUP
  + textwrap.dedent("""
    mesh = sharding.make_mesh(data=2, fsdp=1, tensor=2)
    lo, hi = sharding.process_rows(sharding.rows(mesh), len(lens))
    tokens, logprobs, _ = run(mesh, slice(lo, hi))
    np.savez(sys.argv[1], lo=lo, tokens=tokens, logprobs=logprobs)
""")
)


@pytest.mark.nightly
def test_engine_on_a_2x2x2_mesh_and_on_two_processes_equals_one_device(tmp_path):
  one = tmp_path / "one.npz"
  assert "OK" in run_on_fake_devices("import sys\n" + MESH.replace("sys.argv[1]", repr(str(one))))
  want = np.load(one)
  parts = run_two_processes(PROCESS, tmp_path)
  assert [int(p["lo"]) for p in parts] == [0, 6]  # each process had its own rows
  N = want["tokens"].shape[1]  # each process's width is its own rows' longest max_new_tokens
  joined = lambda name: np.concatenate(
    [np.pad(p[name], ((0, 0), (0, N - p[name].shape[1]))) for p in parts]
  )
  np.testing.assert_array_equal(joined("tokens"), want["tokens"])
  np.testing.assert_allclose(joined("logprobs"), want["logprobs"], atol=1e-5)
