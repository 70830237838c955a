"""Calibrating a KV-budget schedule: the cheapest per-bin budget whose tail acceptance (p5 by
default) stays >= tau.

Sparrow's recipe: sample rollouts on a prompt set (each prompt repeated 8x), re-score them densely
and sparsely under a grid of candidate budgets, take the 5th percentile of the per-token acceptance
alpha per position bin for every candidate (the "p5 surface"), and choose per bin the cheapest
candidate whose p5 >= tau, made non-decreasing. p5 barely moves during training, so this runs once.
The percentile is a parameter (`quantile`, 5 the paper's): the surface holds every percentile of
`acceptance.PERCENTILES` and the quantile's (the same alphas), so one calibration can choose a table
for any of them (`choose_schedule`), and the table records the quantile it holds. It keeps the mean
acceptance per bin too, which sets the expected length of a speculative round: `speculative_plan`
picks per bin the budget and draft count that maximise lossless (speculative) throughput.

Candidates are top-k page counts in the paper's form: candidate c keeps min(c + always_kept,
cached pages) pages at every step, and the chosen schedule is a `KVSchedule.table` of candidates.

Bins. The per-token alpha of the token at position j compares the two next-token distributions
computed at the query j - 1, whose decode step saw `cached_len = j` tokens. Tokens are binned by
`schedule.position_bin(j, page_size, bin_size)`, the function a table schedule uses for that step's
budget (and the trainer for its tail statistics), so the value chosen for bin b is the one that
governs the tokens whose p5 was measured in bin b.

Alpha. "exact" scores sum_x min(p, q) (`acceptance_rate`); "topk20" scores the reference code's
lower bound from each side's top-20 (`topk_bound_from_logits`), which is what the paper's tau (0.86)
was measured with. The bound is <= the exact rate token by token, so at the same tau it picks
budgets at least as large: use "topk20" to compare with the paper's tau and published tables.

Rollouts. By default one set is sampled (sparse at the largest candidate, like the paper, or dense)
and re-scored under every candidate. `on_policy` instead samples each candidate's rollouts with the
sparse sampler under that candidate's own schedule (same prompts, same keys) and scores them
against its sparse teacher-forced logits, i.e. the policy that sampled them; each candidate then has
its own token counts per bin.

The expensive part is the grid: one dense pass per batch of sequences, then one sparse
teacher-forced pass per candidate, all candidates through a single compiled function (the budget is
a traced lookup table, not a static schedule), `candidates_per_pass` of them vmapped together.
"""

import dataclasses
import functools
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.mismatch import cost_model
from sparrow_jax.mismatch.acceptance import (
  acceptance_rate,
  percentile_name,
  tail_percentiles,
  tail_stats,
  topk_bound_from_logits,
)
from sparrow_jax.model import qwen3
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.rollout import engine, sampler
from sparrow_jax.sparsity import policy
from sparrow_jax.sparsity.schedule import BudgetTable, KVSchedule, is_quantile, position_bin

# The paper's grid: top-k pages (page size 16) for contexts up to ~37K tokens.
PAPER_CANDIDATES = (
  29,
  45,
  61,
  77,
  93,
  125,
  157,
  189,
  221,
  253,
  317,
  381,
  445,
  509,
  637,
  765,
  893,
  1021,
)
# Per-token acceptance the tail is taken of: name -> fn(logits_p, logits_q, temperature=T).
ALPHAS = {"exact": acceptance_rate, "topk20": functools.partial(topk_bound_from_logits, k=20)}


@dataclasses.dataclass(frozen=True)
class CalibrationConfig:
  """What a calibration holds and how it samples and scores (its model, sparsity and sampling
  come beside it)."""

  tau: float = 0.86  # the acceptance the schedule holds ...
  quantile: float = 5  # ... at this tail percentile per bin (5: the paper's p5)
  bin_size: int = 2048  # tokens of cached length per schedule bin
  alpha: str = "exact"  # a key of ALPHAS (see the module docstring)
  candidates: tuple = ()  # top-k pages scored, strictly increasing; (): default_candidates
  repeats: int = 8  # samples per prompt (the paper: 8)
  sample_sparse: bool = True  # rollouts sampled sparsely (the paper) or densely
  sample_topk: int = 0  # the sparse sampler's top-k (0: the largest candidate)
  on_policy: bool = False  # each candidate samples its own rollouts under its own schedule
  batch_size: int = 8  # rows per teacher-forced pass
  generate_batch_size: int = 64  # rows per rollout batch
  candidates_per_pass: int = 1  # candidates vmapped together (memory grows with it)
  verbose: bool = True  # a progress line per pass

  def __post_init__(self):
    object.__setattr__(self, "candidates", tuple(int(c) for c in self.candidates))
    if self.candidates:
      _check_candidates(self.candidates, "CalibrationConfig.candidates")
    if not is_quantile(self.quantile):
      raise ValueError(
        f"CalibrationConfig.quantile = {self.quantile!r}: must be a percentile in (0, 50), "
        "e.g. 5 (p5)"
      )
    if self.alpha not in ALPHAS:
      raise ValueError(f"CalibrationConfig.alpha must be one of {list(ALPHAS)}, got {self.alpha!r}")
    for name in ("repeats", "bin_size", "batch_size", "generate_batch_size", "candidates_per_pass"):
      if getattr(self, name) < 1:
        raise ValueError(f"CalibrationConfig.{name} must be >= 1, got {getattr(self, name)}")
    if self.sample_topk < 0:
      raise ValueError(f"CalibrationConfig.sample_topk must be >= 0, got {self.sample_topk}")
    if self.on_policy and (not self.sample_sparse or self.sample_topk):
      raise ValueError(
        f"CalibrationConfig.on_policy samples each candidate under its own schedule: "
        f"sample_sparse={self.sample_sparse} / sample_topk={self.sample_topk} do not apply "
        "(leave them at True / 0)"
      )


class Calibration(NamedTuple):
  schedule: KVSchedule  # the chosen table
  tail: dict  # percentile -> [num_candidates, num_bins] acceptance (NaN: empty bin)
  count: np.ndarray  # [num_candidates, num_bins] generated tokens behind each tail (rows
  # differ only on-policy, where each candidate samples its own)
  candidates: tuple  # top-k pages per candidate, increasing
  tau: float
  quantile: float  # the percentile the schedule holds at tau
  bin_size: int
  alpha: str  # a key of ALPHAS
  on_policy: bool
  mean: np.ndarray | None = None  # [num_candidates, num_bins] mean acceptance (NaN: empty bin),
  # what sets a speculative round's expected length (`speculative_plan`)


def candidate_schedule(topk: int, sparse: SparseConfig, bin_size: int = 2048) -> KVSchedule:
  """Constant top-k `topk` (plus the always-kept pages) as a one-value table."""
  return KVSchedule.table((int(topk),), sparse.page_size, sparse.always_kept, bin_size)


def default_candidates(
  max_len: int, page_size: int = 16, always_kept: int = 3, num: int = 18
) -> tuple:
  """The paper's grid when the context has room for it (>= 1021 scored pages); otherwise `num`
  geometric-ish top-k values from 1 up to every scored page (fewer if there are fewer pages), so
  the largest reproduces dense attention."""
  scored = -(-max_len // page_size) - always_kept
  if scored >= PAPER_CANDIDATES[-1]:
    return PAPER_CANDIDATES
  if scored < 1:
    raise ValueError(
      f"max_len={max_len} fits in {always_kept} always-kept pages of {page_size} "
      "tokens: there is no budget to calibrate"
    )
  n = num  # rounding merges small values: densify until `num` distinct ones (or all of them)
  while True:
    cands = np.unique(np.round(np.geomspace(1, scored, n)).astype(int))
    if len(cands) >= min(num, scored):
      return tuple(int(c) for c in cands)
    n += 1


def token_bins(gen_mask_BS):
  """Which alphas count, and where: (mask, cached_len), both [B, S - 1], for the tokens at
  positions 1..S-1 (alpha_BS[:, :-1] scores them); cached_len = j for the token at j, to be binned
  by `position_bin` (see the module docstring)."""
  B, S = gen_mask_BS.shape
  return (jnp.asarray(gen_mask_BS, bool)[:, 1:], jnp.broadcast_to(jnp.arange(1, S), (B, S - 1)))


def bin_counts(gen_mask_BS, page_size: int, bin_size: int, num_bins: int) -> np.ndarray:
  """Generated tokens per schedule bin -> int [num_bins]."""
  mask_BS, cached_len_BS = token_bins(gen_mask_BS)
  bins = np.asarray(position_bin(cached_len_BS, page_size, bin_size))[np.asarray(mask_BS)]
  return np.bincount(bins[bins < num_bins], minlength=num_bins)[:num_bins]


@functools.partial(jax.jit, static_argnames=("cfg",))
def _dense_hidden(params, tokens_BS, valid_BS, *, cfg):
  return qwen3.forward_hidden(params, tokens_BS, cfg, mask_BT=valid_BS)


@functools.partial(jax.jit, static_argnames=("cfg", "sparse", "alpha"))
def _sparse_alpha(
  params, tokens_BS, valid_BS, prompt_len_B, x_p_BSD, budget_US, temperature, *, cfg, sparse, alpha
):
  """alpha_UBS (ALPHAS[alpha]) between the dense and the sparse teacher-forced distributions of
  each candidate (budget table row), from the final hidden states: the logits exist one sequence
  chunk at a time (`qwen3.map_logits`), never [B, S, V]. The candidate axis is vmapped; its size is
  the only shape it adds."""

  def one(budget_S):
    attention_fn = policy.teacher_forced_attention_fn(sparse, BudgetTable(budget_S), prompt_len_B)
    x_q_BSD = qwen3.forward_hidden(
      params, tokens_BS, cfg, mask_BT=valid_BS, attention_fn=attention_fn
    )
    fn = lambda logits: ALPHAS[alpha](logits[0], logits[1], temperature=temperature)
    return qwen3.map_logits(params, cfg, fn, (x_p_BSD, x_q_BSD))

  return jax.vmap(one)(budget_US)


@functools.partial(jax.jit, static_argnums=(3, 4, 5, 6))
def _tails_per_bin(alpha, mask, pos, bin_size, num_bins, page_size, percentiles):
  """[len(percentiles) + 1, num_bins]: each percentile per bin, then the mean."""
  stats = tail_stats(alpha, mask, pos, bin_size, num_bins, page_size, percentiles=percentiles)
  return jnp.stack([stats[percentile_name(p) + "_bin"] for p in percentiles] + [stats["mean_bin"]])


def _check_candidates(candidates, name: str = "candidates"):
  cands = tuple(int(c) for c in candidates)
  if not cands or any(c < 0 for c in cands) or any(b <= a for a, b in zip(cands, cands[1:])):
    raise ValueError(
      f"{name} must be non-negative top-k page counts, strictly increasing; got {list(candidates)}"
    )
  return cands


def _check_sparse_layers(cfg, sparse):
  if sparse.dense_layers >= cfg.num_hidden_layers:
    raise ValueError(
      f"SparseConfig.dense_layers ({sparse.dense_layers}) leaves none of the "
      f"{cfg.num_hidden_layers} layers sparse: every budget would look exact"
    )


def _check_rows(tokens_BS, gen_mask_BS, prompt_len_B):
  """The scored rows as host arrays, their shapes checked."""
  tokens_BS = np.asarray(tokens_BS, np.int32)
  gen_mask_BS = np.asarray(gen_mask_BS, bool)
  prompt_len_B = np.asarray(prompt_len_B, np.int32)
  B, S = tokens_BS.shape
  if gen_mask_BS.shape != (B, S) or prompt_len_B.shape != (B,):
    raise ValueError(
      f"gen_mask_BS {gen_mask_BS.shape} must match tokens_BS {tokens_BS.shape} and "
      f"prompt_len_B {prompt_len_B.shape} must be ({B},)"
    )
  return tokens_BS, gen_mask_BS, prompt_len_B


def _alpha_per_candidate(
  params, cfg, tokens_BS, gen_mask_BS, prompt_len_B, cands, sparse, cc, temperature
):
  """Every token's acceptance under each candidate -> alpha_UBS: a dense pass per batch of
  `cc.batch_size` rows, then the candidates' sparse passes, `cc.candidates_per_pass` at a time."""
  B, S = tokens_BS.shape
  # Fixed shapes so everything compiles once: the last batch is topped up with copies of row 0
  # (scored nowhere), the last candidate group with copies of the largest candidate.
  batch_size = min(cc.batch_size, B)
  pad_rows = -B % batch_size
  row_idx = np.concatenate([np.arange(B), np.zeros(pad_rows, int)])
  valid_BS = (np.arange(S)[None] < prompt_len_B[:, None]) | gen_mask_BS
  tables = np.stack(
    [sampler.budget_table(candidate_schedule(c, sparse, cc.bin_size), S, sparse) for c in cands]
  )
  per_pass = min(cc.candidates_per_pass, len(cands))
  groups = -(-len(cands) // per_pass)
  tables = np.concatenate([tables, np.repeat(tables[-1:], groups * per_pass - len(cands), 0)])

  alpha_UBS = np.zeros((len(cands), B, S), np.float32)
  batches, start_time, done = (B + pad_rows) // batch_size, time.time(), 0
  for b in range(batches):
    rows = row_idx[b * batch_size : (b + 1) * batch_size]
    real = rows[: min(batch_size, B - b * batch_size)]
    args = (jnp.asarray(tokens_BS[rows]), jnp.asarray(valid_BS[rows]))
    x_p_BSD = _dense_hidden(params, *args, cfg=cfg)
    for g in range(groups):
      pass_alpha_UBS = _sparse_alpha(
        params,
        *args,
        jnp.asarray(prompt_len_B[rows]),
        x_p_BSD,
        jnp.asarray(tables[g * per_pass : (g + 1) * per_pass]),
        jnp.float32(temperature),
        cfg=cfg,
        sparse=sparse,
        alpha=cc.alpha,
      )
      c0, c1 = g * per_pass, min((g + 1) * per_pass, len(cands))
      alpha_UBS[c0:c1, real] = np.asarray(pass_alpha_UBS)[: c1 - c0, : len(real)]
      done += 1
      if cc.verbose:
        elapsed = time.time() - start_time
        eta = elapsed / done * (batches * groups - done)
        print(
          f"[calibrate] batch {b + 1}/{batches} candidates {cands[c0:c1]} "
          f"({done}/{batches * groups} passes) {elapsed:.1f}s elapsed, ETA {eta:.1f}s",
          flush=True,
        )
  return alpha_UBS


def tail_surface(
  params,
  cfg: Qwen3Config,
  tokens_BS,
  gen_mask_BS,
  prompt_len_B,
  candidates: Sequence[int],
  sparse: SparseConfig,
  *,
  num_bins: int,
  calibration: CalibrationConfig = CalibrationConfig(),
  temperature: float = 1.0,
  with_mean: bool = False,
):
  """Percentiles of the per-token acceptance per schedule bin for each candidate -> {percentile:
  float [U, b]} (U candidates, b bins), the percentiles
  `acceptance.tail_percentiles(calibration.quantile)`; with `with_mean`, (that dict, the mean
  acceptance float [U, b]).

  tokens_BS: right-padded prompt + completion rows (as `sampler.full_sequences` makes them);
  gen_mask_BS: the completion tokens (the only ones scored); prompt_len_B: where decoding began.
  candidates: top-k pages (paper form), strictly increasing. Each batch of `calibration.batch_size`
  rows gets one dense pass; its final hidden states [batch_size, S, D] stay in memory while every
  candidate's sparse pass is compared with them in sequence chunks, `candidates_per_pass`
  candidates at a time (vmapped: memory grows with it). Memory is linear in S. Bins of
  `calibration.bin_size` tokens; alpha as `calibration.alpha`. Empty bins are NaN.
  """
  cands, cc = _check_candidates(candidates), calibration
  tokens_BS, gen_mask_BS, prompt_len_B = _check_rows(tokens_BS, gen_mask_BS, prompt_len_B)
  if not temperature > 0:
    raise ValueError(
      f"temperature must be > 0 (acceptance compares sampling distributions), got {temperature}"
    )
  _check_sparse_layers(cfg, sparse)
  position_bin(0, sparse.page_size, cc.bin_size)  # whole pages a bin, before the expensive part
  stat_mask_BS, cached_len_BS = token_bins(gen_mask_BS)
  alpha_UBS = _alpha_per_candidate(
    params, cfg, tokens_BS, gen_mask_BS, prompt_len_B, cands, sparse, cc, temperature
  )
  percentiles = tail_percentiles(cc.quantile)
  tails_UJb = np.stack(
    [
      np.asarray(
        _tails_per_bin(
          jnp.asarray(alpha_BS[:, :-1]),
          stat_mask_BS,
          cached_len_BS,
          cc.bin_size,
          num_bins,
          sparse.page_size,
          percentiles,
        )
      )
      for alpha_BS in alpha_UBS
    ]
  )
  tails = {p: tails_UJb[:, i] for i, p in enumerate(percentiles)}
  return (tails, tails_UJb[:, -1]) if with_mean else tails


def choose_schedule(
  tail_Ub,
  candidates: Sequence[int],
  tau: float,
  *,
  page_size: int = 16,
  always_kept: int = 3,
  bin_size: int = 2048,
  quantile: float = 5,
) -> KVSchedule:
  """Per bin the cheapest candidate whose tail tail_Ub (the `quantile`-th percentile of alpha) is
  >= tau (the largest if none meets it), then a running maximum so the budget never shrinks with
  length -> `KVSchedule.table` of top-k values, recording `quantile`.

  A bin with no data (all NaN) takes the previous bin's value (the smallest candidate when it is
  the first): the running maximum does that by itself once an empty bin starts from the smallest.
  """
  cands = _check_candidates(candidates)
  tail_Ub = np.asarray(tail_Ub, np.float64)
  if tail_Ub.ndim != 2 or tail_Ub.shape[0] != len(cands):
    raise ValueError(
      f"tail_Ub must be [num_candidates={len(cands)}, num_bins], got {tail_Ub.shape}"
    )
  meets_Ub = tail_Ub >= tau  # NaN compares False
  pick_b = np.where(meets_Ub.any(0), meets_Ub.argmax(0), len(cands) - 1)
  pick_b = np.where(np.isnan(tail_Ub).all(0), 0, pick_b)
  pick_b = np.maximum.accumulate(pick_b)
  return KVSchedule.table([cands[i] for i in pick_b], page_size, always_kept, bin_size, quantile)


def speculative_plan(
  mean_Ub,
  candidates: Sequence[int],
  cfg: Qwen3Config,
  sparse: SparseConfig,
  *,
  bin_size: int,
  ks: Sequence[int] = (1, 2, 4, 8),
  rows: float = 64,
  hardware="h200",
) -> dict:
  """Per bin, the candidate budget and draft count k that maximise the predicted throughput of
  lossless (speculative) rollouts, from each candidate's mean acceptance mean_Ub [U, b]
  (NaN: an empty bin) -> {"cached_len", "topk", "k", "tokens_per_round", "speedup"}, one entry a
  bin (speedup over dense decoding there; None where the bin is empty) and the settings.

  The mean, not a tail percentile: with drafts accepted independently a round's expected length
  is `cost_model.expected_tokens_per_round`(mean, k). Bin b is priced at its middle cached length,
  (b + 1/2) x bin_size, with every one of `rows` rows there (`cost_model.roofline_round_rate` on
  `hardware`); dense decoding (k = 0, "topk" None) stands where no pair beats it, and ties go to
  the smaller budget and the smaller k. A speculative round's drafts extend prefixes sampled from
  the dense policy: a calibration with dense rollouts (`sample_sparse` False) measures alpha on
  those prefixes.
  """
  cands = _check_candidates(candidates)
  mean_Ub = np.asarray(mean_Ub, np.float64)
  if mean_Ub.ndim != 2 or mean_Ub.shape[0] != len(cands):
    raise ValueError(
      f"mean_Ub must be [num_candidates={len(cands)}, num_bins], got {mean_Ub.shape}"
    )
  ks = tuple(int(k) for k in ks)
  if not ks or min(ks) < 1:
    raise ValueError(f"ks (draft tokens per round) must be integers >= 1, got {list(ks)}")
  position_bin(0, sparse.page_size, bin_size)  # whole pages a bin
  hw = cost_model.get_hardware(hardware)
  common = dict(ks=ks, rows=rows, hardware=hw, sparse=sparse)
  plan = {name: [] for name in ("cached_len", "topk", "k", "tokens_per_round", "speedup")}
  for b, alpha_U in enumerate(mean_Ub.T):
    cached_len = (b + 0.5) * bin_size
    dense = cost_model.roofline_round_rate(
      cfg, None, cached_len, k=0, alpha=1.0, rows=rows, hardware=hw
    )
    best = (dense, None, 0)
    for c, alpha in zip(cands, alpha_U):
      if np.isnan(alpha):
        continue
      schedule = candidate_schedule(c, sparse, bin_size)
      k, rate, _ = cost_model.best_draft(cfg, schedule, cached_len, alpha, **common)
      if rate > best[0]:
        best = (rate, c, k)
    rate, topk, k = best
    per_round = 1.0 if topk is None else alpha_U[cands.index(topk)]
    per_round = float(cost_model.expected_tokens_per_round(per_round, k))
    entry = dict(topk=topk, k=k, tokens_per_round=per_round, speedup=rate / dense)
    if np.isnan(alpha_U).all():
      entry = dict.fromkeys(entry)
    plan["cached_len"].append(cached_len)
    for name, value in entry.items():
      plan[name].append(value)
  return dict(plan, ks=list(ks), rows=rows, hardware=hw.name, candidates=list(cands))


def pad_prompts(prompts: Sequence[Sequence[int]], pad_id: int = 0):
  """Right-padded prompt_BT and prompt_len_B from variable-length token-id lists."""
  lengths = [len(p) for p in prompts]
  if not prompts or min(lengths) < 1:
    raise ValueError(
      f"prompts must be a non-empty list of non-empty token-id lists; got lengths {lengths[:8]}"
    )
  prompt_BT = np.full((len(prompts), max(lengths)), pad_id, np.int32)
  for i, p in enumerate(prompts):
    prompt_BT[i, : len(p)] = p
  return prompt_BT, np.asarray(lengths, np.int32)


def _rollouts(
  params,
  cfg: Qwen3Config,
  prompt_BT,
  prompt_len_B,
  key,
  schedule,
  sparse: SparseConfig,
  *,
  max_new_tokens: int,
  sampling: sampler.Sampling,
  calibration: CalibrationConfig,
):
  """Right-padded prompt + completion rows and their completion mask (tokens_BS, gen_mask_BS),
  sampled densely when `schedule` is None, else sparsely under it. The batch starting at row i
  draws with fold_in(key, i), so every schedule sees the same prompts and keys."""
  B, gen_bs = len(prompt_len_B), min(calibration.generate_batch_size, len(prompt_len_B))
  idx = np.concatenate([np.arange(B), np.zeros(-B % gen_bs, int)])  # same shape every batch
  seqs, masks, t0 = [], [], time.time()
  for i in range(0, len(idx), gen_bs):
    rows = idx[i : i + gen_bs]
    out = engine.generate(
      params,
      cfg,
      prompt_BT[rows],
      prompt_len_B[rows],
      jax.random.fold_in(key, i),
      max_new_tokens=max_new_tokens,
      sampling=sampling,
      sparse=None if schedule is None else sparse,
      schedule=schedule,
    )
    seq_BS, gen_mask_BS = sampler.full_sequences(
      prompt_BT[rows], prompt_len_B[rows], out, sampling.pad_id
    )
    seqs.append(np.asarray(seq_BS))
    masks.append(np.asarray(gen_mask_BS))
    if calibration.verbose:
      print(
        f"[calibrate] generated {min(i + gen_bs, B)}/{B} rollouts "
        f"({'dense' if schedule is None else 'sparse top-k ' + str(schedule.values[0])}, "
        f"mean length {float(np.mean(out.lengths)):.0f}) {time.time() - t0:.1f}s",
        flush=True,
      )
  return np.concatenate(seqs)[:B], np.concatenate(masks)[:B]


def _runs(cc: CalibrationConfig, cands, sparse):
  """The calibration's rollout runs: (candidates scored, the schedule their rollouts are sampled
  under; None: dense) each."""
  if cc.on_policy:
    return [((c,), candidate_schedule(c, sparse, cc.bin_size)) for c in cands]
  if cc.sample_sparse:
    return [(cands, candidate_schedule(cc.sample_topk or cands[-1], sparse, cc.bin_size))]
  return [(cands, None)]


def _score_runs(
  params, cfg, prompt_BT, prompt_len_B, key, cands, sparse, max_new_tokens, sampling, cc, max_bins
):
  """Each run's rollouts scored under its candidates -> (tail dicts, means [U, b], token counts
  [U, b]), a run after another."""
  runs = _runs(cc, cands, sparse)
  # on-policy, one progress line per candidate instead of one per pass
  quiet = dataclasses.replace(cc, verbose=cc.verbose and not cc.on_policy)
  quantile = cc.quantile
  tails, means, count, t0 = [], [], [], time.time()
  for r, (run_cands, schedule) in enumerate(runs):
    tokens_BS, gen_mask_BS = _rollouts(
      params,
      cfg,
      prompt_BT,
      prompt_len_B,
      key,
      schedule,
      sparse,
      max_new_tokens=max_new_tokens,
      sampling=sampling,
      calibration=quiet,
    )
    count_b = bin_counts(gen_mask_BS, sparse.page_size, cc.bin_size, max_bins)
    count.append(np.repeat(count_b[None], len(run_cands), 0))
    run_tails, run_mean = tail_surface(
      params,
      cfg,
      tokens_BS,
      gen_mask_BS,
      prompt_len_B,
      run_cands,
      sparse,
      num_bins=max_bins,
      calibration=quiet,
      temperature=sampling.temperature,
      with_mean=True,
    )
    tails.append(run_tails)
    means.append(run_mean)
    if cc.verbose and cc.on_policy:
      elapsed = time.time() - t0
      print(
        f"[calibrate] on-policy top-k {run_cands[0]} ({r + 1}/{len(runs)}): mean length "
        f"{gen_mask_BS.sum(1).mean():.0f}, {percentile_name(quantile)} per non-empty bin "
        f"{[round(float(v), 3) for v in tails[-1][quantile][0, count_b > 0]]} "
        f"{elapsed:.1f}s elapsed, "
        f"ETA {elapsed / (r + 1) * (len(runs) - r - 1):.1f}s",
        flush=True,
      )
  return tails, means, np.concatenate(count)


def calibrate(
  params,
  cfg: Qwen3Config,
  prompts: Sequence[Sequence[int]],
  key,
  *,
  max_new_tokens: int,
  calibration: CalibrationConfig = CalibrationConfig(),
  sparse: SparseConfig = SparseConfig(),
  sampling: sampler.Sampling = sampler.Sampling(),
) -> Calibration:
  """End to end: rollouts -> tail surface -> the schedule holding `calibration.quantile` at tau.

  Each prompt is repeated `repeats` times and sampled under `sampling`: with the sparse sampler at
  top-k `sample_topk` (default the largest candidate) like the paper, or densely when
  `sample_sparse` is False; then `tail_surface` scores those rollouts under every candidate
  (default `default_candidates` for the longest row). With `on_policy`, each candidate samples its
  own rollouts under its own schedule and `tail_surface` scores them for that candidate alone.
  Then `choose_schedule` at `tau` on the quantile (the surface keeps
  `acceptance.tail_percentiles(quantile)`).

  Args:
    params: the model's parameters.
    cfg: the model's Qwen3Config.
    prompts: the prompts, each a list of token ids.
    key: the rollouts' PRNG key (every candidate's rollouts see the same prompts and keys).
    max_new_tokens: tokens each rollout may generate.
    calibration: what the calibration targets and how it samples and scores (CalibrationConfig:
      tau, quantile, bin_size, alpha, candidates, repeats, sample_sparse, sample_topk, on_policy,
      batch sizes).
    sparse: the page geometry and page score the candidates run with.
    sampling: how the rollouts' tokens are drawn; its temperature is the one acceptance compares.

  Returns:
    Calibration: the chosen schedule, the tail surface (percentile -> [U, b] acceptance over U
    candidates and b bins, NaN for an empty bin), the generated tokens behind each entry, the
    candidates and the settings, and the mean acceptance [U, b].

  Raises:
    ValueError: a SparseConfig that leaves no layer sparse, a bin_size that is not whole pages,
      candidates that are not strictly increasing, or a sampling temperature of 0.
  """
  cc = calibration
  _check_sparse_layers(cfg, sparse)
  position_bin(0, sparse.page_size, cc.bin_size)  # whole pages a bin, before the rollouts
  prompt_BT, prompt_len_B = pad_prompts(prompts, sampling.pad_id)
  prompt_BT = np.repeat(prompt_BT, cc.repeats, 0)
  prompt_len_B = np.repeat(prompt_len_B, cc.repeats)
  max_len = prompt_BT.shape[1] + max_new_tokens
  cands = cc.candidates or _check_candidates(
    default_candidates(max_len, sparse.page_size, sparse.always_kept)
  )
  max_bins = max_len // cc.bin_size + 2
  quantile, percentiles = cc.quantile, tail_percentiles(cc.quantile)
  tails, means, count = _score_runs(
    params, cfg, prompt_BT, prompt_len_B, key, cands, sparse, max_new_tokens, sampling, cc, max_bins
  )

  # Bins up to the last one holding a generated token (the table's last value holds beyond).
  used = np.nonzero(count.any(0))[0]
  num_bins = int(used.max()) + 1 if used.size else 1
  tail = {p: np.concatenate([t[p] for t in tails])[:, :num_bins] for p in percentiles}
  schedule = choose_schedule(
    tail[quantile],
    cands,
    cc.tau,
    page_size=sparse.page_size,
    always_kept=sparse.always_kept,
    bin_size=cc.bin_size,
    quantile=quantile,
  )
  return Calibration(
    schedule,
    tail,
    count[:, :num_bins],
    cands,
    float(cc.tau),
    quantile,
    cc.bin_size,
    cc.alpha,
    bool(cc.on_policy),
    np.concatenate(means)[:, :num_bins],
  )


def surface_dict(result: Calibration) -> dict:
  """JSON-ready surface: "tail" holds, per percentile ("1", "5", ...), its value per candidate per
  bin (null for empty bins); "quantile" is the one the schedule was chosen by; "mean" the mean
  acceptance the same way; with the token counts.

  "count_bin" is the tokens per bin, the most over candidates; on-policy, where each candidate
  scored its own rollouts, "count_bin_by_candidate" holds every candidate's counts as well.
  """
  out = {
    "tau": result.tau,
    "quantile": result.quantile,
    "alpha": result.alpha,
    "on_policy": result.on_policy,
    "bin_size": result.bin_size,
    "page_size": result.schedule.page_size,
    "always_kept": result.schedule.always_kept,
    "candidates": list(result.candidates),
    "count_bin": result.count.max(0).tolist(),
  }
  if result.on_policy:
    out["count_bin_by_candidate"] = {
      str(c): count_b.tolist() for c, count_b in zip(result.candidates, result.count)
    }
  as_json = lambda tail_Ub: {
    str(c): [None if np.isnan(v) else float(v) for v in tail_b]
    for c, tail_b in zip(result.candidates, tail_Ub)
  }
  out = {
    **out,
    "tail": {f"{p:g}": as_json(tail_Ub) for p, tail_Ub in result.tail.items()},
    "chosen_topk": list(result.schedule.values),
  }
  if result.mean is not None:
    out["mean"] = as_json(result.mean)
  return out


def surface_tail(surface: dict, quantile: float, path: str = "the surface") -> tuple:
  """(candidates, tail_Ub) of a `surface_dict` (as read from surface.json) at `quantile`; None
  (an empty bin) -> NaN."""
  if f"{quantile:g}" not in surface["tail"]:
    raise ValueError(
      f"{path} holds the percentiles {sorted(surface['tail'], key=float)} of "
      f"alpha, not {quantile:g}: calibrate again (experiments/calibrate_schedule.py "
      f"with --config.stats.quantile={quantile:g})"
    )
  tail = surface["tail"][f"{quantile:g}"]
  cands = surface["candidates"]
  return cands, np.array([tail[str(c)] for c in cands], np.float64)
