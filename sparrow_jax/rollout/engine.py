"""The rollout engine: continuous batching over a page pool.

A fixed number of slots decode together in jitted chunks of `chunk_steps` steps; between chunks a
host scheduler frees the slots and pages of rows that ended and admits the next rows. A GRPO
group's prompt is prefilled once (`_insert`) into pool pages its rows share; a partial last prompt
page is kept as a template and copied into each row's first page of its own. Rows take pages as
they grow: before each chunk every running row gets the pages its next chunk can fill. Admission
holds back the pages the running rows need for `reserve_chunks` more chunks; if the pool still runs
dry, the row with the fewest generated tokens is preempted (its pages freed) and decoded again from
its first token when it is readmitted. With `drain_slots`, a rollout's last rows move to the
first slots and chunks decode only those.

Each row samples with its own key, `row_key(key, row, t)` (the run's key folded with the row's
index, then the token's index), so its tokens and log-probs do not depend on its slot, the number of
slots, the chunk length, the admission order or a preemption: a preempted row decodes the same
tokens again. A slot that runs no row writes the pool's trash page and reads nothing.

`EngineConfig(static=True)` is the static batch in the same machinery, the baseline benchmarks
compare with: every row's pages allocated at its full length on admission, and rows admitted only
when every slot is free (waves; no refill).
"""

import collections
import dataclasses
import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from sparrow_jax.attention import page_pool, paged_cache
from sparrow_jax.sparsity import policy
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.sparsity.schedule import BudgetTable
from sparrow_jax.model import qwen3
from sparrow_jax import sharding
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.rollout import sampler, speculative


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  num_slots: int = 8  # rows decoding together: the decode step's batch
  num_pages: int = 1024  # pages in the pool, page_pool.TRASH_PAGE included (`pages_for_bytes`)
  chunk_steps: int = 16  # decode steps per jitted chunk; the scheduler runs between chunks
  reserve_chunks: int = 2  # admission keeps back the pages running rows fill in this many chunks
  static: bool = False  # the static batch: full-length pages, admission only into an empty batch
  # Once every device runs at most this many rows, chunks decode that many slots only (the rows
  # moved to the first slots), so a rollout's last long rows stop paying for the empty slots
  # beside them. 0: off. A second compiled decode program, built on first use.
  drain_slots: int = 0
  # Exact mode (rollout/speculative.py): each round the sparse policy drafts this many tokens and
  # the dense policy verifies them in one pass, so rows are the dense policy's samples; a chunk
  # runs chunk_steps // (speculate + 1) rounds (at least one). 0: off (rows sampled as decoded).
  speculate: int = 0

  def __post_init__(self):
    for name, low in (
      ("num_slots", 1),
      ("num_pages", 2),
      ("chunk_steps", 1),
      ("reserve_chunks", 0),
      ("drain_slots", 0),
      ("speculate", 0),
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or value < low:
        raise ValueError(f"EngineConfig.{name} must be an int >= {low}, got {value!r}")
    if self.drain_slots >= self.num_slots:
      raise ValueError(
        f"EngineConfig.drain_slots ({self.drain_slots}) must be below num_slots "
        f"({self.num_slots}), or 0 (off)"
      )

  @property
  def chunk_rounds(self) -> int:
    """Speculative rounds per chunk."""
    return max(self.chunk_steps // (self.speculate + 1), 1)

  @property
  def chunk_tokens(self) -> int:
    """The most positions a row's chunk writes past its cache (and tokens it may advance)."""
    return self.chunk_rounds * (self.speculate + 1) if self.speculate else self.chunk_steps


DENSE_PAGE_SIZE = 16  # tokens per pool page in dense rollouts (sparse ones use SparseConfig's)


def page_size(sparse: Optional[SparseConfig]) -> int:
  return DENSE_PAGE_SIZE if sparse is None else sparse.page_size


def pages_for_bytes(
  cfg: Qwen3Config,
  pool_bytes: float,
  page_size: int = 16,
  dtype=jnp.float32,
  page_score: str = "mean",
) -> int:
  """How many pages a pool of `pool_bytes` holds (keys, values and summaries of every layer)."""
  return int(pool_bytes // page_pool.page_bytes(cfg, page_size, dtype, page_score))


@dataclasses.dataclass
class EngineStats:
  decode_steps: int = 0  # decode steps run (every slot computes in each)
  chunks: int = 0
  useful_row_steps: int = 0  # decoded tokens the rollout keeps (a preempted row's are not)
  computed_row_steps: int = 0  # slots decoded x decode steps
  preemptions: int = 0
  peak_pages: int = 0  # most pool pages in use at once
  # Speculative rollouts: row-rounds run, drafts proposed and accepted, and the KV pages (x layers)
  # the rounds read, drafts and verification together, next to what dense decoding of the same
  # tokens reads.
  rounds: int = 0
  drafted: int = 0
  accepted: int = 0
  kv_pages_read: float = 0.0
  kv_pages_dense: float = 0.0

  @property
  def accepted_per_round(self) -> float:
    """Tokens a row-round emits on average: accepted drafts plus the residual or bonus token."""
    return (self.accepted + self.rounds) / max(self.rounds, 1)

  @property
  def draft_acceptance(self) -> float:
    return self.accepted / max(self.drafted, 1)

  @property
  def occupancy(self) -> float:
    return self.useful_row_steps / max(self.computed_row_steps, 1)

  @property
  def rows_in_flight(self) -> float:
    return self.useful_row_steps / max(self.decode_steps, 1)


def row_key(key, row, t):
  """The key of row `row`'s token t: independent of where and when the row runs."""
  return jax.random.fold_in(jax.random.fold_in(key, row), t)


def _sample_rows(logits_BV, keys_B, sampling: sampler.Sampling):
  """One token per row, each from its own key -> (token_B, logp_B, (top_lp, top_id) or None)."""
  s = sampling

  def one(logits_V, key):
    token, logp_V = sampler.sample_token(logits_V[None], key, s.temperature, s.top_p, s.top_k)
    return token[0], logp_V[0]

  token_B, logp_BV = jax.vmap(one)(logits_BV, keys_B)
  token_B = token_B.astype(jnp.int32)
  logp_B = jnp.take_along_axis(logp_BV, token_B[:, None], axis=1)[:, 0]
  top = jax.lax.top_k(logp_BV, s.num_top_logprobs) if s.num_top_logprobs else None
  return token_B, logp_B, top


@functools.partial(jax.jit, static_argnames=("cfg", "sampling"), donate_argnames=("pool",))
def _insert(params, lora, pool, prompt_BT, prompt_len_B, dest_BP, rows_BG, key, *, cfg, sampling):
  """Prefills B prompts (each device its own: rows split like the pool's shards) into their
  shard's pool pages dest_BP and samples the first token of each prompt's G rows."""
  Z, T = pool.page_size, prompt_BT.shape[1]
  chunk = min(-(-qwen3.PREFILL_CHUNK // Z) * Z, -(-T // Z) * Z)
  cache = paged_cache.init_cache(
    cfg, prompt_BT.shape[0], -(-T // chunk) * chunk, Z, pool.dtype, pool.page_score
  )
  logits_BV, cache = qwen3.prefill(params, prompt_BT, prompt_len_B, cfg, cache, lora=lora)
  dest_BP = jnp.pad(
    dest_BP, ((0, 0), (0, cache.num_pages - dest_BP.shape[1])), constant_values=page_pool.TRASH_PAGE
  )
  pool = page_pool.write_pages(pool, cache, dest_BP)
  B, G = rows_BG.shape
  keys_N = jax.vmap(lambda r: row_key(key, r, 0))(rows_BG.reshape(B * G))
  logits_NV = jnp.repeat(logits_BV, G, axis=0)
  token_N, logp_N, top = _sample_rows(logits_NV, keys_N, sampling)
  return pool, token_N.reshape(B, G), logp_N.reshape(B, G), top


@functools.partial(jax.jit, donate_argnames=("pool",))
def _copy_pages(pool, src_RN, dst_RN):
  return page_pool.copy_pages(pool, src_RN, dst_RN)


@functools.partial(
  jax.jit, static_argnames=("cfg", "steps", "sparse", "sampling"), donate_argnames=("pool",)
)
def _decode_chunk(params, lora, pool, budget, key, slots, *, cfg, steps, sparse, sampling):
  """Up to `steps` decode steps over every slot (stops early once no slot runs a row), selecting
  at most `budget.max_selected` pages (a static field: one compiled decode per cap).

  slots: dict of [S] arrays token (the last sampled, to append), length (tokens cached), n_gen
  (tokens generated), max_new, row, active, and page_table [S, PR]. Returns the pool, the slots
  after the chunk and what each step emitted per slot ([S, steps]; a slot's tokens are its first
  n_gen_after - n_gen_before columns)."""
  params, lora = qwen3.unstack_layers(params, lora)
  attention_fn = policy.pool_decode_attention_fn(
    sparse, budget, None if budget is None else budget.max_selected
  )
  pad_id, num_top = sampling.pad_id, sampling.num_top_logprobs
  eos = jnp.asarray(sampling.eos_ids or (-1,), jnp.int32)
  S = slots["token"].shape[0]
  out = dict(
    tokens=jnp.full((S, steps), pad_id, jnp.int32), logprobs=jnp.zeros((S, steps), jnp.float32)
  )
  if num_top:
    out.update(
      top_lp=jnp.zeros((S, steps, num_top), jnp.float32),
      top_id=jnp.zeros((S, steps, num_top), jnp.int32),
    )

  def body(carry):
    j, pool, s, out = carry
    layers = page_pool.layer_views(pool, s["page_table"], s["length"], s["active"])
    logits_SV, layers = qwen3.decode_step(
      params, s["token"], cfg, layers, attention_fn=attention_fn, lora=lora
    )
    keys_S = jax.vmap(functools.partial(row_key, key))(s["row"], s["n_gen"])
    token_S, logp_S, top = _sample_rows(logits_SV, keys_S, sampling)
    active = s["active"]
    out = dict(
      out,
      tokens=out["tokens"].at[:, j].set(jnp.where(active, token_S, pad_id)),
      logprobs=out["logprobs"].at[:, j].set(jnp.where(active, logp_S, 0.0)),
    )
    if num_top:
      out.update(
        top_lp=out["top_lp"].at[:, j].set(top[0]), top_id=out["top_id"].at[:, j].set(top[1])
      )
    n_gen = s["n_gen"] + active
    ended = active & (jnp.isin(token_S, eos) | (n_gen >= s["max_new"]))
    s = dict(
      s,
      token=jnp.where(active, token_S, s["token"]),
      length=s["length"] + active,
      n_gen=n_gen,
      active=active & ~ended,
    )
    return j + 1, page_pool.from_layers(pool, layers), s, out

  cond = lambda carry: (carry[0] < steps) & jnp.any(carry[2]["active"])
  steps_run, pool, slots, out = jax.lax.while_loop(cond, body, (0, pool, slots, out))
  return pool, slots, out, steps_run


@functools.partial(
  jax.jit,
  static_argnames=("cfg", "rounds", "draft", "sparse", "sampling"),
  donate_argnames=("pool",),
)
def _speculative_chunk(
  params, lora, pool, budget, key, slots, *, cfg, rounds, draft, sparse, sampling
):
  """Up to `rounds` speculative rounds (rollout/speculative.py) over every slot, `draft` drafts
  each: the sparse actor (params with `lora`, pages under `budget`) drafts, the dense policy
  (params alone) verifies. Slots as `_decode_chunk`'s; a slot emits 1 to draft + 1 tokens a
  round, its tokens the first n_gen_after - n_gen_before columns of the [S, rounds * (draft + 1)]
  outputs, which add `alpha` (each token's draft acceptance rate, NaN for a bonus token).
  Returns (pool, slots, out, rounds run, per-slot counters: accepted drafts, rounds, KV pages
  read and the pages dense decoding of the emitted tokens reads)."""
  params, lora = qwen3.unstack_layers(params, lora)  # drafts: params + lora; verify: params
  draft_fn = policy.pool_decode_attention_fn(
    sparse, budget, None if budget is None else budget.max_selected
  )
  verify_fn = policy.pool_verify_attention_fn()
  s0, k, C, Z = slots, draft, draft + 1, pool.page_size
  pad_id, num_top = sampling.pad_id, sampling.num_top_logprobs
  eos = jnp.asarray(sampling.eos_ids or (-1,), jnp.int32)
  S, W = slots["token"].shape[0], rounds * C
  # Drafts and verification write up to `draft` positions past a row's last: trash-page columns.
  table = jnp.pad(slots["page_table"], ((0, 0), (0, -(-C // Z) + 1)))
  L = cfg.num_hidden_layers
  L_dense = L if sparse is None else min(sparse.dense_layers, L)
  pages_by_len = None if budget is None else budget.pages_by_len
  out = dict(
    tokens=jnp.full((S, W), pad_id, jnp.int32),
    logprobs=jnp.zeros((S, W), jnp.float32),
    alpha=jnp.full((S, W), jnp.nan, jnp.float32),
  )
  if num_top:
    out.update(
      top_lp=jnp.zeros((S, W, num_top), jnp.float32), top_id=jnp.zeros((S, W, num_top), jnp.int32)
    )
  count = dict(
    accepted=jnp.zeros(S, jnp.int32),
    rounds=jnp.zeros(S, jnp.int32),
    read=jnp.zeros(S, jnp.float32),
    dense=jnp.zeros(S, jnp.float32),
  )

  def pages_read(length_S):  # KV pages x layers a decode step at cached length length_S reads
    pages = -(-length_S // Z)
    sparse_pages = pages if pages_by_len is None else jnp.minimum(pages_by_len[length_S], pages)
    return (L_dense * pages + (L - L_dense) * sparse_pages).astype(jnp.float32)

  def body(carry):
    j, pool, s, out, count = carry
    active, length = s["active"], s["length"]
    keys_SC = jax.vmap(
      lambda r, t: jax.vmap(lambda c: row_key(key, r, t + c))(jnp.arange(C, dtype=t.dtype))
    )(s["row"], s["n_gen"])

    def draft_step(i, dc):
      pool, token, drafts_Sk, logq_SkV, read = dc
      layers = page_pool.layer_views(pool, table, length + i, active)
      logits_SV, layers = qwen3.decode_step(
        params, token, cfg, layers, attention_fn=draft_fn, lora=lora
      )
      token, logq_SV = speculative.draft_tokens(logits_SV, keys_SC[:, i], sampling)
      return (
        page_pool.from_layers(pool, layers),
        token,
        drafts_Sk.at[:, i].set(token),
        logq_SkV.at[:, i].set(logq_SV),
        read + pages_read(length + i + 1),
      )

    V = cfg.vocab_size
    pool, _, drafts_Sk, logq_SkV, read = jax.lax.fori_loop(
      0,
      k,
      draft_step,
      (
        pool,
        s["token"],
        jnp.zeros((S, k), jnp.int32),
        jnp.zeros((S, k, V), jnp.float32),
        jnp.zeros(S, jnp.float32),
      ),
    )
    layers = page_pool.layer_views(pool, table, length, active)
    tokens_SC = jnp.concatenate([s["token"][:, None], drafts_Sk], axis=1)
    logits_SCV, new_kv = qwen3.verify_step(params, tokens_SC, cfg, layers, attention_fn=verify_fn)
    logp_SCV = sampler.sampled_logp(
      logits_SCV.reshape(S * C, V), sampling.temperature, sampling.top_p, sampling.top_k
    ).reshape(S, C, V)
    emitted_SC, n_acc_S, logp_SC, alpha_Sk = jax.vmap(speculative.accept_round)(
      logp_SCV, logq_SkV, drafts_Sk, keys_SC
    )
    # What the row keeps: up to its first EOS and its max_new.
    c_C = jnp.arange(C)
    eos_SC = jnp.isin(emitted_SC, eos) & (c_C[None] <= n_acc_S[:, None])
    first_eos_S = jnp.where(jnp.any(eos_SC, axis=1), jnp.argmax(eos_SC, axis=1), C)
    m_S = jnp.minimum(jnp.minimum(n_acc_S + 1, first_eos_S + 1), s["max_new"] - s["n_gen"])
    m_S = jnp.where(active, m_S, 0)
    keep_S = jnp.where(active, n_acc_S + 1, 0)
    layers = tuple(x.write_span(kv[0], kv[1], length, keep_S) for x, kv in zip(layers, new_kv))
    pool = page_pool.from_layers(pool, layers)
    cols_SC = jnp.where(
      c_C[None] < m_S[:, None], (s["n_gen"] - s0["n_gen"])[:, None] + c_C[None], W
    )
    rows_SC = jnp.broadcast_to(jnp.arange(S)[:, None], (S, C))
    put = lambda buf, x: buf.at[rows_SC, cols_SC].set(x, mode="drop")
    alpha_SC = jnp.pad(alpha_Sk, ((0, 0), (0, 1)), constant_values=jnp.nan)
    alpha_SC = jnp.where(c_C[None] < k, alpha_SC, jnp.nan)
    out = dict(
      out,
      tokens=put(out["tokens"], emitted_SC),
      logprobs=put(out["logprobs"], logp_SC),
      alpha=put(out["alpha"], alpha_SC),
    )
    if num_top:
      top_lp, top_id = jax.lax.top_k(logp_SCV, num_top)
      out.update(top_lp=put(out["top_lp"], top_lp), top_id=put(out["top_id"], top_id))
    n_gen = s["n_gen"] + m_S
    kept_eos = first_eos_S < m_S
    ended = active & (kept_eos | (n_gen >= s["max_new"]))
    last_S = jnp.take_along_axis(emitted_SC, n_acc_S[:, None], axis=1)[:, 0]
    dense_read_S = jnp.sum(
      jnp.where(c_C[None] < m_S[:, None], L * -(-(length[:, None] + c_C[None] + 1) // Z), 0), axis=1
    )
    count = dict(
      accepted=count["accepted"] + jnp.where(active, n_acc_S, 0),
      rounds=count["rounds"] + active,
      read=count["read"] + jnp.where(active, read + L * -(-length // Z), 0.0),
      dense=count["dense"] + dense_read_S.astype(jnp.float32),
    )
    s = dict(
      s,
      token=jnp.where(active, last_S, s["token"]),
      length=length + keep_S,
      n_gen=n_gen,
      active=active & ~ended,
    )
    return j + 1, pool, s, out, count

  cond = lambda carry: (carry[0] < rounds) & jnp.any(carry[2]["active"])
  rounds_run, pool, slots, out, count = jax.lax.while_loop(cond, body, (0, pool, slots, out, count))
  return pool, slots, out, rounds_run, count


@dataclasses.dataclass
class _Row:
  index: int  # the row's index in the request: its key and its place in the output
  group: int
  prompt_len: int
  max_new: int
  tokens: list = dataclasses.field(default_factory=list)
  logprobs: list = dataclasses.field(default_factory=list)
  top: list = dataclasses.field(default_factory=list)
  alpha: list = dataclasses.field(default_factory=list)  # speculative rollouts
  pages: list = dataclasses.field(default_factory=list)  # its own pool pages, in logical order
  first: Optional[tuple] = None  # (token, logp, top) sampled at its group's prefill
  slot: Optional[int] = None  # its slot on its group's shard while it runs
  done: bool = False


@dataclasses.dataclass
class _Group:
  rows: list
  shard: Optional[int] = None  # the device whose pool holds its prompt (set at its prefill)
  shared: list = dataclasses.field(default_factory=list)  # full prompt pages, shared by the rows
  template: Optional[int] = None  # the partial last prompt page
  unfinished: int = 0


class _Shard:
  """One device's slots and free pages."""

  def __init__(self, engine: EngineConfig, max_pages_per_row: int):
    self.free_pages = collections.deque(range(1, engine.num_pages))
    self.slots = [None] * engine.num_slots
    self.page_table = np.zeros((engine.num_slots, max_pages_per_row), np.int32)


class _Scheduler:
  """Host-side bookkeeping of every shard's slots and pages for one `run`."""

  def __init__(
    self, engine: EngineConfig, page_size: int, rows, groups, max_pages_per_row: int, shards: int
  ):
    self.engine, self.Z = engine, page_size
    self.rows, self.groups = rows, groups
    self.shards = [_Shard(engine, max_pages_per_row) for _ in range(shards)]
    self.stats = EngineStats()

  def shared_count(self, row):
    return row.prompt_len // self.Z

  def pages_needed(self, row, steps_ahead: int, n_gen: Optional[int] = None) -> int:
    """Own pages the row needs to hold its cache `steps_ahead` decode steps from now, with n_gen
    tokens generated (default: its own count), capped at its last cached token (the final sampled
    token is never appended); the static batch takes them all at once."""
    cached = row.prompt_len + (len(row.tokens) if n_gen is None else n_gen) - 1
    last = row.prompt_len + row.max_new - 1
    horizon = last if self.engine.static else min(cached + steps_ahead, last)
    return -(-horizon // self.Z) - self.shared_count(row)

  def running(self, shard=None):
    shards = range(len(self.shards)) if shard is None else (shard,)
    return [self.rows[i] for r in shards for i in self.shards[r].slots if i is not None]

  def shard_of(self, row) -> int:
    return self.groups[row.group].shard

  def take_pages(self, shard: int, n: int) -> list:
    free = self.shards[shard].free_pages
    pages = [free.popleft() for _ in range(n)]
    used = self.engine.num_pages - 1 - len(free)
    self.stats.peak_pages = max(self.stats.peak_pages, used)
    return pages

  def place(self, row, slot):
    shard = self.shards[self.shard_of(row)]
    row.slot = slot
    shard.slots[slot] = row.index
    table = self.groups[row.group].shared + row.pages
    shard.page_table[slot] = 0
    shard.page_table[slot, : len(table)] = table

  def release(self, row):
    """The row leaves its slot and gives back its own pages; a finished group's shared pages
    go back too."""
    group = self.groups[row.group]
    shard = self.shards[group.shard]
    if row.slot is not None:
      shard.slots[row.slot] = None
      shard.page_table[row.slot] = 0
      row.slot = None
    shard.free_pages.extend(row.pages)
    row.pages = []
    if row.done:
      group.unfinished -= 1
      if group.unfinished == 0:
        shard.free_pages.extend(group.shared + ([group.template] if group.template else []))
        group.shared, group.template = [], None

  def compact(self, width: int):
    """Moves every shard's running rows into its first `width` slots."""
    for shard in self.shards:
      free = [i for i in range(width) if shard.slots[i] is None]
      for i in range(width, len(shard.slots)):
        if shard.slots[i] is not None:
          row = self.rows[shard.slots[i]]
          shard.slots[i] = None
          shard.page_table[i] = 0
          self.place(row, free.pop(0))

  def reserve(self, shard: int) -> int:
    """Pages the shard's running rows will still take over `reserve_chunks` more chunks."""
    ahead = self.engine.chunk_tokens * (1 + self.engine.reserve_chunks)
    return sum(max(self.pages_needed(r, ahead) - len(r.pages), 0) for r in self.running(shard))


@dataclasses.dataclass(frozen=True, eq=False)
class Requests:
  """The rows a rollout samples, host arrays: right-padded prompts (row b's is
  prompt_BT[b, :prompt_len_B[b]]) in runs of `group_size` copies of one prompt (GRPO groups, each
  prefilled once)."""

  prompt_BT: np.ndarray  # [B, T] int32
  prompt_len_B: np.ndarray  # [B] int32 in [1, T]
  max_new_B: np.ndarray  # [B] tokens each row may generate (an int: the same for every row)
  group_size: int = 1
  # With several processes, each passes its own rows (`sharding.process_rows`) and the index of
  # its first row in the whole batch: the rows' keys are global.
  first_row: int = 0

  def __post_init__(self):
    prompt_BT = np.asarray(self.prompt_BT, np.int32)
    B, T = prompt_BT.shape
    prompt_len_B = np.asarray(self.prompt_len_B, np.int32)
    max_new_B = np.broadcast_to(np.asarray(self.max_new_B, np.int32), (B,)).copy()
    for name, value in (("prompt_BT", prompt_BT), ("prompt_len_B", prompt_len_B)):
      object.__setattr__(self, name, value)
    object.__setattr__(self, "max_new_B", max_new_B)
    if prompt_len_B.shape != (B,) or prompt_len_B.min() < 1 or prompt_len_B.max() > T:
      raise ValueError(
        f"Requests.prompt_len_B must be [{B}] lengths in [1, {T}] (the prompt width), got "
        f"{prompt_len_B.tolist()}"
      )
    if max_new_B.min() < 1:
      raise ValueError(
        f"Requests.max_new_B (max_new_tokens: one per row or one for all) must be positive, "
        f"got {max_new_B.tolist()}"
      )
    g = self.group_size
    if g < 1 or B % g:
      raise ValueError(f"Requests.group_size must be >= 1 and divide the {B} rows, got {g}")
    runs = lambda x: x.reshape(-1, g, *x.shape[1:])
    if not (
      np.all(runs(prompt_BT) == runs(prompt_BT)[:, :1])
      and np.all(runs(prompt_len_B) == runs(prompt_len_B)[:, :1])
    ):
      raise ValueError(f"Requests.group_size = {g}: the rows are not runs of {g} identical prompts")


def _any_process(flag: bool) -> bool:
  """Whether `flag` holds on any process: every process then takes the same branch, so that they
  all enter the same jitted calls (a collective per call with several processes)."""
  if jax.process_count() == 1:
    return flag
  return bool(np.any(multihost_utils.process_allgather(np.asarray(flag))))


def _budget(schedule, sparse, max_len: int) -> BudgetTable:
  """The BudgetTable over cached lengths 0..max_len of a schedule, or a BudgetTable built once by
  the caller (the trainer's, one cap for all its stages) as it is; its max_selected set (from the
  table where it is 0)."""
  if schedule is None:
    raise ValueError("sparse generation needs a `schedule` (e.g. KVSchedule.fixed(pages))")
  if isinstance(schedule, BudgetTable):
    if schedule.pages_by_len.shape[0] < max_len + 1:
      raise ValueError(
        f"the BudgetTable covers cached lengths up to "
        f"{schedule.pages_by_len.shape[0] - 1}, the rollout needs {max_len}"
      )
    table, budget = None, schedule
  else:
    table = sampler.budget_table(schedule, max_len, sparse)
    budget = BudgetTable(jnp.asarray(table))
  if budget.max_selected:
    return budget
  cap = sampler.max_selected_pages(
    sharding.to_host(budget.pages_by_len) if table is None else table
  )
  return budget.replace(max_selected=cap)


def run(
  params,
  cfg: Qwen3Config,
  requests: Requests,
  key,
  *,
  engine: EngineConfig = EngineConfig(),
  sampling: sampler.Sampling = sampler.Sampling(),
  sparse: Optional[SparseConfig] = None,
  schedule=None,
  lora=None,
  order: Optional[Sequence[int]] = None,
):
  """Samples a completion for every request row through the engine.

  order: the order rows are admitted in (a permutation of the rows; default: row order); it changes
  nothing in the output. sparse / schedule / lora as `generate`; schedule may be a BudgetTable,
  used as is (its max_selected, when 0, from its largest budget rounded up to a power of two). The
  pool keeps keys and values in the embedding's dtype.
  On a mesh (`jax.set_mesh`) every device of data x fsdp has its own pool of engine.num_pages pages
  and engine.num_slots slots, and a group runs on one device. With several processes each passes
  the rows its devices hold (`Requests.first_row`), schedules them on its own devices and gets them
  back; the processes agree only on whether any has work left before each collective call.
  Returns (sampler.Rollout with [B, max(max_new_B)] arrays, EngineStats)."""
  prompt_BT, prompt_len_B, max_new_B = requests.prompt_BT, requests.prompt_len_B, requests.max_new_B
  group_size, first_row = requests.group_size, requests.first_row
  eos_ids, num_top = sampling.eos_ids, sampling.num_top_logprobs
  B, T = prompt_BT.shape
  if T + int(max_new_B.max()) > cfg.max_position_embeddings:
    raise ValueError(
      f"prompt width ({T}) + max_new_B ({int(max_new_B.max())}) exceeds "
      f"max_position_embeddings ({cfg.max_position_embeddings})"
    )
  Z = page_size(sparse)
  prompt_BT = np.pad(prompt_BT, ((0, 0), (0, -T % Z)))  # whole pages: one prefill shape
  max_pages_per_row = -(-(T + int(max_new_B.max())) // Z)
  budget = (
    None
    if sparse is None
    else _budget(schedule, sparse, max(max_pages_per_row * Z, T + int(max_new_B.max())))
  )
  pool = page_pool.init_pool(
    cfg,
    engine.num_pages,
    Z,
    params["embed"].dtype,
    sparse.page_score if sparse is not None else "mean",
  )
  R, S, C = pool.shards, engine.num_slots, engine.chunk_tokens
  # This process's shards of the pool: it schedules only them; arrays of every shard's slots are
  # assembled from each process's part.
  mesh = jax.sharding.get_mesh()
  rows_sh = None if mesh.empty else sharding.rows(mesh)
  r_lo, r_hi = (0, R) if rows_sh is None else sharding.process_rows(rows_sh, R)
  R_local = r_hi - r_lo
  to_global = lambda x: (
    x if rows_sh is None else sharding.from_local_rows(x, rows_sh, x.shape[0] // R_local * R)
  )
  to_local = lambda x: np.asarray(x) if rows_sh is None else sharding.local_rows(x)
  per_insert = max(1, S // group_size)  # groups a device prefills per insert call

  rows = [_Row(b, b // group_size, int(prompt_len_B[b]), int(max_new_B[b])) for b in range(B)]
  groups = [
    _Group(list(range(g * group_size, (g + 1) * group_size)), unfinished=group_size)
    for g in range(B // group_size)
  ]
  order = list(range(B)) if order is None else [int(b) for b in order]
  if sorted(order) != list(range(B)):
    raise ValueError(f"order must be a permutation of the {B} rows, got {order}")
  sched = _Scheduler(engine, Z, rows, groups, max_pages_per_row, R_local)
  for row in rows:  # a row that cannot fit alone in a pool would wait forever
    need = -(-(row.prompt_len + row.max_new - 1) // Z) + 1
    if need > engine.num_pages - 1:
      raise ValueError(
        f"EngineConfig.num_pages = {engine.num_pages} cannot hold row {row.index} "
        f"({row.prompt_len} prompt + {row.max_new} new tokens need {need} pages "
        f"with the trash page and a prompt template)"
      )
  queue = collections.deque(order)

  def insert(planned):
    """Prefill the planned groups (up to per_insert per device) and sample their rows' first
    tokens."""
    nonlocal pool
    n = R_local * per_insert
    prompts = np.zeros((n, prompt_BT.shape[1]), np.int32)
    lens = np.ones(n, np.int32)
    dest = np.zeros((n, prompt_BT.shape[1] // Z), np.int32)
    row_ids = np.zeros((n, group_size), np.int32)
    at = {}
    for r, group_ids in enumerate(planned):
      for j, g in enumerate(group_ids):
        i, group, first = r * per_insert + j, groups[g], rows[groups[g].rows[0]]
        pages = group.shared + ([group.template] if group.template is not None else [])
        prompts[i], lens[i], dest[i, : len(pages)] = prompt_BT[first.index], first.prompt_len, pages
        row_ids[i], at[g] = np.asarray(group.rows) + first_row, i
    pool, token, logp, top = _insert(
      params,
      None if engine.speculate else lora,  # exact mode: the dense policy's prompt and first token
      pool,
      *map(to_global, (prompts, lens, dest, row_ids)),
      key,
      cfg=cfg,
      sampling=sampling,
    )
    token, logp = to_local(token), to_local(logp)
    top = None if top is None else tuple(to_local(x).reshape(n, group_size, -1) for x in top)
    for g, i in at.items():
      for j, b in enumerate(groups[g].rows):
        rows[b].first = (
          int(token[i, j]),
          float(logp[i, j]),
          None if top is None else (top[0][i, j], top[1][i, j]),
        )

  def restart(row):
    """The row back to its first token (at admission and after a preemption)."""
    token, logp, top = row.first
    row.tokens, row.logprobs, row.top = [token], [logp], ([top] if top is not None else [])
    row.alpha = [float("nan")]  # sampled at the prefill, from the dense policy
    row.done = token in eos_ids or row.max_new == 1

  def admit_round() -> bool:
    """Admits what fits from the queue: rows of prefilled groups into their device's free slots,
    new groups (up to per_insert a device) onto the device with the most free slots, as long as
    each device keeps its reserve. Returns whether anything was admitted."""
    nonlocal pool
    planned = [[] for _ in range(R_local)]
    free_slots = [sh.slots.count(None) for sh in sched.shards]
    busy = [bool(sched.running(r)) for r in range(R_local)]  # the static batch waits for empty
    admitted = []
    for b in list(queue):
      row, group = rows[b], groups[rows[b].group]
      new_group = group.shard is None
      need = sched.pages_needed(row, C, n_gen=1) + (
        sched.shared_count(row) + (1 if row.prompt_len % Z else 0) if new_group else 0
      )
      fits = lambda r: (
        free_slots[r] > 0
        and not (engine.static and busy[r])
        and len(sched.shards[r].free_pages) >= need + (0 if engine.static else sched.reserve(r))
      )
      if new_group:
        options = [r for r in range(R_local) if len(planned[r]) < per_insert and fits(r)]
        if not options:
          continue
        r = max(options, key=lambda r: (free_slots[r], len(sched.shards[r].free_pages), -r))
        group.shard = r
        group.shared = sched.take_pages(r, sched.shared_count(row))
        if row.prompt_len % Z:
          group.template = sched.take_pages(r, 1)[0]
        planned[r].append(row.group)
      elif not fits(group.shard):
        continue
      r = group.shard
      queue.remove(b)
      row.pages = sched.take_pages(r, sched.pages_needed(row, C, n_gen=1))
      row.slot = sched.shards[r].slots.index(None)
      sched.shards[r].slots[row.slot] = row.index  # held; placed once its first token is known
      free_slots[r] -= 1
      admitted.append(row)
    if _any_process(any(planned)):
      insert(planned)
    copies = [[] for _ in range(R_local)]
    for row in admitted:
      restart(row)
      if row.done:
        sched.release(row)
        continue
      group = groups[row.group]
      if group.template is not None:
        copies[group.shard].append((group.template, row.pages[0]))
      sched.place(row, row.slot)
    if _any_process(any(copies)):
      pairs = np.full((2, R_local, S), page_pool.TRASH_PAGE, np.int32)
      for r, shard_copies in enumerate(copies):
        for j, (src, dst) in enumerate(shard_copies):
          pairs[:, r, j] = src, dst
      pool = _copy_pages(pool, to_global(pairs[0]), to_global(pairs[1]))
    return bool(admitted)

  def grow():
    """Pages for every running row's next chunk; preempt the least advanced rows if short."""
    for r in range(R_local):
      while True:
        short = {x.index: sched.pages_needed(x, C) - len(x.pages) for x in sched.running(r)}
        if sum(max(n, 0) for n in short.values()) <= len(sched.shards[r].free_pages):
          break
        victim = min(sched.running(r), key=lambda x: (len(x.tokens), -x.index))
        sched.release(victim)
        sched.stats.preemptions += 1
        sched.stats.useful_row_steps -= len(victim.tokens) - 1  # decoded again on readmission
        queue.appendleft(victim.index)
      for x in sched.running(r):
        if short[x.index] > 0:
          x.pages += sched.take_pages(r, short[x.index])
          sched.place(x, x.slot)

  while True:
    while _any_process(admit_round()):
      pass
    if queue and not sched.running():
      raise ValueError(
        f"EngineConfig.num_pages = {engine.num_pages} is too small to admit "
        f"row {queue[0]} while other groups hold their prompt pages"
      )
    if not _any_process(bool(sched.running())):
      break
    grow()
    W = S  # slots this chunk decodes per device
    if engine.drain_slots and not _any_process(
      max(len(sched.running(r)) for r in range(R_local)) > engine.drain_slots
    ):
      W = engine.drain_slots
      sched.compact(W)
    running = sched.running()
    n = R_local * W
    slots = dict(
      token=np.zeros(n, np.int32),
      length=np.zeros(n, np.int32),
      n_gen=np.zeros(n, np.int32),
      max_new=np.ones(n, np.int32),
      row=np.zeros(n, np.int32),
      active=np.zeros(n, bool),
      page_table=np.concatenate([sh.page_table[:W] for sh in sched.shards]),
    )
    at = {r.index: sched.shard_of(r) * W + r.slot for r in running}
    for r in running:
      i = at[r.index]
      slots["token"][i], slots["length"][i] = r.tokens[-1], r.prompt_len + len(r.tokens) - 1
      slots["n_gen"][i], slots["max_new"][i] = len(r.tokens), r.max_new
      slots["row"][i], slots["active"][i] = first_row + r.index, True
    slots = {k: to_global(v) for k, v in slots.items()}
    if engine.speculate:
      pool, after, out, steps_run, count = _speculative_chunk(
        params,
        lora,
        pool,
        budget,
        key,
        slots,
        cfg=cfg,
        rounds=engine.chunk_rounds,
        draft=engine.speculate,
        sparse=sparse,
        sampling=sampling,
      )
      _count_rounds(sched.stats, {k: to_local(v) for k, v in count.items()}, engine.speculate)
    else:
      pool, after, out, steps_run = _decode_chunk(
        params, lora, pool, budget, key, slots, cfg=cfg, steps=C, sparse=sparse, sampling=sampling
      )
    out = {k: to_local(v) for k, v in out.items()}
    n_gen_after, active_after = to_local(after["n_gen"]), to_local(after["active"])
    steps_run = int(sharding.to_host(steps_run))
    per_step = engine.speculate + 1  # tokens a decode step (a round) can emit per slot
    sched.stats.chunks += 1
    sched.stats.decode_steps += steps_run
    sched.stats.computed_row_steps += steps_run * per_step * R_local * W
    for r in running:
      i = at[r.index]
      new = int(n_gen_after[i]) - len(r.tokens)
      sched.stats.useful_row_steps += new
      r.tokens += out["tokens"][i, :new].tolist()
      r.logprobs += out["logprobs"][i, :new].tolist()
      if num_top:
        r.top += list(zip(out["top_lp"][i, :new], out["top_id"][i, :new]))
      if engine.speculate:
        r.alpha += out["alpha"][i, :new].tolist()
      if not active_after[i]:
        r.done = True
        sched.release(r)
  return _rollout(rows, int(max_new_B.max()), sampling, engine.speculate), sched.stats


def _count_rounds(stats: EngineStats, count: dict, draft: int) -> None:
  """A speculative chunk's per-slot counters into the rollout's stats."""
  rounds = int(np.sum(count["rounds"]))
  stats.rounds += rounds
  stats.drafted += rounds * draft
  stats.accepted += int(np.sum(count["accepted"]))
  stats.kv_pages_read += float(np.sum(count["read"]))
  stats.kv_pages_dense += float(np.sum(count["dense"]))


def full_batch(
  rows: int,
  group_size: int,
  max_len: int,
  sparse: Optional[SparseConfig],
  chunk_steps: int = EngineConfig.chunk_steps,
) -> EngineConfig:
  """Slots for a device's `rows` rows at once (whole GRPO groups: a group runs on one device) and a
  pool that holds them all at `max_len` tokens (their pages, a prompt template page per group, the
  trash page): no row waits or is preempted, and a row stops costing once it ends."""
  groups = max(-(-rows // group_size), 1)
  slots = groups * group_size
  return EngineConfig(
    num_slots=slots,
    num_pages=slots * -(-max_len // page_size(sparse)) + groups + 1,
    chunk_steps=chunk_steps,
  )


def _local_rows(x, lo: int, hi: int) -> np.ndarray:
  """This process's rows [lo, hi) of a host array or a (possibly multi-process) global array."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return sharding.local_rows(x)
  return np.asarray(x)[lo:hi]


def generate(
  params,
  cfg: Qwen3Config,
  prompt_BT,
  prompt_len_B,
  key,
  *,
  max_new_tokens: int,
  sampling: sampler.Sampling = sampler.Sampling(),
  sparse: Optional[SparseConfig] = None,
  schedule=None,
  lora=None,
  prefill_group: int = 1,
) -> sampler.Rollout:
  """Samples completions for right-padded prompts (row b's prompt is prompt_BT[b, :prompt_len_B[b]])
  through the engine, every row of a device in a slot at once and a pool that holds them all.

  prefill_group = n: the rows come in runs of n copies of one prompt (a GRPO group), prefilled once
  per run. sparse=None: dense attention. sparse=SparseConfig(...) with a schedule (anything with
  `budget_pages(cached_len)`, checked by `budget_table`, or a BudgetTable used as is): block top-k
  decoding. `lora` (a model.lora.LoRA) is applied in this actor only. Rows stop at their first of
  `sampling.eos_ids` (kept in the completion). Same key -> same output. On a mesh the prompts may
  be global arrays and the rollout comes back as global arrays with rows over data x fsdp (each
  process's own)."""
  B, T = np.shape(prompt_BT)
  mesh = jax.sharding.get_mesh()
  rows_sh = None if mesh.empty else sharding.rows(mesh)
  lo, hi = (0, B) if rows_sh is None else sharding.process_rows(rows_sh, B)
  engine = full_batch(B // page_pool.row_shards(), prefill_group, T + max_new_tokens, sparse)
  requests = Requests(
    _local_rows(prompt_BT, lo, hi),
    _local_rows(prompt_len_B, lo, hi),
    max_new_tokens,
    group_size=prefill_group,
    first_row=lo,
  )
  rollout, _ = run(
    params,
    cfg,
    requests,
    key,
    engine=engine,
    sampling=sampling,
    sparse=sparse,
    schedule=schedule,
    lora=lora,
  )
  if rows_sh is None:
    return rollout
  return jax.tree_util.tree_map(
    lambda x: sharding.from_local_rows(np.asarray(x), rows_sh, B), rollout
  )


def _rollout(rows, N: int, sampling: sampler.Sampling, speculate: int = 0) -> sampler.Rollout:
  B, pad_id, num_top = len(rows), sampling.pad_id, sampling.num_top_logprobs
  tokens = np.full((B, N), pad_id, np.int32)
  logprobs = np.zeros((B, N), np.float32)
  lengths = np.asarray([len(r.tokens) for r in rows], np.int32)
  top_lp = np.zeros((B, N, num_top), np.float32) if num_top else None
  top_id = np.zeros((B, N, num_top), np.int32) if num_top else None
  for r in rows:
    n = len(r.tokens)
    tokens[r.index, :n] = r.tokens
    logprobs[r.index, :n] = r.logprobs
    if num_top:
      top_lp[r.index, :n] = np.stack([t[0] for t in r.top])
      top_id[r.index, :n] = np.stack([t[1] for t in r.top])
  alpha = None
  if speculate:
    alpha = np.full((B, N), np.nan, np.float32)
    for r in rows:
      alpha[r.index, : len(r.alpha)] = r.alpha
  return sampler.Rollout(
    jnp.asarray(tokens),
    jnp.asarray(logprobs),
    jnp.asarray(lengths),
    None if top_lp is None else jnp.asarray(top_lp),
    None if top_id is None else jnp.asarray(top_id),
    None if alpha is None else jnp.asarray(alpha),
  )
