"""Inputs that cannot run fail in one line before anything is written (issue 41, items 6-8): a model
dir with one edited field, a damaged task file, sizes this machine cannot hold, a schedule past
int32. Each case goes through `trainer.train` up to the point where the train state would be built
(here replaced by a stop), so a check that does not fire fails the test at once, not after
training into NaNs."""

import gzip
import json
import os
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparrow_jax.rl import run_config, trainer
from tests.helpers import ROOT
from tests.test_trainer import config, small

pytestmark = pytest.mark.slow

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

  monkeypatch.setattr(trainer, "_build_state", stop)


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


@pytest.mark.parametrize("name", sorted(MODEL_EDITS))
def test_model_dir_edit_is_one_line_before_the_workdir(tmp_path, stop_before_state, name):
  file, edit, message = MODEL_EDITS[name]
  hf_dir = model_variant(str(tmp_path / "model"), file, edit)
  work = tmp_path / "run"
  with pytest.raises(ValueError, match=message) as raised:
    trainer.train(tiny_model_config(work, hf_dir))
  assert "\n" not in str(raised.value).strip()
  assert not work.exists()


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


def test_a_pool_no_machine_holds_is_refused_before_the_workdir(tmp_path, stop_before_state):
  work = tmp_path / "run"
  with pytest.raises(
    ValueError,
    match=(
      r"config\.rollout\.pool_gb = 1000000\.0 is invalid: a device needs at least 1e\+06 GB \(a KV "
      r"pool of \d+ pages"
    ),
  ):
    trainer.train(small(work, rollout__pool_gb=1e6))
  assert not work.exists()


def test_too_many_rollouts_for_the_device_are_refused_before_the_workdir(
  tmp_path, stop_before_state, monkeypatch
):
  """Every row's pages at full length (the default pool) against a device of 1 GB (the check's
  source of the size, fixed here so the test does not depend on this machine's memory)."""
  monkeypatch.setattr(run_config, "device_memory_bytes", lambda device: 10**9)
  work = tmp_path / "run"
  with pytest.raises(
    ValueError,
    match=(
      r"config\.rollout\.prompts_per_step = '8192 \(x group_size 4\)' is invalid: a device needs "
      r"at least [\d.]+ GB .* more than this cpu device's 1 GB"
    ),
  ):
    trainer.train(small(work, rollout__prompts_per_step=8192))
  assert not work.exists()
  with pytest.raises(_Reached):  # a step that fits passes
    trainer.train(small(work, rollout__prompts_per_step=4))


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
