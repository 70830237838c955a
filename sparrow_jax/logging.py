"""Metrics out: TensorBoard (tensorboardX writer) and a metrics.jsonl that notebooks can read."""
import json
import os

import numpy as np
from tensorboardX import SummaryWriter


class MetricsLogger:
  """Writes scalars, per-bin arrays (one scalar per bin) and bucketed histograms."""

  def __init__(self, workdir: str):
    os.makedirs(workdir, exist_ok=True)
    self.writer = SummaryWriter(os.path.join(workdir, "tensorboard"))
    self.jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")

  def write(self, step: int, metrics: dict) -> None:
    row = {"step": step}
    for name, value in metrics.items():
      value = np.asarray(value)
      if name.endswith("histogram"):
        self._histogram(name, value, step)
      elif value.ndim == 0:
        self.writer.add_scalar(name, float(value), step)
        row[name] = float(value)
      else:  # per position bin: one curve per bin, skipping empty (NaN) bins
        for i, v in enumerate(value.tolist()):
          if np.isfinite(v):
            self.writer.add_scalar(f"{name}/{i:02d}", v, step)
        row[name] = [None if not np.isfinite(v) else v for v in value.tolist()]
    self.jsonl.write(json.dumps(row) + "\n")
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
