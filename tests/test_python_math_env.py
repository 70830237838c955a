"""env:python_math: problems from the single-turn math tasks' local files, in their stream; a prompt
that offers the python tool in Qwen3's format (ChatML turns, as SmolLM2 writes them too); a call's
observation is the program's exit status, stdout and stderr, bounded when it fails or hangs; the
final \\boxed{} answer graded as the single-turn task grades it; bad fields refused by name."""

import json

import pytest

from sparrow_jax.data import tasks
from sparrow_jax.data.tokenizer import IM_END, Tokenizer, tool_call_text, train_bpe
from sparrow_jax.envs import protocol, python_math, registry, tools
from sparrow_jax.envs import turns as turns_lib
from sparrow_jax.sandbox import runner
from tests.helpers import play_episode

ROWS = [
  {"problem": "What is 6 times 7?", "answer": "42"},
  {"problem": "Half of 1?", "answer": "\\frac{1}{2}"},
  {"problem": "What is 2 + 2?", "answer": "4"},
  {"problem": "", "answer": "5"},  # malformed: skipped, as the single-turn task skips it
  {"problem": "What is 10 - 3?", "answer": "7"},
]


@pytest.fixture
def data_file(tmp_path):
  path = tmp_path / "polaris.jsonl"
  path.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
  return str(path)


def _env(data_file, **fields):
  return registry.make_env("env:python_math", dataset="math:polaris", path=data_file, **fields)


def _call(code):
  return tool_call_text("python", {"code": code}) + IM_END


def _play(env, actions):
  """The steps of `actions` (tests/helpers.play_episode), calls run in the env's own pool."""
  return play_episode(env, actions, env.config.pool(max_workers=1))


# ---------------------------------------------------------------------------------------- problems


def test_problems_are_the_single_turn_task_s_stream(data_file):
  """The same file, seed and position give the single-turn task's problems (its rows, its skips,
  its shuffled order), and the default is the reasoning-gym task of configs/real_lm_rl.py."""
  for seed in (0, 3):
    task = tasks.make_task("math:polaris", data_file, seed=seed)
    env = _env(data_file, seed=seed)
    assert env.sample(6, 2) == task.sample(6, 2)  # past one epoch of 4: the next order
  assert [p.reference for p in env.sample(4, 0)] != [
    p.reference for p in _env(data_file).sample(4, 0)
  ]
  gym = registry.make_env("env:python_math", limit=20)
  want = tasks.make_task("math:reasoning_gym:basic_arithmetic", seed=0, limit=20).sample(5, 7)
  assert gym.sample(5, 7) == want


def test_the_prompt_offers_the_python_tool_in_qwen3_s_format(data_file):
  env = _env(data_file)
  problem = env.sample(1, 0)[0]
  prompt = protocol.prompt_text(env, problem)
  system, user, generation = prompt.split("<|im_start|>")[1:]
  assert system.startswith("system\n# Tools\n") and '"name": "python"' in system
  assert '"required": ["code"]' in system and "<tool_call></tool_call> XML tags" in system
  assert user == f"user\n{problem.question}\n\n{python_math.INSTRUCTION}<|im_end|>\n"
  assert "python tool" in python_math.INSTRUCTION and "\\boxed{}" in python_math.INSTRUCTION
  assert generation == "assistant\n"  # thinking on: no empty think block for a non-Qwen3 model
  bare = protocol.prompt_text(_env(data_file, list_tools=False), problem)
  assert bare == f"<|im_start|>{user}<|im_start|>assistant\n"  # no system turn without tools
  example = protocol.prompt_text(_env(data_file, example=True), problem)
  call = tool_call_text("python", {"code": python_math.EXAMPLE_CODE})
  assert (
    example.index(python_math.EXAMPLE_QUESTION)
    < example.index(call)
    < example.index(problem.question)
  )
  assert "<tool_response>" not in example  # the example stops at its call


def test_a_chatml_tokenizer_without_the_tool_tags_reads_and_writes_the_episode(data_file):
  """SmolLM2's vocabulary has ChatML's <|im_start|> and <|im_end|> (its EOS: a turn ends there)
  but not Qwen3's tool tags: the tags are plain text pieces, the prompt, a call and the observation
  still encode and decode to themselves, and the decoded call parses."""
  env = _env(data_file, example=True)
  prompt = protocol.prompt_text(env, env.sample(1, 0)[0])
  observation = protocol.observation_text(["exit status: 0\nstdout:\n42\n\nstderr:\n"])
  tok = Tokenizer(tok=train_bpe([prompt, observation], 400), eos_ids=(2,), pad_id=0)
  assert tok.token_id(IM_END) == 2 and tok.tok.token_to_id("<tool_call>") is None
  action = _call("print(6 * 7)")
  for text in (prompt, action, observation):
    assert tok.decode(tok.encode(text)) == text
  assert tok.encode(action)[-1] == 2  # the call turn ends at the EOS the engine stops on
  assert protocol.parse_action(tok.decode(tok.encode(action))) == protocol.ToolCall(
    "python", {"code": "print(6 * 7)"}
  )


# ---------------------------------------------------------------------------------------- episodes


@pytest.mark.slow
def test_a_python_call_s_observation_is_exit_status_and_stdout_then_the_answer_is_graded(data_file):
  env = _env(data_file)
  problem = next(p for p in env.sample(4, 0) if p.reference == "42")
  env.reset(problem)
  steps = _play(env, [_call("print(6 * 7)"), "The program printed 42: \\boxed{42}" + IM_END])
  assert (steps[0].reason, steps[0].done) == ("tool_ok", False)
  assert steps[0].observation == "exit status: 0\nstdout:\n42\n\nstderr:\n"
  assert (steps[1].reason, steps[1].done) == ("answer", True)
  assert env.grade() == (1.0, "correct") and env.turns == 2


@pytest.mark.parametrize(
  "answer",
  [
    "\\boxed{42}",
    "\\boxed{42.0}",
    "\\boxed{41}",
    "the answer is 42",
    "<think>\nit is \\boxed{42}",
    "<think>\nmaybe 41\n</think>\n\n\\boxed{42}",
    "\\boxed{\\frac{1}{2}}",
    "\\boxed{0.5}",
    "\\boxed{1/2}",
  ],
)
def test_the_final_answer_is_graded_as_the_single_turn_task_grades_it(data_file, answer):
  """Whatever the answer, right or wrong, the episode's reward and reason are Task.grade's of the
  same text and problem."""
  task = tasks.make_task("math:polaris", data_file)
  env = _env(data_file)
  for problem in [p for p in task.problems if p.reference in ("42", "\\frac{1}{2}")]:
    env.reset(problem)
    env.step(answer + IM_END)
    assert env.grade() == task.grade([answer + IM_END], [problem])[0]


def test_a_right_and_a_wrong_answer_after_no_call(data_file):
  env = _env(data_file)
  problem = next(p for p in env.sample(4, 0) if p.reference == "7")
  env.reset(problem)
  assert _play(env, ["\\boxed{7}" + IM_END])[0].reason == "answer"
  assert env.grade() == (1.0, "correct")
  env.reset(problem)
  env.step("\\boxed{8}" + IM_END)
  assert env.grade() == (0.0, "wrong")


def test_a_bad_call_is_an_observation_and_max_turns_ends_the_episode(data_file):
  env = _env(data_file, max_turns=2)
  env.reset(env.sample(1, 0)[0])
  steps = _play(env, [tool_call_text("python", {"program": "print(1)"}) + IM_END] * 3)
  assert steps[0].reason == "bad_call" and "takes arguments ['code']" in steps[0].observation
  assert [s.reason for s in steps] == ["bad_call", "max_turns"]
  assert env.grade() == (0.0, "max_turns")


# ---------------------------------------------------------------------------------------- failures


@pytest.mark.slow
def test_a_raising_program_gives_its_exit_status_and_traceback_cut_to_the_observation_budget(
  data_file,
):
  env = _env(data_file, max_observation_chars=512)
  env.reset(env.sample(1, 0)[0])
  (step,) = _play(env, [_call("print('x' * 100000)\nraise ValueError('no luck')")])
  assert step.reason == "tool_ok" and not step.done  # the row goes on to its next turn
  assert step.observation.startswith("exit status: 1\nstdout:\nxxx")
  assert len(step.observation) <= 512 and "[truncated from " in step.observation
  env.reset(env.sample(1, 0)[0])
  (step,) = _play(env, [_call("raise ValueError('no luck')")])
  assert step.observation.startswith("exit status: 1\nstdout:\n\nstderr:\nTraceback")
  assert step.observation.endswith("ValueError: no luck\n")


@pytest.mark.slow
def test_a_looping_program_ends_at_the_sandbox_s_clock_with_its_output_so_far(data_file):
  env = _env(data_file, code_timeout_s=0.5)
  env.reset(env.sample(1, 0)[0])
  (step,) = _play(env, [_call("print('started', flush=True)\nwhile True: pass")])
  assert step.reason == "tool_ok" and not step.done
  assert step.observation.startswith("timeout after 0.5s (the sandbox's limit)\nstdout:\nstarted")


@pytest.mark.slow
def test_a_program_past_tool_timeout_s_becomes_the_pool_s_timeout_and_the_row_goes_on(data_file):
  """A program the pool abandons (its sandbox clock, set here past tool_timeout_s as a starved
  CPU can stretch it) is the observation "timeout after Xs"; the engine's turns carry on."""
  env = _env(data_file, tool_timeout_s=0.5, code_timeout_s=0.25)
  env.reset(env.sample(1, 0)[0])
  env.tools = {"python": tools.PythonTool(runner.SandboxLimits(timeout_s=5.0))}
  (step,) = _play(env, [_call("while True: pass")])
  assert (step.reason, step.observation, step.done) == ("tool_timeout", "timeout after 0.5s", False)
  steps = _play(env, ["\\boxed{0}" + IM_END])
  assert steps[0].done and env.grade().reason in ("wrong", "correct")


class _Prints:
  """The python tool's schema, printing `output` whatever the code."""

  schema = tools.PythonTool().schema

  def __init__(self, output):
    self.output = output

  def __call__(self, code):
    return self.output


def test_the_engine_s_turns_count_the_tool_use_of_python_math_rows(data_file):
  """EnvTurns over env:python_math rows, as the trainer drives them: a call is counted and its
  observation comes back as the template's tool turn, cut to max_observation_tokens."""
  output = "exit status: 0\nstdout:\n" + "9 " * 200
  env = _env(data_file, max_observation_tokens=40)
  env.reset(env.sample(1, 0)[0])
  env.tools = {"python": _Prints(output)}  # the sandbox's part is tested above
  tok = Tokenizer(tok=train_bpe([protocol.observation_text([output])], 300), eos_ids=(2,), pad_id=0)
  turns = turns_lib.EnvTurns({0: env}, tok, env.config.pool())
  assert turns.turn_ended(0, tok.encode(_call("print(9)")))  # the row waits on its call
  (ids,) = turns.observations(wait=True).values()
  assert tok.decode(ids) == protocol.observation_turn(env.config, output, tok)
  assert "[truncated from " in tok.decode(ids) and tok.decode(ids).count("9") < 200
  assert turns.counts[0]["tool_calls"] == 1 and turns.counts[0]["tool_ok"] == 1


# ------------------------------------------------------------------------------------------ config


@pytest.mark.parametrize(
  "fields, says",
  [
    (
      {"dataset": "code:taco"},
      "PythonMathConfig.dataset = 'code:taco' must be a math task, one of",
    ),
    ({"dataset": "math:nope"}, "PythonMathConfig.dataset = 'math:nope' must be a math task"),
    ({"dataset": "math:reasoning_gym:"}, "PythonMathConfig.dataset = 'math:reasoning_gym:' must"),
    ({"dataset": 3}, "PythonMathConfig.dataset must be a string, got 3"),
    ({"dataset": "math:gsm8k"}, "PythonMathConfig.path = '' must name math:gsm8k's local data"),
    ({"path": "x.jsonl"}, "PythonMathConfig.path = 'x.jsonl' must be '' for math:reasoning_gym:"),
    ({"limit": -1}, "PythonMathConfig.limit must be >= 0, got -1"),
    ({"seed": 1.5}, "PythonMathConfig.seed must be an int, got 1.5"),
    ({"example": 1}, "PythonMathConfig.example must be a bool, got 1"),
    ({"code_timeout_s": 0.0}, "PythonMathConfig.code_timeout_s must be positive, got 0.0"),
    (
      {"code_timeout_s": 10.0},
      "PythonMathConfig.code_timeout_s = 10.0 must be < tool_timeout_s (10.0)",
    ),
    ({"max_turns": 0}, "PythonMathConfig.max_turns must be positive, got 0"),
  ],
)
def test_a_bad_field_is_refused_in_one_line_naming_it(fields, says):
  with pytest.raises(ValueError) as error:
    registry.env_config("env:python_math", **fields)
  assert str(error.value).startswith(says) and "\n" not in str(error.value)


def test_an_unreadable_dataset_file_is_refused_naming_the_field(tmp_path):
  env = registry.make_env("env:python_math", dataset="math:gsm8k", path=str(tmp_path / "no.jsonl"))
  with pytest.raises(ValueError, match=r"^PythonMathConfig.dataset = 'math:gsm8k' with path = "):
    env.sample(1, 0)


def test_the_real_lm_config_builds_its_env_task_and_names_a_bad_env_field():
  from configs import real_lm_multi_turn
  from sparrow_jax.rl import build

  c = real_lm_multi_turn.get_config()
  task = build.make_task(c)
  assert task.name == "env:python_math" and task.config.example
  c.env.dataset = "code:taco"
  with pytest.raises(ValueError, match=r"^config.env.dataset = 'code:taco' must be a math task"):
    build.make_task(c)
