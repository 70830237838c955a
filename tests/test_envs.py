"""Environments: a turn's tool call parsed (or what was wrong with it), observations rendered in
Qwen3's template with the model's tokens told apart from context, env:pointer_chase played through
the tool pool, and env:NAME resolution."""

import threading
import time

import pytest

from sparrow_jax.data.tokenizer import Tokenizer, chat_template, tool_call_text, train_bpe
from sparrow_jax.envs import pointer_chase, protocol, registry
from sparrow_jax.envs import turns as turns_lib
from sparrow_jax.envs.protocol import BadCall, ToolCall
from tests.helpers import play_episode

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call>'
CONVERSATION = [
  {"role": "system", "content": "Be brief."},
  {"role": "user", "content": "Where does k1 lead?"},
  {"role": "assistant", "content": f"<think>\nLook it up.\n</think>\n\n{CALL}"},
  {"role": "tool", "content": "k1 -> k2"},
  {"role": "assistant", "content": "<think>\nFound.\n</think>\n\n\\boxed{k2}"},
]
# Written by hand from Qwen3's chat template (Qwen/Qwen3-8B tokenizer_config.json): tools in the
# system turn, one JSON object a line; a tool message is a user turn of <tool_response>; both
# assistant turns come after the last question, so both keep their reasoning.
QWEN3_TEXT = (
  "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with "
  "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
  '<tools>\n{"type": "function", "function": {"name": "lookup", "parameters": {}}}\n</tools>\n\n'
  "For each function call, return a json object with function name and arguments within "
  "<tool_call></tool_call> XML tags:\n<tool_call>\n"
  '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
  "<|im_start|>user\nWhere does k1 lead?<|im_end|>\n"
  "<|im_start|>assistant\n<think>\nLook it up.\n</think>\n\n"
  '<tool_call>\n{"name": "lookup", "arguments": {"key": "k1"}}\n</tool_call><|im_end|>\n'
  "<|im_start|>user\n<tool_response>\nk1 -> k2\n</tool_response><|im_end|>\n"
  "<|im_start|>assistant\n<think>\nFound.\n</think>\n\n\\boxed{k2}<|im_end|>\n"
)
ACTIONS = [
  f"<think>\nLook it up.\n</think>\n\n{CALL}<|im_end|>",
  "<think>\nFound.\n</think>\n\n\\boxed{k2}<|im_end|>",
]
ADDED = [
  "<think>",
  "</think>",
  "<tool_call>",
  "</tool_call>",
  "<tool_response>",
  "</tool_response>",
]


@pytest.fixture(scope="module")
def tokenizer():
  """A byte-level BPE with Qwen3's special and added tokens, trained here (nothing downloaded)."""
  return Tokenizer(tok=train_bpe([QWEN3_TEXT], 300, ADDED), eos_ids=(2,), pad_id=0)


def _transcript(enable_thinking=True):
  """The conversation as a rollout builds it: prompt, action, observation, action."""
  t = protocol.Transcript()
  t.add(chat_template(CONVERSATION[:2], tools=TOOLS, enable_thinking=enable_thinking), False)
  t.add(ACTIONS[0], True)
  t.add(protocol.observation_text(["k1 -> k2"], enable_thinking), False)
  t.add(ACTIONS[1], True)
  return t


# ------------------------------------------------------------------------------------------ render


def test_a_tool_conversation_renders_to_qwen3s_template_text():
  assert chat_template(CONVERSATION, tools=TOOLS, add_generation_prompt=False) == QWEN3_TEXT
  # A tool response written as a user turn is no question: the turns before it keep reasoning.
  as_user = dict(
    CONVERSATION[3], role="user", content="<tool_response>\nk1 -> k2\n</tool_response>"
  )
  written = CONVERSATION[:3] + [as_user] + CONVERSATION[4:]
  assert chat_template(written, tools=TOOLS, add_generation_prompt=False) == QWEN3_TEXT
  # Structured tool_calls render as the model writes them.
  calls = [{"function": {"name": "lookup", "arguments": {"key": "k1"}}}]
  structured = dict(CONVERSATION[2], content="<think>\nLook it up.\n</think>\n\n", tool_calls=calls)
  assert (
    chat_template(
      CONVERSATION[:2] + [structured] + CONVERSATION[3:], tools=TOOLS, add_generation_prompt=False
    )
    == QWEN3_TEXT
  )
  assert tool_call_text("lookup", {"key": "k1"}) == CALL


def test_consecutive_tool_messages_share_one_user_turn():
  messages = [{"role": "tool", "content": "a"}, {"role": "tool", "content": "b"}]
  assert chat_template(messages, add_generation_prompt=False) == (
    "<|im_start|>user\n<tool_response>\na\n</tool_response>\n<tool_response>\nb\n"
    "</tool_response><|im_end|>\n"
  )


def test_the_rollouts_transcript_is_the_template_text_and_its_actions_are_known(tokenizer):
  t = _transcript()
  assert t.text == QWEN3_TEXT[:-1]  # the model stops at its <|im_end|>
  assert [t.text[a:b] for a, b in t.spans] == ACTIONS
  assert protocol.action_spans(QWEN3_TEXT) == t.spans
  ids, is_action = t.tokens(tokenizer)
  assert tokenizer.decode(ids) == t.text
  assert tokenizer.decode([i for i, a in zip(ids, is_action) if a]) == "".join(ACTIONS)
  assert tokenizer.decode([i for i, a in zip(ids, is_action) if not a]).endswith(
    "<|im_start|>user\n<tool_response>\nk1 -> k2\n</tool_response><|im_end|>\n"
    "<|im_start|>assistant\n"
  )
  mask_ids, mask = protocol.token_mask(tokenizer, t.text, t.spans)
  assert tokenizer.decode([i for i, a in zip(mask_ids, mask) if a]) == "".join(ACTIONS)


def test_with_thinking_off_the_empty_think_block_is_context():
  t = _transcript(enable_thinking=False)
  assert t.text.count("<|im_start|>assistant\n<think>\n\n</think>\n\n") == 2
  assert protocol.action_spans(t.text, enable_thinking=False) == t.spans
  assert [t.text[a:b] for a, b in t.spans] == ACTIONS


def test_truncate_tokens_bounds_an_observation_saying_from_how_many(tokenizer):
  text = "k1 -> k2\n" * 500
  short = protocol.truncate_tokens(tokenizer, text, 50)
  assert len(tokenizer.encode(short)) <= 50
  assert short.endswith(f"[truncated from {len(tokenizer.encode(text))} to 50 tokens]")
  assert protocol.truncate_tokens(tokenizer, "k1", 50) == "k1"


# ----------------------------------------------------------------------------------------- parsing


def test_parse_action_reads_one_call_or_none():
  assert protocol.parse_action(ACTIONS[0]) == ToolCall("lookup", {"key": "k1"})
  assert protocol.parse_action("\\boxed{k2}<|im_end|>") is None
  # A call inside unfinished or finished reasoning is thought, not action.
  assert protocol.parse_action(f"<think>\nmaybe {CALL}") is None
  assert protocol.parse_action(f"<think>\nmaybe {CALL}\n</think>\n\n\\boxed{{k2}}") is None


@pytest.mark.parametrize(
  "text, says",
  [
    ("<tool_call>\n{name: lookup}\n</tool_call>", "error: the tool call is not JSON (Expecting"),
    ("<tool_call>\n" + "[" * 100_000 + "\n</tool_call>", "error: the tool call is "),
    ('<tool_call>\n{"name": "lookup"}\n</tool_call>', 'error: a tool call is {"name": <string>'),
    ('<tool_call>\n["lookup"]\n</tool_call>', 'error: a tool call is {"name": <string>'),
    (
      '<tool_call>\n{"name": "lookup", "arguments": {}}',
      "error: a tool call is <tool_call>...</tool_call>, one tag is missing",
    ),
    (
      '{"name": "lookup", "arguments": {}}\n</tool_call>',
      "error: a tool call is <tool_call>...</tool_call>, one tag is missing",
    ),
    (CALL + CALL, "error: one tool call per turn, got 2"),
  ],
)
def test_a_malformed_call_is_an_observation_saying_what_was_wrong(text, says):
  parsed = protocol.parse_action(text)
  assert isinstance(parsed, BadCall) and parsed.observation.startswith(says), parsed
  assert len(parsed.observation) < 300


def test_check_arguments_names_the_tool_and_its_parameters():
  schemas = {"lookup": pointer_chase.tools.LookupTool({}).schema}
  assert protocol.check_arguments(ToolCall("lookup", {"key": "k1"}), schemas) is None
  unknown = protocol.check_arguments(ToolCall("search", {"q": "x"}), schemas)
  assert unknown.observation == "error: unknown tool 'search'; tools: ['lookup']"
  wrong = protocol.check_arguments(ToolCall("lookup", {"k": "k1"}), schemas)
  assert wrong.observation == "error: tool lookup takes arguments ['key'], got 'k'"
  typed = protocol.check_arguments(ToolCall("lookup", {"key": 7}), schemas)
  assert typed.observation == "error: tool lookup takes string arguments; not strings: ['key']"


# ----------------------------------------------------------------------------------- pointer chase


def test_pointer_chase_episode_reset_step_done_reward():
  env = registry.make_env("env:pointer_chase", hops=3, keys=12, decoys=4)
  problem = env.sample(1, 5)[0]
  messages = env.reset(problem)
  assert messages == [{"role": "user", "content": problem.question}]
  assert (
    f"Start at key {problem.start}" in problem.question and "Follow 3 lookups" in problem.question
  )
  actions = pointer_chase.reference_actions(problem)
  assert len(actions) == 4 and actions[-1] == f"\\boxed{{{problem.answer}}}"
  steps = play_episode(env, [a + "<|im_end|>" for a in actions], env.config.pool())
  key = problem.start
  for step in steps[:3]:  # each observation holds the hop's line among 4 decoys
    assert step.reason == "tool_ok" and not step.done
    lines = step.observation.split("\n")
    assert len(lines) == 5 and f"{key} -> {problem.table[key]}" in lines
    key = problem.table[key]
  assert key == problem.answer
  assert (steps[3].done, steps[3].reason) == (True, "answer")
  assert env.grade() == (1.0, "correct")
  wrong = registry.make_env("env:pointer_chase", hops=3, keys=12)
  wrong.reset(problem)
  wrong.step("\\boxed{k9999}")
  assert wrong.grade() == (0.0, "wrong")


def test_pointer_chase_wrong_key_and_bad_calls_are_observations_the_episode_goes_on():
  env = registry.make_env("env:pointer_chase", hops=2, keys=8)
  problem = env.sample(1, 0)[0]
  env.reset(problem)
  absent = next(
    pointer_chase.key_name(i)
    for i in range(10_000)
    if pointer_chase.key_name(i) not in problem.table
  )
  steps = play_episode(
    env,
    [tool_call_text("lookup", {"key": absent}), "<tool_call>\nnot json\n</tool_call>"],
    env.config.pool(),
  )
  assert steps[0].reason == "tool_error"
  assert steps[0].observation == f"error: KeyError: no entry '{absent}'"
  assert steps[1].reason == "bad_call" and steps[1].observation.startswith(
    "error: the tool call is not JSON"
  )
  assert not env.done


def test_pointer_chase_max_turns_ends_the_episode_with_its_reason():
  env = registry.make_env("env:pointer_chase", hops=2, keys=8, max_turns=3)
  problem = env.sample(1, 0)[0]
  env.reset(problem)
  call = tool_call_text("lookup", {"key": problem.start})
  steps = play_episode(env, [call] * 5, env.config.pool())
  assert [s.reason for s in steps] == ["tool_ok", "tool_ok", "max_turns"]
  assert steps[-1].done and steps[-1].observation == "stopped: max turns (3) reached"
  assert env.grade() == (0.0, "max_turns")
  with pytest.raises(ValueError, match="step\\(\\) needs an episode in progress"):
    env.step(call)


def test_pointer_chase_is_a_pure_function_of_seed_and_position():
  env = registry.make_env("env:pointer_chase", hops=4, keys=20, decoys=3, seed=1)
  again = registry.make_env("env:pointer_chase", hops=4, keys=20, decoys=3, seed=1)
  other = registry.make_env("env:pointer_chase", hops=4, keys=20, decoys=3, seed=2)
  assert env.sample(3, 10) == again.sample(3, 10) and env.sample(3, 10)[1] == again.sample(1, 11)[0]
  # the tables themselves differ with the seed, not only the problems' ids
  assert [p.table for p in env.sample(3, 10)] != [p.table for p in other.sample(3, 10)]
  problem = env.sample(1, 10)[0]
  env.reset(problem), again.reset(problem)
  assert env.tools["lookup"](problem.start) == again.tools["lookup"](problem.start)
  chain, key = [problem.start], problem.start
  for _ in range(problem.hops):
    key = problem.table[key]
    chain.append(key)
  assert len(set(chain)) == 5 and len(problem.table) == 20 and chain[-1] == problem.answer


def test_pointer_chase_grading_reads_the_answer_part():
  grade = pointer_chase.grade_answer
  assert grade("<think>\n\\boxed{k1}\n</think>\n\n\\boxed{k2}", "k2") == (1.0, "correct")
  assert grade("<think>\n\\boxed{k2}", "k2") == (0.0, "unfinished_thinking")
  assert grade("it is k2", "k2") == (0.0, "no_answer")
  assert grade("<think>\n\\boxed{k2}\n</think>\n\nno idea", "k2") == (0.0, "no_answer")


# ---------------------------------------------------------------------------------------- registry


def test_env_names_resolve_and_an_unknown_one_is_refused_in_one_line_naming_it():
  assert "env:pointer_chase" in registry.env_names()
  assert isinstance(registry.make_env("env:pointer_chase"), pointer_chase.PointerChaseEnv)
  with pytest.raises(ValueError) as error:
    registry.make_env("env:nope")
  assert str(error.value) == f"unknown environment 'env:nope'; known: {registry.env_names()}"
  with pytest.raises(ValueError, match=r"unknown field\(s\) \['hopz'\] for environment env:po"):
    registry.make_env("env:pointer_chase", hopz=3)


@pytest.mark.parametrize(
  "fields, says",
  [
    ({"hops": 0}, "PointerChaseConfig.hops must be positive, got 0"),
    ({"hops": 2.5}, "PointerChaseConfig.hops must be an int, got 2.5"),
    ({"tool_timeout_s": -1.0}, "PointerChaseConfig.tool_timeout_s must be positive, got -1.0"),
    ({"enable_thinking": 1}, "PointerChaseConfig.enable_thinking must be a bool, got 1"),
    ({"seed": -1}, "PointerChaseConfig.seed must be >= 0, got -1"),
    ({"hops": 8, "max_turns": 8}, "PointerChaseConfig.max_turns = 8 must be > hops (8)"),
    ({"hops": 5, "keys": 4}, "PointerChaseConfig.keys = 4 must be >= hops + 1 (6)"),
  ],
)
def test_env_config_refuses_a_bad_value_naming_the_field(fields, says):
  with pytest.raises(ValueError) as error:
    registry.env_config("env:pointer_chase", **fields)
  assert str(error.value).startswith(says) and "\n" not in str(error.value)


# ------------------------------------------------------------------------ the engine's turns


def _env_turns(tokenizer, rows=2, **fields):
  envs = {}
  for row in range(rows):
    env = registry.make_env("env:pointer_chase", hops=2, keys=12, decoys=3, **fields)
    env.reset(env.sample(1, row)[0])
    envs[row] = env
  return turns_lib.EnvTurns(envs, tokenizer, envs[0].config.pool())


def test_env_turns_play_each_row_s_episode_through_the_pool_as_token_ids(tokenizer):
  """A row's turn (token ids) is its env's action: a call runs in the pool and comes back as the
  observation's ids (the tool response in Qwen3's user turn, then the next generation prompt), a
  malformed one at once, a final answer ends the row; each row keeps its own episode."""
  turns = _env_turns(tokenizer)
  ids = lambda text: tokenizer.encode(text + "<|im_end|>")
  actions = {row: pointer_chase.reference_actions(env.problem) for row, env in turns.envs.items()}
  assert turns.turn_ended(0, ids(actions[0][0])) is True
  assert turns.turn_ended(1, ids("<tool_call>\nnot json\n</tool_call>")) is True
  got = {}
  while len(got) < 2:
    got.update(turns.observations(wait=True))
  env0 = turns.envs[0]
  passage = pointer_chase.Passages(env0.problem, 3, 0)[env0.problem.start]
  assert tokenizer.decode(got[0]) == protocol.observation_text([passage])
  assert "error: the tool call is not JSON" in tokenizer.decode(got[1])
  for row in (0, 1):  # the rest of each episode, row 1 from its first lookup
    for action in actions[row][1 - row : -1]:
      assert turns.turn_ended(row, ids(action)) is True
      while row not in turns.observations(wait=True):
        pass
    assert turns.turn_ended(row, ids(actions[row][-1])) is False
    assert turns.grade(row) == (1.0, "correct")


def test_a_restarted_row_starts_its_episode_over_and_never_gets_its_old_call_s_answer(tokenizer):
  """A preempted row decodes again from its first token: its env is reset, and the answer of the
  call it waited on (still running) is dropped; a row cut by its max_new tokens grades 0."""
  turns = _env_turns(tokenizer, rows=1)
  env = turns.envs[0]
  call = pointer_chase.reference_actions(env.problem)[0]
  slow = _Slow(env.tools["lookup"])
  env.tools["lookup"] = slow
  assert turns.turn_ended(0, tokenizer.encode(call + "<|im_end|>")) is True
  turns.restart(0)
  slow.go.set()
  assert slow.answered.wait(10)
  for _ in range(20):  # the pool's result comes in at a poll: none is the row's now
    assert turns.observations(wait=False) == {}
    time.sleep(0.02)
  assert not turns.pool.pending() and env.turns == 0
  assert turns.grade(0) == (0.0, "max_tokens")


class _Slow:
  """A tool that answers once `go` is set, and says when it has."""

  def __init__(self, tool):
    self.tool, self.schema = tool, tool.schema
    self.go, self.answered = threading.Event(), threading.Event()

  def __call__(self, **arguments):
    self.go.wait(10)
    try:
      return self.tool(**arguments)
    finally:
      self.answered.set()
