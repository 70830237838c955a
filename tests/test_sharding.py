"""The mesh code path on 8 fake CPU devices (each test in a subprocess: XLA_FLAGS must be set before
jax starts): forward, the sampler (XLA and Pallas decode under shard_map) and three train steps on a
2 x 2 x 2 (data, fsdp, tensor) mesh equal the same calls on a mesh of one device; one compilation;
every state leaf where the rules put it."""

import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT, subprocess_env

SCRIPT = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np, optax
    from jax.sharding import PartitionSpec as P
    import sparrow_jax as sj
    from sparrow_jax.attention.select import SparseConfig
    from sparrow_jax.sparsity.schedule import BudgetTable, KVSchedule
    from sparrow_jax.model import lora as lora_lib
    from sparrow_jax import sharding
    from sparrow_jax.rl import step_schema
    from sparrow_jax.rl import train_step as ts
    from sparrow_jax.rollout import sampler
    from tests.helpers import tiny_config
    assert len(jax.devices()) == 8, jax.devices()

    CFG = tiny_config(vocab_size=96, num_hidden_layers=3)  # every axis divisible by 2
    SPARSE = SparseConfig(page_size=4, dense_layers=1)
    SC = step_schema.StepConfig(
      rl=step_schema.RLConfig(num_minibatches=2),
      stats=step_schema.StatsConfig(bin_size=16, num_bins=4),
      rollout=step_schema.RolloutConfig(group_size=4, page_size=4),
    )
    T, N, ROWS = 12, 24, 8
    TABLE = sampler.budget_table(KVSchedule.fixed(4, page_size=4), T + N, SPARSE)
    params = sj.init_params(CFG, jax.random.PRNGKey(0), std=0.3)
    lora = jax.tree_util.tree_map(
        lambda x: x + 0.01, lora_lib.init_lora(params, jax.random.PRNGKey(1), rank=4, alpha=8.0))
    opt, lora_opt = optax.adamw(1e-3), optax.adam(1e-2)
    init = lambda p, l: step_schema.init_state(p, opt, l, lora_opt)

    def prompts(seed):
      rng = np.random.RandomState(seed)
      prompt_len = np.repeat(rng.randint(6, T, ROWS // 4), 4).astype(np.int32)
      prompt = np.repeat(rng.randint(1, 96, (ROWS // 4, T)), 4, 0).astype(np.int32)
      rewards = rng.randint(0, 2, ROWS).astype(np.float32)
      return prompt * (np.arange(T)[None] < prompt_len[:, None]), prompt_len, rewards

    def run(mesh, impl="xla"):
      sparse = SparseConfig(page_size=4, dense_layers=1, attention_impl=impl)
      with jax.set_mesh(mesh):
        abstract = jax.eval_shape(init, params, lora)
        shardings = step_schema.state_sharding(abstract, mesh, opt, lora_opt)
        state = jax.jit(init, out_shardings=shardings)(sharding.place(params, shardings.params),
                                                       sharding.place(lora, shardings.lora))
        step = ts.make_train_step(CFG, SC, opt, lora_opt, sparse, shardings)
        rows = sharding.rows(mesh)
        budget = sharding.place(BudgetTable(TABLE), sharding.replicated(mesh))
        to_batch = jax.jit(step_schema.batch_from_rollout, out_shardings=rows)
        logits = jax.jit(sj.forward, static_argnums=2)(
            state.params, sharding.from_local_rows(prompts(0)[0], rows, ROWS), CFG)
        out = {"logits": sharding.to_host(logits), "tokens": [], "metrics": []}
        for seed in range(3 if impl == "xla" else 1):
          prompt, prompt_len, rewards = (sharding.from_local_rows(x, rows, ROWS)
                                         for x in prompts(seed))
          rollout = sj.generate(state.params, CFG, prompt, prompt_len, jax.random.PRNGKey(seed),
                                max_new_tokens=N, sparse=sparse, schedule=budget, lora=state.lora,
                                sampling=sj.Sampling(num_top_logprobs=20), prefill_group=4)
          assert rollout.tokens.sharding.is_equivalent_to(rows, 2), rollout.tokens.sharding
          out["tokens"].append(sharding.to_host(rollout.tokens))
          if impl == "xla":
            state, metrics = step(state, to_batch(prompt, prompt_len, rollout, rewards), budget)
            out["metrics"].append(jax.tree_util.tree_map(sharding.to_host, metrics))
        if impl == "xla":
          assert step._cache_size() == 1, step._cache_size()  # 3 steps, one executable
          for leaf, want in zip(jax.tree_util.tree_leaves(state),
                                jax.tree_util.tree_leaves(shardings)):
            assert leaf.sharding.is_equivalent_to(want, leaf.ndim), (leaf.sharding, want)
          out["state"] = state
      return out

    one = run(sharding.make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    eight = run(mesh)
    # the rules, spot-checked on the sharded state
    state = eight["state"]
    assert state.params["layers"]["q"].sharding.spec == P(None, "fsdp", "tensor")
    assert state.params["embed"].sharding.spec == P("tensor", "fsdp")
    assert state.lora.params["layers"]["down"]["a"].sharding.spec == P(None, "tensor", None)
    assert state.lora.params["layers"]["down"]["b"].sharding.spec == P(None, None, "fsdp")
    mu = state.opt_state[0].mu
    assert mu["layers"]["o"].sharding.spec == P(None, "tensor", "fsdp")
    assert state.step.sharding.spec == P()
    np.testing.assert_allclose(eight["logits"], one["logits"], atol=1e-5)
    for a, b in zip(eight["tokens"], one["tokens"]):
      np.testing.assert_array_equal(a, b)
    for step, (a, b) in enumerate(zip(eight["metrics"], one["metrics"])):
      assert a.keys() == b.keys()
      for name in a:
        np.testing.assert_allclose(a[name], b[name], atol=1e-5, err_msg=f"step {step + 1} {name}")
    pallas = run(mesh, impl="pallas")  # the Pallas kernel (interpret mode) under shard_map
    np.testing.assert_array_equal(pallas["tokens"][0], one["tokens"][0])
    print("OK")
""")


def run_on_fake_devices(script, devices=8, timeout=600):
  """Runs `script` in a fresh interpreter with `devices` fake CPU devices; returns its stdout."""
  result = subprocess.run(
    [sys.executable, "-c", script],
    env=subprocess_env(devices),
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=timeout,
  )
  assert result.returncode == 0, result.stderr[-5000:]
  assert "Involuntary full rematerialization" not in result.stderr  # no array gathered whole
  return result.stdout


@pytest.mark.slow
def test_sampler_and_train_step_on_a_2x2x2_mesh_equal_one_device():
  assert "OK" in run_on_fake_devices(SCRIPT)
