"""A run never loses data, and every command-line error is one line naming the field with exit
status 2 (issue 29, items 4 and 6). Nothing here trains: checkpoints are of a toy state, and the
trainer is stopped by the check under test before its first compilation."""

import dataclasses
import json
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from sparrow_jax import checkpoint, records
from sparrow_jax import logging as metrics_log
from sparrow_jax.data import tasks
from sparrow_jax.rl import build, run_config, trainer, workdir
from tests.helpers import ROOT, SMALL
from tests.test_trainer import small

TOY = {
  "w": jnp.asarray(np.random.default_rng(0).normal(size=(16, 64)), jnp.float32),
  "half": jnp.asarray(np.arange(6), jnp.bfloat16),
  "step": jnp.int32(7),
}


def toy_checkpoints(workdir, steps=(1, 2)):
  """Checkpoints of TOY at `steps` in `workdir` (as the trainer saves them) -> their directory."""
  mgr = checkpoint.manager(str(workdir), keep=len(steps))
  for step in steps:
    checkpoint.save(mgr, step, TOY, {"step": step})
  mgr.wait_until_finished()
  return workdir / "checkpoints"


def files_of(directory) -> dict:
  """{relative path: (size, mtime)} of every file and directory under `directory`."""
  out = {}
  for root, dirs, files in os.walk(directory):
    for name in dirs + files:
      path = os.path.join(root, name)
      out[os.path.relpath(path, directory)] = (os.path.getsize(path), os.stat(path).st_mtime_ns)
  return out


def test_flipped_byte_in_array_data_is_a_corrupt_checkpoint(tmp_path):
  """One flipped bit in the newest checkpoint's array data fails its checksum: that checkpoint is
  moved aside and the previous one restores, bit-exact."""
  directory = toy_checkpoints(tmp_path)
  data = [
    os.path.join(root, f)
    for root, _, fs in os.walk(directory / "2" / "state")
    for f in fs
    if os.sep + "d" + os.sep in os.path.join(root, f)
  ]
  biggest = max(data, key=os.path.getsize)  # the arrays' chunks
  raw = bytearray(open(biggest, "rb").read())
  raw[len(raw) // 2] ^= 0x10
  open(biggest, "wb").write(bytes(raw))
  state, meta = checkpoint.restore_latest(checkpoint.manager(str(tmp_path), 2), TOY)
  assert meta == {"step": 1}
  assert sorted(os.listdir(directory)) == ["1", "2.corrupt"]
  for name, value in TOY.items():
    np.testing.assert_array_equal(np.asarray(state[name]), np.asarray(value))


def test_emptied_checkpoint_is_moved_aside(tmp_path):
  """A write cut short (every file of the newest checkpoint empty) reads as no checkpoint."""
  directory = toy_checkpoints(tmp_path)
  for root, _, fs in os.walk(directory / "2"):
    for f in fs:
      open(os.path.join(root, f), "wb").close()
  _, meta = checkpoint.restore_latest(checkpoint.manager(str(tmp_path), 2), TOY)
  assert meta == {"step": 1} and sorted(os.listdir(directory)) == ["1", "2.corrupt"]


@pytest.mark.parametrize(
  "like, words",
  [
    ({**TOY, "ref": jnp.zeros(3)}, "ref only in this config's state"),
    ({"w": TOY["w"], "step": TOY["step"]}, "half only in the checkpoint"),
    ({**TOY, "w": jnp.zeros((16, 32))}, r"w is \(16, 64\) float32 in the checkpoint, \(16, 32\)"),
  ],
  ids=["extra_leaf", "missing_leaf", "other_shape"],
)
def test_checkpoint_of_another_state_stops_and_changes_nothing(tmp_path, like, words):
  """A good checkpoint that does not fit this config's state (a changed flag) is not corrupt:
  the restore stops, naming the difference, and no checkpoint is moved or touched."""
  directory = toy_checkpoints(tmp_path)
  before = files_of(directory)
  with pytest.raises(ValueError, match=f"holds another train state.*{words}.*Nothing was changed"):
    checkpoint.restore_latest(checkpoint.manager(str(tmp_path), 2), like)
  assert files_of(directory) == before


def test_checkpoints_without_config_json_stop_and_change_nothing(tmp_path):
  """config.json deleted: nothing says which config the checkpoints belong to, so the run stops
  before it loads anything, and the workdir is left as it was."""
  work = tmp_path / "run"
  toy_checkpoints(work)
  before = files_of(work)
  with pytest.raises(ValueError, match=r"holds checkpoints .* but no config\.json"):
    trainer.train(small(work, total_steps=1))
  assert files_of(work) == before


def test_unreadable_config_json_stops_and_changes_nothing(tmp_path):
  work = tmp_path / "run"
  toy_checkpoints(work)
  (work / "config.json").write_text('{"seed": 0, "rl": {')
  before = files_of(work)
  with pytest.raises(ValueError, match=r"config\.json is not JSON .* Nothing was changed"):
    trainer.train(small(work, total_steps=1))
  assert files_of(work) == before


@pytest.mark.parametrize(
  "change, field",
  [
    (
      {"rollout__max_prompt_len": 8},
      r"config\.rollout\.max_prompt_len = 8 is invalid: must hold every prompt: 4 of 4 are longer",
    ),
    ({"seed": -1}, r"config\.seed = -1 is invalid: must be an int in \[0, 2147483647\]"),
    (
      {"rollout__num_top_logprobs": 10**6},
      r"config\.rollout\.num_top_logprobs = 1000000 is invalid: must be <= the model's vocabulary",
    ),
  ],
  ids=["prompt_too_long", "seed_negative", "top_logprobs_over_vocab"],
)
def test_step0_config_error_leaves_no_workdir(tmp_path, change, field):
  """Checks that need the data or the vocabulary run before the workdir is made, so the corrected
  command is not refused as "another config"."""
  work = tmp_path / "run"
  with pytest.raises(ValueError, match=field):
    trainer.train(small(work, total_steps=1, **change))
  assert not work.exists()


def test_every_prompt_of_a_dataset_is_checked_up_front(tmp_path):
  """A dataset task's prompts are all checked against max_prompt_len before anything is written,
  not only the first step's: a long one later in the data would stop the run at its step."""
  c = small(tmp_path / "run")
  tokenizer = build.make_task(c).own_tokenizer
  problems = [
    tasks.Problem(id=f"p{i}", question="q", prompt="a;b", reference="1") for i in range(12)
  ]
  first = {p.id for p in tasks.Task("math:toy", "math", tuple(problems)).sample(4, 0)}
  late = next(i for i, p in enumerate(problems) if p.id not in first)
  problems[late] = dataclasses.replace(problems[late], prompt="a;b " * 100)
  dataset = tasks.Task("math:toy", "math", tuple(problems))
  with pytest.raises(
    ValueError,
    match=(
      r"config\.rollout\.max_prompt_len = 64 is invalid: must hold every prompt: 1 of 12 are "
      rf"longer, the longest \('p{late}' of task 'math:toy'\) has 100 tokens"
    ),
  ):
    run_config.check_inputs(c, dataset, build.model_config(c), tokenizer)


def test_task_the_tokenizer_cannot_read_is_refused_up_front(tmp_path):
  """The tiny pointer-chase vocabulary reads a math prompt as mostly its unknown token: refused,
  naming the task and the model, before anything is written."""
  from tests.test_trainer import config

  c = config(workdir=str(tmp_path / "run"), task__name="math:reasoning_gym:basic_arithmetic")
  task = tasks.make_task(c.task.name, limit=8)
  cfg, _, tokenizer = build.load_model(c, task)
  with pytest.raises(
    ValueError,
    match=(
      r"config\.task\.name = 'math:reasoning_gym:basic_arithmetic' is invalid: must be a task the "
      r"model's tokenizer can read: \d+ of its \d+ prompt tokens are the unknown token \(id 0\) "
      r"of config\.model\.hf_dir = 'assets/pointer_chase_tiny'"
    ),
  ):
    run_config.check_inputs(c, task, cfg, tokenizer)
  run_config.check_inputs(c, build.make_task(config()), cfg, tokenizer)  # its own task reads


@pytest.mark.nightly
def test_second_run_on_a_locked_workdir_is_refused(tmp_path):
  """While a run holds the workdir's lock, another is refused (one line, exit 2) and writes
  nothing; once the holder is killed (SIGKILL), the kernel has released the lock."""
  work = tmp_path / "run"
  work.mkdir()
  holder = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "import fcntl, sys, time\n"
      "f = open(sys.argv[1], 'a+'); fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True)\n"
      "time.sleep(600)",
      str(work / workdir.LOCK_FILE),
    ],
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "held"
    out = run_cli(work, [])
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"error: config.workdir = '{work}' is in use by another run")
    assert sorted(os.listdir(work)) == [workdir.LOCK_FILE]
    with pytest.raises(ValueError, match="is in use by another run"):  # in-process too
      with workdir.workdir_lock(str(work)):
        pass
  finally:
    holder.kill()
    holder.wait()
  with workdir.workdir_lock(str(work)):  # a killed run leaves nothing stuck
    with pytest.raises(ValueError, match=r"is in use by another run \(pid \d+ on "):
      with workdir.workdir_lock(str(work)):
        pass


def metrics_file(work, text):
  work.mkdir(exist_ok=True)
  (work / "metrics.jsonl").write_text(text)
  return work / "metrics.jsonl"


ROWS = '{"step": 1, "reward/mean": 0.5}\n{"step": 2, "reward/mean": 0.25}\n'


def test_torn_last_metrics_line_is_dropped_and_repaired(tmp_path):
  """A kill mid-write leaves a torn last line: a resume drops it and appends after whole rows."""
  path = metrics_file(tmp_path / "run", ROWS + '{"step": 3, "reward/me')
  assert [r["step"] for r in metrics_log.read_rows(str(path))] == [1, 2]
  assert workdir.logged_row(str(tmp_path / "run"), 2) == {"step": 2, "reward/mean": 0.25}
  logger = metrics_log.MetricsLogger(str(tmp_path / "run"), resume_step=2)
  logger.write(3, {"reward/mean": 1.0})
  logger.close()
  assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]


def test_damaged_metrics_line_before_the_last_stops_naming_it(tmp_path):
  """Only a torn last line is a kill's; a bad line before it is left for a person to look at."""
  path = metrics_file(tmp_path / "run", '{"step": 1}\n{"st\n{"step": 2}\n')
  with pytest.raises(ValueError, match=r"metrics\.jsonl line 2 is not JSON"):
    metrics_log.MetricsLogger(str(tmp_path / "run"), resume_step=2)
  assert path.read_text() == '{"step": 1}\n{"st\n{"step": 2}\n'


def test_summary_without_the_last_row_is_written_not_a_traceback(tmp_path):
  """A run at its last step whose metrics row was lost still finishes: summary.json's last is
  null (the lookup raised StopIteration)."""
  work = tmp_path / "run"
  metrics_file(work, ROWS)
  assert workdir.logged_row(str(work), 3) is None
  workdir.write_summary(small(work, total_steps=3), None, None, None, None, None, [])
  summary = json.loads((work / "summary.json").read_text())
  assert summary.pop("peak_rss_gib") > 0
  assert summary == {
    "steps": 3,
    "time_s": None,
    "last": None,
    "eval": [],
    "command": records.command(),
    "commit": records.commit_at_start(),
    "machine": records.machine(),
  }


def test_summary_and_config_are_replaced_whole_or_not_at_all(tmp_path, monkeypatch):
  """A write that fails half way (here: a value JSON cannot hold, a failing fsync) leaves the old
  file as it was and no temporary file."""
  work = tmp_path / "run"
  work.mkdir()
  (work / "summary.json").write_text("old")
  with pytest.raises(TypeError):
    workdir.write_summary(
      small(work, total_steps=3), None, None, None, {"step": 3, "x": object()}, None, []
    )
  assert os.listdir(work) == ["summary.json"] and (work / "summary.json").read_text() == "old"
  (work / "config.json").write_text("old")

  def fail(fd):
    raise OSError("disk full")

  monkeypatch.setattr(os, "fsync", fail)
  with pytest.raises(OSError, match="disk full"):
    metrics_log.write_atomic(str(work / "config.json"), "new")
  assert sorted(os.listdir(work)) == ["config.json", "summary.json"]
  assert (work / "config.json").read_text() == "old"


def run_cli(work, args):
  """`python -m sparrow_jax.train` on the SMALL config with `args` in a subprocess (CPU)."""
  return subprocess.run(
    [
      sys.executable,
      "-m",
      "sparrow_jax.train",
      "--config=configs/default.py",
      f"--config.workdir={work}",
      *SMALL,
      *args,
    ],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
  """{'null_values': a KVSchedule JSON with "values": null, 'not_parquet': text named .parquet}."""
  root = tmp_path_factory.mktemp("bad_files")
  schedule = json.loads(
    open(os.path.join(ROOT, "assets/pointer_chase_tiny/calibration_quest/schedule.json")).read()
  )
  (root / "null_values.json").write_text(json.dumps({**schedule, "values": None}))
  (root / "not_parquet.parquet").write_text("problem,answer\n1+1,2\n")
  return {"null_values": root / "null_values.json", "not_parquet": root / "not_parquet.parquet"}


@pytest.mark.nightly
@pytest.mark.parametrize(
  "args, message",
  [
    (["--config.nonexistent=1"], r"config\.nonexistent is not a field of configs/default\.py"),
    (["--config.rl.foo=1"], r"config\.rl\.foo is not a field of configs/default\.py"),
    (["--config.total_steps=abc"], r"config\.total_steps = 'abc' is invalid: invalid literal"),
    ([f"--config.seed={2**70}"], rf"config\.seed = {2**70} is invalid: must be an int in"),
    (["--config.seed=-1"], r"config\.seed = -1 is invalid"),
    (
      ["--config.rl.learning_rate=inf"],
      r"config\.rl\.learning_rate = inf is invalid: must be a "
      "finite number",
    ),
    (["--config.rl.entropy_coef=nan"], r"config\.rl\.entropy_coef = nan is invalid"),
    (["--config.rollout.temperature=inf"], r"config\.rollout\.temperature = inf is invalid"),
    (
      ["--config.rollout.schedule={null_values}"],
      r"config\.rollout\.schedule = '.*null_values\.json': KVSchedule JSON 'values' must be a list",
    ),
    (
      ["--config.task.name=math:polaris", "--config.task.path={not_parquet}"],
      r"config\.task\.path = '.*not_parquet\.parquet' is invalid: .*not_parquet\.parquet is not a "
      "readable parquet file",
    ),
    (["--config.workdir="], r"config\.workdir = '' is invalid: must be a directory path"),
  ],
  ids=[
    "unknown_field",
    "unknown_nested_field",
    "wrong_type",
    "seed_2**70",
    "seed_-1",
    "learning_rate_inf",
    "entropy_coef_nan",
    "temperature_inf",
    "schedule_values_null",
    "not_parquet",
    "workdir_empty",
  ],
)
def test_cli_error_is_one_line_naming_the_field_exit_2(tmp_path, bad_files, args, message):
  work = tmp_path / "run"
  out = run_cli(work, [a.format(**bad_files) for a in args])
  assert out.returncode == 2, out.stderr[-3000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
  assert re.search(message, lines[0]), lines[0]
  assert not work.exists()


def _edit_meta(directory, step, edit):
  """Applies `edit(meta dict) -> meta dict` to checkpoint `step`'s meta JSON as it lies on disk."""
  files = [
    os.path.join(root, f)
    for root, _, fs in os.walk(directory / str(step) / "meta")
    for f in fs
    if '"step"' in open(os.path.join(root, f), errors="replace").read()
  ]
  assert len(files) == 1, files
  meta = json.loads(open(files[0]).read())
  open(files[0], "w").write(json.dumps(edit(meta)))


@pytest.mark.parametrize(
  "edit, words",
  [
    (lambda m: {**m, "step": 1}, r"its meta fails its checksum"),
    (
      lambda m: {k: v for k, v in m.items() if k != checkpoint.META_CHECKSUM} | {"step": 1},
      r"its meta says step 1, its directory step 2",
    ),
  ],
  ids=["checksummed", "without_checksum"],
)
def test_edited_checkpoint_meta_is_refused_and_changes_nothing(tmp_path, edit, words):
  """One changed value in a meta that still parses ("step" 2 -> 1) would resume step 2's weights
  at step 1's data position: the restore stops naming the checkpoint, nothing is moved."""
  directory = toy_checkpoints(tmp_path)
  _edit_meta(directory, 2, edit)
  before = files_of(directory)
  with pytest.raises(
    ValueError, match=rf"checkpoint .*checkpoints/2: {words}.*Nothing was changed"
  ):
    checkpoint.restore_latest(checkpoint.manager(str(tmp_path), 2), TOY)
  assert files_of(directory) == before


def test_no_readable_checkpoint_is_refused_unless_restart_from_scratch(tmp_path):
  """Every checkpoint emptied: each is moved aside and the restore refuses, naming where they went,
  this time and the next (nothing restarts at step 0 on its own); restart_from_scratch=True
  starts again, the moved checkpoints kept."""
  directory = toy_checkpoints(tmp_path)
  for root, _, fs in os.walk(directory):
    for f in fs:
      open(os.path.join(root, f), "wb").close()
  for _ in range(2):
    with pytest.raises(
      checkpoint.NoReadableCheckpoint,
      match=(
        rf"no checkpoint of {directory} is readable: {directory}/1\.corrupt, "
        rf"{directory}/2\.corrupt were moved aside .*--config\.restart_from_scratch=True"
      ),
    ):
      checkpoint.restore_latest(checkpoint.manager(str(tmp_path), 2), TOY)
  mgr = checkpoint.manager(str(tmp_path), 2)
  assert checkpoint.restore_latest(mgr, TOY, restart_from_scratch=True) is None
  assert sorted(os.listdir(directory)) == ["1.corrupt", "2.corrupt"]


@pytest.mark.nightly
def test_sigterm_saves_a_checkpoint_and_exits_0(tmp_path):
  """A real SIGTERM mid-run (what a cluster scheduler sends): the step under way finishes, its
  checkpoint is saved (ckpt_every is far off), a line says so, exit 0. Temporary files a killed
  run left beside config.json / summary.json / metrics.jsonl are removed at the start."""
  import signal

  from tests.helpers import launch_small

  work = tmp_path / "run"
  work.mkdir()
  stale = [".metrics.jsonl.4242.tmp", ".summary.json.4242.tmp", ".config.json.77.tmp"]
  for name in stale:
    (work / name).write_text("torn")
  p = launch_small(work, "--config.total_steps=40", "--config.ckpt_every=100")
  lines = []
  for line in p.stdout:  # ends when the process does: a failure shows its output, no hang
    lines.append(line)
    if line.startswith("step 1/40"):
      p.send_signal(signal.SIGTERM)
      break
  out = "".join(lines) + p.communicate(timeout=300)[0]
  assert p.returncode == 0, out[-3000:]
  match = re.search(r"stopped by SIGTERM after step (\d+): saved checkpoint (\S+);", out)
  assert match, out[-3000:]
  step = int(match.group(1))
  assert 1 <= step < 40 and match.group(2) == f"{work}/checkpoints/{step}"
  assert os.listdir(work / "checkpoints") == [str(step)]
  assert [r["step"] for r in metrics_log.read_rows(str(work / "metrics.jsonl"))][-1] == step
  assert not (work / "summary.json").exists()  # not a finished run
  assert not set(stale) & set(os.listdir(work))


# The CLI on a disk that fills once the first checkpoint is written. A file-size limit stands in for
# a full disk (both fail a write, EFBIG and ENOSPC, the same way, and the limit needs no
# privileges): at 100 kB only the second checkpoint's array files fail (its write fails); at 1 byte
# every write does, the metrics and TensorBoard's events of step 2 first.
FULL_DISK_AFTER_CHECKPOINT_1 = """
import resource, signal, sys
from absl import app
from sparrow_jax import checkpoint, train

save, limit = checkpoint.save, int(sys.argv.pop(1))

def save_then_fill_the_disk(mgr, step, state, meta, rollouts=None):
  save(mgr, step, state, meta, rollouts)
  if step == 1:
    mgr.wait_until_finished()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, not kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

checkpoint.save = save_then_fill_the_disk
app.run(train.main, flags_parser=train._parse_flags)
"""


@pytest.mark.nightly
@pytest.mark.parametrize("limit", [100_000, 1], ids=["checkpoint_write_fails", "every_write_fails"])
def test_a_full_disk_is_one_line_and_the_last_good_checkpoint_restores(tmp_path, limit):
  """A write that fails for lack of space ends the run with its one-line error alone on stderr:
  not under orbax's logs (quiet unless --verbose), nor the tracebacks of its writes still in flight
  (checkpoint._run_in_new_loop); TensorBoard's events are written in the step's own thread
  (logging._Events), so their failed write ends the run too, where a writer thread of their own
  died and left the run blocked. The checkpoint before it (the only one kept) stays, and the same
  command resumes from it."""
  from tests.helpers import subprocess_env

  # The limit would fail the tests' compilation cache writes too (a warning of jax's): this run
  # reads that cache but writes none.
  env = dict(subprocess_env(), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="1e9")
  work = tmp_path / "run"
  args = [
    f"--config.workdir={work}",
    *SMALL,
    "--config.total_steps=2",
    "--config.ckpt_every=1",
    "--config.keep_checkpoints=1",
    "--config.export_hf=False",
  ]
  run = lambda *cmd: subprocess.run(
    [sys.executable, *cmd, "--config=configs/default.py", *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  out = run("-c", FULL_DISK_AFTER_CHECKPOINT_1, str(limit))
  assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
  assert "step 1/2" in out.stdout
  assert "1" in os.listdir(work / "checkpoints")
  again = run("-m", "sparrow_jax.train")
  assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
  assert f"resumed from {work} at step 1" in again.stdout
  assert os.listdir(work / "checkpoints") == ["2"]
