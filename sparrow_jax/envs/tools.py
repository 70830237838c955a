"""Tools an environment offers the model, and the pool that runs their calls off the decode thread.

  pool = ToolPool(max_workers=4, timeout_s=10.0, max_chars=16384)
  pool.submit(row_id, tool, **call.arguments)   # returns at once
  for result in pool.ready():                    # finished (or abandoned) calls, each bounded
    ...result.row_id, result.text, result.status ("ok" | "error" | "timeout"), result.truncated

Every result is an observation the run can go on with: a tool that raises gives "error: <type>:
<message>", one that hangs past `timeout_s` gives "timeout after <t>s" (its thread is abandoned and
its worker slot given to the next call, so a hung call never holds up the others), one that returns
megabytes is cut to `max_chars` with a note saying from how many.

Tools: `PythonTool` runs code in the project's sandbox (sparrow_jax/sandbox: its isolation and
limits, docs/sandbox.md); `LookupTool` returns passages of a local corpus (a dict, or a directory of
text files indexed when the tool is made, so a key can never name a path outside it).
"""

import concurrent.futures
import dataclasses
import os
import threading
import time
from typing import Any, Callable, Hashable, Mapping

from sparrow_jax.sandbox import runner

STATUSES = ("ok", "error", "timeout")
TEXT_SUFFIXES = (".txt", ".md")


@dataclasses.dataclass(frozen=True)
class ToolResult:
  """One call's bounded observation. `status`: ok, error (the tool raised) or timeout (abandoned);
  `truncated`: the text was cut to the pool's max_chars."""

  row_id: Hashable
  text: str
  status: str
  truncated: bool = False
  seconds: float = 0.0


def truncate(text: str, max_chars: int) -> tuple:
  """(text cut to at most max_chars characters, note included, whether it was cut). The head is
  kept: tool output (a passage, a program's prints) reads from its start."""
  if len(text) <= max_chars:
    return text, False
  note = f"\n[truncated from {len(text)} to {max_chars} chars]"
  return text[: max(max_chars - len(note), 0)] + note, True


def error_text(error: BaseException) -> str:
  """A raised tool's observation: its type and message (a KeyError's unquoted: str() of a
  KeyError is the repr of its key)."""
  message = error.args[0] if isinstance(error, KeyError) and error.args else error
  return f"error: {type(error).__name__}: {message}"


def _as_text(value: Any) -> str:
  return value if isinstance(value, str) else repr(value)


@dataclasses.dataclass
class _Job:
  row_id: Hashable
  fn: Callable
  args: tuple
  kwargs: dict
  future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
  started: float | None = None  # time.monotonic() when a worker took it; None while queued


class ToolPool:
  """Runs tool calls on worker threads, at most `max_workers` at a time, each within `timeout_s`
  from its start. One call per row at a time (a row waits for its observation). Not itself
  thread-safe: one caller (the engine's host loop) submits and polls."""

  def __init__(self, max_workers: int = 4, timeout_s: float = 10.0, max_chars: int = 16384):
    for name, value in (("max_workers", max_workers), ("timeout_s", timeout_s)):
      if not value > 0:
        raise ValueError(f"ToolPool.{name} must be positive, got {value!r}")
    if not (isinstance(max_chars, int) and max_chars >= 64):
      raise ValueError(f"ToolPool.max_chars must be an int >= 64, got {max_chars!r}")
    self.max_workers, self.timeout_s, self.max_chars = max_workers, timeout_s, max_chars
    self._queued, self._running = [], {}  # row_id -> _Job
    self._lock = threading.Lock()  # workers start the next queued job when they finish

  def submit(self, row_id: Hashable, fn: Callable, /, *args, **kwargs) -> None:
    """Queues fn(*args, **kwargs) as row_id's call and returns at once."""
    if row_id in self.pending():
      raise ValueError(f"row {row_id!r} already has a tool call in flight")
    with self._lock:
      self._queued.append(_Job(row_id, fn, args, kwargs))
    self._dispatch()

  def pending(self) -> set:
    """The rows whose calls are queued or running."""
    with self._lock:
      return {job.row_id for job in self._queued} | set(self._running)

  def ready(self) -> list:
    """The calls finished since the last poll, and those past their timeout (abandoned), as
    ToolResults; never blocks."""
    now, out = time.monotonic(), []
    with self._lock:
      for row_id, job in list(self._running.items()):
        if job.future.done():
          out.append(self._result(job, now))
        elif now - job.started > self.timeout_s:
          text = f"timeout after {self.timeout_s:g}s"
          out.append(ToolResult(row_id, text, "timeout", seconds=now - job.started))
        else:
          continue
        del self._running[row_id]  # an abandoned thread runs on, out of the count
    self._dispatch()
    return out

  def wait(self, timeout_s: float | None = None, poll_s: float = 0.01) -> list:
    """ready(), waiting up to timeout_s (None: until a pending call ends) for a first result."""
    stop = None if timeout_s is None else time.monotonic() + timeout_s
    while not (results := self.ready()) and self.pending():
      if stop is not None and time.monotonic() >= stop:
        break
      time.sleep(poll_s)
    return results

  def _result(self, job, now) -> ToolResult:
    seconds = now - job.started
    error = job.future.exception()
    if error is not None:
      text, truncated = truncate(error_text(error), self.max_chars)
      return ToolResult(job.row_id, text, "error", truncated, seconds)
    text, truncated = truncate(_as_text(job.future.result()), self.max_chars)
    return ToolResult(job.row_id, text, "ok", truncated, seconds)

  def _dispatch(self):
    """Starts queued jobs while fewer than max_workers run. Daemon threads: an abandoned hung
    call must not keep the process alive at exit."""
    with self._lock:
      # A finished call waiting for the caller's poll holds no worker.
      while self._queued and self._working() < self.max_workers:
        job = self._queued.pop(0)
        job.started = time.monotonic()
        self._running[job.row_id] = job
        threading.Thread(target=self._work, args=(job,), daemon=True).start()

  def _working(self) -> int:
    return sum(not job.future.done() for job in self._running.values())

  def _work(self, job):
    try:
      job.future.set_result(job.fn(*job.args, **job.kwargs))
    except BaseException as e:  # a tool's failure is its row's observation, never the pool's
      job.future.set_exception(e)
    self._dispatch()


# -------------------------------------------------------------------------------------------- tools


def function_schema(name: str, description: str, parameters: dict) -> dict:
  """A tool's entry in the chat template's tool list (the OpenAI function format Qwen3 reads)."""
  required = list(parameters)
  properties = {k: {"type": "string", "description": v} for k, v in parameters.items()}
  return {
    "type": "function",
    "function": {
      "name": name,
      "description": description,
      "parameters": {"type": "object", "properties": properties, "required": required},
    },
  }


def run_text(case: dict, timeout_s: float) -> str:
  """A sandbox case's outcome as the model reads it: exit status (or the timeout), then stdout and
  stderr."""
  if case["status"] == "timeout":
    head = f"timeout after {timeout_s:g}s (the sandbox's limit)"
  elif case["status"] == "output_limit":
    head = "error: output past the sandbox's limit"
  else:
    head = f"exit status: {case['exit']}"
  return f"{head}\nstdout:\n{case.get('stdout', '')}\nstderr:\n{case.get('stderr', '')}"


@dataclasses.dataclass(frozen=True)
class PythonTool:
  """python(code): runs `code` as a program in the sandbox (empty stdin) under `limits`; returns
  its exit status, stdout and stderr (each capped by the sandbox: output_bytes of stdout, 4 KiB
  of stderr)."""

  limits: runner.SandboxLimits = runner.SandboxLimits()
  name: str = "python"

  @property
  def schema(self) -> dict:
    return function_schema(
      self.name,
      "Run a Python 3 program; returns its exit status, stdout and stderr.",
      {"code": "the program"},
    )

  def __call__(self, code: str) -> str:
    if not isinstance(code, str):
      raise TypeError(f"code must be a string, got {type(code).__name__}")
    run = runner.run_cases(code, "stdio", [""], limits=self.limits)
    if not run.cases:
      raise RuntimeError(f"the sandbox failed: {run.error}")
    return run_text(run.cases[0], self.limits.timeout_s)


def _directory_index(root: str) -> dict:
  """Key (path relative to root, without its suffix) -> file path, for the text files under
  root. Symbolic links are not followed: every file listed lies inside root."""
  index = {}
  for folder, _, files in os.walk(root):
    for name in sorted(files):
      path = os.path.join(folder, name)
      stem, suffix = os.path.splitext(os.path.relpath(path, root))
      if suffix in TEXT_SUFFIXES and not os.path.islink(path):
        index[stem.replace(os.sep, "/")] = path
  return index


@dataclasses.dataclass(frozen=True)
class LookupTool:
  """lookup(key): the passage stored under `key`, from `passages` (key -> text) or, for
  from_directory, read from its file when asked (passages may be long: the long-context case). An
  unknown key raises KeyError (the pool makes it an observation)."""

  passages: Mapping[str, str]
  name: str = "lookup"
  description: str = "Look up a key; returns the passage stored under it."

  @classmethod
  def from_directory(cls, root: str, **fields) -> "LookupTool":
    if not os.path.isdir(root):
      raise ValueError(f"lookup corpus {root} is not a directory")
    return cls(_LazyFiles(_directory_index(root)), **fields)

  @property
  def schema(self) -> dict:
    return function_schema(self.name, self.description, {"key": "the key to look up"})

  def __call__(self, key: str) -> str:
    if not isinstance(key, str) or key not in self.passages:
      raise KeyError(f"no entry {key!r}")
    return self.passages[key]


class _LazyFiles(Mapping):
  """key -> the text of its file, read on access (as UTF-8, bad bytes replaced)."""

  def __init__(self, index: dict):
    self.index = index

  def __getitem__(self, key):
    with open(self.index[key], encoding="utf-8", errors="replace") as f:
      return f.read()

  def __iter__(self):
    return iter(self.index)

  def __len__(self):
    return len(self.index)
