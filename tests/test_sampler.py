"""sj.generate (the engine with every row in a slot at once) against the teacher-forced forward,
dense and sparse."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparrow_jax as sj
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.rollout import programs, sampler
from sparrow_jax.sparsity.schedule import KVSchedule
from tests import helpers
from tests.helpers import tiny_config

CFG = tiny_config(num_hidden_layers=3)
PARAMS = sj.init_params(CFG, jax.random.PRNGKey(0), std=0.3)
PROMPT_LEN = jnp.asarray([9, 21, 14])
PROMPT = jnp.asarray(np.random.RandomState(0).randint(1, CFG.vocab_size, (3, 21))) * (
  jnp.arange(21)[None] < PROMPT_LEN[:, None]
)
SPARSE = SparseConfig(page_size=4, dense_layers=1)


def rescored_logprobs(out, **forward_kwargs):
  return helpers.rescored_logprobs(PARAMS, CFG, PROMPT, PROMPT_LEN, out, **forward_kwargs)


@pytest.mark.slow
def test_dense_sampler_logprobs_match_forward():
  out = sj.generate(PARAMS, CFG, PROMPT, PROMPT_LEN, jax.random.PRNGKey(1), max_new_tokens=30)
  ref, valid = rescored_logprobs(out)
  assert int(valid.sum()) == 90
  np.testing.assert_allclose(np.where(valid, out.logprobs, 0), np.where(valid, ref, 0), atol=1e-5)


@pytest.mark.slow
def test_full_budget_sparse_equals_dense():
  kw = dict(max_new_tokens=40, sampling=sj.Sampling(temperature=0.0))
  dense = sj.generate(PARAMS, CFG, PROMPT, PROMPT_LEN, jax.random.PRNGKey(2), **kw)
  sparse = sj.generate(
    PARAMS,
    CFG,
    PROMPT,
    PROMPT_LEN,
    jax.random.PRNGKey(2),
    sparse=SPARSE,
    schedule=KVSchedule.fixed(64, page_size=4),
    **kw,
  )
  np.testing.assert_array_equal(dense.tokens, sparse.tokens)
  np.testing.assert_allclose(dense.logprobs, sparse.logprobs, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("page_score, other", [("mean", "quest"), ("quest", "mean")])
def test_sparse_sampler_matches_sparse_teacher_forcing(page_score, other):
  schedule = KVSchedule.fixed(4, page_size=4)
  sparse = dataclasses.replace(SPARSE, page_score=page_score)
  out = sj.generate(
    PARAMS,
    CFG,
    PROMPT,
    PROMPT_LEN,
    jax.random.PRNGKey(3),
    max_new_tokens=40,
    sparse=sparse,
    schedule=schedule,
  )
  sparse_ref, valid = rescored_logprobs(
    out, sparse=sparse, schedule=schedule, prompt_len_B=PROMPT_LEN
  )
  np.testing.assert_allclose(
    np.where(valid, out.logprobs, 0), np.where(valid, sparse_ref, 0), atol=1e-4
  )
  # The budget really is binding (dense re-scoring differs), and so is the page score (the other
  # one's teacher-forced pages give other log-probs).
  dense_ref, _ = rescored_logprobs(out)
  other_ref, _ = rescored_logprobs(
    out,
    sparse=dataclasses.replace(SPARSE, page_score=other),
    schedule=schedule,
    prompt_len_B=PROMPT_LEN,
  )
  for ref in (dense_ref, other_ref):
    assert float(jnp.abs(jnp.where(valid, out.logprobs - ref, 0)).max()) > 1e-3


@pytest.mark.slow
def test_eos_stops_rows_and_same_key_same_output():
  kw = dict(max_new_tokens=25, sampling=sj.Sampling(eos_ids=(3, 5, 7, 11), pad_id=0))
  a = sj.generate(PARAMS, CFG, PROMPT, PROMPT_LEN, jax.random.PRNGKey(4), **kw)
  b = sj.generate(PARAMS, CFG, PROMPT, PROMPT_LEN, jax.random.PRNGKey(4), **kw)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  for row, n in zip(np.asarray(a.tokens), np.asarray(a.lengths)):
    assert not set(row[: n - 1].tolist()) & {3, 5, 7, 11}
    if n < 25:
      assert row[n - 1] in (3, 5, 7, 11) and (row[n:] == 0).all()


@pytest.mark.slow
def test_top_k_one_is_greedy_and_top_p_restricts():
  kw = dict(max_new_tokens=12)
  generate = lambda seed, **sampling: sj.generate(
    PARAMS,
    CFG,
    PROMPT,
    PROMPT_LEN,
    jax.random.PRNGKey(seed),
    sampling=sj.Sampling(**sampling),
    **kw,
  )
  greedy = generate(5, temperature=0.0)
  top1 = generate(5, top_k=1)
  np.testing.assert_array_equal(greedy.tokens, top1.tokens)
  tiny_p = generate(6, top_p=1e-6)
  np.testing.assert_array_equal(greedy.tokens, tiny_p.tokens)


@pytest.mark.slow
def test_top_logprobs_returned():
  out = sj.generate(
    PARAMS,
    CFG,
    PROMPT,
    PROMPT_LEN,
    jax.random.PRNGKey(7),
    max_new_tokens=6,
    sampling=sj.Sampling(num_top_logprobs=20),
  )
  assert out.top_logprobs.shape == (3, 6, 20)
  assert bool(jnp.all(out.top_logprobs[..., :1] >= out.logprobs[..., None] - 1e-6))


@pytest.mark.slow
def test_changing_schedule_does_not_recompile():
  kw = dict(max_new_tokens=10, sparse=SPARSE)
  sj.generate(
    PARAMS,
    CFG,
    PROMPT,
    PROMPT_LEN,
    jax.random.PRNGKey(8),
    schedule=KVSchedule.fixed(5, page_size=4),
    **kw,
  )
  compiled = lambda: (programs.prefill._cache_size(), programs.decode_chunk._cache_size())
  before = compiled()
  for schedule in (
    KVSchedule.fixed(6, page_size=4),
    KVSchedule.table([1, 2, 3], page_size=4, bin_size=8),
  ):
    sj.generate(PARAMS, CFG, PROMPT, PROMPT_LEN, jax.random.PRNGKey(8), schedule=schedule, **kw)
  assert compiled() == before


def test_bad_input_rejected():
  key = jax.random.PRNGKey(0)
  with pytest.raises(ValueError, match="max_position_embeddings"):
    sj.generate(PARAMS, CFG, PROMPT, PROMPT_LEN, key, max_new_tokens=600)
  with pytest.raises(ValueError, match="max_new_tokens"):
    sj.generate(PARAMS, CFG, PROMPT, PROMPT_LEN, key, max_new_tokens=0)
  with pytest.raises(ValueError, match="power of two"):
    SparseConfig(page_size=12)
  with pytest.raises(ValueError, match="always-kept"):
    sj.generate(
      PARAMS,
      CFG,
      PROMPT,
      PROMPT_LEN,
      key,
      max_new_tokens=4,
      sparse=SPARSE,
      schedule=KVSchedule.fixed(1, page_size=4, always_kept=1),
    )
  with pytest.raises(ValueError, match="page_size"):
    sj.generate(
      PARAMS,
      CFG,
      PROMPT,
      PROMPT_LEN,
      key,
      max_new_tokens=4,
      sparse=SPARSE,
      schedule=KVSchedule.fixed(8, page_size=16),
    )
  with pytest.raises(ValueError, match="attention_impl"):
    SparseConfig(attention_impl="cuda")


@pytest.mark.slow
@pytest.mark.parametrize("trunc", [dict(top_k=5), dict(top_p=0.6), dict(top_k=8, top_p=0.8)])
def test_logprobs_are_of_the_truncated_distribution(trunc):
  """Under top-k / top-p the behaviour log-prob is that of the renormalised truncated softmax (what
  was sampled), not of the full softmax."""
  out = sj.generate(
    PARAMS,
    CFG,
    PROMPT,
    PROMPT_LEN,
    jax.random.PRNGKey(9),
    max_new_tokens=20,
    sampling=sj.Sampling(temperature=0.7, num_top_logprobs=3, **trunc),
  )
  seq_BS, _ = sampler.full_sequences(PROMPT, PROMPT_LEN, out)
  logp_BSV = np.asarray(
    jax.nn.log_softmax(sj.forward(PARAMS, seq_BS, CFG) / 0.7, axis=-1), np.float64
  )
  valid = np.arange(20)[None] < np.asarray(out.lengths)[:, None]
  for b in range(3):
    for j in np.nonzero(valid[b])[0]:
      p_V = np.exp(logp_BSV[b, int(PROMPT_LEN[b]) + j - 1])  # the logits that predicted token j
      order = np.argsort(-p_V)
      keep = np.zeros_like(p_V, bool)
      keep[order[: trunc.get("top_k", len(p_V))]] = True
      q_V = np.where(keep, p_V, 0) / np.where(keep, p_V, 0).sum()
      if "top_p" in trunc:
        sorted_q = q_V[order]
        keep[order[(np.cumsum(sorted_q) - sorted_q) >= trunc["top_p"]]] = False
        q_V = np.where(keep, q_V, 0) / np.where(keep, q_V, 0).sum()
      token = int(out.tokens[b, j])
      assert keep[token], (b, j)
      np.testing.assert_allclose(float(out.logprobs[b, j]), np.log(q_V[token]), atol=1e-4)
      np.testing.assert_allclose(
        np.exp(np.asarray(out.top_logprobs[b, j], np.float64)), np.sort(q_V)[::-1][:3], atol=1e-4
      )


def test_schedule_geometry_must_match_the_sparse_config():
  """SparseConfig is the one source of truth for page size and always-kept pages: a schedule
  built for another geometry is rejected, naming both values."""
  key = jax.random.PRNGKey(0)
  with pytest.raises(ValueError, match="always_kept = 2 differs .* always-kept pages .*: 3"):
    sj.generate(
      PARAMS,
      CFG,
      PROMPT,
      PROMPT_LEN,
      key,
      max_new_tokens=4,
      sparse=SPARSE,
      schedule=KVSchedule.fixed(8, page_size=4, always_kept=2),
    )
  with pytest.raises(ValueError, match="page_size = 16 differs .* page size: 4"):
    sj.generate(
      PARAMS,
      CFG,
      PROMPT,
      PROMPT_LEN,
      key,
      max_new_tokens=4,
      sparse=SPARSE,
      schedule=KVSchedule.fixed(8, page_size=16),
    )
