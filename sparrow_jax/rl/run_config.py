"""The checks of a training run's experiment config, each run before anything is written: the
fields only the whole config knows (`validate`; the components check their own fields,
`schema.from_group`), then against the mesh, the task and the model's tokenizer, the device's
memory (the sizes rl/memory.py computes, the train step's compiled from abstract inputs), the
workdir, and the rule for resuming a workdir. rl/build.py runs them as it builds the run.
"""

import fcntl
import json
import math
import os
import tempfile

from etils import epath
import ml_collections
import numpy as np

from sparrow_jax import schema, sharding
from sparrow_jax.attention.select import SparseConfig
from sparrow_jax.logging import is_local
from sparrow_jax.mismatch import cost_model
from sparrow_jax.model import lora as lora_lib
from sparrow_jax.model.config import Qwen3Config
from sparrow_jax.model.hf import load_config
from sparrow_jax.rl import memory, rollouts, step_schema
from sparrow_jax.rl.evaluate import EvalConfig
from sparrow_jax.rollout import engine, sampler
from sparrow_jax.sparsity import schedule as schedule_lib


def require(ok: bool, field: str, value, allowed: str):
  if not ok:
    raise ValueError(f"config.{field} = {value!r} is invalid: {allowed}")


# Config integers are array sizes, counts and the seed of a 32-bit jax PRNG key: int32 holds them.
INT_MIN, INT_MAX = -(2**31), 2**31 - 1


def _check_scalars(c) -> None:
  """Each value alone: a workdir to write to, a seed a PRNG key holds, every int in int32 and
  every float finite (an inf learning rate or NaN coefficient would train on nonsense)."""
  require(
    isinstance(c.workdir, str) and c.workdir.strip() != "",
    "workdir",
    c.workdir,
    "must be a directory path (not empty)",
  )
  require(
    isinstance(c.seed, int) and not isinstance(c.seed, bool) and 0 <= c.seed <= INT_MAX,
    "seed",
    c.seed,
    f"must be an int in [0, {INT_MAX}]",
  )
  for field, value in _flat(c.to_dict()).items():
    if isinstance(value, float):
      require(math.isfinite(value), field, value, "must be a finite number")
    elif isinstance(value, int) and not isinstance(value, bool):
      require(
        INT_MIN <= value <= INT_MAX, field, value, f"must be an int in [{INT_MIN}, {INT_MAX}]"
      )


def validate(c: ml_collections.ConfigDict) -> None:
  """Rejects a bad config up front, naming the field. Each component checks its own fields (the
  train step's `StepConfig`, `Sampling`, `AsyncConfig`, `SparseConfig`, `LoopConfig`,
  `EvalConfig`); what is
  left here is what only the whole config knows. What needs the data or the model's vocabulary is
  `check_inputs`, also run before anything is written."""
  _check_scalars(c)
  step_schema.StepConfig.from_config(c)
  schema.from_group(sampler.Sampling, c, "rollout")
  rollouts.AsyncConfig.of(c)
  _check_batch(c)
  _check_run_fields(c)
  _check_model_fields(c)
  _check_schedule(c)
  _check_ranges(c)
  _check_speculate(c)
  _check_model_fits(c)
  _check_env_task(c)


def _check_batch(c) -> None:
  """The step's rows: how many, split how over the mesh and the minibatches, sampled how."""
  r = c.rollout
  require(r.prompts_per_step >= 1, "rollout.prompts_per_step", r.prompts_per_step, "must be >= 1")
  for name in ("data", "fsdp", "tensor"):
    ways = c.mesh[name]
    require(
      isinstance(ways, int) and (ways >= 1 or (name == "data" and ways == -1)),
      f"mesh.{name}",
      ways,
      "a positive number of devices" + (" or -1 (the rest)" if name == "data" else ""),
    )
  batch = r.prompts_per_step * r.group_size
  require(
    batch % c.rl.num_minibatches == 0,
    "rl.num_minibatches",
    c.rl.num_minibatches,
    f"must divide the batch of {batch} rollouts (prompts_per_step * group_size)",
  )
  require(r.max_new_tokens > 0, "rollout.max_new_tokens", r.max_new_tokens, "must be positive")
  require(
    r.top_p == 1.0,
    "rollout.top_p",
    r.top_p,
    "must be 1.0 in training: PPO, TIS and acceptance compare the sampled distribution "
    "with the dense policy's full softmax, which a truncated sampler does not match",
  )


def _check_run_fields(c) -> None:
  require(c.total_steps > 0, "total_steps", c.total_steps, "must be positive")
  require(c.ckpt_every > 0, "ckpt_every", c.ckpt_every, "must be positive")
  _check_profile_steps(c)
  _check_evaluation(c)
  _check_distributed(c.distributed)
  _check_row_length_fields(c)


def _check_model_fields(c) -> None:
  """Which model, in which dtype, and the LoRA DistillSparse puts on it."""
  require(
    bool(c.model.hf_dir) != bool(c.model.preset),
    "model.hf_dir / model.preset",
    (c.model.hf_dir, c.model.preset),
    "set exactly one of the two",
  )
  require(
    c.model.dtype in ("float32", "bfloat16"), "model.dtype", c.model.dtype, "float32 | bfloat16"
  )
  require(
    not c.distill.enabled or c.rollout.sparse,
    "distill.enabled",
    c.distill.enabled,
    "DistillSparse adapts the sparse actor: needs rollout.sparse = True",
  )
  targets = tuple(t for t in c.distill.targets.split(",") if t)
  require(
    set(targets) <= set(lora_lib.TARGETS) and targets,
    "distill.targets",
    c.distill.targets,
    f"comma-separated subset of {lora_lib.TARGETS}",
  )


def _check_schedule(c) -> None:
  """rollout.schedule against the sparse config (its own fields checked first, named as theirs)
  and the closed loop's settings. No JAX computation: validate runs before
  jax.distributed.initialize."""
  r = c.rollout
  adaptive = schedule_lib.parse_adaptive(r.schedule, r.page_size) if r.sparse else None
  if r.sparse:
    sparse = schema.from_group(SparseConfig, c, "rollout")
    stages = ((0, adaptive[1]),) if adaptive else schedule_lib.parse_stages(r.schedule, r.page_size)
    for _, schedule in stages:
      require(
        schedule.always_kept <= schedule.max_pages,
        "rollout.schedule",
        r.schedule,
        "budget below the always-kept pages",
      )
      schedule.check_quantile(
        c.stats.quantile, f"config.rollout.schedule = {r.schedule!r}", "config.stats.quantile"
      )
      try:
        sampler.check_geometry(schedule, sparse)
      except ValueError as e:
        raise ValueError(f"config.rollout.schedule = {r.schedule!r} is invalid: {e}") from None
  if adaptive:
    _validate_adaptive(c, *adaptive)
  # The loop's ranges in every run, not only adaptive ones: a bad value is refused even where it
  # is not read yet; its share against stats.quantile binds only the adaptive runs that pool it.
  schema.from_group(schedule_lib.LoopConfig, c, "rollout", *(("stats",) if adaptive else ()))


def _check_ranges(c) -> None:
  """The fields no component owns: the optimizers', the trainer's and the engine's sizes."""
  r = c.rollout
  for field, ok, allowed in (
    ("rl.learning_rate", c.rl.learning_rate > 0, "must be > 0"),
    ("rl.warmup_steps", c.rl.warmup_steps >= 0, "must be >= 0"),
    ("rl.max_grad_norm", c.rl.max_grad_norm > 0, "must be > 0"),
    ("rl.weight_decay", c.rl.weight_decay >= 0, "must be >= 0"),
    ("keep_checkpoints", c.keep_checkpoints >= 1, "must be >= 1"),
    ("max_nonfinite_steps", c.max_nonfinite_steps >= 1, "must be >= 1"),
    ("rollout.max_prompt_len", r.max_prompt_len >= 1, "must be >= 1"),
    ("rollout.engine_slots", r.engine_slots >= 0, "must be >= 0 (0 = all of a device's rows)"),
    ("rollout.pool_gb", r.pool_gb >= 0, "must be >= 0 (0 = room for all rows at full length)"),
    (
      "rollout.chunk_steps",
      1 <= r.chunk_steps <= r.max_new_tokens,
      f"must be in [1, rollout.max_new_tokens = {r.max_new_tokens}]: a chunk runs that many "
      "decode steps of every slot, and no row decodes more",
    ),
    (
      "rollout.speculate_ks",
      len(r.speculate_ks) > 0 and all(isinstance(k, int) and k >= 1 for k in r.speculate_ks),
      "must be draft counts >= 1, e.g. (1, 2, 4)",
    ),
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
    require(ok, field, value, allowed)


def _check_profile_steps(c) -> None:
  steps = c.profile_steps
  ints = isinstance(steps, (tuple, list)) and all(
    isinstance(s, int) and not isinstance(s, bool) for s in steps
  )
  require(
    steps == () or (ints and len(steps) == 2 and 0 <= steps[0] < steps[1] <= c.total_steps),
    "profile_steps",
    steps,
    f"() (off) or (start, stop): the steps start..stop - 1, 0-based, ints with 0 <= start < "
    f"stop <= total_steps ({c.total_steps})",
  )


def _check_evaluation(c) -> None:
  e = schema.from_group(EvalConfig, c, "eval")
  require(
    e.every <= c.total_steps,
    "eval.every",
    e.every,
    f"must be 0 (off) or at most total_steps ({c.total_steps}): an evaluation runs after every "
    "eval.every-th step",
  )


def _check_env_task(c) -> None:
  """A multi-turn task (task.name env:NAME) on several processes plays each process's rows there,
  but its held-out evaluation gathers every row's episode on one host: not built."""
  if not c.task.name.startswith("env:"):
    return
  n, every = c.distributed.num_processes, c.eval.every
  require(
    n in (-1, 1) or every == 0,
    "eval.every",
    every,
    f"must be 0 with distributed.num_processes = {n}: the held-out evaluation of a multi-turn "
    f"task (task.name = {c.task.name!r}) runs on one process",
  )


def _check_distributed(d) -> None:
  """-1 is "detected from the cluster" (build.init_distributed)."""
  require(
    d.num_processes == -1 or d.num_processes >= 1,
    "distributed.num_processes",
    d.num_processes,
    "-1 (detected) or >= 1",
  )
  last = d.num_processes - 1 if d.num_processes >= 1 else INT_MAX
  require(
    d.process_id == -1 or 0 <= d.process_id <= last,
    "distributed.process_id",
    d.process_id,
    f"-1 (detected) or in [0, {last}] (num_processes - 1)",
  )


def _check_speculate(c) -> None:
  """Exact mode drafts with the sparse policy, so it needs sparse rollouts. A round drafts k
  tokens and verifies k + 1 positions, and no row emits more than max_new_tokens: a longer window
  drafts tokens no row can keep."""
  r = c.rollout
  fits = lambda k: isinstance(k, int) and not isinstance(k, bool) and 0 <= k < r.max_new_tokens
  window = f"k + 1 <= rollout.max_new_tokens ({r.max_new_tokens})"
  if r.speculate == "auto":
    require(
      all(fits(k) for k in r.speculate_ks),
      "rollout.speculate_ks",
      r.speculate_ks,
      f'draft counts k of rollout.speculate = "auto" must have {window}',
    )
  else:
    require(
      fits(r.speculate),
      "rollout.speculate",
      r.speculate,
      f'must be 0 (off), "auto" (a draft count of speculate_ks per position bin), or an int '
      f"k of draft tokens a round with {window}",
    )
  require(
    r.speculate == 0 or r.sparse,
    "rollout.speculate",
    r.speculate,
    "must be 0 with dense rollouts (rollout.sparse = False): the sparse policy drafts",
  )


def _check_row_length_fields(c) -> None:
  """Sizes bounded by the rows' length max_prompt_len + max_new_tokens: a length bucket longer than
  the rows is never chosen (a row of the full length runs at it already), and a position bin past
  a row's end holds nothing."""
  length = c.rollout.max_prompt_len + c.rollout.max_new_tokens
  long = [n for n in c.rl.length_buckets if n > length]
  require(
    not long,
    "rl.length_buckets",
    c.rl.length_buckets,
    f"must be at most the row length max_prompt_len + max_new_tokens = {length} ({long} past "
    "it; () = off)",
  )
  require(
    c.stats.num_bins <= length,
    "stats.num_bins",
    c.stats.num_bins,
    f"must be at most the row length max_prompt_len + max_new_tokens = {length}: a bin past "
    "a row's end holds nothing",
  )


def _validate_adaptive(c, tau, base):
  """What 'adaptive:TAU:BASE' needs beyond its spec (which `parse_adaptive` checks)."""
  r, s = c.rollout, c.stats
  require(
    s.exact_acceptance,
    "stats.exact_acceptance",
    s.exact_acceptance,
    f"must be True with rollout.schedule = {r.schedule!r}: its budgets move by the tail of "
    "exact alpha per bin (the sampled and top-20 estimators are biased low in the tail)",
  )
  require(
    s.tau == tau,
    "stats.tau",
    s.tau,
    f"must equal the TAU {tau:g} of rollout.schedule = {r.schedule!r}: the loop pools "
    "each bin's share of tokens under stats.tau (acceptance/frac_below_tau_bin)",
  )
  require(
    base.bin_size == s.bin_size,
    "stats.bin_size",
    s.bin_size,
    f"must equal the bin_size {base.bin_size} of the BASE of {r.schedule!r}: the tail of "
    "stats bin b moves table bin b, so both must bin the same tokens",
  )
  require(
    max(base.values) >= 1,
    "rollout.schedule",
    r.schedule,
    "BASE's top-k are all 0, so its ceiling (rollout.adaptive_headroom x the largest) is 0",
  )


def _check_model_fits(c):
  """Checks against the model's config.json or preset (read without the weights)."""
  r = c.rollout
  cfg = load_config(c.model.hf_dir) if c.model.hf_dir else Qwen3Config.preset(c.model.preset)
  if r.sparse:
    require(
      r.dense_layers < cfg.num_hidden_layers,
      "rollout.dense_layers",
      r.dense_layers,
      f"must be below the model's {cfg.num_hidden_layers} layers (sparse rollouts need a "
      "sparse layer)",
    )
  length = r.max_prompt_len + r.max_new_tokens
  require(
    length <= cfg.max_position_embeddings,
    "rollout.max_prompt_len + max_new_tokens",
    length,
    f"must be <= the model's max_position_embeddings ({cfg.max_position_embeddings})",
  )


def check_pool(c, sparse, one_row: engine.EngineConfig) -> None:
  """rollout.pool_gb holds a row at its cap (`one_row`: the engine config of one row a device)."""
  r = c.rollout
  if not r.pool_gb:
    return
  Z, length = engine.page_size(sparse), r.max_prompt_len + r.max_new_tokens
  need = -(-(length - 1) // Z) + 2  # a row at its cap, its prompt's template page, the trash page
  require(
    one_row.num_pages >= need,
    "rollout.pool_gb",
    r.pool_gb,
    f"holds {one_row.num_pages} pages of {Z} tokens; one row of max_prompt_len + max_new_tokens = "
    f"{length} tokens needs {need}",
  )


def check_rows(c, rows_per_device: int, device, sparse) -> None:
  """A device's rows of the step, checked before its prompts are made and read (`check_inputs`,
  which would take hours over a huge batch): as int32 token ids alone (a lower bound of the step's
  memory) they must fit the device, and engine_slots may not exceed them (a slot without a row
  stays empty)."""
  r, have = c.rollout, memory.device_memory_bytes(device)
  length = r.max_prompt_len + r.max_new_tokens
  need = rows_per_device * length * 4
  require(
    not have or need <= have,
    "rollout.prompts_per_step",
    f"{r.prompts_per_step} (x group_size {r.group_size})",
    f"a device's {rows_per_device} rows of max_prompt_len + max_new_tokens = {length} tokens "
    f"take {need / 1e9:.3g} GB as token ids alone, more than this {device.platform} device's "
    f"{have / 1e9:.3g} GB: lower it or group_size, or add devices on mesh.data",
  )
  slots = engine.full_batch(rows_per_device, r.group_size, length, sparse).num_slots
  require(
    r.engine_slots <= slots,
    "rollout.engine_slots",
    r.engine_slots,
    f"must be at most the {slots} rows a device decodes (0 = all of them)",
  )


def check_memory(
  c, cfg: Qwen3Config, engine_cfg, sparse, step: memory.StepMemory, device, rollout_weights: int = 0
) -> None:
  """Refuses, before the model's weights are read or the workdir written, a run one device cannot
  hold. The train state stays on the device throughout; beside it the rollout holds its KV page
  pool (engine_cfg's pages) and the train step its batch, activations, gradients, logits chunks and
  metrics (`step`, XLA's numbers). The larger of the two must fit. With rollout devices of their
  own (mesh.rollout_devices; rollout_weights: the bytes of the weights whole on one of them) each
  side has its devices: a trainer device holds the train step, a rollout device the weights and
  the pool. The refusal names the fields of
  what does not fit: the train state's larger part when the state alone does not (no smaller batch
  helps then), else the pool when it is the rollout that does not fit and the larger addition, else
  the step's larger addition."""
  have = memory.device_memory_bytes(device)
  if not have:
    return
  pool = memory.pool_bytes(c, cfg, engine_cfg, sparse)
  rollout = (rollout_weights or step.state) + pool
  overlap = rollouts.AsyncConfig.of(c)
  kept = overlap.partial_groups and not rollout_weights  # carried rows keep their pool
  peak = step.peak + (pool if kept else 0)  # through the update, beside the step
  if max(peak, rollout) <= have:
    return
  require(
    rollout_weights <= have,
    "mesh.rollout_devices",
    overlap.rollout_devices,
    f"a rollout device holds the weights whole, {rollout_weights / 1e9:.3g} GB, more than this "
    f"{device.platform} device's {have / 1e9:.3g} GB: colocate the rollout (0), whose weights "
    "keep their tensor sharding, or a smaller model",
  )
  parts = memory.parts(c, cfg, engine_cfg, step, pool)
  if step.state > have:
    names = ("lora", "model")
  elif (rollout > have or kept) and (step.peak <= have or pool >= step.peak - step.state):
    names = ("pool",)
  else:
    names = ("metrics", "rows")
  part = max((parts[n] for n in names), key=lambda p: p.size)
  gb = lambda n: f"{n / 1e9:.3g} GB"
  require(
    False,
    part.field,
    part.value,
    f"{part.what}: {gb(part.size)}; a device needs at least {gb(max(peak, rollout))} (the "
    f"train step {gb(step.peak)} by XLA's memory analysis"
    f"{', with the KV pool partial rollouts keep ' + gb(peak) if kept else ''}, the rollout with "
    "its KV pool "
    f"{gb(rollout)}{' on a rollout device' if rollout_weights else ''}; the train state "
    f"{gb(step.state)}, its LoRA {gb(step.lora)}), more than this "
    f"{device.platform} device's {gb(have)}: {part.fix}",
  )


def check_inputs(c, task, cfg: Qwen3Config, tokenizer) -> None:
  """The checks that need the task, the model's config and its tokenizer, run before anything is
  written: the tokenizer's ids within the model's vocabulary, top-k log-probs within it, and
  prompts within rollout.max_prompt_len."""
  r = c.rollout
  check_tokenizer(c, cfg, tokenizer)
  require(
    r.num_top_logprobs <= cfg.vocab_size,
    "rollout.num_top_logprobs",
    r.num_top_logprobs,
    f"must be <= the model's vocabulary of {cfg.vocab_size} tokens (0 = off)",
  )
  unknown_id = _unknown_id(tokenizer)
  problems, lengths, unknown = _encode_prompts(task, tokenizer, r.prompts_per_step, unknown_id)
  longest = int(np.argmax(lengths))
  over = sum(n > r.max_prompt_len for n in lengths)
  require(
    over == 0,
    "rollout.max_prompt_len",
    r.max_prompt_len,
    f"must hold every prompt: {over} of {len(lengths)} are longer, the longest "
    f"({getattr(problems[longest], 'id', longest)!r} of task {task.name!r}) has "
    f"{lengths[longest]} tokens",
  )
  # A vocabulary made for another task (the tiny pointer-chase model on math) encodes most of the
  # text as its unknown token: the run would train on prompts it cannot see.
  require(
    unknown <= sum(lengths) / 2,
    "task.name",
    task.name,
    f"must be a task the model's tokenizer can read: {unknown} of its {sum(lengths)} prompt "
    f"tokens are the unknown token (id {unknown_id}) of config.model.hf_dir = "
    f"{c.model.hf_dir!r}; use a model made for this task",
  )


def check_evaluation_rows(c, task) -> None:
  """The held-out evaluation's rows within the host's memory: it encodes every row's prompt at once
  (rl/evaluate.py), padded to the longest, up to max_prompt_len int32 tokens (an endless task
  generates every problem first)."""
  e, r = c.eval, c.rollout
  problems = min(e.problems or len(task), len(task)) if hasattr(task, "__len__") else e.problems
  need, have = problems * e.samples * r.max_prompt_len * 4, memory.host_memory_bytes()
  require(
    not have or need <= have,
    "eval.problems",
    f"{e.problems} (x eval.samples {e.samples})",
    f"{problems} problems x {e.samples} samples of up to rollout.max_prompt_len = "
    f"{r.max_prompt_len} tokens take up to {need / 1e9:.3g} GB, more than this host's "
    f"{have / 1e9:.3g} GB: lower eval.problems or eval.samples",
  )


def check_tokenizer(c, cfg: Qwen3Config, tokenizer) -> None:
  """Every id the tokenizer can produce, and its EOS and pad ids, below the model's vocab_size: an
  id past the embedding reads a clamped row (a model that cannot see its tokens), an EOS the model
  cannot sample never ends a row. Errors name the file the id comes from."""
  d = c.model.hf_dir
  model = f"{os.path.join(d, 'config.json')} vocab_size" if d else f"preset {c.model.preset!r}"
  where = f"config.model.hf_dir = {d!r}: " if d else "the task's tokenizer: "
  top = max(tokenizer.tok.get_vocab(with_added_tokens=True).values(), default=-1)
  if top >= cfg.vocab_size:
    raise ValueError(
      f"{where}{os.path.join(d, 'tokenizer.json') if d else 'its vocabulary'} has token ids up to "
      f"{top}, past the model's vocabulary ({model} = {cfg.vocab_size}): use the model's own "
      "tokenizer"
    )
  for ids, what in ((tokenizer.eos_ids, "eos"), ((tokenizer.pad_id,), "pad")):
    bad = [i for i in ids if not 0 <= i <= top]
    source = (
      f"{os.path.join(d, 'generation_config.json')} {what}_token_id or tokenizer_config.json "
      f"{what}_token"
      if d
      else "the task's"
    )
    if bad:
      raise ValueError(
        f"{where}{what.upper()} id {bad[0]} ({source}) is not a token of the tokenizer (ids "
        f"0..{top}; {model} = {cfg.vocab_size}): set it to a token id in range"
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


def check_workdir(workdir: str) -> None:
  """The workdir can be made and locked (workdir.workdir_lock), checked before anything is written
  there: a URL needs an epath file system for its scheme (the lease is written through it); a local
  path needs its nearest existing folder to hold a file with an flock, which a probe file there
  (unnamed, gone when closed) tries. A file system without flock (some network mounts) would fail
  the lock only after the workdir was made."""
  allowed = (
    "must be a directory path whose nearest existing folder is writable on a file system with "
    "flock, or a URL of a file system epath knows (gs://, s3://)"
  )
  if not is_local(workdir):
    try:
      epath.Path(workdir)
    except KeyError:  # etils' registry of URL schemes
      scheme = workdir.split("://")[0]
      require(False, "workdir", workdir, f"no file system for {scheme}://: {allowed}")
    return
  folder = os.path.abspath(workdir)
  while not os.path.lexists(folder):
    folder = os.path.dirname(folder)
  try:
    with tempfile.TemporaryFile(dir=folder) as probe:
      fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except OSError as e:
    require(False, "workdir", workdir, f"{folder} cannot hold its lock ({e.strerror}): {allowed}")


# Fields that may differ when a workdir is resumed: how long to run and what to keep, not what runs.
# Also where it runs: a run may resume on another mesh or cluster (orbax reshards the state).
RESUMABLE_FIELDS = (
  "workdir",
  "total_steps",
  "ckpt_every",
  "keep_checkpoints",
  "export_hf",
  "max_nonfinite_steps",
  "restart_from_scratch",
  "profile_steps",
  "eval.every",
  "eval.completions",
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
  if not epath.Path(path).exists():
    checkpoints = os.path.join(c.workdir, "checkpoints")
    folder = epath.Path(checkpoints)
    if folder.is_dir() and any(p.name.isdigit() for p in folder.iterdir()):
      raise ValueError(
        f"config.workdir = {c.workdir!r} holds checkpoints ({checkpoints}) but no "
        f"config.json to check this config against. {put_back}"
      )
    return
  try:
    old = _flat(json.loads(epath.Path(path).read_text()))
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


def check_mesh(c, mesh) -> None:
  """The batch against the mesh: each micro-batch's rows split evenly over data x fsdp, and each
  process holds whole GRPO groups (it samples and rewards its own prompts)."""
  r = c.rollout
  ways = mesh.shape["data"] * mesh.shape["fsdp"]
  rows = r.prompts_per_step * r.group_size
  slices = c.rl.num_minibatches * c.rl.micro_batches
  require(
    rows % (slices * ways) == 0,
    "rl.micro_batches",
    c.rl.micro_batches,
    f"rows per micro-batch ({rows} rollouts / rl.num_minibatches {c.rl.num_minibatches} / "
    f"rl.micro_batches = {rows / slices:g}) must be a whole multiple of mesh data x fsdp = "
    f"{ways}",
  )
  lo, hi = sharding.process_rows(sharding.rows(mesh), rows)
  require(
    lo % r.group_size == 0 and hi % r.group_size == 0,
    "rollout.group_size",
    r.group_size,
    f"this process holds rows [{lo}, {hi}): each process must hold whole groups",
  )


def check_rollout_split(c, n: int, ways: int, rows: int) -> None:
  """Rollout devices of their own (mesh.rollout_devices = n a process, `ways` of them over every
  process): each holds whole GRPO groups of the step's `rows`."""
  require(
    rows % (ways * c.rollout.group_size) == 0,
    "mesh.rollout_devices",
    n,
    f"the {rows} rows of a step must split into whole groups of {c.rollout.group_size} over the "
    f"{ways} rollout devices",
  )


def check_rollout_mesh(n: int, rollout_rows, train_rows) -> None:
  """Rollout devices of their own (mesh.rollout_devices = n): each process rolls out the rows it
  trains on (so its rollouts never cross to another host)."""
  require(
    (rollout_rows.lo, rollout_rows.hi) == (train_rows.lo, train_rows.hi),
    "mesh.rollout_devices",
    n,
    f"this process would roll out rows [{rollout_rows.lo}, {rollout_rows.hi}) and train on "
    f"[{train_rows.lo}, {train_rows.hi}): the two meshes must split the rows alike over processes",
  )


def check_prompt_lengths(problems, tokenizer, max_prompt_len: int) -> None:
  """The held-out prompts within rollout.max_prompt_len: the budget tables and the memory check
  cover prompts up to it."""
  _, lengths = tokenizer.encode_batch([p.prompt for p in problems])
  require(
    max(lengths) <= max_prompt_len,
    "rollout.max_prompt_len",
    max_prompt_len,
    f"must hold the held-out prompts (config.eval): the longest has {max(lengths)} tokens",
  )
