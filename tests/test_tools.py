"""The tool pool (calls off the caller's thread, each bounded in time and size, none holding up
another) and the tools: Python in the sandbox, lookup over a corpus."""

import os
import threading
import time

import pytest

from sparrow_jax.envs import tools
from sparrow_jax.sandbox import runner


def _raises(message):
  raise RuntimeError(message)


def _collect(pool, rows, timeout_s=5.0):
  """row_id -> ToolResult for `rows`, polling ready() until they all came or timeout_s passed."""
  out, stop = {}, time.monotonic() + timeout_s
  while set(rows) - set(out) and time.monotonic() < stop:
    out.update({r.row_id: r for r in pool.ready()})
    time.sleep(0.005)
  return out


def test_a_raising_tool_gives_its_error_as_the_observation_and_the_pool_goes_on():
  pool = tools.ToolPool(max_workers=2, timeout_s=5.0, max_chars=200)
  pool.submit("a", _raises, "disk on fire")
  pool.submit("b", str.upper, "fine")
  results = _collect(pool, ["a", "b"])
  assert results["a"].status == "error"
  assert results["a"].text == "error: RuntimeError: disk on fire"
  assert (results["b"].status, results["b"].text) == ("ok", "FINE")
  pool.submit("a", str.lower, "AGAIN")  # the row's next call
  assert _collect(pool, ["a"])["a"].text == "again"


def test_a_hung_tool_becomes_a_timeout_observation_and_frees_its_worker():
  release = threading.Event()
  pool = tools.ToolPool(max_workers=1, timeout_s=0.3, max_chars=200)
  try:
    pool.submit("hung", release.wait)
    pool.submit("next", str.upper, "served")  # queued behind the hung call's only worker
    results = _collect(pool, ["hung", "next"])
    assert results["hung"].status == "timeout"
    assert results["hung"].text == "timeout after 0.3s"
    assert results["hung"].seconds >= 0.3  # the time it held its worker (env/tool_seconds)
    assert (results["next"].status, results["next"].text) == ("ok", "SERVED")
    assert not pool.pending()
  finally:
    release.set()  # the abandoned thread ends


def test_a_ten_megabyte_result_is_cut_to_max_chars_saying_from_how_many():
  pool = tools.ToolPool(max_workers=1, timeout_s=5.0, max_chars=1000)
  pool.submit(0, lambda: "x" * 10_000_000)
  pool.submit(1, _raises, "y" * 5000)  # an error's text is bounded too
  results = _collect(pool, [0, 1])
  assert results[0].truncated and results[0].status == "ok"
  assert len(results[0].text) <= 1000
  assert results[0].text.endswith("[truncated from 10000000 to 1000 chars]")
  assert results[1].truncated and results[1].status == "error" and len(results[1].text) <= 1000
  assert results[1].text.startswith("error: RuntimeError: yyy")


def test_a_slow_call_does_not_delay_a_fast_one():
  release = threading.Event()
  pool = tools.ToolPool(max_workers=2, timeout_s=5.0, max_chars=200)
  try:
    pool.submit("slow", release.wait)
    submitted = time.monotonic()
    pool.submit("fast", str.upper, "quick")
    first = pool.wait(timeout_s=2.0)
    assert [r.row_id for r in first] == ["fast"] and first[0].text == "QUICK"
    assert time.monotonic() - submitted < 1.0
    assert pool.pending() == {"slow"}  # still running
  finally:
    release.set()
  assert _collect(pool, ["slow"])["slow"].text == "True"


def test_submit_returns_at_once_and_refuses_a_second_call_for_a_busy_row():
  release = threading.Event()
  pool = tools.ToolPool(max_workers=1, timeout_s=5.0)
  try:
    start = time.monotonic()
    pool.submit(7, release.wait, 2.0)  # bounded, so that a blocking submit fails rather than hangs
    assert time.monotonic() - start < 0.5 and pool.pending() == {7}
    with pytest.raises(ValueError, match="row 7 already has a tool call in flight"):
      pool.submit(7, str, "x")
  finally:
    release.set()


def test_pool_settings_are_checked_by_name():
  with pytest.raises(ValueError, match=r"ToolPool.timeout_s must be positive, got 0"):
    tools.ToolPool(timeout_s=0)
  with pytest.raises(ValueError, match=r"ToolPool.max_chars must be an int >= 64, got 10"):
    tools.ToolPool(max_chars=10)


@pytest.mark.slow
def test_python_tool_runs_code_in_the_sandbox_and_reports_exit_stdout_stderr():
  tool = tools.PythonTool(runner.SandboxLimits(timeout_s=1.0))
  text = tool("import sys\nprint(6 * 7)\nprint('oops', file=sys.stderr)\nsys.exit(3)")
  assert text == "exit status: 3\nstdout:\n42\n\nstderr:\noops\n"
  assert tool("import os\nprint(os.getcwd().startswith('/tmp'))").startswith("exit status: 0")
  assert tool.schema["function"]["parameters"]["required"] == ["code"]


@pytest.mark.slow
def test_python_tool_that_loops_forever_hits_the_sandbox_limit_as_a_bounded_observation():
  tool = tools.PythonTool(runner.SandboxLimits(timeout_s=0.5))
  pool = tools.ToolPool(max_workers=2, timeout_s=30.0, max_chars=300)
  pool.submit("loop", tool, "print('x' * 100000)\nwhile True: pass")
  pool.submit("fast", str.upper, "meanwhile")
  results = _collect(pool, ["loop", "fast"], timeout_s=30.0)
  assert results["fast"].text == "MEANWHILE"
  loop = results["loop"]
  assert loop.status == "ok" and loop.truncated and len(loop.text) <= 300
  assert loop.text.startswith("timeout after 0.5s (the sandbox's limit)\nstdout:\nxxx")


def test_lookup_tool_over_a_dict_and_a_directory(tmp_path):
  lookup = tools.LookupTool({"a": "alpha"})
  assert lookup("a") == "alpha"
  with pytest.raises(KeyError):
    lookup("b")
  (tmp_path / "notes").mkdir()
  (tmp_path / "notes" / "long.txt").write_text("word " * 50_000)
  (tmp_path / "top.md").write_text("top")
  (tmp_path / "skip.bin").write_bytes(b"\0")
  secret = tmp_path.parent / "secret.txt"
  secret.write_text("not in the corpus")
  os.symlink(secret, tmp_path / "link.txt")
  corpus = tools.LookupTool.from_directory(str(tmp_path))
  assert sorted(corpus.passages) == ["notes/long", "top"]
  assert len(corpus("notes/long")) == 250_000  # a long passage, whole (the pool bounds it)
  for key in ("link", "../secret", str(secret), "skip"):
    with pytest.raises(KeyError):
      corpus(key)
  with pytest.raises(ValueError, match="is not a directory"):
    tools.LookupTool.from_directory(str(tmp_path / "absent"))
