"""A run's workdir: the lock (or the lease on an object store) that keeps one run per workdir,
the temporary files a killed run left, and what a run leaves at its end (the exported policy and
summary.json). `hold` opens a workdir for a run once every check has passed.
"""

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
import tempfile

from etils import epath
import jax
import numpy as np

from sparrow_jax import logging as metrics_log
from sparrow_jax import records, sharding
from sparrow_jax.model.hf import save_hf
from sparrow_jax.rl import lease, run_config


def hold(c, run: contextlib.ExitStack):
  """Makes config.workdir and, on the lead process, takes its lock for the run (released when
  `run` closes), checks again under it that the workdir holds this run (run_config.check_resume:
  a run may have written it meanwhile) and removes what a killed run left. Returns what it holds
  (a lease's `check` says whether it is still ours), or None on the other processes."""
  metrics_log.as_path(c.workdir).mkdir(parents=True, exist_ok=True)
  if jax.process_index() != 0:
    return None
  held = run.enter_context(workdir_lock(c.workdir))
  run_config.check_resume(c)
  remove_stale_tmp(c.workdir)
  return held


LOCK_FILE = "run.lock"


def workdir_lock(workdir: str, lease_s: float = lease.LEASE_S, settle_s: float = lease.SETTLE_S):
  """One run per workdir, held while the run lasts; a second run is refused (ValueError naming
  the holder). A local workdir: an flock (`_flock`). Any other epath URL (an object store, no
  flock): a lease with a heartbeat (`lease.Lease`, which says what it guarantees)."""
  path = os.path.join(workdir, LOCK_FILE)
  if metrics_log.is_local(workdir):
    return _flock(workdir, path)
  return lease.Lease(path, lambda holder: _in_use(workdir, path, holder), lease_s, settle_s)


def _in_use(workdir: str, path: str, holder: str) -> ValueError:
  return ValueError(
    f"config.workdir = {workdir!r} is in use by another run ({holder}; {path} is locked): one "
    "run per workdir; wait for it to end or use another config.workdir"
  )


@contextlib.contextmanager
def _flock(workdir: str, path: str):
  """An exclusive flock on `path`. The kernel drops it when the process dies, even by SIGKILL, so
  a killed run leaves nothing stuck. flock is per host: on a shared file system it holds across
  hosts only where that file system supports flock."""
  f = open(path, "a+")
  try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    f.seek(0)
    holder = f.read().strip() or "another process"
    f.close()
    raise _in_use(workdir, path, holder) from None
  try:
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    f.flush()
    yield
  finally:
    f.close()  # releases the lock


# metrics_log.write_atomic's temporary files: .<name>.<pid>.tmp
_TMP_FILE = re.compile(r"^\..+\.\d+\.tmp$")


def remove_stale_tmp(workdir: str) -> None:
  """Deletes the temporary files a killed run left (metrics_log.write_atomic's) in the workdir;
  called under the workdir's lock, so no live writer owns one."""
  stale = [p for p in epath.Path(workdir).iterdir() if _TMP_FILE.match(p.name)]
  for path in stale:
    path.unlink()
  if stale:
    names = ", ".join(sorted(p.name for p in stale))
    metrics_log.progress(f"removed temporary files a killed run left in {workdir}: {names}")


def export_policy(c, cfg, params, directory, task):
  """The trained policy as a Hugging Face dir (sj.load_hf, transformers, experiments/evaluate.py):
  weights and config, plus the tokenizer and generation files of the source model dir (or, for a
  random preset, the task's own vocabulary). Any other epath URL: written to a local temporary
  folder, then copied file by file (safetensors and the tokenizers write local files only)."""
  if not metrics_log.is_local(directory):
    with tempfile.TemporaryDirectory() as local:
      export_policy(c, cfg, params, local, task)
      _copy_files(local, directory)
    return
  save_hf(directory, cfg, params)
  if not c.model.hf_dir:
    task.save_tokenizer(directory)
    return
  for name in _TOKENIZER_FILES:
    if os.path.exists(os.path.join(c.model.hf_dir, name)):
      shutil.copy(os.path.join(c.model.hf_dir, name), directory)


def _copy_files(local: str, directory: str) -> None:
  """The files of local folder `local` into epath folder `directory`, streamed."""
  epath.Path(directory).mkdir(parents=True, exist_ok=True)
  for name in sorted(os.listdir(local)):
    with open(os.path.join(local, name), "rb") as src:
      with epath.Path(directory, name).open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 24)


_TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "vocab.json",
  "merges.txt",
  "generation_config.json",
)


def _strict_json(value):
  """NaN / inf (an empty bin's p5, ...) as null, so the file is strict JSON."""
  if isinstance(value, dict):
    return {k: _strict_json(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_strict_json(v) for v in value]
  return None if isinstance(value, float) and not np.isfinite(value) else value


def write_summary(c, cfg, state, task, last_row: dict, times, eval_history: list) -> None:
  """The end of a run after its last checkpoint: the exported policy (config.export_hf), then
  summary.json (with every held-out evaluation: `eval`), written last, so a workdir without one is
  a run cut before its end."""
  lead = jax.process_index() == 0
  if c.export_hf:  # every process joins the gather; the lead writes
    params = jax.tree_util.tree_map(sharding.to_host, state.params)
    if lead:
      export_policy(c, cfg, params, os.path.join(c.workdir, "hf"), task)
  if lead:  # time_s null: the run's time was not measured by the process that finished it
    metrics_log.write_atomic(
      os.path.join(c.workdir, "summary.json"),
      json.dumps(
        {
          "steps": c.total_steps,
          "time_s": times,
          "last": _strict_json(last_row),
          "eval": _strict_json(eval_history),
          "peak_rss_gib": records.peak_rss_gib(),  # this process's, the lead's
          # float results follow the code and the CPU type (docs/configuration.md)
          "command": records.command(),
          "commit": records.commit_at_start(),
          "machine": records.machine(),
        },
        indent=2,
        allow_nan=False,
      ),
    )


def logged_row(workdir: str, step: int) -> dict | None:
  """Step `step`'s row of metrics.jsonl (the logger's form: per-bin lists, no histograms); None,
  with a warning, when the file does not hold it (a write the machine lost)."""
  path = os.path.join(workdir, "metrics.jsonl")
  rows = [
    r
    for r in (metrics_log.read_rows(path) if epath.Path(path).exists() else ())
    if r.get("step") == step
  ]
  if not rows:
    metrics_log.progress(f"warning: {path} has no row of step {step}; summary.json's last is null")
    return None
  return rows[-1]
