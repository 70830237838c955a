"""The README's Python snippet runs verbatim (on the shipped tiny model)."""

import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_readme_python_snippet_runs(monkeypatch, capsys):
  with open(os.path.join(ROOT, "README.md")) as f:
    readme = f.read()
  section = readme[readme.index("## Using it from Python") :]
  snippet = re.search(r"```python\n(.*?)```", section, re.S).group(1)
  monkeypatch.chdir(ROOT)
  exec(compile(snippet, "README.md", "exec"), {})  # noqa: S102 (our own README)
  assert re.search(r"p5 \d\.\d{3}, mean \d\.\d{3}", capsys.readouterr().out)
  assert os.path.exists("/tmp/sparrow_policy/model.safetensors")
