"""Script mode on the grader's side (a check that is code, e.g. HumanEval's): the names that the
check takes from the candidate, the descriptor that alone brings the check its source and token, and
the token that alone makes a pass."""

import ast
import builtins
import json
import os


def _bound(tree):
  """Every name that code binds anywhere: assigned, defined, imported, a parameter or a caught
  error."""
  names = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
      names.add(node.id)
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      names.add(node.name)
    elif isinstance(node, ast.alias):
      names.add((node.asname or node.name).split(".")[0])
    elif isinstance(node, ast.arg):
      names.add(node.arg)
    elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
      names.add(node.name)
  return names


def _is_stub(statement):
  """Whether a statement of a function body leaves it to be written: pass, ..., a docstring,
  imports."""
  if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
    return isinstance(statement.value.value, str) or statement.value.value is Ellipsis
  return isinstance(statement, (ast.Pass, ast.Import, ast.ImportFrom))


def candidate_names(prefix, script):
  """The functions that a script-mode check takes from the candidate: the prefix's stubs (top-level
  functions with nothing but a docstring, imports and pass in their body, like HumanEval's prompt
  with `pass`), and the names the script reads that neither the prefix, the script nor builtins
  bind. Helper functions with a body stay the prefix's own (trusted) ones in the check."""
  try:
    prefix_tree, script_tree = ast.parse(prefix), ast.parse(script)
  except SyntaxError as e:
    raise ValueError(f"script tests do not parse: {e}") from None
  stubs = {
    node.name
    for node in prefix_tree.body
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and all(map(_is_stub, node.body))
  }
  read = {
    node.id
    for node in ast.walk(script_tree)
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)
  }
  free = read - _bound(prefix_tree) - _bound(script_tree) - set(dir(builtins))
  if not stubs | free:
    raise ValueError(
      "script tests take nothing from the candidate: the prefix defines no stub function "
      "and the script reads no name that the prefix and script leave unbound"
    )
  return sorted(stubs | free)


def secret_fd(script, token):
  """A descriptor with the check's source and the token; only the check process will read it."""
  fd = os.memfd_create("sandbox_check", os.MFD_CLOEXEC)
  os.write(fd, json.dumps({"script": script, "token": token}).encode())
  return fd


def certify(case, token):
  """Script mode: a case passes only with the token, which exists in the check process alone."""
  verdict = case.pop("verdict", None)
  if case["status"] == "ok" and verdict != token:
    case["status"] = "error"
  return case
