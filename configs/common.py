"""Sub-configs shared by the trainer (configs/default.py) and the experiments (configs/*.py).

Each field is defined once, here, with the trainer's default, so `c.model.hf_dir`, `c.task.name` or
`c.rollout.page_size` mean the same in every config and their defaults cannot drift apart. Every
function takes the names of the fields an experiment reads (none: all of them; a field nobody reads
would be a silent no-op flag) and keyword overrides of their defaults; naming a field that does not
exist is an error naming it.

`configs` is installed with the package (pyproject.toml), so `from configs import common` works from
`python experiments/X.py` too, whose sys.path starts at experiments/.
"""

import dataclasses

import ml_collections

from sparrow_jax.envs import registry


def _select(c: ml_collections.ConfigDict, fields, overrides) -> ml_collections.ConfigDict:
  """`c` cut down to `fields` (all when empty), then updated with `overrides`."""
  known = list(c.keys())
  fields = list(fields) or known
  unknown = sorted(set(fields) - set(known))
  if unknown:
    raise ValueError(f"unknown field(s) {unknown}; known: {known}")
  not_kept = sorted(set(overrides) - set(fields))
  if not_kept:
    raise ValueError(f"override(s) {not_kept} of fields not selected ({fields})")
  for name in known:
    if name not in fields:
      del c[name]
  c.update(overrides)
  return c


def env(name: str = "env:pointer_chase", **overrides) -> ml_collections.ConfigDict:
  """A multi-turn environment's fields, for config.task.name = `name`: those of its config class,
  declared once there with their defaults and what each means (sparrow_jax/envs: EnvConfig's
  max_turns, max_observation_tokens, tool_timeout_s, ... and the environment's own), plus the
  tool pool's size."""
  c = ml_collections.ConfigDict(dataclasses.asdict(registry.env_config(name)))
  c.tool_workers = 4  # tool calls running at once (a hung one is abandoned at tool_timeout_s)
  c.update(overrides)
  return c


def model(*fields, **overrides) -> ml_collections.ConfigDict:
  """The policy to load: a Hugging Face dir, or a randomly initialised preset."""
  c = ml_collections.ConfigDict()
  c.hf_dir = "assets/pointer_chase_tiny"  # HF Qwen3 dir (config.json, safetensors, tokenizer)
  c.preset = ""  # instead of hf_dir: a Qwen3Config preset, randomly initialised
  c.dtype = "float32"  # params dtype: float32 | bfloat16
  return _select(c, fields, overrides)


def task(*fields, **overrides) -> ml_collections.ConfigDict:
  """Where prompts come from (sparrow_jax.rl.build.make_task; seeded by the config's
  `seed`)."""
  c = ml_collections.ConfigDict()
  c.name = "synthetic:pointer_chase"  # registry name, e.g. math:polaris, code:taco
  c.path = ""  # local data file/dir for dataset tasks ("" = none)
  c.min_hops = 128  # synthetic task: chain length range (~3 response tokens a hop);
  c.max_hops = 128  # 128 (~450 prompt tokens) is the length calibrated for
  return _select(c, fields, overrides)


def rollout(*fields, **overrides) -> ml_collections.ConfigDict:
  """How rollouts are sampled: lengths, temperature and the block top-k sparse attention."""
  c = ml_collections.ConfigDict()
  c.max_new_tokens = 400  # generation cutoff (a 128-hop answer is 390 tokens)
  c.temperature = 1.0  # sampling temperature (also used when re-scoring)
  c.top_p = 1.0  # nucleus sampling mass; must stay 1.0 in training (docs/configuration.md)
  c.sparse = True  # block top-k sparse rollouts (False = dense baseline)
  c.schedule = "assets/pointer_chase_tiny/calibration_quest/schedule.json"  # KVSchedule: JSON path,
  #                                    "fixed:PAGES", or "paper:MODEL:TAU"
  #                                    (e.g. paper:qwen3-1.7b:0.86), or stages "STEP:SPEC,STEP:SPEC"
  #                                    switched without recompiling, or "adaptive:TAU:BASE" (closed
  #                                    loop from the table BASE; docs/closed_loop.md)
  # adaptive:TAU:BASE only (sparrow_jax.sparsity.schedule.adapt_topk moves each bin once a step):
  c.adaptive_headroom = 2.0  # ceiling of every bin's top-k: this x BASE's largest, fixed at
  #                                    start (it sizes the static page selection); 2x is the paper's
  #                                    step from tau 0.86 to 0.92 (qwen3-1.7b: 253 -> 509 pages)
  c.adaptive_raise = 1.5  # a bin off a cliff (step p10 < tau): top-k x this (>= +1 page);
  #                                    fast, as a bin under tau drifts toward collapse (paper: tau
  #                                    0.75 collapses). Just over the edge (pooled share 5-10%): +1
  #                                    page; a bin that came down to the failed budget goes back
  c.adaptive_lower = 0.95  # a passed bin: top-k x this (>= -1 page), not below its floor
  c.adaptive_window = 4  # steps of tokens a budget is judged on (pooled) before it may
  #                                    pass or fail; a step with p10 < tau fails at once (a cliff)
  c.adaptive_lower_share = 0.04  # a bin passes when at most this share of its pooled tokens is
  #                                    under tau (its pool's p4 >= tau); it fails over 0.05
  #                                    (p5 < tau)
  c.adaptive_min_tokens = 200  # a bin with fewer tokens in the step holds and pools nothing:
  #                                    its p10 then rests on >= 20 tokens, not on one outlier
  c.engine_slots = 0  # rows each device decodes at once (0: all of its step's rows);
  #                                    fewer slots than rows refill a finished row's slot at once
  c.pool_gb = 0.0  # each device's KV page pool, GB (0: room for all its rows at
  #                                    prompt + max_new_tokens, so no row waits or is preempted)
  c.chunk_steps = 16  # decode steps between the engine's scheduler passes
  c.partial_groups = 0  # partial rollouts: GRPO groups under way beyond prompts_per_step;
  #                                    a step's rollout ends once prompts_per_step groups have
  #                                    ended, the rest keep their pages and go on next step under
  #                                    the new weights (docs/async_rl.md); 0 = off
  c.max_carry_steps = 2  # with partial_groups: a row that started this many steps ago ends
  #                                    before a step trains (decoding goes on until it has), so
  #                                    long rows are not carried ever staler; 0 = no bound
  # (an int or "auto": a field of any type, which --config.rollout.speculate=auto can set)
  c.speculate = ml_collections.FieldReference(
    0, field_type=object
  )  # exact mode: the sparse policy drafts this many tokens a round, the dense
  #                                    policy verifies them (rows are dense samples); 0 = off;
  #                                    "auto": per position bin, a k of speculate_ks or dense
  #                                    decoding, whichever the roofline prices fastest at the
  #                                    bin's measured acceptance (docs/rollout_engine.md)
  c.speculate_ks = (1, 2, 4)  # the draft counts "auto" chooses from
  c.speculate_hardware = "this_machine"  # the hardware "auto" prices rounds on (a cost_model
  #                                    HARDWARE key, or this_machine: measured at start)
  c.page_size = 16  # tokens per KV page (power of two; the paper uses 16)
  c.dense_layers = 1  # first layers kept dense (the paper: 2 of 28)
  c.attention_impl = "auto"  # auto (the GPU / TPU kernel on its platform, else xla) | xla |
  #                                    pallas (GPU, Triton) | pallas_tpu (TPU, Mosaic)
  c.page_score = "quest"  # how pages rank for the top-k: mean (the page's mean key, the
  #                                    paper) | quest (per-channel key max / min, an upper bound of
  #                                    q . k; twice the cached summary bytes). Calibrate per choice:
  #                                    `schedule` is quest's tau-0.86 table for the tiny model,
  #                                    which reads 0.75 of the dense KV to mean's 0.90
  #                                    (docs/embedded_default.md "Page scores"); the paper's tables
  #                                    are mean's
  return _select(c, fields, overrides)


def stats(*fields, **overrides) -> ml_collections.ConfigDict:
  """The acceptance tail: the percentile held at tau and the position bins it is measured in."""
  c = ml_collections.ConfigDict()
  c.tau = 0.86  # acceptance threshold (the tail's target; "fraction below
  #                                    tau" metric)
  c.quantile = 5.0  # the tail percentile held at tau: 5 = p5, the paper's; a
  #                                    calibrated schedule must have been calibrated for it
  c.bin_size = 128  # tokens per position bin (a multiple of page_size)
  return _select(c, fields, overrides)


def evaluation(*fields, **overrides) -> ml_collections.ConfigDict:
  """Held-out evaluation during training (sparrow_jax.rl.hooks.Evaluation, the fields'
  checks: rl.evaluate.EvalConfig; docs/configuration.md#evaluation-during-training)."""
  c = ml_collections.ConfigDict()
  c.every = 0  # steps between evaluations, dense and (sparse runs) under the step's budget;
  #                                    0 = off
  c.problems = 16  # held-out problems: the task's first under `seed` (0 = all of a
  #                                    finite task)
  c.samples = 4  # samples per problem (n: mean@n, pass@1 and pass@n)
  c.completions = 2  # completions shown per evaluation and mode (TensorBoard text and
  #                                    <workdir>/eval_samples.jsonl)
  c.seed = 1234  # held-out task seed and sampling key (config.seed: the training stream's)
  return _select(c, fields, overrides)


def mesh(*fields, **overrides) -> ml_collections.ConfigDict:
  """The device mesh (sparrow_jax.sharding): rows over data x fsdp, weights FSDP over fsdp,
  heads / FFN / vocab over tensor. One device is the mesh 1 x 1 x 1; the product must be the number
  of devices of all processes, less the rollout's."""
  c = ml_collections.ConfigDict()
  c.data = -1  # data-parallel ways (-1: the devices fsdp x tensor leaves)
  c.fsdp = 1  # FSDP ways: params, grads and Adam states sharded, rows too
  c.tensor = 1  # tensor-parallel ways (keep within a host: NVLink / ICI)
  # Devices of each process that only roll out, the weights whole on each, rows over them; the
  # rest train on data x fsdp x tensor (0: rollouts run on the trainer's devices; docs/async_rl.md)
  c.rollout_devices = 0
  return _select(c, fields, overrides)


def distributed(*fields, **overrides) -> ml_collections.ConfigDict:
  """Many processes (hosts): jax.distributed.initialize before anything touches a device."""
  c = ml_collections.ConfigDict()
  c.enabled = False  # True on a multi-host cluster (one process per host or GPU)
  c.coordinator = ""  # "host:port" of process 0 ("": detected on SLURM / TPU pods)
  c.num_processes = -1  # processes in all (-1: detected)
  c.process_id = -1  # this process's index (-1: detected)
  return _select(c, fields, overrides)
