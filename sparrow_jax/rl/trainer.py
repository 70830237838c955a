"""The RL loop: sample prompts -> (sparse) rollout -> rewards -> fused train step -> log,
checkpoint.

Everything a step needs is a pure function of (config, step, restored state): the data position is
`step * prompts_per_step`, the rollout key is fold_in(seed key, step), and an adaptive schedule's
table is in the checkpoint meta. So a run killed at any point and restarted with the same workdir
replays exactly the steps an uninterrupted run would have taken.

A run never loses data: every check that can run before the workdir is written does (`validate`,
then `check_inputs` against the task and the model), so a config error leaves no workdir behind;
one run holds a workdir at a time (`workdir_lock`); whole files are replaced atomically and
metrics.jsonl is append-only; only a checkpoint that does not read as one (or fails its checksums)
is moved aside, and any other restore error stops the run, changing nothing
(sparrow_jax.checkpoint).
"""

import contextlib
import dataclasses
import fcntl
import functools
import json
import math
import os
import shutil
import socket
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from sparrow_jax import checkpoint, schema
from sparrow_jax import logging as metrics_log
from sparrow_jax.attention import page_pool
from sparrow_jax.attention.select import IMPLS, PAGE_SCORES, SparseConfig
from sparrow_jax.data import tasks
from sparrow_jax.data.tokenizer import load_tokenizer
from sparrow_jax.mismatch import cost_model
from sparrow_jax.sparsity import schedule as schedule_lib
from sparrow_jax.model import lora as lora_lib
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.model.hf import load_config, load_hf, save_hf
from sparrow_jax import sharding
from sparrow_jax.model.qwen3 import init_params
from sparrow_jax.rl import train_step as ts
from sparrow_jax.rollout import engine, sampler


def _require(ok: bool, field: str, value, allowed: str):
  if not ok:
    raise ValueError(f"config.{field} = {value!r} is invalid: {allowed}")


# Config integers are array sizes, counts and the seed of a 32-bit jax PRNG key: int32 holds them.
INT_MIN, INT_MAX = -(2**31), 2**31 - 1


def _check_scalars(c) -> None:
  """Each value alone: a workdir to write to, a seed a PRNG key holds, every int in int32 and
  every float finite (an inf learning rate or NaN coefficient would train on nonsense)."""
  _require(
    isinstance(c.workdir, str) and c.workdir.strip() != "",
    "workdir",
    c.workdir,
    "must be a directory path (not empty)",
  )
  _require(
    isinstance(c.seed, int) and not isinstance(c.seed, bool) and 0 <= c.seed <= INT_MAX,
    "seed",
    c.seed,
    f"must be an int in [0, {INT_MAX}]",
  )
  for field, value in _flat(c.to_dict()).items():
    if isinstance(value, float):
      _require(math.isfinite(value), field, value, "must be a finite number")
    elif isinstance(value, int) and not isinstance(value, bool):
      _require(
        INT_MIN <= value <= INT_MAX, field, value, f"must be an int in [{INT_MIN}, {INT_MAX}]"
      )


def validate(c: ml_collections.ConfigDict) -> None:
  """Rejects a bad config up front, naming the field. The train step's own fields are checked by
  `StepConfig.from_config` (its components validate themselves) and the sparse ones by
  `SparseConfig`; what is left here is what only the whole config knows. What needs the data or
  the model's vocabulary is `check_inputs`, also run before anything is written."""
  r = c.rollout
  _check_scalars(c)
  ts.StepConfig.from_config(c)
  p = r.page_size
  _require(
    isinstance(p, int) and p > 0 and not p & (p - 1),
    "rollout.page_size",
    p,
    "must be a power of two",
  )
  _require(r.prompts_per_step >= 1, "rollout.prompts_per_step", r.prompts_per_step, "must be >= 1")
  for name in ("data", "fsdp", "tensor"):
    ways = c.mesh[name]
    _require(
      isinstance(ways, int) and (ways >= 1 or (name == "data" and ways == -1)),
      f"mesh.{name}",
      ways,
      "a positive number of devices" + (" or -1 (the rest)" if name == "data" else ""),
    )
  batch = r.prompts_per_step * r.group_size
  _require(
    batch % c.rl.num_minibatches == 0,
    "rl.num_minibatches",
    c.rl.num_minibatches,
    f"must divide the batch of {batch} rollouts (prompts_per_step * group_size)",
  )
  _require(r.max_new_tokens > 0, "rollout.max_new_tokens", r.max_new_tokens, "must be positive")
  _require(
    r.top_p == 1.0,
    "rollout.top_p",
    r.top_p,
    "must be 1.0 in training: PPO, TIS and acceptance compare the sampled distribution "
    "with the dense policy's full softmax, which a truncated sampler does not match",
  )
  _require(r.attention_impl in IMPLS, "rollout.attention_impl", r.attention_impl, f"one of {IMPLS}")
  _require(r.page_score in PAGE_SCORES, "rollout.page_score", r.page_score, f"one of {PAGE_SCORES}")
  _require(c.total_steps > 0, "total_steps", c.total_steps, "must be positive")
  _require(c.ckpt_every > 0, "ckpt_every", c.ckpt_every, "must be positive")
  _require(
    bool(c.model.hf_dir) != bool(c.model.preset),
    "model.hf_dir / model.preset",
    (c.model.hf_dir, c.model.preset),
    "set exactly one of the two",
  )
  _require(
    c.model.dtype in ("float32", "bfloat16"), "model.dtype", c.model.dtype, "float32 | bfloat16"
  )
  _require(
    not c.distill.enabled or r.sparse,
    "distill.enabled",
    c.distill.enabled,
    "DistillSparse adapts the sparse actor: needs rollout.sparse = True",
  )
  targets = tuple(t for t in c.distill.targets.split(",") if t)
  _require(
    set(targets) <= set(lora_lib.TARGETS) and targets,
    "distill.targets",
    c.distill.targets,
    f"comma-separated subset of {lora_lib.TARGETS}",
  )
  _require(
    schedule_lib.is_quantile(c.stats.quantile),
    "stats.quantile",
    c.stats.quantile,
    "must be a percentile in (0, 50), e.g. 5 (p5, the paper's) or 1 (p1)",
  )
  adaptive = schedule_lib.parse_adaptive(r.schedule, p) if r.sparse else None  # (tau, BASE)
  if r.sparse:  # no JAX computation here: validate runs before jax.distributed.initialize
    stages = ((0, adaptive[1]),) if adaptive else schedule_lib.parse_stages(r.schedule, p)
    for _, schedule in stages:
      _require(
        schedule.always_kept <= schedule.max_pages,
        "rollout.schedule",
        r.schedule,
        "budget below the always-kept pages",
      )
      schedule.check_quantile(
        c.stats.quantile, f"config.rollout.schedule = {r.schedule!r}", "config.stats.quantile"
      )
      try:
        sampler.check_geometry(schedule, _sparse(c))
      except ValueError as e:
        raise ValueError(f"config.rollout.schedule = {r.schedule!r} is invalid: {e}") from None
  if adaptive:
    _validate_adaptive(c, *adaptive)
  for field, ok, allowed in (
    ("rl.learning_rate", c.rl.learning_rate > 0, "must be > 0"),
    ("rl.warmup_steps", c.rl.warmup_steps >= 0, "must be >= 0"),
    ("rl.max_grad_norm", c.rl.max_grad_norm > 0, "must be > 0"),
    ("rl.weight_decay", c.rl.weight_decay >= 0, "must be >= 0"),
    ("keep_checkpoints", c.keep_checkpoints >= 1, "must be >= 1"),
    ("max_nonfinite_steps", c.max_nonfinite_steps >= 1, "must be >= 1"),
    ("rollout.max_prompt_len", r.max_prompt_len >= 1, "must be >= 1"),
    ("rollout.num_top_logprobs", r.num_top_logprobs >= 0, "must be >= 0 (0 = off)"),
    ("rollout.engine_slots", r.engine_slots >= 0, "must be >= 0 (0 = all of a device's rows)"),
    ("rollout.pool_gb", r.pool_gb >= 0, "must be >= 0 (0 = room for all rows at full length)"),
    ("rollout.chunk_steps", r.chunk_steps >= 1, "must be >= 1"),
    ("distill.rank", not c.distill.enabled or c.distill.rank >= 1, "must be >= 1"),
    ("distill.alpha", not c.distill.enabled or c.distill.alpha > 0, "must be > 0"),
    ("distill.learning_rate", not c.distill.enabled or c.distill.learning_rate > 0, "must be > 0"),
    (
      "hardware",
      c.hardware in (*cost_model.HARDWARE, cost_model.THIS_MACHINE),
      f"one of {sorted(cost_model.HARDWARE) + [cost_model.THIS_MACHINE]}",
    ),
  ):
    value = c
    for name in field.split("."):
      value = value[name]
    _require(ok, field, value, allowed)
  _check_model_fits(c)


def _validate_adaptive(c, tau, base):
  """What 'adaptive:TAU:BASE' needs beyond its spec (which `parse_adaptive` checks)."""
  r, s = c.rollout, c.stats
  _require(
    s.exact_acceptance,
    "stats.exact_acceptance",
    s.exact_acceptance,
    f"must be True with rollout.schedule = {r.schedule!r}: its budgets move by the tail of "
    "exact alpha per bin (the sampled and top-20 estimators are biased low in the tail)",
  )
  _require(
    s.tau == tau,
    "stats.tau",
    s.tau,
    f"must equal the TAU {tau:g} of rollout.schedule = {r.schedule!r}: the loop pools "
    "each bin's share of tokens under stats.tau (acceptance/frac_below_tau_bin)",
  )
  _require(
    base.bin_size == s.bin_size,
    "stats.bin_size",
    s.bin_size,
    f"must equal the bin_size {base.bin_size} of the BASE of {r.schedule!r}: the tail of "
    "stats bin b moves table bin b, so both must bin the same tokens",
  )
  _require(
    max(base.values) >= 1,
    "rollout.schedule",
    r.schedule,
    "BASE's top-k are all 0, so its ceiling (rollout.adaptive_headroom x the largest) is 0",
  )
  q = c.stats.quantile / 100
  for field, value, ok, allowed in (
    ("adaptive_headroom", r.adaptive_headroom, r.adaptive_headroom >= 1, "must be >= 1"),
    ("adaptive_raise", r.adaptive_raise, r.adaptive_raise > 1, "must be > 1"),
    ("adaptive_lower", r.adaptive_lower, 0 < r.adaptive_lower < 1, "must be in (0, 1)"),
    (
      "adaptive_window",
      r.adaptive_window,
      isinstance(r.adaptive_window, int) and r.adaptive_window >= 1,
      "an int >= 1",
    ),
    (
      "adaptive_lower_share",
      r.adaptive_lower_share,
      0 <= r.adaptive_lower_share < q,
      f"must be in [0, {q:g}): a share above {q:g} fails",
    ),
    (
      "adaptive_min_tokens",
      r.adaptive_min_tokens,
      isinstance(r.adaptive_min_tokens, int) and r.adaptive_min_tokens >= 1,
      "an int >= 1",
    ),
  ):
    _require(ok, f"rollout.{field}", value, allowed)


def _adaptive(c):
  """rollout.schedule = 'adaptive:TAU:BASE' (sparse) -> (the first step's table, the ceiling
  table, next(LoopState, metrics) -> the next step's LoopState: schedule.adapt_topk); None for
  other schedules.

  The table has a bin per stats bin at least (BASE's last value repeated: the same budgets), so
  every measured bin moves its own value; bins past stats.num_bins are never measured and hold."""
  r = c.rollout
  parsed = schedule_lib.parse_adaptive(r.schedule, r.page_size) if r.sparse else None
  if parsed is None:
    return None
  tau, base = parsed
  first = dataclasses.replace(
    base, values=base.values + base.values[-1:] * (c.stats.num_bins - len(base.values))
  )
  ceiling = dataclasses.replace(base, values=(math.ceil(r.adaptive_headroom * max(base.values)),))
  unmeasured = len(first.values) - c.stats.num_bins
  rule = schedule_lib.LoopRule(
    tau,
    ceiling.values[0],
    r.adaptive_raise,
    r.adaptive_lower,
    r.adaptive_window,
    r.adaptive_lower_share,
    r.adaptive_min_tokens,
    c.stats.quantile,
  )

  def next_state(state, metrics):
    pad = lambda x, fill=0: np.pad(np.asarray(x, np.float64), (0, unmeasured), constant_values=fill)
    count_b = pad(metrics["acceptance/count_bin"]).astype(np.int64)
    # the step's tokens under tau per bin (an empty bin's NaN share: none)
    below_b = np.rint(np.nan_to_num(pad(metrics["acceptance/frac_below_tau_bin"])) * count_b)
    p10_b = pad(metrics["acceptance/p10_bin"], np.nan)
    return schedule_lib.adapt_topk(state, count_b, below_b.astype(np.int64), p10_b, rule)

  return first, ceiling, next_state


def _model_config(c) -> Qwen3Config:
  """The model's config.json (read without its weights) or preset."""
  return load_config(c.model.hf_dir) if c.model.hf_dir else Qwen3Config.preset(c.model.preset)


def _check_model_fits(c):
  """Checks against the model's config.json or preset."""
  r = c.rollout
  cfg = _model_config(c)
  if r.sparse:
    _require(
      r.dense_layers < cfg.num_hidden_layers,
      "rollout.dense_layers",
      r.dense_layers,
      f"must be below the model's {cfg.num_hidden_layers} layers (sparse rollouts need a "
      "sparse layer)",
    )
  length = r.max_prompt_len + r.max_new_tokens
  _require(
    length <= cfg.max_position_embeddings,
    "rollout.max_prompt_len + max_new_tokens",
    length,
    f"must be <= the model's max_position_embeddings ({cfg.max_position_embeddings})",
  )
  if r.pool_gb:
    Z = engine.page_size(_sparse(c))
    need = -(-(length - 1) // Z) + 2  # a row at its cap, its prompt's template page, the trash page
    have = engine_config(c, cfg, rows_per_device=1).num_pages
    _require(
      have >= need,
      "rollout.pool_gb",
      r.pool_gb,
      f"holds {have} pages of {Z} tokens; one row of max_prompt_len + max_new_tokens = "
      f"{length} tokens needs {need}",
    )


def predicted_speedup(
  c, cfg, schedule, engine_cfg: engine.EngineConfig, hardware, prompt_lens, lengths
) -> float:
  """Sparse over dense rollout tokens/s of one device of `hardware` running this run's engine
  (its slots and pool) on this step's mean prompt and mean response length (the roofline of
  cost_model.roofline_engine_rate: weights and KV read per decode step, each prompt prefilled
  once)."""
  r = c.rollout
  rate = lambda sched: cost_model.roofline_engine_rate(
    cfg,
    sched,
    int(np.mean(prompt_lens)),
    r.max_new_tokens,
    slots=engine_cfg.num_slots,
    pool_tokens=engine_cfg.num_pages * r.page_size,
    mean_len_frac=min(max(float(np.mean(lengths)) / r.max_new_tokens, 1 / r.max_new_tokens), 1.0),
    n_samples=r.group_size,
    hardware=hardware,
    sparse=_sparse(c),
  )[0]
  return rate(schedule) / rate(None)


def engine_config(c, cfg: Qwen3Config, rows_per_device: int) -> engine.EngineConfig:
  """Each device's slots and pool from config.rollout: by default `engine.full_batch` (every row of
  the device's step at once, no row waits or is preempted); engine_slots / pool_gb size them for
  long-tailed lengths (more rows than slots: a finished row's slot is refilled at once)."""
  r, sparse = c.rollout, _sparse(c)
  config = engine.full_batch(
    rows_per_device, r.group_size, r.max_prompt_len + r.max_new_tokens, sparse, r.chunk_steps
  )
  if r.engine_slots:
    config = dataclasses.replace(config, num_slots=r.engine_slots)
  if r.pool_gb:
    config = dataclasses.replace(
      config,
      num_pages=engine.pages_for_bytes(
        cfg,
        r.pool_gb * 1e9,
        engine.page_size(sparse),
        jnp.dtype(c.model.dtype),
        sparse.page_score if sparse else "mean",
      ),
    )
  return config


def make_task(c):
  """The task of config `c` (its `task` group and `seed`) from the task registry; an unknown name
  or unreadable data names the config fields."""
  try:
    return tasks.make_task(
      c.task.name,
      c.task.path or None,
      seed=c.seed,
      min_hops=c.task.min_hops,
      max_hops=c.task.max_hops,
    )
  except (ValueError, OSError) as e:
    raise ValueError(
      f"config.task.name = {c.task.name!r} with config.task.path = {c.task.path!r} is invalid: {e}"
    ) from None


def check_inputs(c, task, cfg: Qwen3Config, tokenizer) -> None:
  """The checks that need the task, the model's config and its tokenizer, run before anything is
  written: top-k log-probs within the vocabulary, and prompts within rollout.max_prompt_len."""
  r = c.rollout
  _require(
    r.num_top_logprobs <= cfg.vocab_size,
    "rollout.num_top_logprobs",
    r.num_top_logprobs,
    f"must be <= the model's vocabulary of {cfg.vocab_size} tokens (0 = off)",
  )
  unknown_id = _unknown_id(tokenizer)
  problems, lengths, unknown = _encode_prompts(task, tokenizer, r.prompts_per_step, unknown_id)
  longest = int(np.argmax(lengths))
  over = sum(n > r.max_prompt_len for n in lengths)
  _require(
    over == 0,
    "rollout.max_prompt_len",
    r.max_prompt_len,
    f"must hold every prompt: {over} of {len(lengths)} are longer, the longest "
    f"({getattr(problems[longest], 'id', longest)!r} of task {task.name!r}) has "
    f"{lengths[longest]} tokens",
  )
  # A vocabulary made for another task (the tiny pointer-chase model on math) encodes most of the
  # text as its unknown token: the run would train on prompts it cannot see.
  _require(
    unknown <= sum(lengths) / 2,
    "task.name",
    task.name,
    f"must be a task the model's tokenizer can read: {unknown} of its {sum(lengths)} prompt "
    f"tokens are the unknown token (id {unknown_id}) of config.model.hf_dir = "
    f"{c.model.hf_dir!r}; use a model made for this task",
  )


def _unknown_id(tokenizer):
  """The id that text outside the vocabulary encodes to; None when there is none (a byte-level
  BPE, as Qwen's, encodes any text)."""
  unk = getattr(getattr(getattr(tokenizer, "tok", None), "model", None), "unk_token", None)
  return tokenizer.tok.token_to_id(unk) if unk else None


def _encode_prompts(task, tokenizer, first_step: int, unknown_id, batch: int = 1024):
  """(problems, their prompts' token counts, how many of the tokens are `unknown_id`): every
  problem of a dataset task (a tokenizer pass over the data, seconds for 10^5 prompts), or the
  first step's of a generated task (an endless stream; a later, longer prompt stops the run at its
  step, the workdir intact)."""
  problems = getattr(task, "problems", None)
  if problems is None:
    problems = task.sample(first_step, 0)
  lengths, unknown = [], 0
  for i in range(0, len(problems), batch):
    tokens, lengths_B = tokenizer.encode_batch([p.prompt for p in problems[i : i + batch]])
    lengths += lengths_B.tolist()
    if unknown_id is not None:  # padding is the same id in some vocabularies: real tokens only
      real = np.arange(tokens.shape[1])[None, :] < lengths_B[:, None]
      unknown += int(np.sum((tokens == unknown_id) & real))
  return problems, lengths, unknown


def load_model(c, task):
  """(cfg, params, tokenizer). A random preset model is sized to the task's own vocabulary."""
  dtype = jnp.dtype(c.model.dtype)
  if c.model.hf_dir:
    cfg, params = load_hf(c.model.hf_dir, dtype=dtype)
    return cfg, params, load_tokenizer(c.model.hf_dir)
  tokenizer = task.own_tokenizer
  if tokenizer is None:
    raise ValueError(
      f"config.model.preset (random init) needs a task with its own vocabulary "
      f"(synthetic:pointer_chase), not {task.name!r}: set config.model.hf_dir for "
      "dataset tasks"
    )
  preset = Qwen3Config.preset(c.model.preset)
  cfg = Qwen3Config(**{**preset.__dict__, "vocab_size": tokenizer.vocab_size})
  return cfg, init_params(cfg, jax.random.PRNGKey(c.seed), dtype=dtype), tokenizer


def export_policy(c, cfg, params, directory, task):
  """The trained policy as a Hugging Face dir (sj.load_hf, transformers, experiments/evaluate.py):
  weights and config, plus the tokenizer and generation files of the source model dir (or, for a
  random preset, the task's own vocabulary)."""
  save_hf(directory, cfg, params)
  if not c.model.hf_dir:
    task.save_tokenizer(directory)
    return
  for name in _TOKENIZER_FILES:
    if os.path.exists(os.path.join(c.model.hf_dir, name)):
      shutil.copy(os.path.join(c.model.hf_dir, name), directory)


_TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "vocab.json",
  "merges.txt",
  "generation_config.json",
)


def _prompts(problems, tokenizer, group_size, width):
  """Host arrays of right-padded prompt rows (each problem group_size times) and their lengths."""
  texts = [p.prompt for p in problems for _ in range(group_size)]
  tokens, lengths = tokenizer.encode_batch(texts)
  if tokens.shape[1] > width:
    raise ValueError(
      f"a prompt has {tokens.shape[1]} tokens, more than config.rollout.max_prompt_len = {width}"
    )
  tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])), constant_values=tokenizer.pad_id)
  return tokens.astype(np.int32), np.asarray(lengths, np.int32)


def _responses(rollout, tokenizer):
  """Decoded completions of this process's rows."""
  tokens, lengths = sharding.local_rows(rollout.tokens), sharding.local_rows(rollout.lengths)
  return [tokenizer.decode(row[:n]) for row, n in zip(tokens, lengths)]


def init_distributed(c) -> None:
  """jax.distributed.initialize when config.distributed.enabled (before anything touches a
  device). Empty coordinator / -1 counts: detected from the cluster (SLURM, Open MPI, TPU pods)."""
  d = c.distributed
  if not d.enabled or jax.distributed.is_initialized():
    return
  jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU devices: gloo collectives
  kwargs = {
    "coordinator_address": d.coordinator or None,
    "num_processes": d.num_processes if d.num_processes > 0 else None,
    "process_id": d.process_id if d.process_id >= 0 else None,
  }
  jax.distributed.initialize(**{k: v for k, v in kwargs.items() if v is not None})


def make_mesh(c):
  """The config's (data, fsdp, tensor) mesh over every process's devices, checked against the
  batch: each micro-batch's rows must split evenly over data x fsdp, and each process must hold
  whole GRPO groups (it samples and rewards its own prompts)."""
  m, r = c.mesh, c.rollout
  try:
    mesh = sharding.make_mesh(m.data, m.fsdp, m.tensor)
  except ValueError as e:
    raise ValueError(
      f"config.mesh (data={m.data}, fsdp={m.fsdp}, tensor={m.tensor}) is invalid: {e}"
    ) from None
  ways = mesh.shape["data"] * mesh.shape["fsdp"]
  rows = r.prompts_per_step * r.group_size
  slices = c.rl.num_minibatches * c.rl.micro_batches
  _require(
    rows % (slices * ways) == 0,
    "rl.micro_batches",
    c.rl.micro_batches,
    f"rows per micro-batch ({rows} rollouts / rl.num_minibatches {c.rl.num_minibatches} / "
    f"rl.micro_batches = {rows / slices:g}) must be a whole multiple of mesh data x fsdp = "
    f"{ways}",
  )
  lo, hi = sharding.process_rows(sharding.rows(mesh), rows)
  _require(
    lo % r.group_size == 0 and hi % r.group_size == 0,
    "rollout.group_size",
    r.group_size,
    f"this process holds rows [{lo}, {hi}): each process must hold whole groups",
  )
  return mesh


# Fields that may differ when a workdir is resumed: how long to run and what to keep, not what runs.
# Also where it runs: a run may resume on another mesh or cluster (orbax reshards the state).
RESUMABLE_FIELDS = (
  "workdir",
  "total_steps",
  "ckpt_every",
  "keep_checkpoints",
  "export_hf",
  "max_nonfinite_steps",
  "mesh.data",
  "mesh.fsdp",
  "mesh.tensor",
  "distributed.enabled",
  "distributed.coordinator",
  "distributed.num_processes",
  "distributed.process_id",
)


def _flat(d, prefix=""):
  out = {}
  for k, v in d.items():
    out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
  return out


def check_resume(c) -> None:
  """A workdir holds one run: resuming it with another config (other than RESUMABLE_FIELDS) would
  mix two runs in one set of curves and checkpoints, so it is refused, naming the fields. So are
  checkpoints without a readable config.json: nothing says which config they belong to. Reads
  only: a refusal changes nothing."""
  path = os.path.join(c.workdir, "config.json")
  put_back = "Nothing was changed; put back the run's config.json, or use a new config.workdir"
  if not os.path.exists(path):
    checkpoints = os.path.join(c.workdir, "checkpoints")
    if os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints)):
      raise ValueError(
        f"config.workdir = {c.workdir!r} holds checkpoints ({checkpoints}) but no "
        f"config.json to check this config against. {put_back}"
      )
    return
  try:
    with open(path) as f:
      old = _flat(json.load(f))
  except ValueError as e:
    raise ValueError(
      f"config.workdir = {c.workdir!r}: {path} is not JSON ({e}). {put_back}"
    ) from None
  new = _flat(json.loads(c.to_json_best_effort()))
  changed = [
    k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k) and k not in RESUMABLE_FIELDS
  ]
  if changed:
    diffs = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:8])
    raise ValueError(
      f"config.workdir = {c.workdir!r} holds a run with another config ({diffs}). "
      f"Use a new config.workdir, or resume with the run's config ({path}); fields "
      f"that may change on resume: {', '.join(RESUMABLE_FIELDS)}"
    )


def _strict_json(value):
  """NaN / inf (an empty bin's p5, ...) as null, so the file is strict JSON."""
  if isinstance(value, dict):
    return {k: _strict_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_strict_json(v) for v in value]
  return None if isinstance(value, float) and not np.isfinite(value) else value


def _sparse(c):
  return schema.from_group(SparseConfig, c, "rollout") if c.rollout.sparse else None


def _optimizers(c):
  """(learning-rate schedule, optimizer of the base params, optimizer of the LoRA or None)."""
  lr = optax.join_schedules(
    [
      optax.linear_schedule(0.0, c.rl.learning_rate, c.rl.warmup_steps),
      optax.constant_schedule(c.rl.learning_rate),
    ],
    [c.rl.warmup_steps],
  )
  optimizer = optax.chain(
    optax.clip_by_global_norm(c.rl.max_grad_norm), optax.adamw(lr, weight_decay=c.rl.weight_decay)
  )
  lora_opt = None
  if c.distill.enabled:
    lora_opt = optax.chain(
      optax.clip_by_global_norm(c.rl.max_grad_norm), optax.adam(c.distill.learning_rate)
    )
  return lr, optimizer, lora_opt


def _state_init(c, optimizer, lora_opt):
  """(init(params, lora) -> TrainState, make_lora(params) -> the LoRA to start from, or None)."""
  make_lora = None
  if c.distill.enabled:
    make_lora = lambda p: lora_lib.init_lora(
      p,
      jax.random.PRNGKey(c.seed + 1),
      rank=c.distill.rank,
      alpha=c.distill.alpha,
      targets=tuple(c.distill.targets.split(",")),
    )
  init = lambda p, lora: ts.init_state(
    p, optimizer, lora, lora_opt, keep_reference=c.rl.kl_coef > 0
  )
  return init, make_lora


def _build_state(c, params, mesh, optimizer, lora_opt):
  """The initial TrainState, born sharded on `mesh` (optimizer and LoRA states are created on
  their shards), and its shardings."""
  init, make_lora = _state_init(c, optimizer, lora_opt)
  lora = make_lora(params) if make_lora else None
  shardings = ts.state_sharding(jax.eval_shape(init, params, lora), mesh, optimizer, lora_opt)
  params = sharding.place(params, shardings.params)
  lora = None if lora is None else sharding.place(lora, shardings.lora)
  return jax.jit(init, out_shardings=shardings)(params, lora), shardings


def lower_step(c):
  """The config's train step lowered at full size on the current devices' mesh, from abstract
  params and batch (nothing is allocated, no weights or data read): checks that a real-run config
  builds, shards and traces before a cluster is booked. Returns the jax `Lowered` and the train
  state's shardings."""
  validate(c)
  mesh = make_mesh(c)
  r = c.rollout
  cfg = _model_config(c)
  params = jax.eval_shape(
    lambda: init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.dtype(c.model.dtype))
  )
  _, optimizer, lora_opt = _optimizers(c)
  init, make_lora = _state_init(c, optimizer, lora_opt)
  state = jax.eval_shape(init, params, jax.eval_shape(make_lora, params) if make_lora else None)
  shardings = ts.state_sharding(state, mesh, optimizer, lora_opt)
  step = ts.make_train_step(
    cfg, ts.StepConfig.from_config(c), optimizer, lora_opt, _sparse(c), shardings
  )
  length = r.max_prompt_len + r.max_new_tokens
  batch = ts.Batch.abstract(r.prompts_per_step * r.group_size, length, r.num_top_logprobs > 0)
  budget = (
    schedule_lib.BudgetTable(jax.ShapeDtypeStruct((length + 1,), jnp.int32)) if r.sparse else None
  )
  with jax.set_mesh(mesh):
    return step.lower(state, batch, budget), shardings


def _rollout_weights(state, mesh):
  """(params, lora) -> the sampler's copy, gathered over fsdp once per rollout
  (sharding.ROLLOUT_RULES); the identity without FSDP."""
  if mesh.shape["fsdp"] == 1:
    return lambda params, lora: (params, lora)
  rules = sharding.ROLLOUT_RULES
  out = (
    sharding.param_shardings(state.params, mesh, rules),
    None if state.lora is None else sharding.lora_shardings(state.lora, mesh, rules),
  )
  return jax.jit(lambda params, lora: (params, lora), out_shardings=out)


LOCK_FILE = "run.lock"


@contextlib.contextmanager
def workdir_lock(workdir: str):
  """One run per workdir: an exclusive flock on <workdir>/run.lock, held while the run lasts. The
  kernel drops it when the process dies, even by SIGKILL, so a killed run leaves nothing stuck. A
  second run is refused (ValueError naming the holder). flock is per host: on a shared file system
  it holds across hosts only where that file system supports flock."""
  f = open(os.path.join(workdir, LOCK_FILE), "a+")
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    f.seek(0)
    holder = f.read().strip() or "another process"
    f.close()
    raise ValueError(
      f"config.workdir = {workdir!r} is in use by another run ({holder}; "
      f"{os.path.join(workdir, LOCK_FILE)} is locked): one run per workdir; wait "
      "for it to end or use another config.workdir"
    ) from None
  try:
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    yield
  finally:
    f.close()  # releases the lock


def train(c: ml_collections.ConfigDict) -> list:
  """Runs (or resumes) the job described by config `c`; returns the per-step metrics rows."""
  validate(c)
  init_distributed(c)
  mesh = make_mesh(c)
  with jax.set_mesh(mesh), contextlib.ExitStack() as run:
    return _train(c, mesh, run)


def _train(c, mesh, run: contextlib.ExitStack):
  """The run; what it holds until it ends (the workdir lock) goes on `run`."""
  lead = jax.process_index() == 0  # writes the logs, the config and the exported policy
  check_resume(c)  # reads only: a changed config fails before the model loads
  task = make_task(c)  # before the model: a bad dataset fails in seconds
  cfg, params, tokenizer = load_model(c, task)
  check_inputs(c, task, cfg, tokenizer)
  r = c.rollout
  sparse = _sparse(c)
  adaptive = _adaptive(c)  # (first table, ceiling, next_topk) or None
  stages = (
    None
    if not r.sparse
    else (((0, adaptive[0]),) if adaptive else schedule_lib.parse_stages(r.schedule, r.page_size))
  )
  sc = ts.StepConfig.from_config(c)
  lr, optimizer, lora_opt = _optimizers(c)
  state, state_shardings = _build_state(c, params, mesh, optimizer, lora_opt)
  del params
  train_step = ts.make_train_step(cfg, sc, optimizer, lora_opt, sparse, state_shardings)
  rows_sh = sharding.rows(mesh)
  rollout_weights = _rollout_weights(state, mesh)
  to_batch = jax.jit(ts.batch_from_rollout, out_shardings=rows_sh)
  n_prompts = r.prompts_per_step
  n_rows = n_prompts * r.group_size
  lo, hi = sharding.process_rows(rows_sh, n_rows)  # this process's rows: its prompts and rewards
  engine_cfg = engine_config(c, cfg, n_rows // page_pool.row_shards())
  # the predicted speedup's hardware ("this_machine" is measured once, here)
  hardware = cost_model.get_hardware(c.hardware) if sparse else None

  # Nothing is written before this point, so a config error leaves no workdir (or the old one).
  os.makedirs(c.workdir, exist_ok=True)
  if lead:
    run.enter_context(workdir_lock(c.workdir))
    check_resume(c)  # again under the lock: a run may have written its config.json meanwhile
  mgr = checkpoint.manager(c.workdir, c.keep_checkpoints)
  restored = checkpoint.restore_latest(mgr, state)  # restored onto the state's shardings
  start = 0
  # The closed loop's table in force, floors and pools (schedule.adapt_topk).
  loop = schedule_lib.LoopState.start(adaptive[0].values) if adaptive else None
  if restored is not None:
    state, meta = restored
    start = int(meta["step"])
    if adaptive and "adaptive" in meta:
      loop = schedule_lib.LoopState(**{k: tuple(v) for k, v in meta["adaptive"].items()})
    elif adaptive:  # a checkpoint of the per-step loop: its table and floors, an empty pool
      loop = loop.start(meta["topk_bin"])._replace(floor=tuple(meta["floor_bin"]))
    _print(f"resumed from {c.workdir} at step {start} (data position {meta['data_position']})")
  if start == c.total_steps and not os.path.exists(os.path.join(c.workdir, "summary.json")):
    _print(
      f"{c.workdir} is at its last step {start} without summary.json: the run was cut after "
      "its last checkpoint; writing what it had left"
      + (" (hf export, summary)" if c.export_hf else " (summary)")
    )
    _finish(c, cfg, state, task, _logged_row(c.workdir, start) if lead else None, times=None)
    return []
  if start >= c.total_steps:
    _print(
      f"{c.workdir} is at step {start} >= config.total_steps = {c.total_steps}: nothing to "
      "run, nothing rewritten (raise config.total_steps to continue)"
    )
    return []
  if lead:
    metrics_log.write_atomic(
      os.path.join(c.workdir, "config.json"), c.to_json_best_effort(indent=2)
    )
  logger = metrics_log.MetricsLogger(c.workdir, resume_step=start) if lead else None
  cache_len = r.max_prompt_len + r.max_new_tokens
  sampling = sampler.Sampling(
    temperature=r.temperature,
    top_p=r.top_p,
    eos_ids=tokenizer.eos_ids,
    pad_id=tokenizer.pad_id,
    num_top_logprobs=r.num_top_logprobs,
  )

  # One static cap on selected pages for every table the run can use (all stages, or up to the
  # adaptive ceiling): a new stage or adaptive table changes only the traced BudgetTable, so
  # neither the sampler nor the train step recompiles.
  # Each distinct schedule's table is built and placed once (a stage's every step reuses it; an
  # adaptive table only when the budgets moved): -> (pages by length on the host, its BudgetTable).
  table_of = functools.cache(lambda schedule: sampler.budget_table(schedule, cache_len, sparse))
  max_selected = (
    sampler.max_selected_pages(
      [table_of(s) for _, s in stages] + ([table_of(adaptive[1])] if adaptive else [])
    )
    if sparse
    else 0
  )

  @functools.cache
  def budget_of(schedule):
    table = schedule_lib.BudgetTable(table_of(schedule), max_selected)
    return table_of(schedule), sharding.place(table, sharding.replicated(mesh))

  key = jax.random.PRNGKey(c.seed)
  rows, nonfinite = [], 0
  # wall time by part; the first step of a process also compiles (the sampler and the train step)
  times = {"first_step": 0.0, "rollout": 0.0, "train_step": 0.0, "total": time.time()}

  for step in range(start, c.total_steps):
    t0 = time.time()
    schedule = budget_by_len = budget = None
    if sparse:
      stage = schedule_lib.stage_index(stages, step)
      schedule = stages[stage][1]
      if adaptive:
        schedule = dataclasses.replace(schedule, values=loop.topk)
      budget_by_len, budget = budget_of(schedule)
    problems = task.sample(n_prompts, step * n_prompts)[lo // r.group_size : hi // r.group_size]
    local_prompts = _prompts(problems, tokenizer, r.group_size, r.max_prompt_len)
    prompt, prompt_len = (sharding.from_local_rows(x, rows_sh, n_rows) for x in local_prompts)
    params, lora = rollout_weights(state.params, state.lora)
    requests = engine.Requests(*local_prompts, r.max_new_tokens, r.group_size, first_row=lo)
    rollout, engine_stats = engine.run(
      params,
      cfg,
      requests,
      np.asarray(jax.random.fold_in(key, step)),
      engine=engine_cfg,
      sampling=sampling,
      sparse=sparse,
      schedule=budget,
      lora=lora,
    )
    rollout = jax.tree_util.tree_map(  # this process's rows -> the global rows
      lambda x: sharding.from_local_rows(np.asarray(x), rows_sh, n_rows), rollout
    )
    del params, lora
    t_rollout = time.time() - t0
    grouped = [p for p in problems for _ in range(r.group_size)]
    rewards = task.reward(_responses(rollout, tokenizer), grouped)
    batch = to_batch(
      prompt,
      prompt_len,
      rollout,
      sharding.from_local_rows(np.asarray(rewards, np.float32), rows_sh, n_rows),
    )
    t1 = time.time()
    state, metrics = train_step(state, batch, budget)
    metrics = jax.tree_util.tree_map(sharding.to_host, metrics)
    t_train = time.time() - t1
    times["rollout"] += t_rollout
    times["train_step"] += t_train

    prompt_lens, lengths = sharding.to_host(prompt_len), sharding.to_host(rollout.lengths)
    metrics.update(
      {
        "perf/rollout_tokens_per_s": int(np.sum(lengths)) / t_rollout,
        # this process's engine (they depend on the devices, as timings do)
        "perf/engine_occupancy": engine_stats.occupancy,
        "perf/engine_rows_in_flight": engine_stats.rows_in_flight,
        "perf/engine_preemptions": engine_stats.preemptions,
        "perf/train_step_s": t_train,
        "lr": float(lr(step)),
        "kv/read_fraction": cost_model.kv_read_fraction(
          budget_by_len, prompt_lens, lengths, cfg, sparse
        ),
      }
    )
    if sparse is not None:
      metrics["kv/schedule_stage"] = stage
      if adaptive:
        metrics["kv/topk_bin"] = np.asarray(loop.topk, np.int32)  # the table this step ran under
        metrics["kv/floor_bin"] = np.asarray(loop.floor, np.int32)  # and its floors
        # The start table's read of the same rollouts: the loop's saving (or cost) over the table
        # it moved from, paired token for token (two runs' read fractions differ by their lengths).
        metrics["kv/read_fraction_start"] = cost_model.kv_read_fraction(
          budget_of(stages[stage][1])[0], prompt_lens, lengths, cfg, sparse
        )
      metrics["kv/predicted_speedup"] = predicted_speedup(
        c, cfg, schedule, engine_cfg, hardware, prompt_lens, lengths
      )
    if lead:
      logger.write(step + 1, metrics)
    rows.append({k: np.asarray(v).tolist() for k, v in metrics.items()})
    nonfinite = nonfinite + 1 if metrics["skipped"] else 0
    if nonfinite >= c.max_nonfinite_steps:
      raise FloatingPointError(
        f"{nonfinite} non-finite updates in a row (step {step + 1}); see {c.workdir}/metrics.jsonl"
      )
    done = step + 1 - start
    if done == 1:
      times["first_step"] = time.time() - t0
      t_compiled = time.time()
    eta = (
      "--"
      if done == 1
      # compile time excluded: from the steps after the first
      else f"{(time.time() - t_compiled) / (done - 1) * (c.total_steps - step - 1):.0f}s"
    )
    _print(
      f"step {step + 1}/{c.total_steps}  reward {metrics['reward/mean']:.3f}  "
      f"p5 {metrics.get('acceptance/p5', metrics['acceptance_sampled/p5']):.3f}  "
      f"len {metrics['response_length/mean']:.0f}  "
      f"{metrics['perf/rollout_tokens_per_s']:.0f} tok/s  kv {metrics['kv/read_fraction']:.2f}  "
      f"{'SKIPPED ' if metrics['skipped'] else ''}ETA {eta}"
    )
    meta = {"step": step + 1, "data_position": (step + 1) * n_prompts}
    if adaptive:  # the next step's table, a function of this step's tail: a resume replays it
      loop = adaptive[2](loop, metrics)
      meta["adaptive"] = {k: list(v) for k, v in loop._asdict().items()}
    if (step + 1) % c.ckpt_every == 0 or step + 1 == c.total_steps:
      checkpoint.save(mgr, step + 1, state, meta)
  mgr.wait_until_finished()
  if lead:
    logger.close()
  times["total"] = time.time() - times["total"]
  _finish(c, cfg, state, task, rows[-1], times)
  _print(
    f"time: {times['total']:.0f}s in all, first step (with compilation) "
    f"{times['first_step']:.0f}s, rollouts {times['rollout']:.0f}s, train steps "
    f"{times['train_step']:.0f}s"
  )
  _print(
    f"done: {c.total_steps} steps; metrics {c.workdir}/metrics.jsonl, TensorBoard "
    f"{c.workdir}/tensorboard, checkpoints {c.workdir}/checkpoints"
    + (f", policy {c.workdir}/hf" if c.export_hf else "")
  )
  return rows


def _finish(c, cfg, state, task, last_row: dict, times) -> None:
  """The end of a run after its last checkpoint: the exported policy (config.export_hf), then
  summary.json, written last, so a workdir without one is a run cut before its end."""
  lead = jax.process_index() == 0
  if c.export_hf:  # every process joins the gather; the lead writes
    params = jax.tree_util.tree_map(sharding.to_host, state.params)
    if lead:
      export_policy(c, cfg, params, os.path.join(c.workdir, "hf"), task)
  if lead:  # time_s null: the run's time was not measured by the process that finished it
    metrics_log.write_atomic(
      os.path.join(c.workdir, "summary.json"),
      json.dumps(
        {"steps": c.total_steps, "time_s": times, "last": _strict_json(last_row)},
        indent=2,
        allow_nan=False,
      ),
    )


def _logged_row(workdir: str, step: int) -> dict | None:
  """Step `step`'s row of metrics.jsonl (the logger's form: per-bin lists, no histograms); None,
  with a warning, when the file does not hold it (a write the machine lost)."""
  path = os.path.join(workdir, "metrics.jsonl")
  rows = [
    r
    for r in (metrics_log.read_rows(path) if os.path.exists(path) else ())
    if r.get("step") == step
  ]
  if not rows:
    _print(f"warning: {path} has no row of step {step}; summary.json's last is null")
    return None
  return rows[-1]


def _print(message: str) -> None:
  """Progress on the lead process only (every process runs the same loop)."""
  if jax.process_index() == 0:
    print(message, flush=True)
