"""Multi-turn tasks in the trainer (config.task.name = "env:NAME"): each row plays its own episode
through the engine's turns, is graded by its environment, trains on its own turns only (its
observations are context: tests/test_train_step.py), and the run logs its tool use."""

import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from configs import common, default, multi_turn
from sparrow_jax.data import rewards
from sparrow_jax.envs import protocol, registry, tools
from sparrow_jax.rl import build, run_config, trainer
from tests.helpers import (
  PER_DEVICE_METRICS,
  ROOT,
  assert_dashboard_has_data,
  assert_same_metrics,
  free_port,
  rows_by_step,
  subprocess_env,
  write_tiny_hf_dir,
)


@dataclasses.dataclass(frozen=True)
class EchoConfig(protocol.EnvConfig):
  calls: int = 2  # tool calls an episode makes before its next turn is its answer
  seed: int = 0
  MAY_BE_ZERO = ("seed",)


@dataclasses.dataclass(frozen=True)
class EchoProblem:
  id: str
  words: int  # the echo tool answers this many words


def echo(text: str) -> str:
  return text


echo.schema = tools.function_schema("echo", "Echoes its text.", {"text": "the text"})


class EchoEnv(protocol.ToolEnv):
  """A random policy's episode: its first `calls` turns call the echo tool, whatever they say
  (their observation: the problem's count of words), the next is the answer, graded by its length
  (1 when even), so rewards vary within a group."""

  name = "env:echo_test"

  def __init__(self, config: EchoConfig = EchoConfig()):
    super().__init__(config)
    self.tools = {"echo": echo}

  def sample(self, n, position):
    return [EchoProblem(f"echo:{p}", 4 + 9 * (p % 3)) for p in range(position, position + n)]

  def first_messages(self, problem):
    return [{"role": "user", "content": f"Call echo {self.config.calls} times."}]

  def step(self, action):
    if self.turns < self.config.calls:
      self.turns += 1
      text = " ".join(["word"] * self.problem.words)
      return protocol.Step("", False, "tool_call", protocol.ToolCall("echo", {"text": text}))
    return super().step(action)

  def grade_answer(self, text, problem):
    return rewards.Grade(float(len(text) % 2 == 0), "even" if len(text) % 2 == 0 else "odd")


@pytest.fixture
def echo_env(monkeypatch):
  monkeypatch.setitem(registry.ENVS, "env:echo_test", (EchoConfig, EchoEnv))


@pytest.fixture
def model_dir(echo_env, tmp_path):
  """The tiny random model dir, its tokenizer made on the echo episode's text, its turns ending
  every ~8 tokens (EOS ids: every 8th id)."""
  directory = tmp_path / "model"
  problem = build.make_task(multi_turn_config("/unused")).sample(1, 0)[0]
  cfg = write_tiny_hf_dir(directory, corpus=[problem.prompt, protocol.observation_text(["word"])])
  with open(directory / "generation_config.json") as f:
    generation = json.load(f)
  generation["eos_token_id"] = list(range(2, cfg.vocab_size, 8))
  with open(directory / "generation_config.json", "w") as f:
    json.dump(generation, f)
  return str(directory)


def multi_turn_config(workdir, model=None, **changes):
  """The default config on the echo environment (model: a model dir; None: the default's)."""
  c = default.get_config()
  c.workdir, c.total_steps = str(workdir), 2
  c.model.hf_dir = model or os.path.join(ROOT, c.model.hf_dir)
  c.task.name, c.env = "env:echo_test", common.env("env:echo_test")
  r = c.rollout
  r.schedule, r.page_size, r.dense_layers, r.speculate = "fixed:4", 8, 1, 0
  r.max_prompt_len, r.max_new_tokens, r.group_size, r.prompts_per_step = 320, 96, 4, 2
  c.stats.bin_size, c.rl.num_minibatches, c.export_hf = 64, 1, False
  for dotted, value in changes.items():
    *group, field = dotted.split("__")
    (c[group[0]] if group else c)[field] = value
  return c


@pytest.mark.slow
@pytest.mark.parametrize("off_policy_steps, partial_groups", [(0, 0), (1, 0), (0, 2)])
def test_a_multi_turn_run_trains_on_episodes_graded_by_their_env_and_logs_tool_use(
  echo_env, model_dir, tmp_path, off_policy_steps, partial_groups
):
  """On-policy, one step off (step 2's episodes played in the rollout thread while step 1's
  update ran, with step 1's weights) and with carried rows (2 groups more under way than a step
  takes, in 8 slots: episodes go on across steps); step 2 ends with the held-out evaluation's
  episodes."""
  changes = dict(rl__off_policy_steps=off_policy_steps, rollout__partial_groups=partial_groups)
  if partial_groups:
    changes.update(rollout__engine_slots=8)
  c = multi_turn_config(tmp_path / "run", model_dir, **changes)
  c.eval.update(every=2, problems=2, samples=2)
  rows = trainer.train(c)
  assert len(rows) == 2
  assert [r["rollout/weights_step"] for r in rows] == [0, 1 - off_policy_steps]
  assert_dashboard_has_data(c, rows)
  for mode in ("dense", "sparse"):  # graded by the episodes' env: the echo env's reward is 0 or 1
    assert 0.0 <= rows[1][f"eval/{mode}/mean@1"] <= 1.0, mode
  with open(tmp_path / "run" / "eval_samples.jsonl") as f:
    shown = [json.loads(line) for line in f]
  assert {row["mode"] for row in shown} == {"dense", "sparse"}
  assert all("word word" in row["completion"] for row in shown)  # the echo tool's observations
  for row in rows:
    # 8 rows each make 2 calls (unless max_new cuts their episode short)
    assert 0 < row["env/tool_calls"] <= 16 and row["env/tool_errors"] == 0
    assert 1.0 < row["env/turns/mean"] <= 3.0 and row["env/turns/max"] == 3
    assert 0.05 < row["env/observation_share"] < 0.95
    assert 0.0 <= row["reward/mean"] <= 1.0 and np.isfinite(row["loss/policy"])


def test_an_env_task_plays_one_episode_a_row_through_its_tools(echo_env, model_dir):
  from sparrow_jax.data.tokenizer import load_tokenizer

  task = build.make_task(multi_turn_config("/unused", model_dir))
  assert task.kind == "env" and task.config.calls == 2
  problems = task.sample(2, 5)
  assert [p.id for p in problems] == ["echo:5", "echo:6"] and "<tools>" in problems[0].prompt
  assert task.sample(2, 5) == problems  # a pure function of the position
  tokenizer = load_tokenizer(model_dir)
  turns = task.turns({10: problems[0], 11: problems[1]}, tokenizer)
  assert turns.envs[10] is not turns.envs[11]  # each row its own episode
  for _ in range(2):  # a call, its observation into the row
    assert turns.turn_ended(10, tokenizer.encode("a turn"))
    observed = turns.observations(wait=True)
    assert list(observed) == [10] and "word word" in tokenizer.decode(observed[10])
  assert not turns.turn_ended(10, tokenizer.encode("the answer"))  # its third turn answers
  grade = turns.grade(10)
  assert grade.reward == float(len("the answer") % 2 == 0)
  assert turns.grade(11) == rewards.Grade(0.0, "max_tokens")  # never finished
  observed = np.asarray([[0, 1, 1, 0], [0, 0, 0, 0]], bool)
  metrics = turns.metrics(observed, np.asarray([3, 4]), [10, 11])
  assert metrics["env/tool_calls"] == 2 and metrics["env/observation_share"] == 2 / 7
  assert metrics["env/turns/max"] == 3 and metrics["env/tool_seconds"] >= 0.0


def test_the_held_out_evaluation_plays_an_episode_a_row_graded_by_its_env(echo_env, model_dir):
  """4 rows in batches of 3 (the last one padded): each row calls the echo tool twice, then
  answers, and takes its episode's grade (1 for an even-length answer: its last turn, after the
  last observation's generation prompt), not a single-turn grade of its text."""
  import jax

  import sparrow_jax as sj
  from sparrow_jax.data.tokenizer import load_tokenizer
  from sparrow_jax.rl import evaluate

  c = multi_turn_config("/unused", model_dir)
  task, tokenizer = build.make_task(c, c.eval.seed), load_tokenizer(model_dir)
  cfg, params = sj.load_hf(model_dir)
  sampling = build.sampling(c, tokenizer)
  generate = functools.partial(sj.generate, params, cfg, max_new_tokens=256, sampling=sampling)
  problems = evaluate.first_problems(task, 2)
  key = jax.random.PRNGKey(0)
  graded = evaluate.sample_and_grade(generate, tokenizer, task, problems, 2, key, 3)
  assert all(r.count("word word") >= 1 for r in graded.responses), graded.responses
  assert set(graded.reasons) <= {"even", "odd", "max_tokens"}
  assert graded.reasons["even"] + graded.reasons["odd"] > 0  # some episodes answered
  assert int(graded.rewards_a.sum()) == graded.reasons["even"]
  header = protocol.IM_START + "assistant\n"
  for response, reward in zip(graded.responses, graded.rewards_a):
    if reward:
      assert len(response.rsplit(header, 1)[-1]) % 2 == 0, response


def test_the_held_out_env_problems_are_drawn_under_the_eval_seed():
  c = multi_turn.get_config()
  train, held_out = build.make_task(c), build.make_task(c, c.eval.seed)
  assert held_out.config.seed == c.eval.seed != train.config.seed
  assert [p.prompt for p in held_out.sample(4, 0)] != [p.prompt for p in train.sample(4, 0)]


def test_a_row_s_episode_saved_while_its_tool_runs_goes_on_from_its_observation(
  echo_env, model_dir
):
  """What a checkpoint keeps of a carried row waiting on its call: the call is waited for, the
  episode (its turns so far) and the observation come back as JSON into turns made anew."""
  from sparrow_jax.data.tokenizer import load_tokenizer

  task = build.make_task(multi_turn_config("/unused", model_dir))
  tokenizer = load_tokenizer(model_dir)
  problems = {10: task.sample(1, 5)[0], 11: task.sample(1, 6)[0]}
  turns = task.turns(problems, tokenizer)
  assert turns.turn_ended(10, tokenizer.encode("a turn"))  # its call in flight
  state = json.loads(json.dumps(turns.state()))
  back = task.turns(problems, tokenizer)
  back.restore(state)
  observed = back.observations(wait=False)
  assert list(observed) == [10] and observed == turns.observations(wait=False)
  assert back.turn_ended(10, tokenizer.encode("a turn"))  # its second call, then its answer
  assert list(back.observations(wait=True)) == [10]
  assert not back.turn_ended(10, tokenizer.encode("the answer"))
  assert back.grade(10) == rewards.Grade(float(len("the answer") % 2 == 0), "even")
  assert back.counts[10]["tool_calls"] == 2 and back.counts[10]["tool_ok"] == 2
  back.drop([10])
  assert list(back.envs) == [11]


def test_a_multi_turn_held_out_evaluation_on_several_processes_is_refused_naming_the_field(
  echo_env,
):
  c = multi_turn_config("/unused", distributed__num_processes=2, eval__every=1)
  with pytest.raises(ValueError, match="config.eval.every = 1 .*num_processes = 2: the held-out"):
    run_config.validate(c)


@pytest.mark.parametrize(
  "change, says",
  [
    (lambda c: c.env.update(calls=0), "config.env.calls must be positive, got 0"),
    (lambda c: c.env.update(tool_timeout_s=-1.0), "config.env.tool_timeout_s must be positive"),
    (lambda c: c.env.update(tool_workers=0), "config.env.tool_workers must be a positive int"),
    (lambda c: c.env.__setattr__("bogus", 1), r"config.env: unknown field\(s\) \['bogus'\]"),
    (lambda c: c.task.__setattr__("name", "env:nope"), "config.task.name = 'env:nope'"),
    (lambda c: c.__delattr__("env"), "its fields go in a config.env group"),
  ],
)
def test_an_env_task_s_bad_field_is_refused_naming_it(echo_env, change, says):
  c = multi_turn_config("/unused")
  change(c)
  with pytest.raises(ValueError, match=says):
    build.make_task(c)


def test_env_configs_have_every_field_of_their_environment():
  for name in registry.env_names():
    fields = {f.name for f in dataclasses.fields(registry.ENVS[name][0])}
    assert set(common.env(name)) == fields | {"tool_workers"}, name


@pytest.mark.nightly
@pytest.mark.parametrize("off_policy_steps", [0, 1])
def test_a_multi_turn_run_resumed_from_a_mid_run_checkpoint_logs_the_uninterrupted_metrics(
  echo_env, model_dir, tmp_path, off_policy_steps
):
  """A 3-step run resumed from its step-2 checkpoint (its step-3 checkpoint removed, as a kill
  after step 2 leaves it; one step off, the checkpoint holds step 3's episodes, sampled ahead and
  graded, their tool use with them) logs the straight run's step 3."""
  changes = dict(rl__off_policy_steps=off_policy_steps, total_steps=3, ckpt_every=1)
  changes.update(keep_checkpoints=3)
  straight = trainer.train(multi_turn_config(tmp_path / "straight", model_dir, **changes))
  shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "3")
  resumed = trainer.train(multi_turn_config(tmp_path / "resumed", model_dir, **changes))
  assert len(resumed) == 1  # step 3 only
  want = {k: v for k, v in straight[-1].items() if not k.startswith("perf/")}
  got = {k: v for k, v in resumed[0].items() if not k.startswith("perf/")}
  assert got["env/tool_calls"] > 0 and got.keys() == want.keys()
  for key in want:
    if key != "env/tool_seconds":  # wall time
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.nightly
def test_a_multi_turn_run_with_carried_rows_is_extended_as_if_never_stopped(
  echo_env, model_dir, tmp_path
):
  """A 2-step run with carried rows (episodes under way, rows waiting on the echo tool), then the
  same workdir with total_steps 4: the checkpoint keeps each carried row's episode (its turns,
  its observation ready) with its tokens and pages, so steps 3 and 4 are the 4-step run's."""
  changes = dict(rollout__partial_groups=2, rollout__engine_slots=8, ckpt_every=2)
  whole = trainer.train(multi_turn_config(tmp_path / "whole", model_dir, total_steps=4, **changes))
  trainer.train(multi_turn_config(tmp_path / "cut", model_dir, total_steps=2, **changes))
  extended = trainer.train(multi_turn_config(tmp_path / "cut", model_dir, total_steps=4, **changes))
  assert len(extended) == 2 and any(r["rollout/rows_carried"] for r in extended)
  for got, want in zip(extended, whole[2:]):
    assert got["env/tool_calls"] > 0 and got.keys() == want.keys()
    for key in want:
      if not key.startswith("perf/") and key != "env/tool_seconds":  # wall time
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow
def test_the_multi_turn_default_s_model_plays_its_episodes_through_the_tool(tmp_path):
  """configs/multi_turn.py cut to 2 steps of 2 prompts: the shipped model calls lookup about once
  a hop (4 hops), some episodes reach the key, and the observations are a good share of the rows."""
  c = multi_turn.get_config()
  c.workdir, c.total_steps, c.export_hf = str(tmp_path / "run"), 2, False
  c.model.hf_dir = os.path.join(ROOT, c.model.hf_dir)
  c.rollout.prompts_per_step = 2
  rows = trainer.train(c)
  assert len(rows) == 2
  assert_dashboard_has_data(c, rows)
  for row in rows:  # 16 rows a step
    assert row["env/tool_calls"] >= 32 and row["env/turns/mean"] >= 3.0
    assert row["reward/mean"] > 0.0 and row["env/observation_share"] > 0.2


KILLED_RUN = """
import sys, time
from sparrow_jax.envs import registry
from sparrow_jax.rl import trainer
from tests import test_multiturn_training as t

def slow_echo(text: str) -> str:
  time.sleep(float(sys.argv[3]))
  return text

slow_echo.schema = t.echo.schema

class SlowEcho(t.EchoEnv):
  def __init__(self, config=t.EchoConfig()):
    super().__init__(config)
    self.tools = {"echo": slow_echo}

registry.ENVS["env:echo_test"] = (t.EchoConfig, SlowEcho)
trainer.train(t.multi_turn_config(sys.argv[1], sys.argv[2], **t.KILL_CHANGES))
"""
KILL_CHANGES = dict(total_steps=3, ckpt_every=1, keep_checkpoints=3)


def _metric_lines(workdir) -> list:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.endswith("\n")]


@pytest.mark.nightly
def test_a_run_killed_while_rows_wait_on_tools_resumes_to_the_uninterrupted_step(
  echo_env, model_dir, tmp_path
):
  """SIGKILL while step 3's rows wait on a slow tool (each call 1 s, two a row), after the step-2
  checkpoint: the rerun resumes from it and logs the uninterrupted run's step 3 (tool seconds and
  timings aside)."""
  straight = trainer.train(multi_turn_config(tmp_path / "straight", model_dir, **KILL_CHANGES))
  script = tmp_path / "killed_run.py"
  script.write_text(KILLED_RUN)
  workdir = str(tmp_path / "killed")
  cmd = [sys.executable, str(script), workdir, model_dir, "1.0"]
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  run = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  deadline = time.time() + 600
  while len(_metric_lines(workdir)) < 2 or not os.path.isdir(
    os.path.join(workdir, "checkpoints", "2")
  ):
    assert run.poll() is None and time.time() < deadline, run.stdout.read().decode()[-3000:]
    time.sleep(0.05)
  time.sleep(1.0)  # into step 3's rollout: its rows' first calls take 1 s
  run.send_signal(signal.SIGKILL)
  run.wait()
  assert [row["step"] for row in _metric_lines(workdir)] == [1, 2]  # killed inside step 3
  rerun = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert rerun.returncode == 0, rerun.stderr[-3000:]
  lines = _metric_lines(workdir)
  assert [row["step"] for row in lines] == [1, 2, 3]
  got = {k: v for k, v in lines[-1].items() if not k.startswith("perf/")}
  want = {k: v for k, v in straight[-1].items() if k in got}  # histograms: TensorBoard only
  assert got["env/tool_calls"] > 0 and set(want) == set(got) - {"step"}
  as_float = lambda v: np.array(v, dtype=float)  # JSON writes NaN as null
  for key in want:
    if key != "env/tool_seconds":  # wall time
      np.testing.assert_allclose(
        as_float(got[key]), as_float(want[key]), rtol=1e-5, atol=1e-6, err_msg=key
      )


def _multi_turn_default(workdir, processes: int) -> list:
  """configs/multi_turn.py cut to 2 steps of 4 prompts, lossy sparse, in subprocesses: one
  process, or `processes` processes of a device each (CPU collectives, a local coordinator), each
  playing its own rows' episodes; the processes' combined output. Lossy rows, because an exact-mode
  row's tokens depend on where its rounds fall, which moves with when its tools answer."""
  cmd = [
    sys.executable,
    "-m",
    "sparrow_jax.train",
    "--config=configs/multi_turn.py",
    f"--config.workdir={workdir}",
    "--config.total_steps=2",
    "--config.rollout.prompts_per_step=4",
    "--config.rollout.speculate=0",
  ]
  if processes > 1:
    port = free_port()
    cmd += [
      "--config.distributed.enabled=True",
      f"--config.distributed.coordinator=localhost:{port}",
      f"--config.distributed.num_processes={processes}",
      f"--config.mesh.data={processes}",
    ]
  procs = [
    subprocess.Popen(
      cmd + ([f"--config.distributed.process_id={i}"] if processes > 1 else []),
      cwd=ROOT,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
      env=subprocess_env(1),
    )
    for i in range(processes)
  ]
  outs = [p.communicate(timeout=900)[0] for p in procs]
  for p, out in zip(procs, outs):
    assert p.returncode == 0, out[-3000:]
  return outs


@pytest.mark.nightly
def test_multi_turn_default_on_two_processes_logs_the_one_process_run(tmp_path):
  """Each process plays its own rows' episodes (its tools, its observation prefills, the other
  process running the observe program beside it), and process 0 logs every row's tool use: the
  metrics of the one-process run, float rounding of the sharded update aside."""
  _multi_turn_default(tmp_path / "one", 1)
  _multi_turn_default(tmp_path / "two", 2)
  want, got = rows_by_step(tmp_path / "one"), rows_by_step(tmp_path / "two")
  assert got[2]["env/tool_calls"] > 0
  skip = (*PER_DEVICE_METRICS, "env/tool_seconds")  # wall time
  assert_same_metrics(got, want, (1, 2), 1e-5, skip=skip)
