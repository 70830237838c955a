"""Rollout cost in eFLOPs (equivalent FLOPs, after the Kinetics paper, Sadhukhan et al. 2025), as
used by Sparrow section 3.3: cost = compute FLOPs + I * memory bytes, with I = peak FLOP/s / memory
bandwidth, so a byte moved costs what the chip could have computed meanwhile.

One rollout group = `n_samples` samples of `gen_len` tokens from one prompt of `prompt_len` tokens.
The cost is summed over decode steps: step t = 1..gen_len attends to S_t = prompt_len + t cached
tokens, so a schedule whose budget changes along the generation is integrated exactly. Per step
and sample, with P parameters, r = GQA ratio and D = K and V elements per token summed over layers:
  dense:  compute 2 P + 2 r D S_t;  memory: KV of the prompt (shared by the group, read once) and
          of the sample's own t generated tokens, at `dtype_bytes` per element.
  sparse: the first `dense_layers` layers stay dense (as in Sparrow; the layout is a
          `SparseConfig`'s); the others attend to B_t = min(budget_pages(S_t) * page_size, S_t)
          tokens, read per sample (compute 2 r D B_t, memory D B_t elements), plus page scoring:
          one key centroid per page (D/2 elements, the prompt's complete pages shared by the
          group) read and dotted with the group-mean query (D/2 multiply-adds per page, i.e. D
          FLOPs); `page_score` "quest" keeps two summaries a page (key max and min), so twice
          both.
Summed, the dense terms reproduce the paper's C_comp / C_mem up to O(gen_len) terms. Like the paper,
parameter reads are left out: they are amortized over the whole rollout batch. The paper's scoring
compute also multiplies the generated-token part by r (per-head scoring); Sparrow scores with the
group-mean query, which is what is counted here (the difference is < 1% of the cost, memory
dominates).

A second model, `roofline_rollout_time` / `roofline_speedup`, prices what a measurement sees: the
wall time of one device decoding a finite batch of rows, each decode step costing
max(FLOPs / peak FLOP/s, bytes / bandwidth). Beside the terms above it counts the weights read once
per step for the whole running batch, page selection (centroid reads and the top-k), rows that stop
at different lengths (the batch shrinks as they finish) and prefill. With every row at the cutoff,
an unbounded batch and free compute it gives the eFLOPs ratio (up to the top-k's scores). On an
H200 it then runs above it: eFLOPs adds the compute (mostly 2P per token) to the memory term, while
in a memory-bound decode step the compute hides behind the reads (docs/results/cost_model.md).

`roofline_static_rate` and `roofline_engine_rate` price the two ways rollout/engine.py runs rows
in a pool of KV memory: the static batch (every row allocated at the cutoff, a batch decoded until
its longest row ends) and continuous batching (slots refilled as rows end, pages taken as rows
grow), each in generated tokens per second and rows in flight.

`roofline_speculative_rate` prices the engine's lossless mode in the same terms: rounds of k sparse
draft steps and one dense verification pass over the k + 1 new positions (weights read once, the
row's whole KV read once, compute for k + 1 queries), each pass a roofline step, yielding
`expected_tokens_per_round` tokens at the mean per-token acceptance alpha (drafts accepted
independently: the i.i.d. approximation). `roofline_round_rate` is the same round for rows at one
cached length, what calibration compares budgets and k by per bin.
"""

import dataclasses
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparrow_jax.attention.paged_cache import page_score_fns
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.sparsity.schedule import DraftPlan, KVSchedule, position_bin


@dataclasses.dataclass(frozen=True)
class Hardware:
  name: str
  peak_flops: float  # dense matmul FLOP/s at the rollout dtype
  mem_bandwidth: float  # memory bytes/s
  dtype_bytes: int = 2  # bytes per KV element at that dtype (bf16)
  # Seconds each query position of a forward pass costs beyond its roofline (dispatch, sampling,
  # bookkeeping): 0 in the published specs; measured for one model on one machine by
  # `pass_overhead`, where a small model's passes are bound by it rather than by FLOPs or bytes.
  pass_overhead_s: float = 0.0

  @property
  def intensity(self) -> float:
    """I: FLOPs the chip can do in the time it moves one byte."""
    return self.peak_flops / self.mem_bandwidth


HARDWARE = {
  # NVIDIA H100 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with 2:4 sparsity (989 dense),
  # 3.35 TB/s HBM3.
  "h100_sxm": Hardware("h100_sxm", 989e12, 3.35e12),
  # NVIDIA H200 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity (989 dense),
  # 4.8 TB/s HBM3e.
  "h200": Hardware("h200", 989e12, 4.8e12),
  # NVIDIA HGX B200 datasheet, per GPU: FP16/BF16 4.5 PFLOPS with sparsity (2.25 dense),
  # 8 TB/s HBM3e.
  "b200": Hardware("b200", 2.25e15, 8e12),
  # Google Cloud TPU docs (cloud.google.com/tpu/docs/v5e, /v5p, /v6e), per chip: bf16 peak
  # compute and HBM bandwidth.
  "tpu_v5e": Hardware("tpu_v5e", 197e12, 819e9),
  "tpu_v5p": Hardware("tpu_v5p", 459e12, 2765e9),
  "tpu_v6e": Hardware("tpu_v6e", 918e12, 1638e9),
}
THIS_MACHINE = "this_machine"


def _rate(fn, args, work, seconds):
  """Work units per second of `fn(*args)`, timed for about `seconds` after one warm-up call."""
  jax.block_until_ready(fn(*args))
  reps, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds or reps == 0:
    jax.block_until_ready(fn(*args))
    reps += 1
  return work * reps / (time.perf_counter() - start)


def measure_this_machine(
  seconds: float = 2.0, matmul_size: int = 1024, copy_mib: int = 64
) -> Hardware:
  """Hardware entry for the default JAX device, measured: matmul FLOP/s and the bandwidth of a
  memory-bound elementwise pass (reads and writes `copy_mib` MiB), half of `seconds` each.
  Uses float32 on CPU (bf16 matmuls are emulated there), bf16 on accelerators."""
  platform = jax.devices()[0].platform
  dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
  a = jnp.ones((matmul_size, matmul_size), dtype)
  x = jnp.ones((copy_mib * 2**20 // jnp.dtype(dtype).itemsize,), dtype)
  flops = _rate(jax.jit(jnp.matmul), (a, a), 2 * matmul_size**3, seconds / 2)
  bandwidth = _rate(jax.jit(lambda v: v * 2), (x,), 2 * x.nbytes, seconds / 2)
  return Hardware(f"{THIS_MACHINE} ({platform})", flops, bandwidth, jnp.dtype(dtype).itemsize)


def get_hardware(hardware) -> Hardware:
  """A `Hardware`, a key of HARDWARE, or "this_machine" (measured now, a few seconds)."""
  if isinstance(hardware, Hardware):
    return hardware
  if hardware == THIS_MACHINE:
    return measure_this_machine()
  if hardware not in HARDWARE:
    raise ValueError(f"unknown hardware {hardware!r}; known: {sorted(HARDWARE) + [THIS_MACHINE]}")
  return HARDWARE[hardware]


def _config(model) -> Qwen3Config:
  return model if isinstance(model, Qwen3Config) else Qwen3Config.preset(model)


def param_count(model) -> int:
  """P: embedding + decoder layers (attention, q/k norms, MLP, RMSNorms) + final norm + LM head
  when untied."""
  cfg = _config(model)
  d, e, q_width = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads * cfg.head_dim
  attention = 2 * d * q_width + 2 * d * cfg.kv_width + 2 * e
  layer = attention + 3 * d * cfg.intermediate_size + 2 * d
  embed = cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
  return embed + cfg.num_hidden_layers * layer + d


def _steps(prompt_len, gen_len, n_samples):
  if prompt_len < 0 or gen_len < 1 or n_samples < 1:
    raise ValueError(
      f"need prompt_len >= 0, gen_len >= 1, n_samples >= 1; got {prompt_len}, "
      f"{gen_len}, {n_samples}"
    )
  t = np.arange(1, gen_len + 1, dtype=np.float64)
  return prompt_len + t, t


def _sparse_or_paper(schedule: KVSchedule, sparse: SparseConfig | None) -> SparseConfig:
  """The sparse attention priced: `sparse`, or by default the paper's (2 dense layers, mean-key
  page scores) at the schedule's page size."""
  return sparse or SparseConfig(page_size=schedule.page_size)


def _check_dense_layers(cfg: Qwen3Config, sparse: SparseConfig):
  if sparse.dense_layers > cfg.num_hidden_layers:
    raise ValueError(
      f"SparseConfig.dense_layers must be in [0, {cfg.num_hidden_layers}], got "
      f"{sparse.dense_layers}"
    )


def attended_tokens(schedule: KVSchedule, s_t, page_size: int):
  """Tokens a sparse layer reads at s_t cached tokens: the schedule's token budget rounded up to
  whole pages of `page_size` (so page sizes compare at equal budget), at most the whole cache."""
  budget_tokens_t = np.asarray(schedule.budget_pages(s_t.astype(np.int32))) * schedule.page_size
  return np.minimum(np.ceil(budget_tokens_t / page_size) * page_size, s_t)


def dense_rollout_cost(
  model, prompt_len: int, gen_len: int, n_samples: int = 8, hardware="h200"
) -> float:
  """eFLOPs of generating `n_samples` x `gen_len` tokens from one prompt with dense attention."""
  cfg, hw = _config(model), get_hardware(hardware)
  s_t, t = _steps(prompt_len, gen_len, n_samples)
  d = 2 * cfg.kv_width * cfg.num_hidden_layers
  compute = n_samples * (2 * param_count(cfg) + 2 * cfg.group_size * d * s_t)
  memory = hw.dtype_bytes * d * (prompt_len + n_samples * t)
  return float(np.sum(compute + hw.intensity * memory))


def sparse_rollout_cost(
  model,
  schedule: KVSchedule,
  prompt_len: int,
  gen_len: int,
  n_samples: int = 8,
  hardware="h200",
  sparse: SparseConfig | None = None,
) -> float:
  """eFLOPs with block-sparse attention under `schedule` in all but the first
  `sparse.dense_layers` layers (default `_sparse_or_paper`).

  `sparse.page_size` is the page size of the sparse attention; the schedule's token budget is kept,
  rounded up to whole pages, so other page sizes compare at equal budget.
  """
  cfg, hw = _config(model), get_hardware(hardware)
  sparse = _sparse_or_paper(schedule, sparse)
  _check_dense_layers(cfg, sparse)
  dense_layers = sparse.dense_layers
  s_t, t = _steps(prompt_len, gen_len, n_samples)
  z = sparse.page_size
  b_t = attended_tokens(schedule, s_t, z)
  pages_t, prompt_pages = np.ceil(s_t / z), prompt_len // z
  d_dense = 2 * cfg.kv_width * dense_layers
  d_sparse = 2 * cfg.kv_width * (cfg.num_hidden_layers - dense_layers)
  attend = 2 * cfg.group_size * (d_dense * s_t + d_sparse * b_t)
  rows = page_score_fns(sparse.page_score).rows  # summaries kept and scored per page
  compute = n_samples * (2 * param_count(cfg) + attend + rows * d_sparse * pages_t)
  kv_elems = d_dense * (prompt_len + n_samples * t) + n_samples * d_sparse * b_t
  centroid_elems = rows * d_sparse / 2 * (prompt_pages + n_samples * (pages_t - prompt_pages))
  memory = hw.dtype_bytes * (kv_elems + centroid_elems)
  return float(np.sum(compute + hw.intensity * memory))


def rollout_speedup(
  model,
  schedule: KVSchedule,
  prompt_len: int,
  gen_len: int,
  n_samples: int = 8,
  hardware="h200",
  sparse: SparseConfig | None = None,
) -> float:
  """Predicted dense / sparse rollout cost ratio (> 1 means sparse is faster)."""
  hw = get_hardware(hardware)  # measure "this_machine" once for both costs
  dense = dense_rollout_cost(model, prompt_len, gen_len, n_samples, hw)
  return dense / sparse_rollout_cost(model, schedule, prompt_len, gen_len, n_samples, hw, sparse)


def page_size_comparison(
  model,
  schedule: KVSchedule,
  prompt_len: int,
  gen_len: int,
  page_sizes=(16, 32, 64, 128),
  n_samples: int = 8,
  hardware="h200",
  sparse: SparseConfig | None = None,
) -> dict:
  """{page_size: predicted speedup} at the schedule's token budget: only the page-scoring term
  (one centroid per page) and the rounding to whole pages differ."""
  hw, sparse = get_hardware(hardware), _sparse_or_paper(schedule, sparse)
  return {
    z: rollout_speedup(
      model, schedule, prompt_len, gen_len, n_samples, hw, dataclasses.replace(sparse, page_size=z)
    )
    for z in page_sizes
  }


def _stop_probability(gen_len: int, mean_len_frac: float) -> float:
  """p such that lengths min(Geometric(p), gen_len) average mean_len_frac * gen_len (bisection: the
  mean falls as p grows)."""

  def mean_frac(p):
    return -np.expm1(gen_len * np.log1p(-p)) / (p * gen_len)  # sum_{k<gen_len} (1-p)^k / gen_len

  lo, hi = 0.0, 1.0
  for _ in range(100):
    mid = (lo + hi) / 2
    lo, hi = (mid, hi) if mean_frac(mid) > mean_len_frac else (lo, mid)
  return (lo + hi) / 2


def running_fraction(gen_len: int, mean_len_frac: float = 1.0):
  """Fraction of rows still generating at decode step t = 1..gen_len -> [gen_len] array.

  Each generated token ends a response with the same probability p (geometric lengths: the
  maximum-entropy law on the token count for a given mean), set so that the mean length is
  `mean_len_frac` x gen_len; rows still running at the cutoff are cut there (a share
  (1-p)^(gen_len-1) of them). 1.0: every row runs to the cutoff, as the eFLOPs model assumes."""
  if not 1 / gen_len <= mean_len_frac <= 1:  # every row generates at least one token
    raise ValueError(f"mean_len_frac must be in [1/gen_len, 1], got {mean_len_frac}")
  if mean_len_frac == 1:
    return np.ones(gen_len)
  p = _stop_probability(gen_len, mean_len_frac)
  return np.exp(np.arange(gen_len) * np.log1p(-p))


def _row_step_work(cfg: Qwen3Config, hw: Hardware, schedule, s_t, sparse, page_selection: bool):
  """(FLOPs, bytes) that one running row adds to decode step t with s_t cached tokens, the weights
  aside. Its whole KV is read, the prompt's part too: paged-attention kernels read each row's pages
  even when a group shares them. schedule None: dense attention in every layer."""
  kv_layer = 2 * cfg.kv_width  # K and V elements per token and layer
  if schedule is None:
    kv_elems_t = kv_layer * cfg.num_hidden_layers * s_t
    return 2 * cfg.group_size * kv_elems_t, hw.dtype_bytes * kv_elems_t
  sparse = _sparse_or_paper(schedule, sparse)
  _check_dense_layers(cfg, sparse)
  dense_layers, z = sparse.dense_layers, sparse.page_size
  sparse_layers = cfg.num_hidden_layers - dense_layers
  kv_elems_t = kv_layer * (dense_layers * s_t + sparse_layers * attended_tokens(schedule, s_t, z))
  flops_t, bytes_t = 2 * cfg.group_size * kv_elems_t, hw.dtype_bytes * kv_elems_t
  if page_selection:
    # Per sparse layer and KV head, every complete page's centroid (head_dim elements; quest: two
    # rows) is read and dotted with the group-mean query, and its fp32 score is written and read
    # back by the top-k.
    rows = page_score_fns(sparse.page_score).rows
    scored_t = cfg.num_key_value_heads * sparse_layers * (s_t // z)
    flops_t = flops_t + 2 * rows * cfg.head_dim * scored_t
    bytes_t = bytes_t + (hw.dtype_bytes * rows * cfg.head_dim + 2 * 4) * scored_t
  return flops_t, bytes_t


def prefill_time(model, prompt_len: int, n_prompts: float, hardware="h200") -> float:
  """Seconds to prefill `n_prompts` prompts in one pass, the same for dense and sparse rollouts.
  A group's samples share their prompt's KV (prefix caching), so each prompt is prefilled once:
  2P FLOPs per token plus causal attention (query i meets i keys), weights read and KV written
  once."""
  cfg, hw = _config(model), get_hardware(hardware)
  n_params, kv_elems = param_count(cfg), 2 * cfg.kv_width * cfg.num_hidden_layers * prompt_len
  attention = 2 * cfg.group_size * kv_elems * (prompt_len + 1) / 2
  flops = n_prompts * (2 * n_params * prompt_len + attention)
  memory = hw.dtype_bytes * (n_params + n_prompts * kv_elems)
  return max(flops / hw.peak_flops, memory / hw.mem_bandwidth)


def roofline_rollout_time(
  model,
  schedule: KVSchedule | None,
  prompt_len: int,
  gen_len: int,
  *,
  batch_per_device: float,
  mean_len_frac: float,
  n_samples: int = 8,
  hardware="h200",
  sparse: SparseConfig | None = None,
  page_selection: bool = True,
) -> float:
  """Seconds one device takes to prefill and decode `batch_per_device` rows (`n_samples` per
  prompt) that start together and stop after lengths drawn as in `running_fraction`; schedule
  None is dense attention. Each decode step reads every weight once for all running rows, then
  each row's KV (and page selection) as in `_row_step_work`; it lasts max(FLOPs / peak FLOP/s,
  bytes / bandwidth) (roofline). The running batch is its expected size at each step. sparse: as
  `sparse_rollout_cost`; page_selection False leaves the selection's work out."""
  cfg, hw = _config(model), get_hardware(hardware)
  s_t, _ = _steps(prompt_len, gen_len, n_samples)
  rows_t = batch_per_device * running_fraction(gen_len, mean_len_frac)
  row_flops_t, row_bytes_t = _row_step_work(cfg, hw, schedule, s_t, sparse, page_selection)
  n_params = param_count(cfg)
  flops_t = rows_t * (2 * n_params + row_flops_t)
  bytes_t = hw.dtype_bytes * n_params + rows_t * row_bytes_t
  decode = np.sum(np.maximum(flops_t / hw.peak_flops, bytes_t / hw.mem_bandwidth))
  return prefill_time(cfg, prompt_len, batch_per_device / n_samples, hw) + float(decode)


def roofline_speedup(
  model,
  schedule: KVSchedule,
  prompt_len: int,
  gen_len: int,
  *,
  batch_per_device: float,
  mean_len_frac: float,
  n_samples: int = 8,
  hardware="h200",
  sparse: SparseConfig | None = None,
  page_selection: bool = True,
) -> float:
  """Dense / sparse `roofline_rollout_time` (> 1 means sparse is faster); the same rows and
  lengths on both sides, so it is also the ratio of generated tokens per second."""
  hw = get_hardware(hardware)
  common = dict(
    batch_per_device=batch_per_device, mean_len_frac=mean_len_frac, n_samples=n_samples, hardware=hw
  )
  dense = roofline_rollout_time(model, None, prompt_len, gen_len, **common)
  return dense / roofline_rollout_time(
    model,
    schedule,
    prompt_len,
    gen_len,
    **common,
    sparse=sparse,
    page_selection=page_selection,
  )


def kv_bytes_per_token(model, hardware="h200") -> float:
  """Bytes of K and V one cached token takes over every layer."""
  cfg, hw = _config(model), get_hardware(hardware)
  return hw.dtype_bytes * 2 * cfg.kv_width * cfg.num_hidden_layers


def roofline_static_rate(
  model,
  schedule: KVSchedule | None,
  prompt_len: int,
  gen_len: int,
  *,
  pool_tokens: float,
  mean_len_frac: float,
  n_samples: int = 8,
  hardware="h200",
  sparse: SparseConfig | None = None,
  page_selection: bool = True,
) -> tuple[float, float]:
  """(generated tokens/s, mean rows in flight) of one device running the static batch in a pool of
  `pool_tokens` cached tokens: every row is allocated at prompt + cutoff, so the batch is
  pool_tokens // (prompt_len + gen_len) rows, started together and decoded until the cutoff
  (`roofline_rollout_time`: finished rows stop costing), one batch after another."""
  batch = float(pool_tokens // (prompt_len + gen_len))
  if batch < 1:
    raise ValueError(
      f"a pool of {pool_tokens:.0f} tokens holds no row of {prompt_len} + {gen_len} tokens"
    )
  alive_t = running_fraction(gen_len, mean_len_frac)
  seconds = roofline_rollout_time(
    model,
    schedule,
    prompt_len,
    gen_len,
    batch_per_device=batch,
    mean_len_frac=mean_len_frac,
    n_samples=n_samples,
    hardware=hardware,
    sparse=sparse,
    page_selection=page_selection,
  )
  return float(batch * alive_t.sum() / seconds), float(batch * alive_t.mean())


def roofline_engine_rate(
  model,
  schedule: KVSchedule | None,
  prompt_len: int,
  gen_len: int,
  *,
  slots: int,
  pool_tokens: float,
  mean_len_frac: float,
  n_samples: int = 8,
  hardware="h200",
  sparse: SparseConfig | None = None,
  page_selection: bool = True,
) -> tuple[float, float]:
  """(generated tokens/s, rows in flight) of one device running the engine in steady state: a
  finished row's slot takes the next row at once, so the rows in flight are min(slots, what the
  pool holds), each at generated position t with probability proportional to the share of rows
  still running at t (the lengths of `running_fraction`), holding t tokens of its own and its
  share of its group's prompt (prompt_len / n_samples). A step reads the weights once and each
  row's KV as `_row_step_work`; each prompt is prefilled once."""
  cfg, hw = _config(model), get_hardware(hardware)
  alive_t = running_fraction(gen_len, mean_len_frac)
  w_t = alive_t / alive_t.sum()
  t = np.arange(1, gen_len + 1)
  held = prompt_len / n_samples + float(np.sum(w_t * t))
  rows = min(float(slots), pool_tokens / held)
  row_flops_t, row_bytes_t = _row_step_work(
    cfg, hw, schedule, prompt_len + t, sparse, page_selection
  )
  n_params = param_count(cfg)
  flops = rows * (2 * n_params + float(np.sum(w_t * row_flops_t)))
  nbytes = hw.dtype_bytes * n_params + rows * float(np.sum(w_t * row_bytes_t))
  step = max(flops / hw.peak_flops, nbytes / hw.mem_bandwidth)
  prefill_per_token = prefill_time(cfg, prompt_len, 1, hw) / (n_samples * alive_t.sum())
  return float(1.0 / (step / rows + prefill_per_token)), float(rows)


# --- lossless (speculative) rollouts -------------------------------------------------------------


def expected_tokens_per_round(alpha, k: int):
  """Tokens a row gains per speculative round of k sparse drafts verified densely, when each draft
  is accepted with probability alpha independently of the others (the i.i.d. approximation): the
  accepted prefix plus the one token sampled after it (from the residual at the first rejection,
  from p when all k pass), sum_{i=0..k} alpha^i = (1 - alpha^(k+1)) / (1 - alpha). k + 1 at
  alpha = 1, 1 at alpha = 0; k = 0 is dense decoding (1 token a step). Elementwise in alpha.

  With a per-token acceptance that varies but independently of the other tokens' (alpha_t =
  sum_x min(p, q), random along the rollout), E[alpha_1 ... alpha_i] = mean^i, so the mean
  acceptance is what sets the expected length, not its tail."""
  if k < 0:
    raise ValueError(f"k (draft tokens per round) must be >= 0, got {k}")
  alpha = np.asarray(alpha, np.float64)
  if not np.all((alpha >= 0) & (alpha <= 1)):
    raise ValueError(f"alpha (acceptance per draft) must be in [0, 1], got {alpha}")
  return np.sum(alpha[..., None] ** np.arange(k + 1), axis=-1)


def _round_passes(cfg: Qwen3Config, hw: Hardware, schedule, s_t, k: int, sparse, page_selection):
  """One running row's speculative round that starts at s_t cached tokens, pass by pass, the
  weights aside -> (queries_i, flops_i..., bytes_i...) over its k + 1 passes i (then s_t's
  shape): draft step i < k decodes one query under `schedule` at s_t + i cached tokens
  (`_row_step_work`); the verification pass runs k + 1 queries densely in every layer (the last
  accepted token, whose sparse layers' KV the drafts computed sparsely, and the k drafts), query j
  attending to s_t + j tokens, and reads the row's KV (s_t + k tokens) once. KV writes are left out,
  as in every step of this module."""
  s_t = np.asarray(s_t, np.float64)
  drafts = [_row_step_work(cfg, hw, schedule, s_t + i, sparse, page_selection) for i in range(k)]
  dense = [_row_step_work(cfg, hw, None, s_t + j, sparse, False) for j in range(k + 1)]
  flops_i = [f for f, _ in drafts] + [sum(f for f, _ in dense)]
  bytes_i = [b for _, b in drafts] + [dense[-1][1]]
  queries_i = np.array([1] * k + [k + 1], np.float64)
  return queries_i, np.stack(flops_i), np.stack(bytes_i)


def _round_time(cfg: Qwen3Config, hw: Hardware, rows: float, queries_i, flops_i, bytes_i) -> float:
  """Seconds of one round of `rows` rows with per-row work flops_i, bytes_i per pass: each pass
  reads every weight once for all rows, computes 2P FLOPs per query, and lasts max(FLOPs / peak,
  bytes / bandwidth) (the engine's decode step, `roofline_engine_rate`, is the round of k = 0)."""
  n_params = param_count(cfg)
  flops_i = rows * (2 * n_params * queries_i + flops_i)
  bytes_i = hw.dtype_bytes * n_params + rows * bytes_i
  roofline = np.sum(np.maximum(flops_i / hw.peak_flops, bytes_i / hw.mem_bandwidth))
  # the overhead comes with every query position (a verification's k + 1 positions each sample,
  # test and write as a decode step's one does)
  return float(roofline + np.sum(queries_i) * hw.pass_overhead_s)


def pass_overhead(model, hardware, rows: float, cached_len, measured_step_s) -> float:
  """A forward pass's seconds beyond the roofline: measured dense decode steps of `rows` rows, step
  i at cached_len[i] cached tokens (a scalar: all at one), less what `hardware`'s roofline prices
  each at its own length, the median over the steps (>= 0)."""
  hw = dataclasses.replace(get_hardware(hardware), pass_overhead_s=0.0)
  measured, cached = np.broadcast_arrays(np.asarray(measured_step_s, np.float64), cached_len)
  predicted = [round_seconds(model, None, n, k=0, rows=rows, hardware=hw) for n in cached.flat]
  return max(float(np.median(measured.ravel() - np.asarray(predicted))), 0.0)


def alpha_by_length(alpha_bin, cached_len, page_size: int, bin_size: int):
  """The acceptance of each cached length from one value per schedule bin (`position_bin`, the
  last bin's value past the end, as a table schedule's last value holds); a scalar is every
  bin's."""
  alpha_bin = np.atleast_1d(np.asarray(alpha_bin, np.float64))
  bins = np.asarray(position_bin(np.asarray(cached_len).astype(np.int32), page_size, bin_size))
  return alpha_bin[np.minimum(bins, len(alpha_bin) - 1)]


class Drafts(NamedTuple):
  """Exact mode's rounds: k sparse drafts per round, accepted at the mean per-token acceptance
  alpha (a scalar, or one value per bin of the schedule's bins: `alpha_by_length`)."""

  k: int
  alpha: Any


def roofline_speculative_rate(
  model,
  schedule: KVSchedule,
  prompt_len: int,
  gen_len: int,
  *,
  drafts: Drafts,
  slots: int,
  pool_tokens: float,
  mean_len_frac: float,
  n_samples: int = 8,
  hardware="h200",
  page_selection: bool = True,
) -> tuple[float, float, float]:
  """(generated tokens/s, rows in flight, mean tokens per row-round) of one device running the
  engine's lossless speculative rounds in steady state: k sparse draft steps under `schedule`,
  then one dense verification pass (`_round_passes`), every pass priced as the engine's decode
  step (the schedule's pages under the paper's SparseConfig). A round is binned by its first
  draft's cached length; a row at generated position t gains
  E_t = `expected_tokens_per_round`(alpha_t, k) tokens a round.

  As in `roofline_engine_rate`, finished rows' slots refill at once and lengths follow
  `running_fraction`; a row spends 1 / E_t rounds per token at position t, so its rounds, and the
  rows in flight, are at t with weight alive_t / E_t, and each holds its k drafts' tokens on top.
  Rounds near the cutoff are not cut short. k = 0 is dense decoding, `roofline_engine_rate` with
  schedule None."""
  k, alpha = drafts
  cfg, hw = _config(model), get_hardware(hardware)
  sparse = _sparse_or_paper(schedule, None)
  alive_t = running_fraction(gen_len, mean_len_frac)
  t = np.arange(1, gen_len + 1)
  s_t = prompt_len + t
  e_t = expected_tokens_per_round(
    alpha_by_length(alpha, s_t, schedule.page_size, schedule.bin_size), k
  )
  w_t = alive_t / e_t
  w_t = w_t / w_t.sum()
  held = prompt_len / n_samples + float(np.sum(w_t * t)) + k
  rows = min(float(slots), pool_tokens / held)
  queries_i, flops_it, bytes_it = _round_passes(cfg, hw, schedule, s_t, k, sparse, page_selection)
  round_s = _round_time(cfg, hw, rows, queries_i, flops_it @ w_t, bytes_it @ w_t)
  per_round = float(np.sum(w_t * e_t))
  prefill_per_token = prefill_time(cfg, prompt_len, 1, hw) / (n_samples * alive_t.sum())
  return float(1.0 / (round_s / (rows * per_round) + prefill_per_token)), float(rows), per_round


def roofline_round_rate(
  model,
  schedule: KVSchedule | None,
  cached_len: float,
  *,
  k: int,
  alpha: float,
  rows: float,
  hardware="h200",
  sparse: SparseConfig | None = None,
  page_selection: bool = True,
) -> float:
  """Generated tokens/s of `rows` rows all at `cached_len` cached tokens running speculative rounds
  of k drafts under `schedule` at mean acceptance alpha (`_round_passes`, `_round_time`), prefill
  aside; k = 0 is dense decoding (schedule unused). The rate one bin of a calibration prices its
  budgets and k by (`calibrate.speculative_plan`)."""
  round_s = round_seconds(
    model,
    schedule,
    cached_len,
    k=k,
    rows=rows,
    hardware=hardware,
    sparse=sparse,
    page_selection=page_selection,
  )
  return float(rows * expected_tokens_per_round(alpha, k) / round_s)


def round_seconds(
  model,
  schedule: KVSchedule | None,
  cached_len: float,
  *,
  k: int,
  rows: float,
  hardware="h200",
  sparse: SparseConfig | None = None,
  page_selection: bool = True,
) -> float:
  """Seconds the roofline prices one round of `rows` rows at `cached_len` cached tokens at: k
  sparse drafts under `schedule` and the dense verification pass (`_round_passes`, `_round_time`);
  k = 0 is a dense decode step."""
  cfg, hw = _config(model), get_hardware(hardware)
  passes = _round_passes(cfg, hw, schedule, cached_len, k, sparse, page_selection)
  return _round_time(cfg, hw, rows, *passes)


def round_scale(
  model,
  schedule: KVSchedule,
  sparse: SparseConfig,
  measured: dict,
  *,
  rows,
  hardware,
) -> dict:
  """Each draft count's measured seconds per round over what `round_seconds` prices a round at the
  cached length it ran at, on `hardware`: measured = {k: [(seconds per round, cached length),
  ...]} (k = 0: dense decode steps) -> {k: the median of those ratios}. The roofline prices a
  round's passes as independent decode steps at the hardware's peak rates; what a round really
  costs beyond that (the verification's k + 1 sampled positions, the accept test, the cache's
  rollback, a program's fixed cost, a machine slower or busier than its roofline) shows up as the
  factor, which `best_draft` then charges that k's rounds (or dense steps) at every length: so
  draft counts that have run are compared on the measured clock, the roofline giving only how
  their prices change with length. Each round is priced at its own length, not at one shared by
  every k: the roofline's price moves with length, and a k run only at long lengths measured
  against a short length's price would read as slower than it is."""
  common = dict(rows=rows, hardware=hardware, sparse=sparse)
  price = lambda k, n: round_seconds(model, schedule if k else None, n, k=k, **common)
  return {
    k: float(np.median([s / price(k, n) for s, n in timings]))
    for k, timings in measured.items()
    if len(timings)
  }


def best_draft(
  model,
  schedule: KVSchedule,
  cached_len: float,
  alpha: float,
  *,
  ks,
  rows: float,
  hardware="h200",
  sparse: SparseConfig | None = None,
  scale=None,
  margin: float = 0.0,
) -> tuple:
  """The draft count whose rounds `roofline_round_rate` prices fastest at cached_len, the drafts
  under `schedule` at mean acceptance alpha, against dense decoding -> (k, its rate, the dense
  rate); k = 0 (dense) unless a k of `ks` beats it by more than `margin` (a share of the dense
  rate), ties to the smaller k. scale: {k: factor} on k's round seconds (k = 0: a dense step's),
  measured (`round_scale`); a k without one gets the dense step's (the machine's measured clock
  against its roofline), or none."""
  scale = scale or {}
  clock = scale.get(0, 1.0)
  common = dict(rows=rows, hardware=hardware)
  dense = roofline_round_rate(model, None, cached_len, k=0, alpha=1.0, **common) / clock
  best = (0, dense)
  for k in ks:
    rate = roofline_round_rate(
      model, schedule, cached_len, k=k, alpha=alpha, sparse=sparse, **common
    ) / scale.get(k, clock)
    if rate > max(best[1], dense * (1 + margin)):
      best = (k, rate)
  return (*best, dense)


def draft_plan(
  model,
  schedule: KVSchedule,
  sparse: SparseConfig,
  alpha_bin,
  *,
  bin_size: int,
  ks,
  rows: float,
  hardware,
  scale=None,
  margin: float = 0.0,
) -> DraftPlan:
  """Exact mode's regime switch: per position bin of bin_size tokens, the draft count (0: dense
  decoding) `best_draft` picks at the bin's middle cached length for the drafts' mean acceptance
  there, alpha_bin[b] (NaN: not measured, dense), each k's rounds charged its measured `scale`,
  a k taken only where it beats dense by more than `margin`."""
  k_bin = []
  for b, alpha in enumerate(np.asarray(alpha_bin, np.float64)):
    if np.isnan(alpha):
      k_bin.append(0)
      continue
    cached_len = (b + 0.5) * bin_size
    k_bin.append(
      best_draft(
        model,
        schedule,
        cached_len,
        alpha,
        ks=ks,
        rows=rows,
        hardware=hardware,
        sparse=sparse,
        scale=scale,
        margin=margin,
      )[0]
    )
  return DraftPlan(tuple(k_bin), sparse.page_size, bin_size)


def peak_memory_bytes(
  model,
  prompt_len: int,
  gen_len: int,
  *,
  batch_per_device: float,
  mean_len_frac: float,
  hardware="h200",
) -> float:
  """Weights plus the largest KV cache the running rows hold at once (each row's prompt counted,
  an upper bound where prefix caching shares it): whether `batch_per_device` fits the device.
  Sparse rollout keeps the whole cache too (it reads fewer pages, stores all of them)."""
  cfg, hw = _config(model), get_hardware(hardware)
  s_t, _ = _steps(prompt_len, gen_len, 1)
  rows_t = batch_per_device * running_fraction(gen_len, mean_len_frac)
  kv_elems = 2 * cfg.kv_width * cfg.num_hidden_layers * np.max(rows_t * s_t)
  return hw.dtype_bytes * (param_count(cfg) + kv_elems)


def kv_read_fraction(budget_by_len, prompt_len_B, lengths_B, cfg: Qwen3Config, sparse) -> float:
  """KV pages read by a measured rollout relative to dense, over all its generated tokens and
  layers: budget_by_len is the rollout's budget table (pages kept at each cached length), sparse
  its SparseConfig (None: dense, 1.0)."""
  if sparse is None:
    return 1.0
  page_size = sparse.page_size
  read = dense = 0.0
  sparse_layers = cfg.num_hidden_layers - min(sparse.dense_layers, cfg.num_hidden_layers)
  for p, n in zip(np.asarray(prompt_len_B), np.asarray(lengths_B)):
    cached = np.arange(p + 1, p + n + 1)  # cache length when decoding each generated token
    pages = -(-cached // page_size)
    read += np.sum(
      sparse.dense_layers * pages + sparse_layers * np.minimum(budget_by_len[cached], pages)
    )
    dense += np.sum(cfg.num_hidden_layers * pages)
  return float(read / max(dense, 1.0))
