"""Exact rollouts at sparse speed: the sparse policy q drafts, the dense policy p verifies
(speculative sampling, Leviathan et al. 2023; Chen et al. 2023), so a row is a sample of the dense
policy itself while most of its steps read only the sparse budget.

A round of a row whose cache holds n tokens and whose last sampled token x_0 is not cached yet:
  1. k sparse decode steps append x_0, d_1, .., d_{k-1} and draw the drafts d_1 .. d_k, d_i from
     q_{i-1} (the sparse actor: the schedule's budgets, the DistillSparse LoRA when it is on);
  2. one dense pass over x_0, d_1 .. d_k at positions n .. n + k (`qwen3.verify_step`) gives
     p_0 .. p_k, each the dense next-token distribution after its prefix;
  3. `accept_round`: d_i is kept with probability min(1, p_{i-1}(d_i) / q_{i-1}(d_i)); at the first
     rejection the token is drawn from normalize(max(p - q, 0)) instead, and if all k are kept one
     more (the bonus) from p_k. Each emitted token is distributed as p given the tokens before it,
     so the row is a dense sample; at temperature 0 p and q are point masses and the round keeps
     drafts while they equal the dense argmax and then emits the dense argmax: dense greedy.
  4. the cache keeps x_0 .. x_a (a drafts accepted) with the dense pass's keys and values, the rest
     of the round's slots zeroed and the touched pages' summaries rebuilt
     (`page_pool.PoolLayer.write_span`): what dense decoding of the same tokens leaves.
Temperature, top-p and top-k shape p and q alike (`sampler.sampled_logp`). Every draw of a
token (its draft, its acceptance test, its residual or bonus) comes from `draw_keys` of the token's
own key (the row's key and the token's index), so a row's tokens depend on nothing but its key.
"""

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.rollout import sampler


def draw_keys(token_key):
  """The (draft, accept, fix) keys of one token, from its key (`engine.row_key`): the draft is
  drawn with the first, its acceptance test with the second, a residual or bonus token with the
  third."""
  return tuple(jax.random.split(token_key, 3))


def draft_tokens(logits_BV, token_keys_B, sampling: sampler.Sampling):
  """The sparse actor's draws: one token per row from its token's draft key -> (token_B, logq_BV),
  logq the log-probs of the distribution drawn from."""
  s = sampling

  def one(logits_V, key):
    token, logq = sampler.sample_token(
      logits_V[None], draw_keys(key)[0], s.temperature, s.top_p, s.top_k
    )
    return token[0].astype(jnp.int32), logq[0]

  return jax.vmap(one)(logits_BV, token_keys_B)


def acceptance(logp_p_aV, logq_aV):
  """alpha = sum_x min(p(x), q(x)) per row: the probability that a draft from q is accepted."""
  return jnp.sum(jnp.exp(jnp.minimum(logp_p_aV, logq_aV)), axis=-1)


def residual_logits(logp_p_V, logq_V):
  """Log of normalize(max(p - q, 0)) up to a constant: what a token is drawn from after its draft
  is rejected. A rejection implies p(d) < q(d), so the residual has mass; rounding can still empty
  it where p and q agree to the last bit, and there drawing from p is the same rule."""
  residual_V = jnp.maximum(jnp.exp(logp_p_V) - jnp.exp(logq_V), 0.0)
  return jnp.where(jnp.sum(residual_V) > 0, jnp.log(residual_V), logp_p_V)


def n_accepted(u_d, logp_draft_d, logq_draft_d, drafts=None):
  """How many drafts a round keeps: draft i is kept when u_i < p(d_i) / q(d_i), up to the first
  that is not (and the first `drafts`, when given). Strict: u can be 0, and a draft the dense
  policy gives no mass is never kept."""
  # log u < log p - log q  <=>  u < p / q; q(d) > 0 (d was drawn from q), and u < 1.
  ok_d = jnp.log(u_d) < logp_draft_d - logq_draft_d
  if drafts is not None:
    ok_d &= jnp.arange(ok_d.shape[0]) < drafts
  return jnp.sum(jnp.cumprod(ok_d.astype(jnp.int32)))


def accept_round(logp_p_CV, logq_dV, draft_d, token_keys_C, drafts=None):
  """One row's acceptance of k drafts (C = k + 1 positions).

  logp_p_CV: the dense distributions p_0 .. p_k after x_0, d_1 .. d_k (`sampler.sampled_logp`);
  logq_dV: the drafts' distributions q_0 .. q_{k-1}; draft_d: d_1 .. d_k; token_keys_C: the keys
  of the tokens the round emits at offsets 0 .. k; drafts: the row's own draft count this round,
  at most k (exact mode's regime switch; the drafts past it are not judged; 0 draws the one token
  from p_0 with the token's own key, as a decode step does). Returns (tokens_C, n_accepted,
  logp_C, alpha_d): the round emits tokens_C[: n_accepted + 1] (the accepted drafts, then the
  residual or bonus token); logp_C their log-probs under p; alpha_d each draft's acceptance
  rate."""
  k = draft_d.shape[0]
  drafts = k if drafts is None else drafts
  keys = jax.vmap(draw_keys)(token_keys_C)
  u_d = jax.vmap(jax.random.uniform)(keys[1][:k])
  take = lambda logp_aV, ids_a: jnp.take_along_axis(logp_aV, ids_a[:, None], axis=1)[:, 0]
  n = n_accepted(u_d, take(logp_p_CV[:k], draft_d), take(logq_dV, draft_d), drafts)
  # After all drafts accepted the bonus is drawn from p_n itself (a dense step's draw), at a
  # rejection from the residual against q_n. A round of no drafts draws its one token with the
  # token's own key, exactly as a dense decode step does (`programs.sample_rows`): the engine runs
  # chunks of such rounds as dense decode steps.
  fix_V = logp_p_CV[n]
  if k:
    residual_V = residual_logits(fix_V, logq_dV[jnp.minimum(n, k - 1)])
    fix_V = jnp.where(n < drafts, residual_V, fix_V)
  fix = jax.random.categorical(jnp.where(drafts == 0, token_keys_C[0], keys[2][n]), fix_V)
  fix = fix.astype(jnp.int32)
  C = k + 1
  tokens_C = jnp.where(jnp.arange(C) < n, jnp.pad(draft_d, (0, 1)), fix)
  alpha_d = acceptance(logp_p_CV[:k], logq_dV)
  return tokens_C, n, take(logp_p_CV, tokens_C), alpha_d


def metrics(stats, alpha_BM, prompt_len_B, *, bin_size: int, num_bins: int) -> dict:
  """A speculative rollout's metrics from its engine stats (`engine.EngineStats`) and its
  per-token draft alpha (`Rollout.alpha`): rollout/accepted_per_round (tokens a row-round emits,
  the residual or bonus included), rollout/draft_acceptance (accepted / drafted),
  rollout/draft_alpha_mean(_bin) (the expected acceptance per position bin of bin_size tokens, as
  the tail statistics bin them) and kv/read_fraction: the KV pages the drafts and the
  verification passes read over what dense decoding of the same tokens reads."""
  alpha_BM = np.asarray(alpha_BM, np.float64)
  drafted = ~np.isnan(alpha_BM)
  pos_BM = np.asarray(prompt_len_B)[:, None] + np.arange(alpha_BM.shape[1])[None]
  bin_BM = np.minimum(pos_BM // bin_size, num_bins)  # num_bins: past the last bin
  by_bin = [alpha_BM[drafted & (bin_BM == b)] for b in range(num_bins)]
  return {
    "rollout/accepted_per_round": stats.accepted_per_round,
    "rollout/draft_acceptance": stats.draft_acceptance,
    "rollout/draft_alpha_mean": float(np.mean(alpha_BM[drafted])) if drafted.any() else np.nan,
    "rollout/draft_alpha_mean_bin": np.asarray(
      [float(np.mean(a)) if a.size else np.nan for a in by_bin], np.float32
    ),
    "kv/read_fraction": stats.kv_pages_read / max(stats.kv_pages_dense, 1.0),
  }
