"""The case process: runs the candidate program as the job's mode asks (stdio, a call of its
function, or serving a script-mode check's calls)."""

import builtins
import json
import os
import sys

import program
import wire

# Audit events refused to the program when no network namespace could be made: a Python-level
# fallback that native code could bypass, hence the ctypes and process-launch events too.
AUDIT_BLOCKED = frozenset(
  (
    "socket.bind",
    "socket.connect",
    "socket.sendto",
    "socket.sendmsg",
    "socket.getaddrinfo",
    "ctypes.dlopen",
    "ctypes.dlsym",
    "ctypes.call_function",
    "os.system",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "subprocess.Popen",
  )
)


def _refuse_network(event, args):
  if event in AUDIT_BLOCKED:
    raise PermissionError(f"sandbox: {event} is not allowed")


def _lookup(namespace, fn_name):
  """The program's function `fn_name`, or the method of that name of its class Solution."""
  holder = namespace.get("Solution")
  return getattr(holder(), fn_name) if hasattr(holder, fn_name) else namespace[fn_name]


def _builtin_base(cls):
  """The name of the nearest builtin class of an exception type (the check rebuilds that one)."""
  return next(c.__name__ for c in cls.__mro__ if getattr(builtins, c.__name__, None) is c)


def _serve(namespace, requests_fd, replies_fd):
  """In the case process, once the program ran: answers the check's calls until it hangs up."""
  while True:
    try:
      name, args, kwargs = wire.receive(requests_fd, sys.maxsize)
    except EOFError:
      return
    try:
      result = _lookup(namespace, name)(*args, **kwargs)
      reply = (
        ("return", result)
        if wire.plain(result)
        else ("invalid", f"{name} returned a {type(result).__name__}, which is not plain data")
      )
    except Exception as e:  # the check may expect it; a BaseException ends this process instead
      reply = ("raise", _builtin_base(type(e)), str(e))
    wire.send(replies_fd, reply)


def run(job, case):
  """In the case process: executes the program as the job's mode asks. Never returns.
  Descriptors: 0-2 stdio; call mode: 3 the result; script mode: 3 requests in, 4 replies out."""
  code = 1
  try:
    if job["audit_network"]:
      sys.addaudithook(_refuse_network)
    namespace = program.fresh_main()
    if job["mode"] == "call":
      exec(compile(job["program"], "solution.py", "exec"), namespace)
      fn = _lookup(namespace, job["fn_name"])
      result = fn(*case) if isinstance(case, list) else fn(case)
      os.write(3, json.dumps(result, default=repr).encode())
    elif job["mode"] == "stdio":
      exec(compile(job["program"], "solution.py", "exec"), namespace)
    else:
      exec(compile("\n".join([job["prefix"], job["program"]]), "solution.py", "exec"), namespace)
      _serve(namespace, 3, 4)
    code = 0
  except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
  except BaseException:  # the program's own failure: report it like a crash, with its traceback
    import traceback

    traceback.print_exc()
  finally:
    program.flush_and_exit(code)
