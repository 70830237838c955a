"""Metrics out: TensorBoard (tensorboardX event files) and a metrics.jsonl that notebooks can read.

Nothing a kill can tear: the JSONL logs (APPEND_ONLY) are only appended to (a torn last line, a
write the kill cut, is dropped when the run resumes), and whole files are replaced atomically
(`write_atomic`).

A workdir may be any etils.epath URL (gs://, s3://, ...). Object stores have no append and no
atomic rename, but an object written whole appears only once its upload completes: there whole
files are written directly, the JSONL logs are rewritten whole at each write, and TensorBoard
events go through epath (`_EpathRecordWriter`).
"""

import io
import json
import os
import time

from etils import epath
import jax
import numpy as np
from tensorboardX import event_file_writer, record_writer, summary
from tensorboardX.proto.event_pb2 import Event, SessionLog


def progress(message: str) -> None:
  """A progress line, printed by the lead process only (every process runs the same loop)."""
  if jax.process_index() == 0:
    print(message, flush=True)


def is_local(path: str) -> bool:
  """Whether `path` is on the local file system (no URL scheme)."""
  return "://" not in str(path)


def as_path(path: str) -> epath.Path:
  """`path` as an epath.Path, absolute when local (orbax wants absolute local paths)."""
  return epath.Path(path if not is_local(path) else os.path.abspath(path))


# The workdir's JSONL logs, one row (or more) per logged step, each row with its "step": metrics
# (MetricsLogger's) and the completions of each held-out evaluation (rl/hooks.Evaluation's).
APPEND_ONLY = ("metrics.jsonl", "eval_samples.jsonl")


class MetricsLogger:
  """Writes scalars, per-bin arrays (one scalar per bin with tokens: `measured_bins`), bucketed
  histograms and text (a str value: TensorBoard's text tab only, not metrics.jsonl)."""

  def __init__(self, workdir: str, resume_step: int, first_events: tuple = ()):
    """Appends to the workdir's logs from step `resume_step` on (0: a fresh run), after dropping
    what was logged past it (steps a killed run logged after its last checkpoint, replayed now)
    from the APPEND_ONLY files and the TensorBoard events, so each step is logged once.
    `first_events`: summaries the run's first event file carries at step 0 (its dashboard and
    hyperparameters: sparrow_jax.dashboard); a later start of the run finds them there and writes
    none again."""
    as_path(workdir).mkdir(parents=True, exist_ok=True)
    for name in APPEND_ONLY:
      _drop_rows_after(os.path.join(workdir, name), resume_step)
    self.workdir, self.path = workdir, os.path.join(workdir, "metrics.jsonl")
    if not is_local(workdir):
      record_writer.register_writer_factory(workdir.split(":")[0], _EpathRecordWriterFactory())
    self.writer = _Events(
      os.path.join(workdir, "tensorboard"), purge_step=resume_step + 1 if resume_step else None
    )
    if self.writer.first and first_events:
      for event in first_events:
        self.writer.add(event, 0)
      self.writer.flush()

  def write(self, step: int, metrics: dict) -> None:
    try:
      self._write(step, metrics)
    except OSError as e:  # a full disk's errno says neither what nor where
      raise OSError(f"writing step {step}'s metrics to {self.workdir}: {e.strerror or e}") from None

  def _write(self, step: int, metrics: dict) -> None:
    row = {"step": step}  # every bin, empty ones too: readers index the lists by bin
    for name, value in metrics.items():
      if isinstance(value, str):
        self.writer.add(summary.text(name, value), step)
        continue
      value = np.asarray(value)
      if name.endswith("histogram"):
        self._histogram(name, value, step)
      elif value.ndim == 0:
        row[name] = float(value) if np.isfinite(value) else None  # strict JSON: no NaN
      else:
        row[name] = [None if not np.isfinite(v) else v for v in value.tolist()]
    for tag, value in tensorboard_scalars(metrics).items():
      self.writer.add(summary.scalar(tag, value), step)
    append_text(self.path, json.dumps(row, allow_nan=False) + "\n")
    self.writer.flush()

  def _histogram(self, name, counts, step):
    """Counts over equal-width buckets on [0, 1] as a TensorBoard histogram."""
    n = len(counts)
    if counts.sum() == 0:
      return
    limits = np.linspace(0, 1, n + 1)[1:]
    centers = limits - 0.5 / n
    histogram = summary.histogram_raw(
      name,
      min=0.0,
      max=1.0,
      num=int(counts.sum()),
      sum=float((counts * centers).sum()),
      sum_squares=float((counts * centers**2).sum()),
      bucket_limits=limits.tolist(),
      bucket_counts=counts.tolist(),
    )
    self.writer.add(histogram, step)

  def close(self) -> None:
    self.writer.close()


def measured_bins(name: str, values, metrics: dict) -> list:
  """The bins of the per-bin metric `name` (its `values`) that TensorBoard gets a point of: the
  finite ones, less, in a family that counts its tokens per bin or per turn (`<family>/count_bin`,
  `<family>/count_turn` in the same `metrics`), the bins without tokens, whose 0 count would read
  like a measurement."""
  count = metrics.get(f"{name.split('/')[0]}/count_{name.rsplit('_', 1)[-1]}")
  empty = np.zeros(len(values), bool) if count is None else np.asarray(count) == 0
  return [i for i, v in enumerate(np.asarray(values).tolist()) if np.isfinite(v) and not empty[i]]


def tensorboard_scalars(metrics: dict) -> dict:
  """{tag: value} of the scalar points a step's `metrics` give TensorBoard: each scalar as is,
  each per-bin array as a curve per bin `<name>/NN` (`measured_bins`); text and histograms aside."""
  out = {}
  for name, value in metrics.items():
    if isinstance(value, str) or name.endswith("histogram"):
      continue
    value = np.asarray(value)
    if value.ndim == 0:
      out[name] = float(value)
    else:
      out.update({f"{name}/{i:02d}": float(value[i]) for i in measured_bins(name, value, metrics)})
  return out


class _Events:
  """A TensorBoard event file written in the calling thread, so that a write that fails (a full
  disk) raises in the step that made it. tensorboardX's SummaryWriter writes from a thread of its
  own, which such an error ends, and the next step then blocks forever on its full queue."""

  def __init__(self, logdir: str, purge_step: int | None):
    event_file_writer.directory_check(logdir)  # through epath's writer for a URL (as the files)
    # A file's name is its second and host, which a restart within the same second would reuse,
    # truncating the earlier file: later files are numbered, in the order TensorBoard reads them.
    earlier = len(list(as_path(logdir).glob("events*")))
    self.first = not earlier  # the run's first event file
    suffix = f".{earlier:04d}" if earlier else ""
    self.events = event_file_writer.EventsWriter(os.path.join(logdir, "events"), suffix)
    if purge_step is not None:  # TensorBoard drops the events of earlier files from this step on
      self.events.write_event(
        Event(step=purge_step, session_log=SessionLog(status=SessionLog.START))
      )

  def add(self, summary_proto, step: int) -> None:
    self.events.write_event(Event(summary=summary_proto, step=int(step), wall_time=time.time()))

  def flush(self) -> None:
    self.events.flush()

  def close(self) -> None:
    self.events.close()


def _drop_rows_after(path: str, step: int) -> None:
  """The rows of the JSONL file `path` (if there is one) past `step` removed."""
  if as_path(path).exists():
    kept = [row for row in read_rows(path) if row["step"] <= step]
    write_atomic(path, "".join(json.dumps(row, allow_nan=False) + "\n" for row in kept))


def append_text(path: str, text: str) -> None:
  """`text` appended to the JSONL log `path`; on an object store, which has no append, the file is
  rewritten whole with it."""
  if is_local(path):
    with open(path, "a") as f:
      f.write(text)
  else:
    old = as_path(path).read_text() if as_path(path).exists() else ""
    write_atomic(path, old + text)


def read_rows(path: str) -> list:
  """The rows of a JSONL log (APPEND_ONLY). A last line that does not parse is a write cut by a
  kill and is left out; a bad line before it is damage this file's writer cannot make: ValueError
  naming it."""
  lines = as_path(path).read_text().split("\n")
  rows = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      rows.append(json.loads(line))
    except ValueError:
      if any(rest.strip() for rest in lines[i + 1 :]):
        raise ValueError(
          f"{path} line {i + 1} is not JSON ({line[:80]!r}); only a torn last line "
          "is repaired: fix or remove that line to resume"
        ) from None
  return rows


def write_atomic(path: str, text: str | bytes) -> None:
  """`text` (str or bytes) as the file `path`, all or nothing: written to a temporary file beside
  it, flushed to disk, then renamed over it, so a kill leaves the old file or the new one, never a
  torn one. On an object store the object is written directly: its upload is all or nothing, while
  a rename there is a copy and a delete."""
  binary = isinstance(text, bytes)
  if not is_local(path):
    if binary:
      epath.Path(path).write_bytes(text)
    else:
      epath.Path(path).write_text(text)
    return
  directory, name = os.path.split(os.path.abspath(path))
  tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp")  # open(): the usual file mode
  try:
    with open(tmp, "wb" if binary else "w") as f:
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except OSError as e:  # a full disk's errno says neither what nor where
    raise OSError(f"writing {path}: {e.strerror or e}") from None
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


class _EpathRecordWriter:
  """A TensorBoard event file on an epath URL: an object store has no append, so each flush
  rewrites the whole file (tensorboardX's own S3 writer does the same). Event files stay small:
  scalars and histograms, a few KB a step."""

  def __init__(self, path: str):
    self.path, self.buffer = epath.Path(path), io.BytesIO()

  def write(self, data: bytes) -> None:
    self.buffer.write(data)

  def flush(self) -> None:
    self.path.write_bytes(self.buffer.getvalue())

  def close(self) -> None:
    self.flush()


class _EpathRecordWriterFactory:
  """tensorboardX's hook for a URL scheme (`record_writer.register_writer_factory`)."""

  def open(self, path: str) -> _EpathRecordWriter:
    return _EpathRecordWriter(path)

  def directory_check(self, path: str) -> None:
    epath.Path(path).mkdir(parents=True, exist_ok=True)
