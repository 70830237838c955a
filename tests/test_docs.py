"""The README stays a first screen and the docs stay true: README.md is at most 200 lines, every
relative link in README.md and docs/ resolves to a file (and a heading, when it names one), the
README keeps the command .ci/run runs, README.md and docs/*.md state what is, not how it came to
be (no history phrases), code comments quote no measured times or speedups (those live in docs/),
and the pages that explain a results page quote none of its figures (those are rendered from
records)."""

import glob
import io
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
MAX_README_LINES = 200
HISTORY_PHRASES = (
  "build before",
  "this build",
  "until this build",
  "earlier build",
  "the run before these changes",
)
# A measured time or speed quoted in code (a budget such as "< 8 min" is a target, not a figure).
MEASURED_FIGURE = re.compile(
  r"(?<!< )(?<!under )\b\d+(\.\d+)?\s?(ms|min)\b|\b\d+(\.\d+)?x (faster|slower)\b"
  r"|\b\d+(\.\d+)?\s?tok/s\b|\b\d+(\.\d+)? s (on|here|alone|beside)\b"
)
# The pages that explain a results page say what its figures mean; the figures come from the
# records (docs/results/). A measured figure there is a number with two or more decimals, or one
# with a unit of time or memory; the settings the pages name (thresholds, an HBM size) are not.
RESULTS_TOPICS = (
  "correctness",
  "cost_model",
  "decode_speed",
  "distill_sparse",
  "embedded_default",
  "memory",
  "real_lm",
  "rollout_engine",
  "threshold_sweep",
)
HAND_FIGURE = re.compile(
  r"(?<![\w.])(\d+\.\d{2,}|\d+(?:\.\d+)? ?(?:min|minutes|GB|GiB|s|ms|tok/s)\b)"
)
SETTINGS = {"0.85", "0.86", "0.94", "0.95", "0.99", "95 GB", "141 GB"}
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def _read(path):
  with open(path, encoding="utf-8") as f:
    return f.read()


def _markdown_files():
  """README.md and every page under docs/ (the generated results pages included)."""
  return [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


def _without_code_blocks(text):
  return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.S | re.M)


def _prose(text):
  """The text without fenced code blocks and inline code spans, where `](` is code, not a link."""
  return re.sub(r"`[^`\n]*`", "", _without_code_blocks(text))


def relative_links(text):
  """The targets of the markdown links and images in `text` that point into the repository."""
  targets = []
  for target in LINK.findall(_prose(text)):
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
      continue  # http(s), mailto, ...; an anchor on the same page
    targets.append(target.split("#", 1)[0].split("?", 1)[0])
  return targets


def heading_anchors(text):
  """The anchors GitHub gives the headings of a markdown page: lower case, punctuation dropped,
  spaces as hyphens."""
  headings = re.findall(r"^#+ (.*)$", _without_code_blocks(text), re.M)
  return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_anchors_resolve(path):
  """A link to a page's heading (page.md#heading, or #heading on the same page) names one that
  exists."""
  missing = []
  for target in LINK.findall(_prose(_read(path))):
    page, sep, anchor = target.partition("#")
    if not sep or re.match(r"^[a-z][a-z0-9+.-]*:", page, re.I):
      continue
    linked = os.path.normpath(os.path.join(os.path.dirname(path), page)) if page else path
    if linked.endswith(".md") and os.path.exists(linked):
      if anchor not in heading_anchors(_read(linked)):
        missing.append(target)
  assert not missing, f"{os.path.relpath(path, ROOT)} links to missing headings: {missing}"


def test_anchor_names_follow_github():
  text = "# What RL does, measured\n## p5 >= tau (the rule)\n## GPU: `a/b.py`\n```\n# no\n```\n"
  assert heading_anchors(text) == {"what-rl-does-measured", "p5--tau-the-rule", "gpu-abpy"}


def test_readme_is_a_first_screen():
  lines = _read(README).splitlines()
  assert len(lines) <= MAX_README_LINES, (
    f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move detail into docs/"
  )


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(path):
  missing = []
  for target in relative_links(_read(path)):
    resolved = os.path.normpath(os.path.join(os.path.dirname(path), target))
    if not os.path.exists(resolved):
      missing.append(target)
  assert not missing, f"{os.path.relpath(path, ROOT)} links to missing files: {missing}"


def test_docs_have_pages_and_the_readme_links_them():
  readme_links = {os.path.normpath(os.path.join(ROOT, t)) for t in relative_links(_read(README))}
  pages = glob.glob(os.path.join(ROOT, "docs", "*.md"))
  assert pages
  reachable = set(readme_links)
  for page in pages:  # a page is linked from the README or from a page the README links
    if page in readme_links:
      reachable |= {
        os.path.normpath(os.path.join(os.path.dirname(page), t))
        for t in relative_links(_read(page))
      }
  unlinked = sorted(os.path.relpath(p, ROOT) for p in pages if p not in reachable)
  assert not unlinked, f"docs pages no reader can reach from README.md: {unlinked}"


def test_no_history_phrases():
  """Docs, code, configs and experiments say what is now, not what an earlier version did."""
  hits = []
  code = [
    p
    for d in ("sparrow_jax", "kernels", "configs", "experiments")
    for p in glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)
  ]
  for path in [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + sorted(code):
    for number, line in enumerate(_read(path).splitlines(), 1):
      for phrase in HISTORY_PHRASES:
        if phrase in line.lower():
          hits.append(f"{os.path.relpath(path, ROOT)}:{number}: {phrase!r}")
  assert not hits, "history in the docs (say what is now):\n" + "\n".join(hits)


def comment_and_docstring_lines(source: str):
  """(line number, text) of every comment and triple-quoted string (docstrings) in `source`."""
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    triple = tok.type == tokenize.STRING and tok.string.lstrip("rbuRBU")[:3] in ('"""', "'''")
    if tok.type == tokenize.COMMENT or triple:
      for i, line in enumerate(tok.string.splitlines()):
        yield tok.start[0] + i, line


def test_no_measured_figures_in_code_comments():
  """Timings and speedups live in docs/ and results records; code comments point there."""
  hits = []
  for d in ("sparrow_jax", "kernels", "configs", "experiments"):
    for path in sorted(glob.glob(os.path.join(ROOT, d, "**", "*.py"), recursive=True)):
      for number, line in comment_and_docstring_lines(_read(path)):
        if MEASURED_FIGURE.search(line):
          hits.append(f"{os.path.relpath(path, ROOT)}:{number}: {line.strip()}")
  assert not hits, "measured figures in code comments (cite docs/ instead):\n" + "\n".join(hits)


def test_figure_check_sees_figures():
  source = 'x = 1  # 3.0 ms per step\n"""Runs 2.1x faster; < 8 min budget."""\ny = "9 ms"\n'
  found = [n for n, line in comment_and_docstring_lines(source) if MEASURED_FIGURE.search(line)]
  assert found == [1, 2]  # the code string on line 3 is not a comment; "< 8 min" is a budget


def test_results_topics_quote_no_measured_figures():
  for name in RESULTS_TOPICS:
    prose = LINK.sub("", _prose(_read(os.path.join(ROOT, "docs", f"{name}.md"))))
    figures = set(HAND_FIGURE.findall(prose)) - SETTINGS
    assert not figures, f"docs/{name}.md quotes {sorted(figures)}: render them from a record"


def test_hand_figure_check_sees_figures():
  prose = LINK.sub("", _prose("took 7.9 min, 2.23 GiB, p5 0.913; `0.123` and [a](x/0.45.md) not"))
  assert HAND_FIGURE.findall(prose) == ["7.9 min", "2.23", "0.913"]


def test_readme_keeps_the_ci_command():
  """.ci/run runs the README's test command, character for character."""
  ci = [
    line
    for line in _read(os.path.join(ROOT, ".ci", "run")).splitlines()
    if "pytest" in line and not line.startswith("#")
  ]
  assert ci
  assert ci[0] in _read(README).splitlines()


def test_tiers_are_chosen_test_by_test():
  """Markers sit on tests, not on whole files; CI runs every tier but nightly, whose own command
  docs/testing.md gives."""
  for path in glob.glob(os.path.join(ROOT, "tests", "test_*.py")):
    file_mark = re.search(r"^pytestmark\s*=", _read(path), re.M)
    assert not file_mark, f"{path}: mark the tests that are slow, not the file"
  ci = next(
    line for line in _read(os.path.join(ROOT, ".ci", "run")).splitlines() if "pytest" in line
  )
  assert '-m "not nightly"' in ci
  assert "python -m pytest -q -n 2 --dist loadfile -m nightly tests" in _read(
    os.path.join(ROOT, "docs", "testing.md")
  )


def test_link_checker_sees_links():
  """The checks above cannot pass vacuously: links, images, anchors and code are told apart."""
  text = (
    "[a](docs/x.md#part) ![img](assets/y.png) [web](https://e.org) [here](#top)\n"
    "`[code](not/a/link.md)`\n```\n[fenced](not/a/link.md)\n```\n"
  )
  assert relative_links(text) == ["docs/x.md", "assets/y.png"]
