"""KV-budget schedules: how many KV pages a sparse decode step keeps, as a pure function of the
cached length.

Mismatch between sparse and dense attention grows with position under a fixed budget, so Sparrow
grows the budget with the cached length. A `KVSchedule` is frozen and hashable (a valid static
argument of `jax.jit`), and `budget_pages` is vectorized jnp, so one compiled decode loop serves any
length: the kernel sizes its buffers with the static `max_pages` and masks down to the budget.

Budgets count *all* kept pages, the always-kept ones (1 sink + 2 local by default) included, and are
never more than the cached pages, ceil(cached_len / page_size). `cached_len` is the number of tokens
in the KV cache that the decode step attends to (prompt + generated so far, the current token
included).

Kinds (`values` depends on the kind):
  fixed:  values = (pages,)       budget = min(pages, cached_pages); pages counts always-kept pages.
  table:  values = top-k per bin  budget = min(values[bin] + always_kept, cached_pages), the paper's
          form; bin = cached_pages // (bin_size // page_size), and past the last bin the last value
          holds.
  linear: values = (ratio, max_topk)
          budget = min(min(floor(ratio * cached_pages), max_topk) + always_kept, cached_pages).

Closed loop, beyond the paper ('adaptive:TAU:BASE', `parse_adaptive`, `adapt_topk`): the trainer
starts from BASE's table (top-k pages per bin) and after every step moves each bin by the tokens
decoded under that bin's budget (the train step's exact-alpha `acceptance/*_bin`, binned by
`position_bin` like the table). The loop holds the q-th percentile at tau (q = `quantile`, the
trainer's stats.quantile; 5, the paper's p5, by default). The test is pooled, not per step: the
q-th percentile is >= tau exactly when at most q% of the tokens have alpha < tau, and that share
adds up over steps, so each bin keeps a pool of the tokens it decoded since its top-k last changed
and judges the budget on all of them:
  cliff: the step's p10 < tau          -> fails at once (a tenth of a step under tau is a fall off
                                          a cliff, not noise at its edge: raise fast)
  after `window` steps in the pool:
    share under tau > q% (pool pq < tau)  -> fails
    share under tau <= lower_share        -> passes: top-k * lower_factor, at least -1 page, not
                                          below the floor (slow: a probe is judged on `window`
                                          steps of tokens, not on one lucky batch)
  otherwise, or fewer than min_tokens tokens in the bin that step -> holds, and the pool grows
A failed bin that came down to its budget goes back to the budget before (it passed: the probe is
undone); any other is raised x raise_factor (at least +1 page) off a cliff, and by one page when
its pool is just over the edge (a pooled share of q-2q%: the bin is at its edge, and x1.5 from
there overshoots; on the shipped model one such raise, 15 -> 23 pages, cost a run its saving).
Either way its floor becomes top-k + 1: it never returns to a budget that failed. A bin whose
top-k changes starts a new pool.
Why pooled: the per-step p5 of one bin rests on a few prompts, and at the calibrated budget of the
tiny model it falls under tau in 1-6% of steps while the budget holds; the per-step rule (undo and
floor as here, judged on each step's p5) read the offline table's KV or more (quest: 0.764 vs
0.755), its probes failing on one batch and its floors then locking them out
(docs/threshold_sweep.md, "Threshold sweep").
Then top-k is clipped to [0, max_topk] (always-kept pages come on top; max_topk is fixed at the
start because it sizes the static page-selection buffers) and made non-decreasing over bins (a
table's invariant: mismatch grows with position, so a bin is lifted to its predecessor's value).
"""

import dataclasses
import json
import math
import os
import re
from typing import NamedTuple, Optional

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

_KINDS = ("fixed", "table", "linear")
_FIELDS = ("kind", "page_size", "always_kept", "bin_size", "values", "quantile")
_ADAPTIVE = "adaptive:"

# Published tables, top-k pages per 2000-token bin at page size 16 (20 bins; 3 always-kept pages
# are added on top). Source: github.com/Infini-AI-Lab/Sparrow, file
# vortex_torch/vortex_torch/indexer/utils_sglang.py (`_SCHEDULE_POLICY_VALUES`, commit b866e15).
# That file compares `cached_block_len = ceil(cached_seq_len / 16)` against multiples of 125 pages,
# i.e. bins of 2000 tokens measured in whole pages, which `paper()` reproduces with bin_size=2000.
# These are all the (model, tau) pairs the repo publishes: 8B has no 0.88/0.90 table (it has 0.87),
# and 14B only 0.86. Their tau thresholds the p5 of the top-20 lower bound on alpha (the reference's
# `sum_min_from_topk`, the paper's footnote), not of exact alpha, which is >= the bound: compare
# them with `calibrate(alpha="topk20")` schedules and `acceptance_topk20/*` tail stats.
_PAPER_TABLES = {
  ("qwen3-1.7b", 0.75): (29, 29, 45, 45, 61, 61, 77, 77) + (93,) * 12,
  ("qwen3-1.7b", 0.80): (29, 45, 61, 77, 93, 93, 125, 125, 125) + (157,) * 11,
  ("qwen3-1.7b", 0.83): (29, 61, 77, 93, 125, 125, 157, 157) + (189,) * 12,
  ("qwen3-1.7b", 0.86): (29, 61, 93, 93, 125, 157, 189, 221, 221) + (253,) * 11,
  ("qwen3-1.7b", 0.88): (45, 77, 125, 157, 157, 189, 221, 253, 253) + (317,) * 11,
  ("qwen3-1.7b", 0.90): (45, 93, 157, 189, 221, 253, 317, 317) + (381,) * 12,
  ("qwen3-1.7b", 0.92): (61, 125, 189, 221, 253, 317, 381, 381, 445) + (509,) * 11,
  ("qwen3-1.7b", 0.94): (77, 157, 221, 317, 381, 445, 509, 509, 637) + (765,) * 11,
  ("qwen3-4b", 0.75): (29, 29, 29, 29, 45, 61, 77, 93, 125, 125, 125, 125)
  + (157,) * 6
  + (189,) * 2,
  ("qwen3-4b", 0.80): (29, 29, 45, 61, 77, 93, 125, 157, 157, 157, 189) + (221,) * 9,
  ("qwen3-4b", 0.86): (
    29,
    45,
    61,
    77,
    93,
    125,
    157,
    221,
    253,
    253,
    317,
    317,
    317,
    317,
    381,
    381,
    381,
    381,
    509,
    509,
  ),
  ("qwen3-4b", 0.88): (29, 61, 93, 125, 157, 189, 253, 317, 381, 445, 445, 509, 509, 509)
  + (637,) * 6,
  ("qwen3-4b", 0.90): (45, 77, 125, 157, 189, 253, 317, 445, 637) + (765,) * 6 + (893,) * 5,
  ("qwen3-4b", 0.92): (45, 93, 157, 189, 253, 381, 445, 765, 893, 1021, 1021) + (1149,) * 9,
  ("qwen3-8b", 0.75): (29, 29, 29, 45, 45, 77, 77, 77, 93, 93, 93, 93) + (125,) * 6 + (157,) * 2,
  ("qwen3-8b", 0.80): (
    29,
    29,
    45,
    61,
    77,
    93,
    125,
    125,
    157,
    157,
    189,
    189,
    189,
    221,
    221,
    221,
    221,
    253,
    253,
    253,
  ),
  ("qwen3-8b", 0.86): (
    29,
    45,
    61,
    77,
    125,
    157,
    189,
    253,
    253,
    253,
    253,
    317,
    317,
    317,
    317,
    317,
    317,
    385,
    445,
    445,
  ),
  ("qwen3-8b", 0.87): (29, 61, 77, 93, 157, 189, 221)
  + (317,) * 4
  + (381,) * 5
  + (445, 445, 509, 509),
  ("qwen3-8b", 0.92): (45, 93, 125, 189, 253, 445, 509, 637, 765, 765, 765)
  + (893,) * 5
  + (1021,) * 4,
  ("qwen3-14b", 0.86): (29, 45, 77, 125, 253) + (381,) * 10 + (509, 637, 637, 893, 893),
}
_PAPER_BIN_SIZE = 2000
_PAPER_PAGE_SIZE = 16


@dataclasses.dataclass(frozen=True)
class KVSchedule:
  """KV-page budget as a function of cached length (see the module docstring for the kinds)."""

  kind: str
  values: tuple
  page_size: int = 16
  always_kept: int = 3  # 1 sink (BOS) page + 2 local pages
  bin_size: int = 2048  # tokens per table bin (a multiple of page_size); unused otherwise
  quantile: Optional[float] = None  # the tail percentile the table was calibrated to hold at tau
  #                                   (5: p5, the paper's); None: not calibrated (fixed, hand-made)

  def __post_init__(self):
    object.__setattr__(self, "values", tuple(self.values))
    if self.kind not in _KINDS:
      raise ValueError(f"KVSchedule.kind must be one of {_KINDS}, got {self.kind!r}")
    for name in ("page_size", "always_kept", "bin_size"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"KVSchedule.{name} must be a non-negative int, got {value!r}")
    if self.page_size < 1 or self.page_size & (self.page_size - 1):
      raise ValueError(f"KVSchedule.page_size must be a power of two, got {self.page_size}")
    if self.quantile is not None and not is_quantile(self.quantile):
      raise ValueError(
        f"KVSchedule.quantile must be a percentile in (0, 50) or None, got {self.quantile!r}"
      )
    getattr(self, f"_check_{self.kind}")()
    self._check_int32()

  def _check_int32(self):
    """Budgets are int32 on device: a page count past it (10**10 in a JSON) would wrap negative."""
    top = self.values[1] if self.kind == "linear" else max(self.values)  # linear: (ratio, max)
    for name, value in (
      ("page_size", self.page_size),
      ("always_kept", self.always_kept),
      ("bin_size", self.bin_size),
      ("values", top + self.always_kept),
    ):
      if value > INT32_MAX:
        raise ValueError(
          f"KVSchedule.{name} must fit int32 (at most {INT32_MAX} pages, the always-kept "
          f"{self.always_kept} included), got {top if name == 'values' else value}"
        )

  def _check_fixed(self):
    if len(self.values) != 1 or not _is_int(self.values[0]):
      raise ValueError(f"KVSchedule.values for kind 'fixed' must be (pages,), got {self.values!r}")
    if self.values[0] < self.always_kept:
      raise ValueError(
        f"KVSchedule.values: fixed budget {self.values[0]} pages is below the "
        f"always_kept={self.always_kept} pages"
      )

  def _check_table(self):
    if not self.values or not all(_is_int(v) and v >= 0 for v in self.values):
      raise ValueError(
        f"KVSchedule.values for kind 'table' must be non-negative ints (top-k "
        f"pages per bin), got {self.values!r}"
      )
    drops = [i for i in range(1, len(self.values)) if self.values[i] < self.values[i - 1]]
    if drops:
      raise ValueError(
        f"KVSchedule.values must be non-decreasing; bin {drops[0]} drops from "
        f"{self.values[drops[0] - 1]} to {self.values[drops[0]]}"
      )
    if self.bin_size < self.page_size or self.bin_size % self.page_size:
      raise ValueError(
        f"KVSchedule.bin_size ({self.bin_size}) must be a positive multiple of "
        f"page_size ({self.page_size})"
      )

  def _check_linear(self):
    ok = (
      len(self.values) == 2 and isinstance(self.values[0], (int, float)) and _is_int(self.values[1])
    )
    if not ok or not 0 <= self.values[0] <= 1 or self.values[1] < 0:
      raise ValueError(
        f"KVSchedule.values for kind 'linear' must be (0 <= ratio <= 1 of the cached pages, "
        f"max_topk >= 0), got {self.values!r}"
      )

  @classmethod
  def fixed(cls, pages: int, page_size: int = 16, always_kept: int = 3) -> "KVSchedule":
    """Constant budget of `pages` pages, always-kept pages included."""
    return cls("fixed", (pages,), page_size, always_kept)

  @classmethod
  def table(
    cls,
    topk_per_bin,
    page_size: int = 16,
    always_kept: int = 3,
    bin_size: int = 2048,
    quantile: Optional[float] = None,
  ) -> "KVSchedule":
    """Paper form: per bin of `bin_size` cached tokens, top-k pages on top of the always-kept;
    `quantile`: the tail percentile it was calibrated for."""
    return cls("table", tuple(topk_per_bin), page_size, always_kept, bin_size, quantile)

  @classmethod
  def linear(
    cls, ratio: float, max_topk: int, page_size: int = 16, always_kept: int = 3
  ) -> "KVSchedule":
    """Top-k grows as `ratio` of the cached pages, capped at `max_topk` (so buffers stay static)."""
    return cls("linear", (ratio, max_topk), page_size, always_kept)

  @classmethod
  def paper(cls, model: str, tau: float) -> "KVSchedule":
    """The published table for `model` ("qwen3-1.7b", ...) calibrated at threshold `tau` on the
    p5 of the top-20 lower bound of alpha (see `_PAPER_TABLES`)."""
    key = (model.lower(), round(float(tau), 2))
    if key not in _PAPER_TABLES:
      known = ", ".join(f"{m}@{t:.2f}" for m, t in sorted(_PAPER_TABLES))
      raise ValueError(f"no published schedule for model={model!r}, tau={tau}; known: {known}")
    return cls.table(_PAPER_TABLES[key], _PAPER_PAGE_SIZE, 3, _PAPER_BIN_SIZE, quantile=5)

  @property
  def max_pages(self) -> int:
    """Largest budget this schedule can return (static; sizes the decode buffers)."""
    if self.kind == "fixed":
      return self.values[0]
    return (self.values[-1] if self.kind == "table" else self.values[1]) + self.always_kept

  def budget_pages(self, cached_len):
    """Pages kept at `cached_len` cached tokens (int or int array, any shape) -> int32 array."""
    cached_pages = (jnp.asarray(cached_len, jnp.int32) + self.page_size - 1) // self.page_size
    if self.kind == "fixed":
      want = jnp.full_like(cached_pages, self.values[0])
    elif self.kind == "table":
      bins = jnp.minimum(
        position_bin(cached_len, self.page_size, self.bin_size), len(self.values) - 1
      )
      want = jnp.asarray(self.values, jnp.int32)[bins] + self.always_kept
    else:
      ratio, max_topk = self.values
      topk = jnp.floor(ratio * cached_pages.astype(jnp.float32)).astype(jnp.int32)
      want = jnp.minimum(topk, max_topk) + self.always_kept
    return jnp.minimum(want, cached_pages)

  @classmethod
  def parse(cls, spec: str, page_size: int, field: str = "config.rollout.schedule") -> "KVSchedule":
    """'fixed:PAGES' | 'paper:MODEL:TAU' | path to a KVSchedule JSON; errors name `field`."""
    try:
      if spec.startswith("fixed:"):
        schedule = cls.fixed(int(spec[len("fixed:") :]), page_size=page_size)
      elif spec.startswith("paper:"):
        if spec.count(":") != 2:
          raise ValueError("expected 'paper:MODEL:TAU', e.g. 'paper:qwen3-1.7b:0.86'")
        model, tau = spec[len("paper:") :].split(":")
        schedule = cls.paper(model, float(tau))
      elif os.path.isfile(spec):
        schedule = cls.from_json(_read_schedule_file(spec))
      else:
        raise ValueError(f"not {SPEC_FORMS}")
    except ValueError as e:
      raise ValueError(f"{field} = {spec!r}: {e}") from None
    if schedule.page_size != page_size:
      raise ValueError(
        f"{field} = {spec!r} has page_size {schedule.page_size} but "
        f"config.rollout.page_size is {page_size}"
      )
    return schedule

  def check_quantile(self, quantile: float, field: str, quantile_field: str = "stats.quantile"):
    """Refuses a table calibrated for another tail percentile than the run holds."""
    if self.quantile is not None and self.quantile != quantile:
      raise ValueError(
        f"{field} was calibrated to hold p{self.quantile:g} >= tau, but "
        f"{quantile_field} is {quantile:g} (p{quantile:g}): calibrate a table for "
        f"p{quantile:g}, or set {quantile_field} = {self.quantile:g}"
      )

  def to_json(self) -> str:
    return json.dumps({name: getattr(self, name) for name in _FIELDS})

  @classmethod
  def from_json(cls, text: str) -> "KVSchedule":
    try:
      d = json.loads(text)
    except ValueError as e:
      raise ValueError(f"not JSON ({e}): a KVSchedule JSON holds {list(_FIELDS)}") from None
    if not isinstance(d, dict) or set(d) != set(_FIELDS):
      got = sorted(d) if isinstance(d, dict) else type(d).__name__
      raise ValueError(f"KVSchedule JSON must have exactly the fields {list(_FIELDS)}, got {got}")
    if not isinstance(d["values"], list):
      raise ValueError(f"KVSchedule JSON 'values' must be a list of ints, got {d['values']!r}")
    return cls(**d)


SPEC_FORMS = "'fixed:PAGES', 'paper:MODEL:TAU' or the path of a readable KVSchedule JSON file"


def _read_schedule_file(path: str) -> str:
  """The text of a schedule file; one that exists but does not read as text (permissions, I/O, not
  UTF-8) is a ValueError naming what is allowed."""
  try:
    with open(path) as f:
      return f.read()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"cannot read the file ({e}); must be {SPEC_FORMS}") from None


def parse_stages(spec: str, page_size: int, field: str = "config.rollout.schedule") -> tuple:
  """A schedule that changes during training: 'STEP:SCHEDULE,STEP:SCHEDULE,...' (steps increasing,
  the first 0), e.g. '0:paper:qwen3-1.7b:0.86,200:paper:qwen3-1.7b:0.80' as the paper switches
  tau with DistillSparse; a plain schedule spec is one stage from step 0.
  -> ((start_step, KVSchedule), ...)."""
  if _ADAPTIVE in spec:  # it moves its own budgets every step: no stage would say which applies
    raise ValueError(
      f"{field} = {spec!r}: an 'adaptive:TAU:BASE' schedule is the whole run's "
      "schedule; it cannot be combined with stages (parse it with parse_adaptive)"
    )
  parts = spec.split(",") if re.match(r"^\d+:", spec) else [f"0:{spec}"]
  stages = []
  for part in parts:
    match = re.match(r"^(\d+):(.+)$", part.strip())
    if not match:
      raise ValueError(f"{field} = {spec!r}: stage {part!r} is not 'STEP:SCHEDULE'")
    stages.append((int(match.group(1)), KVSchedule.parse(match.group(2), page_size, field)))
  starts = [start for start, _ in stages]
  if starts[0] != 0 or any(b <= a for a, b in zip(starts, starts[1:])):
    raise ValueError(f"{field} = {spec!r}: stage steps must start at 0 and increase, got {starts}")
  return tuple(stages)


def parse_adaptive(spec: str, page_size: int, field: str = "config.rollout.schedule"):
  """'adaptive:TAU:BASE' -> (tau, BASE as a KVSchedule of kind 'table'), BASE being any spec
  `KVSchedule.parse` reads, e.g. 'adaptive:0.86:paper:qwen3-1.7b:0.86'; None for other specs."""
  if not spec.startswith(_ADAPTIVE):
    return None
  tau_text, _, base_spec = spec[len(_ADAPTIVE) :].partition(":")
  try:
    tau = float(tau_text)
  except ValueError:
    tau = float("nan")
  if not 0 < tau < 1:
    raise ValueError(
      f"{field} = {spec!r}: TAU {tau_text!r} must be a number in (0, 1); expected "
      "'adaptive:TAU:BASE', e.g. 'adaptive:0.86:paper:qwen3-1.7b:0.86'"
    )
  base = KVSchedule.parse(base_spec, page_size, field)
  if base.kind != "table":
    raise ValueError(
      f"{field} = {spec!r}: BASE {base_spec!r} is a {base.kind!r} schedule; "
      "adaptive needs a 'table' one (top-k per bin: 'paper:MODEL:TAU' or a JSON)"
    )
  return tau, base


class LoopState(NamedTuple):
  """The closed loop's per-bin state (`adapt_topk`): tuples of ints, one per table bin. Host-side
  and small: the trainer logs it and keeps it in the checkpoint meta, so a resume replays it."""

  topk: tuple  # the table in force (top-k pages per bin, always-kept pages on top)
  floor: tuple  # the lowest top-k the bin may take: one above the highest that failed
  before: tuple  # the top-k the bin had before its current one (a failed probe returns to it)
  tokens: tuple  # the pool: tokens decoded under the current top-k since it was set ...
  below: tuple  # ... of them with alpha < tau ...
  steps: tuple  # ... over this many steps

  @classmethod
  def start(cls, topk) -> "LoopState":
    zeros = (0,) * len(topk)
    return cls(tuple(topk), zeros, tuple(topk), zeros, zeros, zeros)


class LoopRule(NamedTuple):
  """How the closed loop moves each bin's top-k (`adapt_topk`; the module docstring)."""

  tau: float  # the acceptance held ...
  max_topk: int  # the ceiling of every bin
  raise_factor: float  # a cliff multiplies the top-k by this (at least +1)
  lower_factor: float  # a passed pool multiplies it by this (at least -1, never below the floor)
  window: int  # steps a pool holds before it is judged
  lower_share: float  # a pool passes with at most this share of its tokens under tau
  min_tokens: int  # a step measures a bin only with this many tokens in it
  quantile: float = 5  # ... at this percentile: a pool fails with more than quantile % under tau


def adapt_topk(state: LoopState, count_b, below_b, p10_b, rule: LoopRule) -> LoopState:
  """One step of the closed loop (module docstring): the state after the step whose exact alpha
  had, per bin, `count_b` tokens, `below_b` of them under tau and p10 `p10_b` (a NaN p10 compares
  false) -> the state for the next step."""
  tau, max_topk, raise_factor, lower_factor, window, lower_share, min_tokens, quantile = rule
  topk_b, floor_b, before_b, tokens_b, pool_below_b, steps_b = (
    np.asarray(x, np.int64) for x in state
  )
  measured_b = np.asarray(count_b) >= min_tokens
  tokens_b = tokens_b + np.where(measured_b, count_b, 0)
  pool_below_b = pool_below_b + np.where(measured_b, below_b, 0)
  steps_b = steps_b + measured_b
  share_b = pool_below_b / np.maximum(tokens_b, 1)
  judged_b = steps_b >= window
  cliff_b = measured_b & (np.asarray(p10_b, np.float64) < tau)
  failed_b = cliff_b | (judged_b & (share_b > quantile / 100))
  passed_b = ~failed_b & judged_b & (share_b <= lower_share)
  floor_b = np.minimum(np.where(failed_b, np.maximum(floor_b, topk_b + 1), floor_b), max_topk)
  raised_b = np.where(cliff_b, np.maximum(np.ceil(topk_b * raise_factor), topk_b + 1), topk_b + 1)
  up_b = np.where(before_b > topk_b, before_b, raised_b)
  down_b = np.maximum(np.minimum(np.floor(topk_b * lower_factor), topk_b - 1), floor_b)
  next_b = np.where(failed_b, up_b, np.where(passed_b, down_b, topk_b))
  next_b = np.maximum.accumulate(np.clip(next_b, 0, max_topk))
  moved_b = next_b != topk_b
  new = (
    next_b,
    floor_b,
    np.where(moved_b, topk_b, before_b),
    *(np.where(moved_b, 0, x_b) for x_b in (tokens_b, pool_below_b, steps_b)),
  )
  return LoopState(*(tuple(int(v) for v in x_b) for x_b in new))


def stage_index(stages, step: int) -> int:
  """Which of `parse_stages`' stages is in force at training step `step` (0-based)."""
  return max(i for i, (start, _) in enumerate(stages) if start <= step)


@flax.struct.dataclass
class BudgetTable:
  """A schedule evaluated at every cached length 0..max_len: the budget representation that
  crosses jit (train step, sparse teacher forcing, calibration). It is a traced int32 array, so a
  new schedule (a training stage, a calibration candidate) never recompiles; a `KVSchedule` is a
  static argument and would. Decoding also needs a static cap on the pages it selects: tables that
  share one cap share one compiled decode."""

  pages_by_len: jax.Array  # [max_len + 1] pages kept at each cached length
  # the decode's static cap on selected pages (sampler.max_selected_pages); 0: from the table
  max_selected: int = flax.struct.field(pytree_node=False, default=0)
  # exact mode's regime switch: drafts a round starting at each cached length runs (a DraftPlan's
  # k_by_len; 0: the round decodes densely); None: every round drafts the engine's speculate
  draft_by_len: Optional[jax.Array] = None

  def budget_pages(self, cached_len):
    return self.pages_by_len[cached_len]


@dataclasses.dataclass(frozen=True)
class DraftPlan:
  """Exact mode's regime per position bin (`rollout.speculate = "auto"`): k_bin[b] sparse drafts a
  round for a round that starts with its cached length in bin b (position_bin), 0 for plain dense
  decoding there; past the last bin the last value holds. Any k keeps rows exact (every token is
  the dense policy's), so the plan decides speed only (`cost_model.draft_plan` prices it)."""

  k_bin: tuple
  page_size: int
  bin_size: int

  def __post_init__(self):
    position_bin(0, self.page_size, self.bin_size)  # whole pages a bin
    if not self.k_bin or not all(_is_int(k) and k >= 0 for k in self.k_bin):
      raise ValueError(f"DraftPlan.k_bin must be ints >= 0, one a bin, got {self.k_bin!r}")

  def k_by_len(self, max_len: int) -> np.ndarray:
    """[max_len + 1] int32: the drafts of a round starting at each cached length."""
    bins = np.asarray(position_bin(np.arange(max_len + 1), self.page_size, self.bin_size))
    return np.asarray(self.k_bin, np.int32)[np.minimum(bins, len(self.k_bin) - 1)]


def position_bin(cached_len, page_size: int, bin_size: int):
  """Bin of a decode step that attends to `cached_len` tokens: whole pages cached // pages per bin.

  The one position binning of the project: a table schedule's budget, calibration's p5 surface and
  the trainer's tail statistics all bin by it, so "bin k" covers the same tokens everywhere. In the
  token alignment of the trainer and calibration (value[s] concerns token s), the step that
  produced token s attended to s cached tokens, so cached_len is the token's index s. With
  page_size 1 it is plain `cached_len // bin_size`.
  """
  if page_size < 1 or bin_size < page_size or bin_size % page_size:
    raise ValueError(
      f"bin_size ({bin_size}) must be a positive multiple of page_size ({page_size})"
    )
  cached_pages = (jnp.asarray(cached_len, jnp.int32) + page_size - 1) // page_size
  return cached_pages // (bin_size // page_size)


def is_quantile(quantile) -> bool:
  """Whether `quantile` can be the tail percentile a schedule holds at tau: a number in (0, 50)
  (5 is the paper's p5)."""
  return isinstance(quantile, (int, float)) and not isinstance(quantile, bool) and 0 < quantile < 50


INT32_MAX = 2**31 - 1


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """The closed loop's settings, a config component (`schema.from_group(LoopConfig, c, "rollout",
  "stats")`: the rollout group's adaptive_* fields, stats.quantile), checked here; `rule` is the
  LoopRule they make with the spec's tau and the ceiling."""

  adaptive_headroom: float = 2.0  # the ceiling of every bin: this x BASE's largest top-k
  adaptive_raise: float = 1.5  # LoopRule.raise_factor
  adaptive_lower: float = 0.95  # LoopRule.lower_factor
  adaptive_window: int = 4  # LoopRule.window
  adaptive_lower_share: float = 0.04  # LoopRule.lower_share
  adaptive_min_tokens: int = 200  # LoopRule.min_tokens
  quantile: float = 5  # LoopRule.quantile (stats.quantile, which StatsConfig checks)

  def __post_init__(self):
    q = self.quantile / 100
    for name, ok, allowed in (
      ("adaptive_headroom", self.adaptive_headroom >= 1, "must be >= 1"),
      ("adaptive_raise", self.adaptive_raise > 1, "must be > 1"),
      ("adaptive_lower", 0 < self.adaptive_lower < 1, "must be in (0, 1)"),
      ("adaptive_window", _int_at_least(self.adaptive_window, 1), "an int >= 1"),
      (
        "adaptive_lower_share",
        0 <= self.adaptive_lower_share < q,
        f"must be in [0, {q:g}): a share above {q:g} fails",
      ),
      ("adaptive_min_tokens", _int_at_least(self.adaptive_min_tokens, 1), "an int >= 1"),
    ):
      if not ok:
        raise ValueError(f"LoopConfig.{name} = {getattr(self, name)!r} is invalid: {allowed}")

  def ceiling(self, base_values) -> int:
    return math.ceil(self.adaptive_headroom * max(base_values))

  def rule(self, tau: float, max_topk: int) -> LoopRule:
    return LoopRule(
      tau,
      max_topk,
      self.adaptive_raise,
      self.adaptive_lower,
      self.adaptive_window,
      self.adaptive_lower_share,
      self.adaptive_min_tokens,
      self.quantile,
    )


def _int_at_least(value, low: int) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= low
