"""Every experiment is a config file: the experiment configs share the trainer's fields, and each
script runs end to end from its config with small overrides (subprocess, CPU, the shipped model
or a tiny random one), writing sane outputs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import calibrate, default, evaluate, measure_tiny, pretrain_tiny, pretrain_tiny_turns
import sparrow_jax as sj
from sparrow_jax.data.tokenizer import load_tokenizer
from sparrow_jax.sparsity.schedule import KVSchedule
from tests.helpers import ROOT

SHORT = {"task.min_hops": 4, "task.max_hops": 4}  # ~30-token prompts, 18-token answers


@pytest.mark.nightly
@pytest.mark.parametrize("module", [calibrate, evaluate, measure_tiny])
def test_configs_share_the_trainers_fields(module):
  """A field an experiment shares with the trainer holds the trainer's default unless the
  experiment documents why not (evaluate: the trained policy, dense; measure / evaluate: held-out
  seed)."""
  c, trainer = module.get_config(), default.get_config()
  differs = set()
  if module is evaluate:  # dense sampling: no sparse actor, so no exact mode either
    differs = {("model", "hf_dir"), ("rollout", "sparse"), ("rollout", "speculate")}
  for group in ("model", "task", "rollout", "stats"):
    for name in c.get(group, {}):
      if name in trainer[group] and (group, name) not in differs:
        assert c[group][name] == trainer[group][name], (module.__name__, group, name)


@pytest.mark.nightly
def test_pretrain_config_builds_the_shipped_architecture():
  from experiments import pretrain_tiny as script

  shipped, _ = sj.load_hf("assets/pointer_chase_tiny")
  assert script.model_config(pretrain_tiny.get_config()) == shipped


@pytest.mark.nightly
def test_calibrate_shipped_model_on_policy(tmp_path, run_experiment):
  stdout = run_experiment(
    "calibrate_schedule",
    "calibrate",
    {
      **SHORT,
      "num_prompts": 2,
      "calibration.repeats": 2,
      "rollout.max_new_tokens": 16,
      "rollout.page_size": 4,
      "stats.bin_size": 16,
      "calibration.candidates": "(1,4)",
      "calibration.on_policy": True,
      "out_dir": tmp_path,
    },
  )
  assert "on-policy top-k 4 (2/2)" in stdout and "chosen top-k per bin" in stdout
  schedule = KVSchedule.from_json((tmp_path / "schedule.json").read_text())
  surface = json.loads((tmp_path / "surface.json").read_text())
  assert schedule.page_size == 4 and schedule.bin_size == 16 and surface["on_policy"]
  assert set(schedule.values) <= {1, 4} and sum(surface["count_bin"]) > 0
  assert (tmp_path / "calibration.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.nightly
def test_evaluate_shipped_model_sparse_under_the_calibrated_schedule(tmp_path, run_experiment):
  out = tmp_path / "eval.json"
  stdout = run_experiment(
    "evaluate",
    "evaluate",
    {
      **SHORT,
      "model.hf_dir": "assets/pointer_chase_tiny",
      "num_problems": 3,
      "k": "1,2",
      "rollout.max_new_tokens": 24,
      "batch_size": 4,
      "rollout.sparse": True,
      "out": out,
    },
  )
  assert "6/6 samples" in stdout and "calibration_quest/schedule.json" in stdout
  results = json.loads(out.read_text())
  assert results["sparse"] and results["seed"] == 1234 and len(results["per_problem"]) == 3
  assert results["schedule"] == default.get_config().rollout.schedule
  m = results["metrics"]
  assert 0 < m["mean@1"] <= 1 and m["pass@1"] <= m["pass@2"]  # the model follows short chains
  assert (tmp_path / "eval_tb").is_dir()


@pytest.mark.nightly
def test_measure_tiny_shipped_model(tmp_path, run_experiment):
  out = tmp_path / "measurements.json"
  stdout = run_experiment(
    "measure_tiny",
    "measure_tiny",
    {
      **SHORT,
      "num_problems": 4,
      "num_accept": 2,
      "budgets": "3,4",
      "small_budget": 3,
      "batch_size": 4,
      "out": out,
    },
  )
  assert "calibrated assets/pointer_chase_tiny/calibration_quest/schedule.json" in stdout
  record = json.loads(out.read_text())
  assert record["command"].startswith("python experiments/measure_tiny.py")
  results = record["results"]
  assert results["n"] == 4 and results["held_out_seed"] == 1234 and results["hops"] == 4
  assert 0 < results["dense"]["step_score"] <= 1
  assert set(results["sparse"]["budgets"]) == {"3", "4"}
  for row in [*results["sparse"]["budgets"].values(), results["calibrated"]]:
    assert 0 <= row["p5"] <= row["mean"] + 1e-6 <= 1 + 2e-6 and row["count"] > 0
  # 4 pages of 16 hold these <= 58-token sequences whole: sparse is dense there
  assert results["sparse"]["budgets"]["4"]["p5"] == pytest.approx(1.0, abs=1e-4)
  assert results["small_budget"]["pages"] == 3


@pytest.mark.nightly
def test_pretrain_tiny_exports_and_resumes(tmp_path, run_experiment):
  workdir, export = tmp_path / "work", tmp_path / "export"
  # one small curriculum level: 2-hop tables, 4 rows of 64 tokens
  small = {"workdir": workdir, "log_every": 2, "levels": "((1,2,64,4),)"}
  stdout = run_experiment("pretrain_tiny", "pretrain_tiny", {**small, "total_steps": 4})
  assert "step      4" in stdout and (workdir / "hf" / "model.safetensors").exists()
  stdout = run_experiment(
    "pretrain_tiny", "pretrain_tiny", {**small, "total_steps": 6, "export_dir": export}
  )
  assert "resumed at step 4" in stdout and f"exported to {export}" in stdout
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [2, 4, 6]
  assert all(np.isfinite(r["pretrain/loss"]) for r in rows)
  cfg, params = sj.load_hf(str(export))
  assert cfg.num_hidden_layers == 2 and load_tokenizer(str(export)).eos_ids
  log = json.loads((export / "pretrain_log.json").read_text())
  assert log["config"]["total_steps"] == 6 and log["history"][-1]["step"] == 6


def test_episodes_are_packed_with_the_model_s_turns_as_the_only_targets():
  """pretrain_tiny's Episodes corpus (configs/pretrain_tiny_turns.py): each packed episode is the
  environment's reference episode as a rollout builds it, its targets exactly the model's turns
  (the reference calls and the answer, each with its <|im_end|>), its lookup targets the key
  tokens among them; observations and prompts are context."""
  from experiments import pretrain_tiny as script

  corpus = script.Episodes(pretrain_tiny_turns.get_config())
  batch = corpus.pack(step=3, level=0)
  tok = corpus.tokenizer
  targets = np.roll(batch["tokens"], -1, axis=1)
  episodes = 0
  for r in range(len(batch["tokens"])):
    for seg in range(1, batch["segments"][r].max() + 1):
      at = batch["segments"][r] == seg
      text = tok.decode(batch["tokens"][r][at])
      assert text.startswith("<|im_start|>user\nStart at key ") and text.endswith("<|im_end|>")
      trained = tok.decode(targets[r][at & (batch["weights"][r] > 0)])
      turns = [t.split("\n<|im_start|>user")[0] for t in text.split("</think>\n\n")[1:]]
      assert all(t.endswith("<|im_end|>") for t in turns) and trained == "".join(turns)
      keys = [tok.decode([t]) for t in targets[r][at & (batch["lookups"][r] > 0)]]
      assert keys and all(k[0] == "k" and k[1:].isdigit() and len(k) == 3 for k in keys)
      episodes += 1
  assert episodes >= len(batch["tokens"])


@pytest.mark.nightly
def test_pretrain_tiny_turns_rebuilds_the_shipped_multi_turn_model(tmp_path):
  """The shipped assets/pointer_chase_turns_tiny, bit for bit, from its config (2.3 min), compiled
  as it was made: without the tests' XLA flags (LLVM -O0 moves the weights by up to 0.23 over
  625 steps)."""
  export = tmp_path / "export"
  cmd = [sys.executable, "experiments/pretrain_tiny.py", "--config=configs/pretrain_tiny_turns.py"]
  cmd += [f"--config.workdir={tmp_path / 'work'}", f"--config.export_dir={export}"]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
    cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=dict(env, JAX_PLATFORMS="cpu")
  )
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  for name in ("model.safetensors", "tokenizer.json", "config.json", "generation_config.json"):
    shipped = open(os.path.join(ROOT, "assets/pointer_chase_turns_tiny", name), "rb").read()
    assert (export / name).read_bytes() == shipped, name
