"""Metrics out: TensorBoard (tensorboardX writer) and a metrics.jsonl that notebooks can read."""
import json
import os

import numpy as np
from tensorboardX import SummaryWriter


class MetricsLogger:
  """Writes scalars, per-bin arrays (one scalar per bin) and bucketed histograms."""

  def __init__(self, workdir: str, resume_step: int):
    """Appends to the workdir's logs from step `resume_step` on (0: a fresh run), after dropping
    what was logged past it (steps a killed run logged after its last checkpoint, replayed now)
    from metrics.jsonl and the TensorBoard events, so each step is logged once."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(path):
      with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resume_step]
      with open(path, "w") as f:
        f.writelines(kept)
    self.writer = SummaryWriter(os.path.join(workdir, "tensorboard"),
                                purge_step=resume_step + 1 if resume_step else None)
    self.jsonl = open(path, "a")

  def write(self, step: int, metrics: dict) -> None:
    row = {"step": step}
    for name, value in metrics.items():
      value = np.asarray(value)
      if name.endswith("histogram"):
        self._histogram(name, value, step)
      elif value.ndim == 0:
        self.writer.add_scalar(name, float(value), step)
        row[name] = float(value) if np.isfinite(value) else None  # strict JSON: no NaN
      else:  # per position bin: one curve per bin, skipping empty (NaN) bins
        for i, v in enumerate(value.tolist()):
          if np.isfinite(v):
            self.writer.add_scalar(f"{name}/{i:02d}", v, step)
        row[name] = [None if not np.isfinite(v) else v for v in value.tolist()]
    self.jsonl.write(json.dumps(row, allow_nan=False) + "\n")
    self.jsonl.flush()
    self.writer.flush()

  def _histogram(self, name, counts, step):
    """Counts over equal-width buckets on [0, 1] as a TensorBoard histogram."""
    n = len(counts)
    if counts.sum() == 0:
      return
    limits = np.linspace(0, 1, n + 1)[1:]
    centers = limits - 0.5 / n
    self.writer.add_histogram_raw(
        name, min=0.0, max=1.0, num=int(counts.sum()), sum=float((counts * centers).sum()),
        sum_squares=float((counts * centers ** 2).sum()), bucket_limits=limits.tolist(),
        bucket_counts=counts.tolist(), global_step=step)

  def close(self) -> None:
    self.writer.close()
    self.jsonl.close()
