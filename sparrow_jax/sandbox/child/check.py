"""Script mode's check process, which runs no candidate code: the trusted check with the
candidate's functions bound to proxies that pass plain data only."""

import builtins
import json
import os
import signal

import descriptors
import program
import wire

SECRET_BYTES = 1 << 26  # most the check's source and token may take


class BrokenCandidate(BaseException):
  """The candidate's process died or broke the protocol. A BaseException, so that `except Exception`
  in a check does not swallow it; the check fails even where a bare `except:` does."""


def _exception(type_name, message):
  """The exception a candidate's function raised, rebuilt as the builtin type the reply names."""
  cls = getattr(builtins, type_name, None)
  if not (isinstance(cls, type) and issubclass(cls, Exception)):
    raise ValueError(f"the candidate raised {type_name!r}, not a builtin Exception type")
  if issubclass(
    cls, (StopIteration, StopAsyncIteration)
  ):  # would end a check's `for x in map(f, ...)`
    return RuntimeError(f"the candidate raised {type_name}: {message}")
  try:
    return cls(message)
  except Exception:  # a type whose constructor wants more (UnicodeDecodeError, ExceptionGroup)
    return Exception(f"{type_name}: {message}")


class _Candidate:
  """The check's handle on the case process: arguments and return values cross as plain data and
  exceptions as a builtin type and message. Anything else (a dead process, a malformed or non-plain
  reply) marks the candidate broken for good, which fails the check."""

  def __init__(self, requests_fd, replies_fd, limit):
    self.requests_fd, self.replies_fd, self.limit = requests_fd, replies_fd, limit
    self.broken = None

  def function(self, name):
    def call(*args, **kwargs):
      return self.call(name, args, kwargs)

    call.__name__ = call.__qualname__ = name
    return call

  def call(self, name, args, kwargs):
    if self.broken is None:
      try:
        wire.send(self.requests_fd, (name, args, kwargs))
        reply = wire.receive(self.replies_fd, self.limit)
        if type(reply) is tuple and len(reply) == 2 and reply[0] == "return":
          return reply[1]
        if (
          type(reply) is tuple and len(reply) == 3 and reply[0] == "raise" and type(reply[2]) is str
        ):
          error = _exception(reply[1], reply[2])
        else:
          raise ValueError(f"malformed reply {reply!r:.200}")
      except Exception as e:
        self.broken = f"call of {name}: {type(e).__name__}: {e}"
      else:
        raise error
    raise BrokenCandidate(self.broken)


def run(job):
  """In the check process, which runs no candidate code: the trusted prefix and check script, with
  the candidate's functions bound to proxies. Writes the token (descriptor 3) only if the check ran
  to its end and every call came back well-formed. Descriptors: 0-2 stdio, 3 verdict, 4 requests
  out, 5 replies in, 6 the check's source and token."""
  code = 1
  try:
    # The candidate (same uid) may signal us: blocked, a signal can only kill or stop us, which
    # fails.
    signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    secret = json.loads(descriptors.read(6, SECRET_BYTES))
    os.close(6)
    namespace = program.fresh_main()
    exec(compile(job["prefix"], "prefix.py", "exec"), namespace)
    candidate = _Candidate(4, 5, job["output_bytes"])
    namespace.update({name: candidate.function(name) for name in job["names"]})
    exec(compile(secret["script"], "check.py", "exec"), namespace)
    if candidate.broken is not None:  # the check caught BrokenCandidate
      raise BrokenCandidate(candidate.broken)
    os.write(3, secret["token"].encode())
    code = 0
  except BaseException:  # a failed assertion, or any error: no token
    import traceback

    traceback.print_exc()
  finally:
    program.flush_and_exit(code)
