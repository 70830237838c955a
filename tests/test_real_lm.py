"""The real-LM experiments end to end on a tiny random Llama dir (no download): the mismatch study
writes a record whose figures its page renders and a schedule the trainer reads; re-choosing from
the record at another tau needs no model; bench_decode decodes a model dir's own weights."""

import json
import os
import subprocess
import sys

import jax
import pytest

import sparrow_jax as sj
from sparrow_jax.sparsity.schedule import KVSchedule
from tests.helpers import load_file, tiny_config, write_tiny_hf_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _llama_dir(path):
  """write_tiny_hf_dir's tokenizer and EOS with a random tiny Llama (no q/k norms) as the model."""
  qwen = write_tiny_hf_dir(path, num_hidden_layers=2)
  cfg = tiny_config(
    qk_norm=False, vocab_size=qwen.vocab_size, num_hidden_layers=2, max_position_embeddings=1024
  )
  sj.save_hf(str(path), cfg, sj.init_params(cfg, jax.random.PRNGKey(1), std=0.3))
  return cfg


def _run(script, *overrides):
  cmd = [sys.executable, f"experiments/{script}.py", *overrides]
  result = subprocess.run(
    cmd,
    cwd=ROOT,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  return result.stdout


@pytest.fixture(scope="module")
def study(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("real_lm")
  _llama_dir(tmp / "model")
  record, schedule = tmp / "mismatch.json", tmp / "schedule.json"
  out = _run(
    "real_lm_mismatch",
    "--config=configs/real_lm_mismatch.py",
    f"--config.model.hf_dir={tmp / 'model'}",
    "--config.num_prompts=2",
    "--config.rollout.max_new_tokens=40",
    "--config.rollout.page_size=4",
    "--config.rollout.dense_layers=1",
    "--config.stats.bin_size=16",
    "--config.candidates=1,2,4",
    "--config.quest_candidates=2",
    "--config.sample_topk=4",
    f"--config.record={record}",
    f"--config.schedule_out={schedule}",
    f"--config.plot_dir={tmp}",
  )
  return tmp, json.load(open(record)), out


@pytest.mark.nightly
def test_study_record_holds_every_budget_and_its_page_renders(study):
  tmp, record, out = study
  r = record["results"]
  assert {"command", "commit", "machine", "date"} <= set(record)
  assert set(r["stats"]) == {"mean/1", "mean/2", "mean/4", "quest/2"}
  assert r["rows"] == 2 and r["generated_tokens"] == 80  # not stopped at EOS
  for name, s in r["stats"].items():
    for kind in ("exact", "topk20"):
      assert sum(s[kind]["count_bin"]) <= s[kind]["count"] == 80
      assert 0 <= s[kind]["p5"] <= s[kind]["p50"] <= 1, (name, kind)
    assert s["topk20"]["p5"] <= s["exact"]["p5"] + 1e-6  # the bound is a lower bound
    assert r["bound"][name]["share_bound_le_exact"] == 1.0
  for name, t in r["tables"].items():
    assert all(
      k in (r["candidates"] if name.startswith("mean") else r["quest_candidates"])
      for k in t["topk_bin"]
    )
    assert t["topk_bin"] == sorted(t["topk_bin"])  # a budget never shrinks with length
  page = load_file("docs/make_results_pages.py").real_lm_mismatch_page([record])
  for heading in ("(F1)", "(F2)", "(F3)", "top-20 bound", "Quest vs mean"):
    assert heading in page
  assert f"{r['stats']['mean/2']['exact']['p5']:.3f}" in page
  assert os.path.exists(os.path.join(ROOT, r["plot"]))
  table = r["tables"]["mean/exact"]["topk_bin"]
  assert f"top-k per bin {table}" in out


@pytest.mark.nightly
def test_study_schedule_is_a_kv_schedule_and_rechooses_from_the_record(study, tmp_path):
  tmp, record, _ = study
  schedule = KVSchedule.parse(str(tmp / "schedule.json"), 4, field="schedule")
  assert list(schedule.values) == record["results"]["tables"]["mean/exact"]["topk_bin"]
  out = _run(
    "real_lm_mismatch",
    "--config=configs/real_lm_mismatch.py",
    f"--config.from_record={tmp / 'mismatch.json'}",
    "--config.stats.tau=0.0",  # every budget meets it: the smallest everywhere
    f"--config.schedule_out={tmp_path / 's.json'}",
    f"--config.plot_dir={tmp_path}",  # not the shipped assets/real_lm plot
  )
  rechosen = KVSchedule.parse(str(tmp_path / "s.json"), 4, field="schedule")
  assert set(rechosen.values) == {1} and "table mean/exact at tau 0.0" in out


@pytest.mark.slow
def test_bench_decode_decodes_a_model_dir(tmp_path):
  cfg = _llama_dir(tmp_path / "model")
  path = tmp_path / "real_lm_decode.json"
  out = _run(
    "bench_decode",
    "--config=configs/bench_decode.py",
    f"--config.decode.model_dir={tmp_path / 'model'}",
    "--config.decode.schedule=fixed:4",
    "--config.decode.dense_layers=1",
    "--config.decode.contexts=128",
    "--config.decode.steps=2",
    "--config.batch=1",
    "--config.runs=1",
    f"--config.out={path}",
  )
  assert "real weights" in out
  record = json.load(open(path))
  d = record["results"]["decode"]
  assert d["layers"] == cfg.num_hidden_layers and d["vocab_size"] == cfg.vocab_size
  assert d["model_dir"] == str(tmp_path / "model") and d["schedule"] == "fixed:4"
  page = load_file("docs/make_results_pages.py").real_lm_decode_page([record])
  row = d["rows"][0]
  assert f"| 128 | {row['budget']} | 1 | {row['dense_tok_s']:.2f} |" in page
