"""Inputs that cannot run fail in one line before anything is written (issue 41, items 6-8): a model
dir with one edited field, a damaged task file, sizes this machine cannot hold, a schedule past
int32. Each case goes through `trainer.train` up to the point where the train state would be built
(here replaced by a stop), so a check that does not fire fails the test at once, not after
training into NaNs."""

import dataclasses
import errno
import gzip
import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from configs import default
from sparrow_jax.attention import page_pool
from sparrow_jax.rl import build, memory, run_config, trainer
from sparrow_jax.sparsity import schedule as schedule_lib
from tests.helpers import ROOT
from tests.test_trainer import config, small

MODEL_FILES = (
  "config.json",
  "generation_config.json",
  "model.safetensors",
  "tokenizer.json",
  "tokenizer_config.json",
)


def model_variant(directory, file, edit):
  """The shipped tiny model dir with `edit(json of file) -> new json` applied to one file (file
  None: `edit(directory)` writes what it likes) -> the dir."""
  os.makedirs(directory)
  for name in MODEL_FILES:
    shutil.copy(os.path.join(ROOT, "assets/pointer_chase_tiny", name), directory)
  if file is None:
    edit(directory)
    return directory
  path = os.path.join(directory, file)
  with open(path) as f:
    changed = edit(json.load(f))
  with open(path, "w") as f:
    json.dump(changed, f)
  return directory


def merged(**fields):
  return lambda d: {**d, **fields}


def dropped(key):
  return lambda d: {k: v for k, v in d.items() if k != key}


def index_without_weight_map(directory):
  with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": 0}}, f)


def added_token(d):
  """tokenizer.json with one more special token than the model has embeddings for."""
  extra = dict(d["added_tokens"][-1], id=max(t["id"] for t in d["added_tokens"]) + 1)
  return {**d, "added_tokens": d["added_tokens"] + [dict(extra, content="<|extra|>")]}


def pad_out_of_vocab(directory):
  for file, edit in (
    ("tokenizer_config.json", dropped("pad_token")),
    ("generation_config.json", merged(pad_token_id=5000)),
  ):
    path = os.path.join(directory, file)
    with open(path) as f:
      changed = edit(json.load(f))
    with open(path, "w") as f:
      json.dump(changed, f)


class _Reached(Exception):
  """The run passed every input check (what train would do next: build the train state)."""


@pytest.fixture
def stop_before_state(monkeypatch):
  def stop(*args, **kwargs):
    raise _Reached

  monkeypatch.setattr(build, "build_state", stop)


# (file, edit, what the one line names). Unchecked, the first six raise tracebacks; the others
# fail after the workdir is written (a string eps, a scaled rope without its factor) or train with
# exit 0 into NaNs, a model that cannot see some tokens, rows that never stop, or a flag read the
# wrong way ("no" is true).
MODEL_EDITS = {
  "index_without_weight_map": (
    None,
    index_without_weight_map,
    r"model\.safetensors\.index\.json: 'weight_map' must map tensor names",
  ),
  "max_position_embeddings_string": (
    "config.json",
    merged(max_position_embeddings="2048"),
    r"config\.json: .*max_position_embeddings must be a positive int, got '2048'",
  ),
  "config_json_a_list": ("config.json", lambda d: [d], r"config\.json: .*JSON object, got list"),
  "eos_id_null": (
    "generation_config.json",
    merged(eos_token_id=[None]),
    r"generation_config\.json eos_token_id must be a token id",
  ),
  "pad_token_a_number": (
    "tokenizer_config.json",
    merged(pad_token=5),
    r"tokenizer_config\.json pad_token must be a token",
  ),
  "generation_config_a_list": (
    "generation_config.json",
    lambda d: [d],
    r"generation_config\.json must be a JSON object",
  ),
  "rms_norm_eps_string": (
    "config.json",
    merged(rms_norm_eps="1e-6"),
    r"config\.json: .*rms_norm_eps must be a finite number > 0, got '1e-6'",
  ),
  "rms_norm_eps_negative": (
    "config.json",
    merged(rms_norm_eps=-1e-6),
    r"config\.json: .*rms_norm_eps must be a finite number > 0",
  ),
  "rope_theta_0": (
    "config.json",
    merged(rope_theta=0, rope_parameters={"rope_theta": 0, "rope_type": "default"}),
    r"config\.json: .*rope_theta must be a finite number > 0, got 0",
  ),
  "tokenizer_past_model_vocab": (
    "tokenizer.json",
    added_token,
    r"tokenizer\.json has token ids up to 210, past the model's vocabulary \(.*config\.json "
    r"vocab_size = 210\)",
  ),
  "eos_out_of_vocab": (
    "generation_config.json",
    merged(eos_token_id=[5000]),
    r"EOS id 5000 \(.*generation_config\.json eos_token_id or tokenizer_config\.json eos_token\)",
  ),
  "pad_out_of_vocab": (
    None,
    pad_out_of_vocab,
    r"PAD id 5000 \(.*generation_config\.json pad_token_id",
  ),
  "tie_word_embeddings_string": (
    "config.json",
    merged(tie_word_embeddings="no"),
    r"config\.json: .*tie_word_embeddings must be true or false, got 'no'",
  ),
  "rope_scaling_without_factor": (
    "config.json",
    lambda d: {**dropped("rope_parameters")(d), "rope_scaling": {"rope_type": "linear"}},
    r"config\.json: .*rope_scaling factor must be a finite number > 0, got None",
  ),
}


def tiny_model_config(work, hf_dir, **changes):
  """The default (shipped model) config at test size."""
  return config(
    workdir=str(work),
    model__hf_dir=str(hf_dir),
    total_steps=1,
    rollout__prompts_per_step=1,
    rollout__group_size=2,
    rl__num_minibatches=1,
    task__min_hops=4,
    task__max_hops=4,
    rollout__max_prompt_len=64,
    rollout__max_new_tokens=16,
    **changes,
  )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODEL_EDITS))
def test_model_dir_edit_is_one_line_before_the_workdir(tmp_path, stop_before_state, name):
  file, edit, message = MODEL_EDITS[name]
  hf_dir = model_variant(str(tmp_path / "model"), file, edit)
  work = tmp_path / "run"
  with pytest.raises(ValueError, match=message) as raised:
    trainer.train(tiny_model_config(work, hf_dir))
  assert "\n" not in str(raised.value).strip()
  assert not work.exists()


@pytest.mark.slow
def test_the_shipped_model_dir_passes_the_checks(tmp_path, stop_before_state):
  with pytest.raises(_Reached):
    trainer.train(
      tiny_model_config(tmp_path / "run", os.path.join(ROOT, "assets/pointer_chase_tiny"))
    )


ROWS = [{"problem": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(40)]


def _truncated_gz(path):
  raw = gzip.compress("".join(json.dumps(r) + "\n" for r in ROWS).encode())
  path.write_bytes(raw[: len(raw) // 2])


def _damaged_parquet(path):
  pq.write_table(pa.Table.from_pylist(ROWS), path)
  raw = bytearray(path.read_bytes())
  raw[8 : len(raw) // 2] = b"\xff" * (len(raw) // 2 - 8)  # the data pages; the footer intact
  path.write_bytes(bytes(raw))


def _empty_parquet(path):
  schema = pa.schema([("problem", pa.string()), ("answer", pa.string())])
  pq.write_table(pa.Table.from_pylist([], schema=schema), path)


TASK_FILES = {
  "truncated_jsonl_gz": (
    "train.jsonl.gz",
    _truncated_gz,
    r"train\.jsonl\.gz: damaged or truncated gzip file after line \d+",
  ),
  "damaged_parquet": (
    "train.parquet",
    _damaged_parquet,
    r"train\.parquet: damaged parquet data at row 0",
  ),
  "empty_parquet": (
    "train.parquet",
    _empty_parquet,
    r"no usable problems in .*train\.parquet .*the source is empty",
  ),
  "zero_byte_parquet": (
    "train.parquet",
    lambda p: p.write_bytes(b""),
    r"train\.parquet is not a readable parquet file",
  ),
  "json_a_number": (
    "train.json",
    lambda p: p.write_text("42"),
    r"train\.json: a JSON task file is a list of rows .*got int",
  ),
  "deeply_nested_line": (
    "train.jsonl",
    lambda p: p.write_text(json.dumps(ROWS[0]) + "\n" + "[" * 100_000 + "]" * 100_000 + "\n"),
    r"train\.jsonl line 2: JSON nested too deeply to parse",
  ),
}


@pytest.mark.parametrize("name", sorted(TASK_FILES))
def test_task_file_damage_is_one_line_before_the_workdir(tmp_path, stop_before_state, name):
  file, write, message = TASK_FILES[name]
  path = tmp_path / file
  write(path)
  work = tmp_path / "run"
  with pytest.raises(ValueError, match=rf"config\.task\.path = '.*{file}' is invalid: .*{message}"):
    trainer.train(small(work, task__name="math:polaris", task__path=str(path)))
  assert not work.exists()


DEVICE_GB = 4  # the device the size checks measure against, fixed: not this machine's memory


@pytest.fixture
def device_of(monkeypatch):
  monkeypatch.setattr(memory, "device_memory_bytes", lambda device: DEVICE_GB * 10**9)
  monkeypatch.setattr(memory, "host_memory_bytes", lambda: 4 * DEVICE_GB * 10**9)


# Every size a config scales: (changes to the small config, or to the shipped tiny model's
# config.json; the one line). Unchecked, the rank passed every check and ended in
# RESOURCE_EXHAUSTED building the state; a model too wide or deep for the device was read whole
# before any size check (here, with only its config.json edited, its weights' shapes were refused
# instead); the draft window, decode chunk, slots, bins and updates passed every check (to wasted
# decoding, an int32 overflow in the step's trace, hours of compilation) and the evaluation's
# problems were generated for hours; the rows, pool and batch were refused as a KV pool's size;
# the page size and row length were checked already.
GB = r"[\d.e+]+ GB"
OVERSIZED = {
  "lora_rank": (
    {"distill__rank": 10**8},
    None,
    rf"config\.distill\.rank = 100000000 is invalid: the LoRA adapters and their Adam moments: "
    rf"{GB}; a device needs at least {GB} \(the train step {GB} by XLA's memory analysis",
  ),
  "ffn_width": (
    {},
    {"intermediate_size": 10**7},
    r"config\.model\.hf_dir = '.*' is invalid: the params and their Adam moments, of 2 layers, "
    r"hidden_size 128, intermediate_size 10000000, vocab_size 210",
  ),
  "hidden_width": ({}, {"hidden_size": 10**6}, r"config\.model\.hf_dir = .* hidden_size 1000000"),
  "vocab_width": ({}, {"vocab_size": 10**7}, r"config\.model\.hf_dir = .* vocab_size 10000000"),
  "layers": ({}, {"num_hidden_layers": 10**5}, r"config\.model\.hf_dir = .* of 100000 layers"),
  "rows": (
    {"rollout__group_size": 10**6},
    None,
    r"config\.rollout\.prompts_per_step / group_size / max_prompt_len / max_new_tokens = "
    r"\(4, 1000000, 64, 40\) is invalid: the step's batch, activations, gradients and logits "
    r"chunks, of 4000000 rows a backward pass",
  ),
  "pool_gb": (
    {"rollout__pool_gb": 1e6},
    None,
    rf"config\.rollout\.pool_gb = 1000000\.0 is invalid: a KV pool of \d+ pages: 1e\+06 GB; a "
    rf"device needs at least {GB} .* more than this cpu device's {DEVICE_GB} GB",
  ),
  "prompts_per_step": (
    {"rollout__prompts_per_step": 10**9},
    None,
    r"config\.rollout\.prompts_per_step = '1000000000 \(x group_size 4\)' is invalid: a device's "
    r"4000000000 rows of max_prompt_len \+ max_new_tokens = 104 tokens take",
  ),
  "eval_problems": (
    {"eval__every": 1, "eval__problems": 10**9},
    None,
    r"config\.eval\.problems = '1000000000 \(x eval\.samples 4\)' is invalid: 1000000000 "
    r"problems x 4 samples of up to rollout\.max_prompt_len = 64 tokens take up to",
  ),
  "draft_window": (
    {"rollout__speculate": 10**6},
    None,
    r"config\.rollout\.speculate = 1000000 is invalid: .* k \+ 1 <= rollout\.max_new_tokens "
    r"\(40\)",
  ),
  "decode_chunk": (
    {"rollout__chunk_steps": 10**6},
    None,
    r"config\.rollout\.chunk_steps = 1000000 is invalid: must be in \[1, rollout\.max_new_tokens "
    r"= 40\]",
  ),
  "engine_slots": (
    {"rollout__engine_slots": 10**6},
    None,
    r"config\.rollout\.engine_slots = 1000000 is invalid: must be at most the 16 rows a device "
    r"decodes",
  ),
  "num_bins": (
    {"stats__num_bins": 2**31 - 1},
    None,
    r"config\.stats\.num_bins = 2147483647 is invalid: must be at most the row length",
  ),
  "ppo_epochs": (
    {"rl__ppo_epochs": 10**6},
    None,
    r"config\.rl\.ppo_epochs = 1000000 is invalid: ppo_epochs x num_minibatches = 1000000 "
    r"updates a step must be <= 64",
  ),
  "page_size": (
    {"rollout__page_size": 2**20},
    None,
    r"config\.stats\.bin_size = 16 is invalid: must be a positive multiple of "
    r"rollout\.page_size \(1048576\)",
  ),
  "row_length": (
    {"rollout__max_new_tokens": 10**6},
    None,
    r"config\.rollout\.max_prompt_len \+ max_new_tokens = 1000064 is invalid: must be <= the "
    r"model's max_position_embeddings",
  ),
}


@pytest.mark.nightly
@pytest.mark.parametrize("name", sorted(OVERSIZED))
def test_oversized_sizes_are_one_line_before_the_workdir(
  tmp_path, stop_before_state, device_of, name
):
  """On the tiny model, against a device of DEVICE_GB: the memory check compiles the step from
  abstract inputs (XLA's numbers), before the weights are read."""
  changes, model_fields, message = OVERSIZED[name]
  work = tmp_path / "run"
  if model_fields:
    hf_dir = model_variant(str(tmp_path / "model"), "config.json", merged(**model_fields))
    c = tiny_model_config(work, hf_dir)
  else:
    c = small(work, **changes)
  with pytest.raises(ValueError, match=message) as raised:
    trainer.train(c)
  assert "\n" not in str(raised.value).strip()
  assert not work.exists()


def test_rollout_devices_of_their_own_are_checked_apart_from_the_trainers(device_of):
  """Colocated, a device holds the train state beside the rollout's pool; with rollout devices of
  their own a trainer device holds the step, and a rollout device the whole weights and the pool:
  a pool that overflows a trainer device beside the state fits a rollout device beside the
  weights, and whole weights too big for one device are refused naming the layout. Partial
  rollouts hold their pool beside the train step."""
  c = small("/unused")
  cfg = build.model_config(c)
  engine_cfg = build.engine_config(c, cfg, 16)
  gb = 10**9
  page = page_pool.page_bytes(cfg, c.rollout.page_size, jnp.float32, c.rollout.page_score)
  engine_cfg = dataclasses.replace(engine_cfg, num_pages=int(2.5 * gb // page))
  step = memory.StepMemory(peak=3 * gb, state=2 * gb, lora=0, metrics=0)
  sparse = build.sparse_config(c)
  check = lambda weights: run_config.check_memory(
    c, cfg, engine_cfg, sparse, step, jax.devices()[0], weights
  )
  with pytest.raises(ValueError, match=r"^config\.rollout\.prompts_per_step .* a KV pool of"):
    check(0)  # 2 GB of state + 2.5 GB of pool on one 4 GB device
  check(int(1 * gb))  # 1 GB of weights + 2.5 GB of pool on a rollout device; the step 3 GB
  with pytest.raises(
    ValueError, match=r"^config\.mesh\.rollout_devices = 0 .* weights whole, 5 GB"
  ):
    check(5 * gb)
  # Partial rollouts keep the pool through the update: 1 GB of state + 2.5 GB of pool fit a
  # device, and so does the 3 GB step, but not the step beside the pool.
  step = memory.StepMemory(peak=3 * gb, state=1 * gb, lora=0, metrics=0)
  check(0)
  c.rollout.partial_groups = 2  # and the pool, sized for the groups under way, is named by it
  with pytest.raises(
    ValueError, match=r"^config\.rollout\.partial_groups .*KV pool partial rollouts keep 5\.5 GB"
  ):
    check(0)


@pytest.mark.slow
def test_a_step_that_fits_passes_the_size_checks(tmp_path, stop_before_state, device_of):
  with pytest.raises(_Reached):
    trainer.train(small(tmp_path / "run", rollout__prompts_per_step=4))


@pytest.mark.parametrize(
  "schedule, words",
  [
    (
      {"kind": "table", "values": [1, 2, 10**10]},
      r"KVSchedule\.values must fit int32 .* got 10000000000",
    ),
    (
      {"kind": "fixed", "values": [2**31 - 2]},
      r"KVSchedule\.values must fit int32 .* got 2147483646",
    ),
    ({"kind": "linear", "values": [1e10, 8]}, r"'linear' must be \(0 <= ratio <= 1"),
  ],
  ids=["table_1e10", "fixed_past_int32_with_always_kept", "linear_ratio_1e10"],
)
def test_schedule_values_past_int32_are_refused(tmp_path, schedule, words):
  path = tmp_path / "schedule.json"
  fields = {"page_size": 16, "always_kept": 3, "bin_size": 128, "quantile": None}
  path.write_text(json.dumps({**fields, **schedule}))
  with pytest.raises(
    ValueError, match=rf"config\.rollout\.schedule = '.*schedule\.json': .*{words}"
  ):
    run_config.validate(config(workdir=str(tmp_path / "run"), rollout__schedule=str(path)))


def numeric_fields(c) -> dict:
  """{dotted field: value} of every number (or tuple of numbers) of config `c`."""
  number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
  return {
    field: value
    for field, value in run_config._flat(c.to_dict()).items()
    if number(value) or (isinstance(value, tuple) and all(number(v) for v in value))
  }


# An out-of-range value of every numeric field of configs/default.py, each refused by the check
# of the component that owns the field (train_step's RLConfig, DistillConfig, StatsConfig and
# RolloutConfig, SparseConfig, Sampling, LoopConfig, EvalConfig, PointerChase) or of run_config.
OUT_OF_RANGE = {
  "ckpt_every": 0,
  "distill.alpha": 0.0,
  "distill.kl_coef": -1.0,
  "distill.learning_rate": 0.0,
  "distill.ppo_coef": -1.0,
  "distill.rank": 0,
  "distributed.num_processes": 0,
  "distributed.process_id": -2,
  "eval.completions": -1,
  "eval.every": 41,
  "eval.problems": -1,
  "eval.samples": 0,
  "eval.seed": -1,
  "keep_checkpoints": 0,
  "max_nonfinite_steps": 0,
  "mesh.data": 0,
  "mesh.fsdp": 0,
  "mesh.rollout_devices": -1,
  "mesh.tensor": 0,
  "profile_steps": (3, 1),
  "rl.dual_clip": 0.5,
  "rl.entropy_coef": -0.01,
  "rl.eps_high": -0.1,
  "rl.eps_low": 1.0,
  "rl.grpo_std_ddof": 2,
  "rl.kl_coef": -1.0,
  "rl.learning_rate": 0.0,
  "rl.length_buckets": (4096,),
  "rl.logits_chunk": 0,
  "rl.mask_alpha_below": 1.5,
  "rl.mask_row_alpha_below": -0.5,
  "rl.max_grad_norm": 0.0,
  "rl.micro_batches": 0,
  "rl.num_minibatches": 0,
  "rl.off_policy_steps": 2,
  "rl.ppo_epochs": 0,
  "rl.tis_cap": 0.5,
  "rl.warmup_steps": -1,
  "rl.weight_decay": -1.0,
  "rollout.adaptive_headroom": 0.5,
  "rollout.adaptive_lower": 1.5,
  "rollout.adaptive_lower_share": 0.5,
  "rollout.adaptive_min_tokens": 0,
  "rollout.adaptive_raise": 1.0,
  "rollout.adaptive_window": 0,
  "rollout.chunk_steps": 0,
  "rollout.dense_layers": -1,
  "rollout.engine_slots": -1,
  "rollout.group_size": 1,
  "rollout.max_carry_steps": -1,
  "rollout.max_new_tokens": 0,
  "rollout.max_prompt_len": 0,
  "rollout.num_top_logprobs": -1,
  "rollout.page_size": 12,
  "rollout.partial_groups": -1,
  "rollout.pool_gb": -1.0,
  "rollout.prompts_per_step": 0,
  "rollout.speculate": -1,
  "rollout.speculate_ks": (0,),
  "rollout.temperature": 0.0,
  "rollout.top_p": 0.5,
  "seed": -1,
  "stats.bin_size": 0,
  "stats.num_bins": 0,
  "stats.quantile": 60.0,
  "stats.tau": 1.5,
  "task.max_hops": 100,
  "task.min_hops": 0,
  "total_steps": 0,
}


def test_every_numeric_field_has_an_out_of_range_case():
  """A field added to the config without a range check fails here until it has one (and a case)."""
  assert set(numeric_fields(default.get_config())) == set(OUT_OF_RANGE)


@pytest.mark.parametrize("field", sorted(OUT_OF_RANGE))
def test_an_out_of_range_value_is_one_line_naming_its_field(tmp_path, field):
  """The config checks that run before the model is read (validate, then the task's own)."""
  c = config(workdir=str(tmp_path / "run"), **{field.replace(".", "__"): OUT_OF_RANGE[field]})
  with pytest.raises(ValueError, match=rf"^config\.{re.escape(field)}\b") as raised:
    run_config.validate(c)
    build.make_task(c)
  assert "\n" not in str(raised.value)


# Each setting of exact mode, evaluation, length buckets and the workdir that cannot run, refused in
# one line naming the field and what it may be. Unchecked, exact mode with dense rollouts and a
# draft window past the rows ran (drafting nothing, or wasted drafts), an evaluation every 100
# steps of a 40-step run never ran, and a bucket past the rows was dropped.
SETTINGS = {
  "speculate_with_dense_rollouts": (
    {"rollout__speculate": 2, "rollout__sparse": False, "distill__enabled": False},
    r"config\.rollout\.speculate = 2 is invalid: must be 0 with dense rollouts "
    r"\(rollout\.sparse = False\)",
  ),
  "speculate_auto_with_dense_rollouts": (
    {"rollout__speculate": "auto", "rollout__sparse": False, "distill__enabled": False},
    r"config\.rollout\.speculate = 'auto' is invalid: must be 0 with dense rollouts",
  ),
  "speculate_negative": (
    {"rollout__speculate": -3},
    r"config\.rollout\.speculate = -3 is invalid: must be 0 \(off\), \"auto\" \(a draft count of "
    r"speculate_ks per position bin\), or an int k of draft tokens a round with k \+ 1 <= "
    r"rollout\.max_new_tokens \(400\)",
  ),
  "speculate_past_the_rows": (
    {"rollout__speculate": 400},
    r"config\.rollout\.speculate = 400 is invalid: .* k \+ 1 <= rollout\.max_new_tokens \(400\)",
  ),
  "speculate_not_an_int": (
    {"rollout__speculate": 2.5},
    r"config\.rollout\.speculate = 2\.5 is invalid: must be 0 \(off\), \"auto\"",
  ),
  "speculate_unknown_word": (
    {"rollout__speculate": "fast"},
    r"config\.rollout\.speculate = 'fast' is invalid: must be 0 \(off\), \"auto\"",
  ),
  "speculate_ks_past_the_rows": (
    {"rollout__speculate": "auto", "rollout__speculate_ks": (1, 2, 400)},
    r"config\.rollout\.speculate_ks = \(1, 2, 400\) is invalid: draft counts k of "
    r"rollout\.speculate = \"auto\" must have k \+ 1 <= rollout\.max_new_tokens \(400\)",
  ),
  "eval_every_past_the_run": (
    {"eval__every": 100},
    r"config\.eval\.every = 100 is invalid: must be 0 \(off\) or at most total_steps \(40\)",
  ),
  "length_buckets_past_the_rows": (
    {"rl__length_buckets": (512, 1024)},
    r"config\.rl\.length_buckets = \(512, 1024\) is invalid: must be at most the row length "
    r"max_prompt_len \+ max_new_tokens = 912 \(\[1024\] past it; \(\) = off\)",
  ),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_settings_that_cannot_run_are_one_line(tmp_path, name):
  changes, message = SETTINGS[name]
  with pytest.raises(ValueError, match=message) as raised:
    run_config.validate(config(workdir=str(tmp_path / "run"), **changes))
  assert "\n" not in str(raised.value)


def _no_flock(f, operation):
  raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


@pytest.mark.parametrize("where", ["under_a_file", "unknown_url_scheme", "no_flock"])
def test_a_workdir_that_cannot_be_locked_is_refused_before_it_is_made(
  tmp_path, monkeypatch, stop_before_state, where
):
  """Unchecked, the first and third were made (or failed to be) after the model was loaded, with an
  OSError naming no field; the second was a KeyError traceback."""
  (tmp_path / "a_file").write_text("")
  work, words = {
    "under_a_file": (
      str(tmp_path / "a_file" / "run"),
      r"a_file cannot hold its lock \(Not a directory\)",
    ),
    "unknown_url_scheme": ("nofs://bucket/run", r"no file system for nofs://"),
    "no_flock": (str(tmp_path / "run"), r"cannot hold its lock \(No locks available\)"),
  }[where]
  if where == "no_flock":
    monkeypatch.setattr(run_config.fcntl, "flock", _no_flock)
  with pytest.raises(
    ValueError, match=rf"config\.workdir = '{re.escape(work)}' is invalid: .*{words}: must be a"
  ) as raised:
    trainer.train(small(work))
  assert "\n" not in str(raised.value)
  assert not os.path.exists(work)


@pytest.mark.parametrize("how", ["not_utf8", "permission_denied"])
def test_an_unreadable_schedule_file_is_one_line(tmp_path, monkeypatch, how):
  """A file that exists but does not read (as root, permissions do not stop a read: the open is
  made to fail as it does for another user)."""
  path = tmp_path / "schedule.json"
  path.write_bytes(b"\xff\xfe{")
  if how == "permission_denied":

    def denied(*args, **kwargs):
      raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(schedule_lib, "open", denied, raising=False)
  with pytest.raises(
    ValueError,
    match=rf"config\.rollout\.schedule = '{re.escape(str(path))}': cannot read the file .*; must "
    r"be 'fixed:PAGES', 'paper:MODEL:TAU' or the path of a readable KVSchedule JSON file",
  ) as raised:
    run_config.validate(config(workdir=str(tmp_path / "run"), rollout__schedule=str(path)))
  assert "\n" not in str(raised.value)
