"""A forked process made a program of its own: a fresh __main__ and streams, and an exit that
flushes them."""

import os
import sys
import types


def fresh_main():
  """A fresh __main__ module (so that `import __main__` finds the program, not this harness) and
  fresh buffered streams over descriptors 0-2 (the harness's own were never read or written)."""
  main_module = types.ModuleType("__main__")
  sys.modules["__main__"] = main_module
  sys.stdin, sys.stdout, sys.stderr = (
    open(fd, mode, encoding="utf-8", errors="replace", closefd=False)
    for fd, mode in ((0, "r"), (1, "w"), (2, "w"))
  )
  sys.argv = ["solution.py"]
  return main_module.__dict__


def flush_and_exit(code):
  """Flushes the program's streams and ends the process with `code` (1 for 0 if flushing fails)."""
  try:
    sys.stdout.flush()
    sys.stderr.flush()
  except BaseException:
    code = code or 1
  os._exit(code)
