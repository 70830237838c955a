"""Blockwise attention against its materialising jnp reference (values and gradients, dense and
sparse), chunked prefill against one-chunk prefill, the group-shared prefill, and the chunked LM
head against full logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparrow_jax as sj
from sparrow_jax.attention import blockwise, paged_cache, reference, select
from sparrow_jax.model import qwen3
from sparrow_jax.sparsity.schedule import KVSchedule
from tests.helpers import tiny_config

B, T, K, G, E = 2, 77, 2, 3, 16
BLOCKS = dict(block_q=16, block_k=32)  # several query and key blocks, T not a multiple of either


def qkv_and_mask():
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (B, T, K, G, E))
  k = jax.random.normal(ks[1], (B, T, K, E))
  v = jax.random.normal(ks[2], (B, T, K, E))
  mask = np.ones((B, T), bool)
  mask[0, :9] = False  # left padding: its first queries see nothing
  mask[1, 50:] = False  # right padding
  return q, k, v, jnp.asarray(mask)


def causal(mask):
  return jnp.tril(jnp.ones((T, T), bool))[None] & mask[:, None, :]


def blockwise_fn(mask, **kwargs):
  return lambda q, k, v: blockwise.attention(
    q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask, **BLOCKS, **kwargs
  )


def assert_same_with_grads(fn_a, fn_b, args, atol):
  np.testing.assert_allclose(fn_a(*args), fn_b(*args), atol=atol)
  loss = lambda fn: jax.grad(lambda *a: jnp.sum(jnp.sin(fn(*a))), argnums=(0, 1, 2))(*args)
  for got, want in zip(loss(fn_a), loss(fn_b)):
    assert bool(jnp.all(jnp.isfinite(got)))
    np.testing.assert_allclose(got, want, atol=atol)


@pytest.mark.slow
def test_dense_blockwise_matches_reference_values_and_gradients():
  q, k, v, mask = qkv_and_mask()
  ref = lambda q, k, v: reference.dense_attention(q, k, v, causal(mask))
  assert_same_with_grads(blockwise_fn(mask), ref, (q, k, v), atol=2e-5)
  out = blockwise_fn(mask)(q, k, v)
  assert float(jnp.abs(out[0, :9]).max()) == 0.0  # nothing to attend to: zeros, not NaN


@pytest.mark.slow
@pytest.mark.parametrize("page_score", ["mean", "quest"])
def test_sparse_blockwise_reads_the_pages_of_the_reference_mask(page_score):
  q, k, v, mask = qkv_and_mask()
  sparse = select.SparseConfig(
    page_size=8, sink_pages=1, local_pages=1, dense_layers=0, page_score=page_score
  )
  schedule = KVSchedule.fixed(4, page_size=8, always_kept=2)
  prompt_len = jnp.asarray([20, 10])
  keep_BKTP = select.teacher_forced_keep(q, k, prompt_len, schedule, sparse)
  keep_BKTS = jnp.repeat(keep_BKTP, 8, axis=-1)[..., :T]
  ref = lambda q, k, v: reference.dense_attention(q, k, v, causal(mask)[:, None] & keep_BKTS)
  pos = jnp.arange(T)
  budget_BT = jnp.where(
    pos[None] < prompt_len[:, None], -(-T // 8), schedule.budget_pages(pos + 1)[None]
  )
  ours = blockwise_fn(
    mask,
    budget_BT=budget_BT,
    page_size=8,
    page_score=page_score,
    select_fn=functools.partial(select.keep_pages, sparse=sparse),
  )
  assert_same_with_grads(ours, ref, (q, k, v), atol=2e-5)
  # The selection matters: the dense result differs.
  assert float(jnp.abs(ours(q, k, v) - blockwise_fn(mask)(q, k, v)).max()) > 1e-2


def test_query_offset_continues_the_rows():
  q, k, v, mask = qkv_and_mask()
  full = blockwise_fn(mask)(q, k, v)
  tail = blockwise.attention(
    q[:, 48:],
    k.transpose(0, 2, 1, 3),
    v.transpose(0, 2, 1, 3),
    mask,
    q_offset=jnp.int32(48),
    **BLOCKS,
  )
  np.testing.assert_allclose(tail, full[:, 48:], atol=1e-6)


@pytest.mark.slow
def test_chunked_prefill_equals_one_chunk():
  cfg = tiny_config(num_hidden_layers=3)
  params = sj.init_params(cfg, jax.random.PRNGKey(1), std=0.3)
  rng = np.random.RandomState(0)
  prompt = jnp.asarray(rng.randint(1, cfg.vocab_size, (3, 70)))
  prompt_len = jnp.asarray([70, 33, 5])
  runs = {}
  for chunk in (16, 512):
    cache = paged_cache.init_cache(cfg, 3, 96, page_size=8)
    runs[chunk] = qwen3.prefill(params, prompt, prompt_len, cfg, cache, chunk=chunk)
  (logits_a, cache_a), (logits_b, cache_b) = runs[16], runs[512]
  np.testing.assert_allclose(logits_a, logits_b, atol=1e-5)
  for layer in range(3):
    np.testing.assert_allclose(cache_a.keys(layer), cache_b.keys(layer), atol=1e-5)
    np.testing.assert_allclose(cache_a.summaries[layer], cache_b.summaries[layer], atol=1e-5)
  # and the last prompt token's logits are forward's
  ref = sj.forward(params, prompt, cfg)
  np.testing.assert_allclose(logits_a, ref[jnp.arange(3), prompt_len - 1], atol=1e-4)


@pytest.mark.nightly
def test_group_shared_prefill_samples_the_same():
  sparse = select.SparseConfig(page_size=4, dense_layers=1)
  cfg = tiny_config(num_hidden_layers=2)
  params = sj.init_params(cfg, jax.random.PRNGKey(2), std=0.3)
  rng = np.random.RandomState(1)
  prompt = jnp.asarray(np.repeat(rng.randint(1, cfg.vocab_size, (2, 10)), 3, axis=0))
  prompt_len = jnp.asarray([10, 10, 10, 7, 7, 7])
  kwargs = dict(max_new_tokens=12, sparse=sparse, schedule=KVSchedule.fixed(4, page_size=4))
  one = sj.generate(params, cfg, prompt, prompt_len, jax.random.PRNGKey(3), **kwargs)
  shared = sj.generate(
    params, cfg, prompt, prompt_len, jax.random.PRNGKey(3), prefill_group=3, **kwargs
  )
  np.testing.assert_array_equal(one.tokens, shared.tokens)
  np.testing.assert_allclose(one.logprobs, shared.logprobs, atol=1e-5)
  with pytest.raises(ValueError, match="not runs of 2 identical prompts"):
    sj.generate(params, cfg, prompt, prompt_len, jax.random.PRNGKey(3), prefill_group=2, **kwargs)


@pytest.mark.slow
def test_chunked_lm_head_matches_full_logits_with_gradients():
  cfg = tiny_config(tie_word_embeddings=False)
  params = sj.init_params(cfg, jax.random.PRNGKey(4), std=0.3)
  tokens = jnp.asarray(np.random.RandomState(2).randint(0, cfg.vocab_size, (2, 45)))

  def full(params):
    logp = jax.nn.log_softmax(sj.forward(params, tokens, cfg), axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]

  def chunked(params):
    x = qwen3.forward_hidden(params, tokens, cfg)
    fn = lambda logits, t: jnp.take_along_axis(
      jax.nn.log_softmax(logits[0], -1), t[..., None], axis=-1
    )[..., 0]
    return qwen3.map_logits(params, cfg, fn, (x,), (tokens,), chunk=8)

  np.testing.assert_allclose(chunked(params), full(params), atol=1e-5)
  g_full = jax.grad(lambda p: jnp.sum(full(p)))(params)
  g_chunked = jax.grad(lambda p: jnp.sum(chunked(p)))(params)
  # float32 sums in another order: 1.1e-5 absolute on a gradient of 7.49 on one VM's CPU
  jax.tree_util.tree_map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), g_chunked, g_full
  )


@pytest.mark.nightly
def test_remat_policies_and_mlp_chunks_give_the_same_gradients(monkeypatch):
  """remat full (the custom_vjp that keeps each layer's input as integer bits) and remat attention
  (which also keeps the attention's output) give remat none's gradients of params and LoRA through
  the sparse teacher-forced pass (whose attention closes over traced budgets and prompt lengths),
  in bf16 too; so does the MLP in chunks."""
  from sparrow_jax.model import lora as lora_lib
  from sparrow_jax.rollout import sampler
  from sparrow_jax.sparsity import policy
  from sparrow_jax.sparsity.schedule import BudgetTable

  cfg = tiny_config(num_hidden_layers=3)
  sparse = select.SparseConfig(page_size=4, dense_layers=1)
  table = sampler.budget_table(KVSchedule.fixed(3, page_size=4), 40, sparse)
  tokens = jnp.asarray(np.random.RandomState(3).randint(0, cfg.vocab_size, (2, 40)))
  prompt_len = jnp.asarray([9, 14])
  for dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)):  # bf16: one rounding step
    params = sj.init_params(cfg, jax.random.PRNGKey(5), std=0.3, dtype=dtype)
    lora = jax.tree_util.tree_map(
      lambda x: x + 0.01,
      lora_lib.init_lora(params, jax.random.PRNGKey(6), rank=2, alpha=4.0, dtype=dtype),
    )

    @functools.partial(jax.jit, static_argnums=3)
    def grads(params, lora, table, remat):
      def loss(params, lora):
        attention = policy.teacher_forced_attention_fn(sparse, BudgetTable(table), prompt_len)
        x = qwen3.forward_hidden(
          params, tokens, cfg, attention_fn=attention, lora=lora, remat=remat
        )
        return jnp.sum(jnp.sin(x.astype(jnp.float32)))

      return jax.grad(loss, argnums=(0, 1))(params, lora)

    want = grads(params, lora, table, "none")
    close = lambda got: jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(  # to the leaf's scale: recompute reorders sums
        np.asarray(a, np.float32),
        np.asarray(b, np.float32),
        rtol=0,
        atol=tol * float(np.max(np.abs(np.asarray(b, np.float32)))),
      ),
      got,
      want,
    )
    close(grads(params, lora, table, "full"))
    close(grads(params, lora, table, "attention"))
    if dtype == jnp.float32:
      monkeypatch.setattr(qwen3, "MLP_CHUNK", 16)  # 40 positions: 3 chunks, the last one padded
      close(grads(params, lora, jnp.asarray(table), "full"))  # a new table argument: retraced
      monkeypatch.undo()


def test_remat_attention_runs_the_attention_forward_once():
  """Under remat attention the backward reuses the saved attention output: the gradient's program
  has the while loops of remat none (the attention forward and its backward), remat full one more
  (the attention forward again, in the layer's recompute)."""
  cfg = tiny_config(num_hidden_layers=2)
  params = sj.init_params(cfg, jax.random.PRNGKey(0))
  tokens = jnp.zeros((1, 16), jnp.int32)
  attention = lambda layer, q, k, v, mask: blockwise.attention(
    q, k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), mask
  )

  def loops(remat):
    loss = lambda p: jnp.sum(
      qwen3.forward_hidden(p, tokens, cfg, attention_fn=attention, remat=remat)
    )
    return str(jax.make_jaxpr(jax.grad(loss))(params)).count("while[")

  assert loops("attention") == loops("none") < loops("full")
