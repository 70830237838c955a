"""The structure docs/architecture.md describes: packages import one way (LAYERS), module-level
imports between the library's modules form no cycle, the model knows nothing of the sparsity
policy, the kernels import only their jnp twin from the library, and no signature is long."""

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
    if d.startswith("kernels") or d.endswith(("attention.select", "sparsity.policy"))
  }, model_deps
  assert graph["kernels.sparse_decode"] <= {"sparrow_jax.attention.reference"}
  assert graph["kernels.sparse_decode_tpu"] <= {"sparrow_jax.attention.reference"}


# Packages from the bottom up: a module imports only from its own package and the ones below it.
LAYERS = (
  # the core, and the code sandbox (stdlib only: its child runs without the library)
  (
    "sparrow_jax.sharding",
    "sparrow_jax.schema",
    "sparrow_jax.records",
    "sparrow_jax.logging",
    "sparrow_jax.dashboard",
    "sparrow_jax.sandbox",
  ),
  ("sparrow_jax.attention", "sparrow_jax.data"),  # the attention ops; tasks, rewards, tokenizer
  ("sparrow_jax.envs",),  # multi-turn environments and their tools (over data and the sandbox)
  ("kernels",),  # the Pallas kernels, beside their jnp twins
  ("sparrow_jax.model", "sparrow_jax.checkpoint"),
  ("sparrow_jax.sparsity",),  # the sparsity policy and the KV budget schedules
  ("sparrow_jax.rollout",),
  ("sparrow_jax.mismatch",),  # acceptance, calibration, cost model
  ("sparrow_jax.rl",),
  ("sparrow_jax.train", "sparrow_jax"),  # the CLI and the package's public API
)


def layer_of(module: str) -> int:
  """The index in LAYERS of the longest package or module name that `module` is or is inside."""
  matches = [
    (len(name), i)
    for i, names in enumerate(LAYERS)
    for name in names
    if module == name or module.startswith(name + ".")
  ]
  assert matches, f"{module} is in no layer of tests/test_architecture.LAYERS"
  return max(matches)[1]


def test_packages_import_one_way():
  graph = import_graph()
  upward = sorted(
    f"{m} -> {d}"
    for m, deps in graph.items()
    if m != "sparrow_jax"
    for d in deps
    if layer_of(d) > layer_of(m)
  )
  assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def test_layer_check_sees_an_upward_import():
  graph = {"sparrow_jax.model.qwen3": {"sparrow_jax.rl.trainer"}}
  assert layer_of("sparrow_jax.model.qwen3") < layer_of("sparrow_jax.rl.trainer")
  assert layer_of("sparrow_jax.sharding") == 0 and layer_of("sparrow_jax") == len(LAYERS) - 1
  assert [d for m, ds in graph.items() for d in ds if layer_of(d) > layer_of(m)]


MAX_PARAMS = 11  # "about ten": more is a signature that wants a component config
# sj.generate's keywords are the public API (shared/DESIGN.md: add, don't rename), one per setting
# The engine's two entry points: each argument past the model's is a component of its own (the
# requests, the engine, the sampling, the sparse config, the schedule, the adapter, the admission
# order, the draft plan, the environments' turns).
# The engine's public entry points: the model, the rows and the key, then each rollout option a
# keyword of its own (its sparse policy, exact mode, a multi-turn rollout's turns).
LONG_SIGNATURE_ALLOWED = {
  "sparrow_jax.rollout.engine.generate": 13,
  "sparrow_jax.rollout.engine.run": 12,
}


def test_no_long_signatures():
  """No library function takes more than MAX_PARAMS parameters; the grouped ones live in the
  component configs (Sampling, Requests, EngineConfig, CalibrationConfig, SparseConfig, ...).
  Pallas kernel bodies (`_kernel`) take what pallas_call hands them, one ref per operand."""
  long = []
  for module, path in _modules().items():
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, ast.FunctionDef) and node.name != "_kernel":
        a = node.args
        count = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
        if count > LONG_SIGNATURE_ALLOWED.get(f"{module}.{node.name}", MAX_PARAMS):
          long.append(f"{module}.{node.name} ({count})")
  assert not long, long


MAX_FUNCTION_LINES = 80  # a function's code, its docstring aside: what one reads in one screen
# Pallas kernels and their pallas_call wrappers: one body per kernel, the grid, specs and scratch
# declared together (JAX's own Pallas ops are written the same way).
LONG_FUNCTION_ALLOWED = {
  "kernels.sparse_decode.paged_decode_attention",
  "kernels.sparse_decode_tpu._kernel",
  "kernels.sparse_decode_tpu.paged_decode_attention",
}


def code_lines(node) -> int:
  """Lines of a function's body from its first statement after the docstring to its end."""
  body = node.body
  has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
  first = body[1] if has_doc and len(body) > 1 else body[0]
  return node.end_lineno - first.lineno + 1


def long_functions(modules) -> list:
  """module.function (lines) of every function, nested ones included, over MAX_FUNCTION_LINES."""
  long = []
  for module, path in modules.items():
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        name = f"{module}.{node.name}"
        if code_lines(node) > MAX_FUNCTION_LINES and name not in LONG_FUNCTION_ALLOWED:
          long.append(f"{name} ({code_lines(node)})")
  return long


def test_no_long_functions():
  assert not long_functions(_modules())


def test_long_function_check_sees_a_long_function(tmp_path):
  body = "\n".join(f"  x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
  (tmp_path / "m.py").write_text(f'def f():\n  """doc."""\n{body}\n\n\ndef g():\n  return 1\n')
  assert long_functions({"m": str(tmp_path / "m.py")}) == [f"m.f ({MAX_FUNCTION_LINES + 1})"]


# What assembles a run from its config: loading the task, tokenizer and weights, initialising
# params and the LoRA, the optimizers, the mesh, the train step, the hooks. Only rl/build.py calls
# these (the loop may call them through it); the hooks and the checks receive what it built.
RUN_BUILDERS = {
  "make_task",
  "load_tokenizer",
  "load_hf",
  "init_params",
  "init_lora",
  "adam",
  "adamw",
  "make_mesh",
  "init_state",
  "make_train_step",
  "Budgets",
  "ClosedLoop",
  "DraftSwitch",
  "Evaluation",
  "KVMetrics",
  "PerfMetrics",
}


def builder_calls(path) -> set:
  """The RUN_BUILDERS a module calls (by the called name's last part), other than through
  rl/build.py (`build.make_mesh(c)`)."""
  called = set()
  for node in ast.walk(ast.parse(open(path).read())):
    if isinstance(node, ast.Call):
      f = node.func
      if isinstance(f, ast.Attribute) and getattr(f.value, "id", "") != "build":
        called.add(f.attr)
      elif isinstance(f, ast.Name):
        called.add(f.id)
  return called & RUN_BUILDERS


def test_rl_builds_a_run_only_in_build_py():
  modules = _modules()
  assert builder_calls(modules["sparrow_jax.rl.build"])  # the check sees what build.py calls
  others = {
    m: sorted(builder_calls(path))
    for m, path in modules.items()
    if m.startswith("sparrow_jax.rl.") and m != "sparrow_jax.rl.build"
  }
  assert not {m: calls for m, calls in others.items() if calls}, others


def test_library_never_imports_a_plotting_package():
  """Plots are drawn by experiments/ scripts: the library sets no process-wide backend."""
  plotting = ("matplotlib", "seaborn", "plotly")
  found = []
  for module, path in _modules().items():
    for node in ast.walk(ast.parse(open(path).read())):
      names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
      if isinstance(node, ast.ImportFrom) and node.module:
        names = [node.module]
      found += [f"{module}: {n}" for n in names if n.split(".")[0] in plotting]
  assert not found, found
