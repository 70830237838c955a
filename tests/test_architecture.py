"""The import structure docs/architecture.md describes: module-level imports between
the library's modules form no cycle, the model knows nothing of the sparsity policy, and the kernel
imports only its jnp twin from the library."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("sparrow_jax", "kernels")


def _modules():
  """Module name -> path of every .py file under the library's packages."""
  out = {}
  for package in PACKAGES:
    for folder, _, files in os.walk(os.path.join(ROOT, package)):
      for name in files:
        if name.endswith(".py"):
          rel = os.path.relpath(os.path.join(folder, name), ROOT)[:-3].replace(os.sep, ".")
          out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(
            folder, name
          )
  return out


def import_graph():
  """Module -> the library modules it imports at any depth of its source (function-level
  imports included: a lazy import is still a dependency)."""
  modules = _modules()
  graph = {}
  for module, path in modules.items():
    with open(path) as f:
      tree = ast.parse(f.read())
    deps = set()
    for node in ast.walk(tree):
      names = []
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        # `from package import module` depends on the module, `from module import name` on it
        subs = [
          f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules
        ]
        names = subs or [node.module]
      deps |= {n for n in names if n in modules and n != module}
    graph[module] = deps - {m for m in deps if module.startswith(m + ".")}  # not own package
  return graph


def _reachable(graph, start):
  seen, todo = set(), [start]
  while todo:
    for dep in graph[todo.pop()]:
      if dep not in seen:
        seen.add(dep)
        todo.append(dep)
  return seen


def test_no_import_cycles():
  graph = import_graph()
  cycles = sorted(
    m
    for m in graph
    if m in _reachable(graph, m) and m not in PACKAGES and not m.endswith("__init__")
  )
  # The package __init__ re-exports the public API; every other module must not reach itself.
  assert not [m for m in cycles if m != "sparrow_jax"], cycles


def test_model_knows_qwen3_only_and_kernel_imports_its_twin_only():
  graph = import_graph()
  model_deps = _reachable(graph, "sparrow_jax.model.qwen3")
  assert not {
    d
    for d in model_deps
    if d.startswith("kernels") or d.endswith(("attention.select", "attention.policy"))
  }, model_deps
  assert graph["kernels.sparse_decode"] <= {"sparrow_jax.attention.reference"}
  assert graph["kernels.sparse_decode_tpu"] <= {"sparrow_jax.attention.reference"}
