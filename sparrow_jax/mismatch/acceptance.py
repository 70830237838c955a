"""Per-token acceptance rates between the dense policy p and the sparse rollout policy q, and their
tail statistics per position bin.

alpha_t = sum_x min(p(x), q(x)) = 1 - TV(p, q) = E_{x~q}[min(1, p(x)/q(x))] is the probability that
speculative decoding with draft q would accept the token. Means hide collapse (most tokens have
alpha > 0.999 either way); the lower tail, p5 per 2K-position bin, is what Sparrow thresholds.

All functions are pure jnp and jit-able. Acceptance functions work per position; padding is dealt
with by the `mask_BT` of the statistics functions.
"""

import jax
from jax import lax
import jax.numpy as jnp

from sparrow_jax.sparsity.schedule import position_bin

PERCENTILES = (1, 5, 10, 50)
HIGH_ALPHA = 0.999  # "frac_above_0999": tokens where p and q practically agree


def _vocab_chunk(x_BTV, c, chunk, inv_temp):
  """Chunk `c` of the vocabulary axis (float32, times `inv_temp`), and which of its entries no
  earlier chunk covered.

  The last chunk is shifted left to stay in bounds instead of padding V (padding would copy the
  whole [B, T, V] array, which is what chunking avoids); its overlap is masked out.
  """
  start = jnp.minimum(c * chunk, x_BTV.shape[-1] - chunk)
  x_BTC = lax.dynamic_slice_in_dim(x_BTV, start, chunk, axis=-1).astype(jnp.float32) * inv_temp
  fresh_C = start + jnp.arange(chunk) >= c * chunk
  return x_BTC, fresh_C


def _num_chunks(vocab, chunk_size):
  chunk = min(chunk_size, vocab)
  return chunk, -(-vocab // chunk)


def _logsumexp(x_BTV, chunk_size, inv_temp):
  """Online (running max, running sum) logsumexp over vocabulary chunks."""
  chunk, n = _num_chunks(x_BTV.shape[-1], chunk_size)

  def body(c, carry):
    m_BT, s_BT = carry
    x_BTC, fresh_C = _vocab_chunk(x_BTV, c, chunk, inv_temp)
    x_BTC = jnp.where(fresh_C, x_BTC, -jnp.inf)
    new_m_BT = jnp.maximum(m_BT, x_BTC.max(-1))
    shift_BT = jnp.where(jnp.isfinite(new_m_BT), new_m_BT, 0.0)  # all -inf so far: avoid inf-inf
    s_BT = s_BT * jnp.exp(m_BT - shift_BT) + jnp.exp(x_BTC - shift_BT[..., None]).sum(-1)
    return new_m_BT, s_BT

  init = (jnp.full(x_BTV.shape[:-1], -jnp.inf), jnp.zeros(x_BTV.shape[:-1]))
  m_BT, s_BT = lax.fori_loop(0, n, body, init)
  return jnp.where(jnp.isfinite(m_BT), m_BT, 0.0) + jnp.log(s_BT)


def acceptance_rate(logits_p_BTV, logits_q_BTV, temperature=1.0, chunk_size=8192):
  """alpha_BT = sum_x min(p(x), q(x)) with p = softmax(logits_p / T), q = softmax(logits_q / T).

  Works over vocabulary chunks of `chunk_size` so temporaries stay at [B, T, chunk] (float32) even
  for a 151K vocabulary; first each side's logsumexp, then the sum of minima chunk by chunk.
  """
  if logits_p_BTV.shape != logits_q_BTV.shape:
    raise ValueError(
      f"logits_p_BTV {logits_p_BTV.shape} and logits_q_BTV {logits_q_BTV.shape} "
      "must have the same shape"
    )
  if isinstance(temperature, (int, float)) and temperature <= 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  inv_temp = 1.0 / jnp.asarray(temperature, jnp.float32)  # applied per chunk: no scaled copy
  lse_p_BT = _logsumexp(logits_p_BTV, chunk_size, inv_temp)
  lse_q_BT = _logsumexp(logits_q_BTV, chunk_size, inv_temp)
  chunk, n = _num_chunks(logits_p_BTV.shape[-1], chunk_size)

  def body(c, alpha_BT):
    xp_BTC, fresh_C = _vocab_chunk(logits_p_BTV, c, chunk, inv_temp)
    xq_BTC, _ = _vocab_chunk(logits_q_BTV, c, chunk, inv_temp)
    min_BTC = jnp.minimum(
      jnp.exp(xp_BTC - lse_p_BT[..., None]), jnp.exp(xq_BTC - lse_q_BT[..., None])
    )
    return alpha_BT + jnp.where(fresh_C, min_BTC, 0.0).sum(-1)

  return lax.fori_loop(0, n, body, jnp.zeros(logits_p_BTV.shape[:-1]))


def topk_acceptance_bound(top_logp_p_BTk, top_ids_p_BTk, top_logp_q_BTk, top_ids_q_BTk):
  """Lower bound on alpha from each side's top-k (normalized) log-probs: sum over the tokens in
  both top-k sets of min(p, q). This is what the reference implementation logs (k = 20); tokens
  outside either set are dropped, so it is <= the exact `acceptance_rate`. Ids within a set must
  be distinct.
  """
  same_BTkk = top_ids_p_BTk[..., :, None] == top_ids_q_BTk[..., None, :]
  lq_at_p_BTk = jnp.max(jnp.where(same_BTkk, top_logp_q_BTk[..., None, :], -jnp.inf), axis=-1)
  return jnp.exp(jnp.minimum(top_logp_p_BTk, lq_at_p_BTk)).sum(-1)


def topk_bound_from_logits(logits_p_BTV, logits_q_BTV, k=20, temperature=1.0, chunk_size=8192):
  """`topk_acceptance_bound` of each side's top-`k` of log_softmax(logits / T): the reference
  code's `sum_min_from_topk` (k = 20), the statistic the paper's tau was measured with.

  The top-k is taken on the raw logits (dividing by T > 0 keeps the order) and normalized with the
  chunked logsumexp, so no [B, T, V] log-softmax copy is made (151K vocabulary).
  """
  if logits_p_BTV.shape != logits_q_BTV.shape:
    raise ValueError(
      f"logits_p_BTV {logits_p_BTV.shape} and logits_q_BTV {logits_q_BTV.shape} "
      "must have the same shape"
    )
  if not 1 <= k <= logits_p_BTV.shape[-1]:
    raise ValueError(f"k must be in [1, {logits_p_BTV.shape[-1]}] (the vocabulary), got {k}")
  if isinstance(temperature, (int, float)) and temperature <= 0:
    raise ValueError(f"temperature must be > 0, got {temperature}")
  inv_temp = 1.0 / jnp.asarray(temperature, jnp.float32)

  def top(logits_BTV):
    top_BTk, ids_BTk = lax.top_k(logits_BTV, k)
    lse_BT = _logsumexp(logits_BTV, chunk_size, inv_temp)
    return top_BTk.astype(jnp.float32) * inv_temp - lse_BT[..., None], ids_BTk

  return topk_acceptance_bound(*top(logits_p_BTV), *top(logits_q_BTV))


def sampled_acceptance(logp_p_BT, logp_q_BT):
  """min(1, p(x)/q(x)) for the token x that was sampled from q: an unbiased estimate of alpha,
  free in every RL step (logp_q from the rollout, logp_p from the dense re-score)."""
  return jnp.exp(jnp.minimum(logp_p_BT - logp_q_BT, 0.0))


def _sorted_quantile(sorted_a, start, count, q):
  """numpy's default ('linear') q-quantile of sorted_a[start:start+count]; NaN when count == 0.
  `start`, `count` may be arrays (one quantile per segment)."""
  pos = q * (jnp.maximum(count, 1) - 1)
  lo = jnp.floor(pos).astype(jnp.int32)
  hi = jnp.minimum(lo + 1, jnp.maximum(count, 1) - 1)
  a, b = sorted_a[start + lo], sorted_a[start + hi]
  return jnp.where(count > 0, a + (b - a) * (pos - lo), jnp.nan)


def row_percentile(x_BT, mask_BT, p):
  """Each row's p-th percentile of x over its masked tokens (numpy's 'linear') -> [B]; NaN for a
  row without tokens."""
  sorted_BT = jnp.sort(jnp.where(mask_BT, x_BT, jnp.inf), axis=1)
  count_B = jnp.sum(mask_BT, axis=1)
  return jax.vmap(lambda s_T, n: _sorted_quantile(s_T, 0, n, p / 100))(sorted_BT, count_B)


def percentile_name(p) -> str:
  """The statistic's name of percentile p: "p5", "p1", "p2.5"."""
  return f"p{float(p):g}"


def tail_percentiles(quantile) -> tuple:
  """The percentiles logged when `quantile` is the one held at tau: PERCENTILES and it."""
  return tuple(sorted(set(PERCENTILES) | {quantile}))


def _flat(alpha_BT, mask_BT):
  """Flat alpha (float32) and its valid tokens."""
  return jnp.asarray(alpha_BT, jnp.float32).reshape(-1), jnp.asarray(mask_BT, bool).reshape(-1)


def _high_and_below(alpha_a, valid_a, tau):
  """Which valid tokens are above HIGH_ALPHA, and (with `tau`) which are below tau."""
  high_a = (alpha_a > HIGH_ALPHA) & valid_a
  return high_a, None if tau is None else (alpha_a < tau) & valid_a


def _summary(sorted_a, start, count, sum_alpha, num_high, num_below, suffix, percentiles):
  stats = {
    percentile_name(p) + suffix: _sorted_quantile(sorted_a, start, count, p / 100)
    for p in percentiles
  }
  stats[f"mean{suffix}"] = sum_alpha / count  # 0 / 0 = NaN for an empty bin
  stats[f"frac_above_0999{suffix}"] = num_high / count
  if num_below is not None:
    stats[f"frac_below_tau{suffix}"] = num_below / count
  stats[f"count{suffix}"] = count
  return stats


def tail_stats(
  alpha_BT,
  mask_BT,
  positions_BT,
  bin_size=2048,
  num_bins=20,
  page_size=1,
  tau=None,
  percentiles=PERCENTILES,
):
  """Masked tail statistics of alpha, overall and per position bin.

  positions_BT is each token's absolute position in its sequence, counting prompt + generated
  tokens (position 0 = first prompt token), which is also the number of tokens cached when it was
  decoded. Bins are `schedule.position_bin(position, page_size, bin_size)`: with page_size 1, bin b
  holds positions [b*bin_size, (b+1)*bin_size); with the KV page size, a token is binned by the
  whole pages cached at its decode step, exactly as a table schedule picks that step's budget.
  Tokens past the last bin count in the overall statistics only.

  With `tau`, also "frac_below_tau" (overall and per bin): the share of tokens with alpha < tau.
  The q-th percentile is >= tau exactly when that share is <= q% (up to the quantile's
  interpolation), and unlike a percentile it pools over steps: sum(frac_below_tau_bin * count_bin)
  / sum(count_bin) is the share over all of them (the closed loop's test, schedule.adapt_topk).

  Returns a dict of jnp arrays: overall scalars "p1", "p5", "p10", "p50" (one per `percentiles`,
  named by `percentile_name`), "mean", "frac_above_0999", "count" (int32), and the same per bin
  with a "_bin" suffix, shape [num_bins].
  Percentiles use numpy's default linear interpolation. Empty bins (and an empty mask) give NaN
  percentiles, mean and fraction, and count 0. Static shapes: jit-able for any mask.
  """
  alpha_a, valid_a = _flat(alpha_BT, mask_BT)
  bin_a = position_bin(jnp.asarray(positions_BT).reshape(-1), page_size, bin_size)
  high_a, below_a = _high_and_below(alpha_a, valid_a, tau)
  count = valid_a.sum(dtype=jnp.int32)
  overall = _summary(
    jnp.sort(jnp.where(valid_a, alpha_a, jnp.inf)),
    0,
    count,
    jnp.where(valid_a, alpha_a, 0.0).sum(),
    high_a.sum(),
    None if tau is None else below_a.sum(),
    "",
    percentiles,
  )
  per_bin = _binned(alpha_a, valid_a, high_a, below_a, bin_a, num_bins, "_bin", percentiles)
  return {**overall, **per_bin}


def _binned(alpha_a, valid_a, high_a, below_a, bin_a, num_bins, suffix, percentiles):
  """`_summary` of each of bins 0..num_bins-1 of the valid tokens (arrays [num_bins])."""
  # One sort by (bin, alpha) lays each bin out contiguously; masked/out-of-range tokens go last.
  key_a = jnp.where(valid_a & (bin_a >= 0) & (bin_a < num_bins), bin_a, num_bins)
  _, sorted_a = lax.sort((key_a, alpha_a), num_keys=2)
  count_b = jnp.zeros(num_bins + 1, jnp.int32).at[key_a].add(1)[:num_bins]
  start_b = jnp.cumsum(count_b) - count_b
  in_bin_a = key_a < num_bins
  sum_b = jnp.zeros(num_bins + 1).at[key_a].add(jnp.where(in_bin_a, alpha_a, 0.0))[:num_bins]
  per_bin_sum = lambda x_a: jnp.zeros(num_bins + 1).at[key_a].add(x_a & in_bin_a)[:num_bins]
  return _summary(
    sorted_a,
    start_b,
    count_b,
    sum_b,
    per_bin_sum(high_a),
    None if below_a is None else per_bin_sum(below_a),
    suffix,
    percentiles,
  )


def turn_stats(alpha_BT, mask_BT, turn_BT, num_turns, tau=None, percentiles=PERCENTILES):
  """`tail_stats`' per-bin statistics with a multi-turn row's turns for bins: turn t holds the
  tokens sampled after t tool observations. Keys end in "_turn", arrays [num_turns]; a row's
  turns from `num_turns` on are left out (they count in `tail_stats`' overall statistics)."""
  alpha_a, valid_a = _flat(alpha_BT, mask_BT)
  high_a, below_a = _high_and_below(alpha_a, valid_a, tau)
  turn_a = jnp.asarray(turn_BT).reshape(-1)
  return _binned(alpha_a, valid_a, high_a, below_a, turn_a, num_turns, "_turn", percentiles)


def alpha_histogram(alpha_BT, mask_BT, num_buckets=20):
  """Counts of masked alpha in `num_buckets` equal-width buckets over [0, 1] (bucket i holds
  [i/n, (i+1)/n); alpha = 1 falls in the last), for a TensorBoard histogram -> int32 [num_buckets].
  """
  idx_a = jnp.clip(jnp.floor(jnp.asarray(alpha_BT).reshape(-1) * num_buckets), 0, num_buckets - 1)
  weight_a = jnp.asarray(mask_BT, jnp.int32).reshape(-1)
  return jnp.zeros(num_buckets, jnp.int32).at[idx_a.astype(jnp.int32)].add(weight_a)
