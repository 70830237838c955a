"""Code sandbox: hostile programs get reward 0, the limits hold, and this (trainer) process is
unharmed.

Every attack runs twice: with the namespaces (network/mount/pid/user), and with `namespaces=False`,
the explicit fallback for where unshare is refused (tests/test_sandbox_fs.py: the file system).
"""

import os
import signal
import socket

import pytest

from sparrow_jax.data.rewards import code_reward, grade_code, grade_code_batch
from sparrow_jax.sandbox import runner

LIMITS = dict(timeout_s=1.0, memory_mb=256, nproc=32, output_bytes=1 << 16)
ADD = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)"


def fenced(program):
  return f"Here it is.\n```python\n{program}\n```\n"


def stdio_run(program, **overrides):
  limits = runner.SandboxLimits.make(**{**LIMITS, **overrides})
  return runner.run_cases(program, "stdio", [""], limits=limits)


@pytest.fixture(params=[True, False], ids=["namespaces", "fallback"])
def namespaces(request):
  return request.param


def _uid_processes(uid):
  pids = []
  for entry in os.listdir("/proc"):
    try:
      if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
        pids.append(entry)
    except OSError:
      pass
  return pids


def test_correct_solutions_get_1():
  assert code_reward(fenced(ADD_PROGRAM), ADD, **LIMITS) == 1.0
  call = {"fn_name": "add", "inputs": [[1, 2], [[1], [2]]], "outputs": [[3], [[1, 2]]]}
  assert code_reward(fenced("def add(a, b):\n  return a + b"), call, **LIMITS) == 1.0
  assert (
    code_reward(fenced("class Solution:\n  def add(self, a, b):\n    return a + b"), call) == 1.0
  )
  script = {"prefix": "import math\n", "script": "assert hypot_(3, 4) == 5\n"}
  assert (
    code_reward(fenced("def hypot_(a, b):\n  return math.hypot(a, b)"), script, **LIMITS) == 1.0
  )


def test_wrong_answers_partial_credit_and_missing_code():
  half = "a, b = map(int, input().split())\nprint(3)"
  assert grade_code(fenced(half), ADD, **LIMITS) == (0.0, "wrong_answer")
  assert grade_code(fenced(half), ADD, partial=True, **LIMITS) == (0.5, "partial")
  assert grade_code("no code at all", ADD) == (0.0, "no_code")
  assert grade_code(fenced("raise SystemExit(3)"), ADD, **LIMITS).reason == "runtime_error"
  # Whitespace and float tolerance as judges apply them.
  tests = {"inputs": [""], "outputs": ["0.3333333 2\n"]}
  assert code_reward(fenced("print(1/3, ' 2 ')"), tests, **LIMITS) == 1.0


def test_bad_specs_raise_value_errors_naming_the_problem():
  with pytest.raises(ValueError, match="2 inputs but 1 outputs"):
    code_reward(fenced("pass"), {"inputs": ["", ""], "outputs": [""]})
  with pytest.raises(ValueError, match="not valid JSON"):
    code_reward(fenced("pass"), "{bad")
  with pytest.raises(ValueError, match="unknown sandbox limit"):
    code_reward(fenced("pass"), ADD, timeout=3)


@pytest.mark.slow
def test_infinite_loop_and_sleep_hit_the_timeout(namespaces):
  for program in ("while True:\n  pass", "import time\ntime.sleep(30)"):
    assert code_reward(fenced(program), ADD, namespaces=namespaces, **LIMITS) == 0.0
    assert stdio_run(program, namespaces=namespaces).cases[0]["status"] == "timeout"


def test_cpu_time_limit_kills_before_the_wall_clock(namespaces):
  run = stdio_run("while True:\n  pass", namespaces=namespaces, timeout_s=30.0, cpu_s=1)
  assert run.cases[0]["status"] == "error"
  assert run.cases[0]["exit"] in (-signal.SIGXCPU, -signal.SIGKILL)


@pytest.mark.slow
def test_fork_bomb_is_capped_and_cleaned_up(namespaces):
  bomb = "import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass"
  assert code_reward(fenced(bomb), ADD, namespaces=namespaces, **LIMITS) == 0.0
  counter = (
    "import os, sys, time\nn = 0\nwhile True:\n  try:\n    pid = os.fork()\n"
    "  except OSError:\n    print(n)\n    sys.exit(0)\n  if pid == 0:\n    time.sleep(60)\n  n += 1"
  )
  run = stdio_run(counter, namespaces=namespaces)
  assert run.isolation.get("nproc") is not None, run.isolation  # root or user namespaces (CI: root)
  assert int(run.cases[0]["stdout"]) < LIMITS["nproc"]
  assert _uid_processes(run.isolation["uid"]) == [] or os.geteuid() != 0


def test_memory_hog_gets_memory_error(namespaces):
  hog = "x = bytearray(1 << 30)\nprint(len(x))"
  assert (
    code_reward(
      fenced(hog), {"inputs": [""], "outputs": [str(1 << 30)]}, namespaces=namespaces, **LIMITS
    )
    == 0.0
  )
  assert "MemoryError" in stdio_run(hog, namespaces=namespaces).cases[0]["stderr"]


def test_a_gigabyte_of_output_is_cut_at_the_file_size_limit(namespaces):
  flood = "import sys\nblock = 'x' * (1 << 20)\nfor _ in range(1024):\n  sys.stdout.write(block)"
  assert (
    code_reward(
      fenced(flood), {"inputs": [""], "outputs": ["x" * (1 << 30)]}, namespaces=namespaces, **LIMITS
    )
    == 0.0
  )
  case = stdio_run(flood, namespaces=namespaces).cases[0]
  assert case["status"] == "error" and len(case["stdout"]) <= LIMITS["output_bytes"]


def test_network_socket_cannot_reach_the_host(namespaces):
  server = socket.socket()
  server.bind(("127.0.0.1", 0))
  server.listen()
  server.setblocking(False)
  port = server.getsockname()[1]
  program = (
    f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
    "print('connected')"
  )
  try:
    assert (
      code_reward(
        fenced(program), {"inputs": [""], "outputs": ["connected"]}, namespaces=namespaces, **LIMITS
      )
      == 0.0
    )
    with pytest.raises(BlockingIOError):
      server.accept()
  finally:
    server.close()


def test_files_outside_the_work_dir_survive(namespaces, tmp_path):
  sentinel = tmp_path / "sentinel.txt"
  sentinel.write_text("keep")
  os.chmod(tmp_path, 0o755)  # reachable, not writable, for others: the uid drop is what protects it
  program = (
    f"import os\nopen({str(sentinel)!r}, 'a').write('pwned')\nos.remove({str(sentinel)!r})\n"
    "print('done')"
  )
  assert (
    code_reward(
      fenced(program), {"inputs": [""], "outputs": ["done"]}, namespaces=namespaces, **LIMITS
    )
    == 0.0
  )
  assert sentinel.read_text() == "keep"


def test_disk_writes_are_capped(namespaces):
  big_file = "open('big', 'wb').write(b'x' * (1 << 20))"
  assert "File too large" in stdio_run(big_file, namespaces=namespaces).cases[0]["stderr"]
  many_files = "for i in range(64):\n  open(f'f{i}', 'wb').write(b'x' * (1 << 15))"
  run = stdio_run(many_files, namespaces=namespaces, tmpfs_mb=1)
  if namespaces:  # a private size-capped tmpfs holds the work directory
    assert run.isolation.get("private_tmp"), run.isolation
    assert "No space left on device" in run.cases[0]["stderr"]
  else:  # documented fallback: the work directory is on disk and only each file is capped
    assert not run.isolation.get("private_tmp")


def test_parent_environment_is_invisible(namespaces, monkeypatch):
  monkeypatch.setenv("SPARROW_TEST_SECRET", "s3cret-value")
  program = (
    "import os\nfound = os.environ.get('SPARROW_TEST_SECRET', '')\n"
    "for pid in os.listdir('/proc'):\n  try:\n"
    "    if b's3cret-value' in open(f'/proc/{pid}/environ', 'rb').read():\n"
    "      found = 's3cret-value'\n  except OSError:\n    pass\nprint(found)"
  )
  assert (
    code_reward(
      fenced(program),
      {"inputs": [""], "outputs": ["s3cret-value"]},
      namespaces=namespaces,
      **LIMITS,
    )
    == 0.0
  )
  assert "s3cret" not in stdio_run(program, namespaces=namespaces).cases[0]["stdout"]


def test_killing_the_parent_fails_and_the_trainer_survives(namespaces):
  me = os.getpid()
  program = (
    "import os, signal\nfor pid in (os.getppid(), %d):\n  try:\n    os.kill(pid, signal.SIGKILL)\n"
    "  except OSError:\n    pass\n" % me
  )
  if (
    os.geteuid() == 0 or namespaces
  ):  # kill(-1) is only harmless where the uid drop or a pid ns holds
    program += "try:\n  os.kill(-1, signal.SIGKILL)\nexcept OSError:\n  pass\n"
  program += "print('still here')"
  assert (
    code_reward(
      fenced(program), {"inputs": [""], "outputs": ["never"]}, namespaces=namespaces, **LIMITS
    )
    == 0.0
  )
  assert os.getpid() == me
  assert code_reward(fenced(ADD_PROGRAM), ADD, namespaces=namespaces, **LIMITS) == 1.0


@pytest.mark.slow
def test_parallel_pool_isolates_a_fork_bomb_from_correct_solutions():
  bomb = fenced("import os\nwhile True:\n  try:\n    os.fork()\n  except OSError:\n    pass")
  good = fenced(ADD_PROGRAM)
  grades = grade_code_batch([bomb, good, good, bomb, good], [ADD] * 5, max_workers=3, **LIMITS)
  assert [g.reward for g in grades] == [0.0, 1.0, 1.0, 0.0, 1.0]


def test_probe_and_cleanup(tmp_path):
  facts = runner.probe(runner.SandboxLimits(**LIMITS))
  assert facts["works"], facts
  if os.geteuid() == 0:
    assert facts["uid"] != 0
  runner.run_cases("open('scratch', 'w').write('x')", "stdio", [""], work_root=str(tmp_path))
  assert list(tmp_path.iterdir()) == []
