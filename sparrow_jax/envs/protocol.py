"""Multi-turn environments: the protocol, the parsing of a turn's tool call, and the rendering of
observations in the model's chat template (Qwen3's tool format).

One episode, as the rollout engine drives it (one environment object per row):

  env = registry.make_env("env:pointer_chase", hops=3)
  problem = env.sample(1, position)[0]
  prompt = chat_template(env.reset(problem), tools=env.schemas, enable_thinking=...)
  loop: action = the row's generated turn (up to and with <|im_end|>)
        step = env.step(action)
        if step.done: grade = env.grade(); stop                       # a rewards.Grade
        if step.call: pool.submit(row, env.tools[step.call.name], **step.call.arguments)
                      ... later, its ToolResult from pool.ready(): step = env.observe(result)
        the row goes on after observation_text([step.observation]) (context: masked out of the loss)

A model turn is a final answer (no tool call) or exactly one call, written as Qwen3 writes it:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. A malformed call, an unknown tool
or bad arguments become an observation saying what was wrong; `max_turns` ends the episode with
reason "max_turns".
"""

import dataclasses
import json
from typing import ClassVar, NamedTuple

from sparrow_jax.data import rewards
from sparrow_jax.data.tokenizer import (
  IM_END,
  IM_START,
  THINK_CLOSE,
  THINK_OPEN,
  TOOL_CALL_CLOSE,
  TOOL_CALL_OPEN,
  chat_template,
)
from sparrow_jax.envs import tools as tools_lib

QUOTE_CHARS = 120  # how much of a malformed call an observation quotes back


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """Fields every environment has; an environment's own config adds its fields."""

  max_turns: int = 8  # model turns per episode, the final answer's included
  max_observation_tokens: int = 2048  # a tool response's tokens in the context (truncate_tokens)
  max_observation_chars: int = 16384  # the pool's cut, before tokenizing: megabytes stay cheap
  tool_timeout_s: float = 10.0  # a call past it is abandoned: "timeout after Xs"
  enable_thinking: bool = True  # the generation prompts' think switch (chat_template)
  list_tools: bool = True  # the tools' schemas in the system turn, as Qwen3's template writes
  #                          them (off: a model trained on the format needs no instructions)
  MAY_BE_ZERO: ClassVar[tuple] = ()  # numeric fields of a subclass for which 0 is allowed

  def __post_init__(self):
    """Every int field an int, every bool a bool, every number positive (or >= 0 if in
    MAY_BE_ZERO); the error names the field and the value."""
    for field in dataclasses.fields(self):
      name, value = f"{type(self).__name__}.{field.name}", getattr(self, field.name)
      if field.type is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ValueError(f"{name} must be an int, got {value!r}")
      if field.type is bool and not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
      if field.type is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ValueError(f"{name} must be a number, got {value!r}")
      least = 0 if field.name in self.MAY_BE_ZERO else 1e-300
      if field.type in (int, float) and not value >= least:
        raise ValueError(f"{name} must be {'>= 0' if least == 0 else 'positive'}, got {value!r}")

  def pool(self, max_workers: int = 4) -> tools_lib.ToolPool:
    """A pool that bounds calls as this config says."""
    return tools_lib.ToolPool(max_workers, self.tool_timeout_s, self.max_observation_chars)


class ToolCall(NamedTuple):
  name: str
  arguments: dict


class BadCall(NamedTuple):
  """A turn that tried to call a tool and failed; `observation` says why (bounded)."""

  observation: str


@dataclasses.dataclass(frozen=True)
class Step:
  """What an action led to. `call`: a tool call the caller runs (ToolPool) and hands to
  env.observe; `observation`: the next tool response ("" when done or while `call` runs); `reason`:
  answer, max_turns, bad_call, tool_call, or tool_ok / tool_error / tool_timeout."""

  observation: str
  done: bool
  reason: str
  call: ToolCall | None = None


def _quote(text: str) -> str:
  return repr(text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "...")


def _call_of(body: str):
  """A ToolCall from the JSON between the tags, or a BadCall saying what is wrong with it."""
  try:
    data = json.loads(body)
  except ValueError as e:  # JSONDecodeError
    return BadCall(f"error: the tool call is not JSON ({e.msg} at char {e.pos}): {_quote(body)}")
  except RecursionError:
    return BadCall("error: the tool call is JSON nested too deeply to read")
  if not (
    isinstance(data, dict)
    and isinstance(data.get("name"), str)
    and isinstance(data.get("arguments"), dict)
  ):
    return BadCall(
      'error: a tool call is {"name": <string>, "arguments": <object>}, got ' + _quote(body)
    )
  return ToolCall(data["name"], data["arguments"])


def parse_action(text: str):
  """The tool call of one model turn (its answer part, after any </think>): a ToolCall, a BadCall
  (the observation saying what was wrong) or None (no call: a final answer, or thinking that never
  ended)."""
  answer = rewards.final_text(text)
  if answer is None:
    return None
  opened, closed = answer.count(TOOL_CALL_OPEN), answer.count(TOOL_CALL_CLOSE)
  if opened == 0 and closed == 0:
    return None
  if opened > 1 or closed > 1:
    return BadCall(f"error: one tool call per turn, got {max(opened, closed)}")
  rest = answer.split(TOOL_CALL_OPEN)[-1] if opened else ""
  if TOOL_CALL_CLOSE not in rest:
    return BadCall(
      f"error: a tool call is {TOOL_CALL_OPEN}...{TOOL_CALL_CLOSE}, one tag is missing"
    )
  return _call_of(rest.split(TOOL_CALL_CLOSE)[0].strip())


def check_arguments(call: ToolCall, schemas: dict):
  """None when `call` names a tool of `schemas` (name -> schema) with exactly its parameters, else
  a BadCall saying what differs."""
  if call.name not in schemas:
    return BadCall(f"error: unknown tool {call.name[:QUOTE_CHARS]!r}; tools: {sorted(schemas)}")
  wanted = sorted(schemas[call.name]["function"]["parameters"]["properties"])
  if sorted(call.arguments) != wanted:
    got = _quote(", ".join(sorted(call.arguments)))
    return BadCall(f"error: tool {call.name} takes arguments {wanted}, got {got}")
  bad = [k for k in wanted if not isinstance(call.arguments[k], str)]
  if bad:
    return BadCall(f"error: tool {call.name} takes string arguments; not strings: {bad}")
  return None


# ---------------------------------------------------------------------------------------- rendering


def observation_text(responses, enable_thinking: bool = True) -> str:
  """What follows a tool-calling turn's <|im_end|> in the row: the tool responses as Qwen3's user
  turn, then the next generation prompt. The leading newline is the one the template writes after
  each <|im_end|> (the model stops at <|im_end|> itself)."""
  tool_messages = [{"role": "tool", "content": r} for r in responses]
  return "\n" + chat_template(tool_messages, enable_thinking=enable_thinking)


def prompt_text(env, problem) -> str:
  """The first prompt of `env`'s episode of `problem` (which this starts): its first messages in
  the chat template, its tools in the system turn (unless its config's list_tools is off)."""
  messages = env.reset(problem)
  tools = list(env.schemas.values()) if env.config.list_tools else None
  return chat_template(messages, tools=tools, enable_thinking=env.config.enable_thinking)


def observation_turn(config: EnvConfig, observation: str, tokenizer=None) -> str:
  """What goes into the row after a turn: the observation as a tool response, cut to the env's
  max_observation_tokens of `tokenizer` (None: uncut), then the next generation prompt."""
  if tokenizer is not None:
    observation = truncate_tokens(tokenizer, observation, config.max_observation_tokens)
  return observation_text([observation], config.enable_thinking)


def truncate_tokens(tokenizer, text: str, max_tokens: int) -> str:
  """`text` cut to about max_tokens tokens of `tokenizer` (the note included; a cut inside a
  multi-byte character may re-encode a token or two longer), noting from how many."""
  ids = tokenizer.encode(text)
  if len(ids) <= max_tokens:
    return text
  note = f"\n[truncated from {len(ids)} to {max_tokens} tokens]"
  keep = max(max_tokens - len(tokenizer.encode(note)), 0)
  return tokenizer.decode(ids[:keep]) + note


@dataclasses.dataclass
class Transcript:
  """A row's text as the rollout builds it, piece by piece: the prompt and observations are context,
  the model's turns are actions (the tokens the loss trains on)."""

  pieces: list = dataclasses.field(default_factory=list)  # (text, is_action)

  def add(self, text: str, is_action: bool):
    self.pieces.append((text, is_action))

  @property
  def text(self) -> str:
    return "".join(text for text, _ in self.pieces)

  @property
  def spans(self) -> list:
    """(start, end) character spans of the actions in `text`."""
    out, at = [], 0
    for text, is_action in self.pieces:
      if is_action:
        out.append((at, at + len(text)))
      at += len(text)
    return out

  def tokens(self, tokenizer) -> tuple:
    """(ids, is_action per id), each piece encoded on its own as the engine feeds it."""
    ids, is_action = [], []
    for text, action in self.pieces:
      piece = tokenizer.encode(text)
      ids += piece
      is_action += [action] * len(piece)
    return ids, is_action


def action_spans(text: str, enable_thinking: bool = True) -> list:
  """(start, end) character spans of the model's turns in a rendered conversation: each assistant
  turn from after its `<|im_start|>assistant\\n` header to its <|im_end|> included (the model
  writes the <|im_end|>, not the newline after it). With thinking disabled an empty think block
  right after the header is the generation prompt's, so context."""
  header, empty_think = f"{IM_START}assistant\n", f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"
  spans, at = [], 0
  while (start := text.find(header, at)) >= 0:
    start += len(header)
    if not enable_thinking and text.startswith(empty_think, start):
      start += len(empty_think)
    end = text.find(IM_END, start)
    end = len(text) if end < 0 else end + len(IM_END)
    spans.append((start, end))
    at = end
  return spans


def token_mask(tokenizer, text: str, spans) -> tuple:
  """(ids of `text`, whether each is an action token: it starts inside one of `spans`), from the
  tokenizer's character offsets (`tokenizer.tok`: a Hugging Face tokenizers.Tokenizer)."""
  encoding = tokenizer.tok.encode(text, add_special_tokens=False)
  starts = [start for start, _ in encoding.offsets]
  return encoding.ids, [any(a <= s < b for a, b in spans) for s in starts]


# ------------------------------------------------------------------------------------ environments


class ToolEnv:
  """An episode of turns with tools, the bookkeeping every tool environment shares. A subclass
  gives `tools` (name -> callable with a `schema`), `first_messages(problem)` and
  `grade_answer(text, problem)` (a rewards.Grade), and may override `describe(result)`."""

  name = "env:?"

  def __init__(self, config: EnvConfig):
    self.config = config
    self.tools = {}  # name -> tool; a subclass fills it (per episode where tools hold its data)
    self.problem, self.turns, self.final, self.reason = None, 0, None, None

  @property
  def schemas(self) -> dict:
    """name -> the tool's JSON schema (pass list(env.schemas.values()) as chat_template's tools)."""
    return {name: tool.schema for name, tool in self.tools.items()}

  @property
  def done(self) -> bool:
    return self.reason is not None

  def reset(self, problem) -> list:
    """Starts an episode on `problem`; returns its first messages (render them with
    chat_template(..., tools=list(env.schemas.values())))."""
    self.problem, self.turns, self.final, self.reason = problem, 0, None, None
    return self.first_messages(problem)

  def step(self, action: str) -> Step:
    """The model's turn `action`: a final answer ends the episode; a valid call comes back as
    Step.call for the caller to run; anything else is an observation saying what was wrong."""
    if self.problem is None or self.done:
      raise ValueError(f"{self.name}: step() needs an episode in progress (reset() first)")
    self.turns += 1
    parsed = parse_action(action)
    if parsed is None:
      self.final, self.reason = action, "answer"
      return Step("", True, "answer")
    if self.turns >= self.config.max_turns:
      self.reason = "max_turns"
      return Step(f"stopped: max turns ({self.config.max_turns}) reached", True, "max_turns")
    if isinstance(parsed, ToolCall):
      parsed = check_arguments(parsed, self.schemas) or parsed
    if isinstance(parsed, BadCall):
      return Step(parsed.observation, False, "bad_call")
    return Step("", False, "tool_call", parsed)

  def state(self) -> dict:
    """The episode's progress as JSON (a checkpoint's, for a row carried over steps); its problem
    is the caller's to keep (a task derives it from the row's data position)."""
    return {"turns": self.turns, "final": self.final, "reason": self.reason}

  def restore(self, problem, state: dict) -> None:
    """The episode of `problem` back where `state()` left it: reset on it (the tools an episode
    builds are built again), then its progress."""
    self.reset(problem)
    self.turns, self.final, self.reason = state["turns"], state["final"], state["reason"]

  def observe(self, result: tools_lib.ToolResult) -> Step:
    """The pool's result of this episode's call as the next observation."""
    return Step(self.describe(result), False, f"tool_{result.status}")

  def describe(self, result: tools_lib.ToolResult) -> str:
    return result.text

  def grade(self) -> rewards.Grade:
    """The episode's reward: the subclass's grade of the final answer; 0, reason "max_turns", when
    the turns ran out first."""
    if not self.done:
      raise ValueError(f"{self.name}: grade() needs a finished episode")
    if self.reason == "max_turns":
      return rewards.Grade(0.0, "max_turns")
    return self.grade_answer(self.final, self.problem)

  def first_messages(self, problem) -> list:
    raise NotImplementedError

  def reference_actions(self, problem) -> list:
    """A perfect policy's turns on `problem` (without the <|im_end|> ending each), where the
    environment has one: what a tiny model is pretrained on (`replay`)."""
    raise NotImplementedError(f"{self.name} has no reference policy")

  def grade_answer(self, text: str, problem) -> rewards.Grade:
    raise NotImplementedError


def replay(env: ToolEnv, problem, actions, tokenizer=None) -> Transcript:
  """`env`'s episode of `problem` with `actions` as the model's turns (each ending with the
  <|im_end|> that ends a turn), as a rollout builds it: the prompt and the observations context,
  the actions the tokens a model learns (a tiny model pretrained on an environment's format:
  experiments/pretrain_tiny.py). Tool calls run in the env's pool; observations as
  `observation_turn` renders them. Stops at the action that ends the episode."""
  transcript = Transcript()
  transcript.add(prompt_text(env, problem), False)
  pool = env.config.pool(max_workers=1)
  for action in actions:
    transcript.add(action, True)
    step = env.step(action)
    if step.done:
      break
    if step.call is not None:
      name, arguments = step.call
      pool.submit(0, env.tools[name], **arguments)
      (result,) = pool.wait()
      step = env.observe(result)
    transcript.add(observation_turn(env.config, step.observation, tokenizer), False)
  return transcript
