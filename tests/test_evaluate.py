"""sparrow_jax.rl.evaluate: the unbiased pass@k estimator, and an evaluation end to end on an
offline reasoning-gym math task with a tiny random Qwen3 and a small BPE tokenizer built here."""

import itertools
import json
import math
import os

import numpy as np
import pytest

from configs import evaluate as evaluate_config
from experiments import evaluate as evaluate_script
from sparrow_jax.rl import build, evaluate
from tests.helpers import write_tiny_hf_dir

CORPUS = [
  "What is 12 + 7 * 3 - 4? Calculate the following expression.",
  "Please reason step by step, and put your final answer within \\boxed{}.",
  "user assistant <think> </think> the answer is \\boxed{25}",
  "0 1 2 3 4 5 6 7 8 9 + - * / =",
]


@pytest.mark.parametrize(
  "n, c, k, want",
  [
    (10, 0, 1, 0.0),
    (10, 10, 5, 1.0),
    (10, 3, 1, 0.3),
    (5, 1, 5, 1.0),
    (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (10, 2, 3, 1 - 56 / 120),  # 1 - C(8,3)/C(10,3)
    (16, 4, 4, 1 - 495 / 1820),
  ],
)
def test_pass_at_k_hand_computed(n, c, k, want):
  assert evaluate.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12)


def test_pass_at_k_matches_brute_force_over_subsets():
  """pass@k = the fraction of the C(n, k) subsets of k samples that hold a correct one."""
  for n in range(1, 8):
    for c in range(n + 1):
      correct = [i < c for i in range(n)]
      for k in range(1, n + 1):
        subsets = list(itertools.combinations(correct, k))
        want = sum(any(s) for s in subsets) / len(subsets)
        assert evaluate.pass_at_k(n, c, k) == pytest.approx(want, abs=1e-12), (n, c, k)
  assert evaluate.pass_at_k(200, 3, 100) == pytest.approx(
    1 - math.comb(197, 100) / math.comb(200, 100), rel=1e-9
  )


def test_summarize_and_bad_k():
  rewards = np.array([[1, 0, 0, 0], [0.5, 0.5, 0, 0]])
  correct = rewards == 1
  m = evaluate.summarize(rewards, correct, [1, 2])
  assert m["mean@1"] == m["mean@2"] == pytest.approx(0.25)
  assert m["pass@1"] == pytest.approx((0.25 + 0) / 2)
  assert m["pass@2"] == pytest.approx((0.5 + 0) / 2)
  with pytest.raises(ValueError, match="config.k"):
    evaluate.parse_ks("1,8", samples=4)
  with pytest.raises(ValueError, match="c <= n"):
    evaluate.pass_at_k(3, 4, 1)


def _tiny_model_dir(directory):
  write_tiny_hf_dir(directory, corpus=CORPUS)
  return directory


@pytest.mark.nightly
def test_evaluate_end_to_end_on_reasoning_gym(tmp_path, run_experiment):
  model_dir = _tiny_model_dir(tmp_path / "model")
  out = tmp_path / "eval" / "results.json"
  stdout = run_experiment(
    "evaluate",
    "evaluate",
    {
      "model.hf_dir": model_dir,
      "task.name": "math:reasoning_gym:basic_arithmetic",
      "num_problems": 3,
      "samples": 4,
      "k": "1,2,4",
      "rollout.max_new_tokens": 12,
      "batch_size": 8,
      "out": out,
      "seed": 0,
      "rollout.sparse": True,
      "rollout.schedule": "fixed:4",
      "rollout.page_size": 8,
      "rollout.dense_layers": 1,
    },
  )
  for k in (1, 2, 4):
    assert f"mean@{k}" in stdout and f"pass@{k}" in stdout
  assert "12/12 samples" in stdout  # progress over two batches (8 + 4 rows)

  results = json.loads(out.read_text())
  assert results["task"] == "math:reasoning_gym:basic_arithmetic" and results["sparse"]
  assert results["num_problems"] == 3 and results["samples"] == 4 and results["k"] == [1, 2, 4]
  assert len(results["per_problem"]) == 3
  assert sum(results["grade_reasons"].values()) == 12
  metrics = results["metrics"]
  for k in (1, 2, 4):
    assert 0.0 <= metrics[f"mean@{k}"] <= 1.0
    assert 0.0 <= metrics[f"pass@{k}"] <= 1.0
  assert metrics["pass@1"] <= metrics["pass@2"] <= metrics["pass@4"]
  assert 0 < metrics["response_length/mean"] <= 12
  # The per-problem counts reproduce the summary.
  n_correct = [p["correct"] for p in results["per_problem"]]
  assert metrics["pass@2"] == pytest.approx(
    np.mean([evaluate.pass_at_k(4, c, 2) for c in n_correct])
  )
  assert os.listdir(tmp_path / "eval" / "results_tb")  # TensorBoard event file


def test_evaluate_counts_correct_samples(tmp_path, monkeypatch):
  """With a scripted sampler that answers the first 1 + (problem index) samples of each problem
  right (and leaves the others unanswered), the per-problem counts and pass@k / mean@k follow."""
  from sparrow_jax.data.tokenizer import load_tokenizer
  from sparrow_jax.rollout.sampler import Rollout

  model_dir = _tiny_model_dir(tmp_path / "model")
  tok = load_tokenizer(str(model_dir))
  c = evaluate_config.get_config()
  c.model.hf_dir, c.task.name, c.seed = str(model_dir), "math:reasoning_gym:basic_arithmetic", 0
  c.num_problems, c.samples, c.k, c.batch_size = 3, 4, "1,4", 5
  c.rollout.max_new_tokens, c.out = 64, str(tmp_path / "r.json")
  problems = evaluate.first_problems(build.make_task(c), 3)
  answer_of = {p.prompt: p.reference for p in problems}
  rows_seen = []

  def scripted_generate(params, cfg, prompt_BT, prompt_len_B, key, *, max_new_tokens, **kwargs):
    tokens, lengths = [], []
    for row, n in zip(np.asarray(prompt_BT), np.asarray(prompt_len_B)):
      problem = list(answer_of).index(tok.decode(row[:n]))
      sample = sum(1 for r in rows_seen if r == problem)
      rows_seen.append(problem)
      text = f"so \\boxed{{{answer_of[tok.decode(row[:n])]}}}" if sample <= problem else "hmm"
      ids = tok.encode(text + "<|im_end|>")[:max_new_tokens]
      tokens.append(ids + [tok.pad_id] * (max_new_tokens - len(ids)))
      lengths.append(len(ids))
    return Rollout(np.array(tokens), np.zeros((len(tokens), max_new_tokens)), np.array(lengths))

  monkeypatch.setattr(evaluate_script.sj, "generate", scripted_generate)
  results = evaluate_script.evaluate(c)
  assert [p["correct"] for p in results["per_problem"]] == [1, 2, 3]
  m = results["metrics"]
  assert m["mean@1"] == m["mean@4"] == pytest.approx(6 / 12)
  assert m["pass@1"] == pytest.approx((1 / 4 + 2 / 4 + 3 / 4) / 3)
  assert m["pass@4"] == pytest.approx(1.0)
  assert results["grade_reasons"]["correct"] == 6
  assert json.loads((tmp_path / "r.json").read_text())["metrics"] == m
