"""What the harness gives up before it runs a program: nested user namespaces, the keys, setuid
gains, its uid, its capabilities, being dumpable; and the limit on its processes."""

import ctypes
import os
import resource

import mounts
import seccomp
import syscalls

_LINUX_CAPABILITY_VERSION_3 = 0x20080522
# Imported before the uid drop in the explicit fallback without namespaces (no mount namespace to
# expose the interpreter) when the interpreter's files are not readable by the sandbox uid; reported
# as "preimported_only" in the isolation facts.
PREIMPORT = (
  "array",
  "bisect",
  "collections",
  "copy",
  "dataclasses",
  "datetime",
  "decimal",
  "enum",
  "fractions",
  "functools",
  "heapq",
  "itertools",
  "math",
  "operator",
  "queue",
  "random",
  "re",
  "statistics",
  "string",
  "traceback",
  "typing",
)


def close_user_namespaces(mapped_fd):
  """In the harness, in a user namespace of its own that init mapped (see init._fork_harness): its
  limit of user namespaces goes to 0. The kernel checks that limit of every ancestor when one is
  created, so the program can create none (no unshare(CLONE_NEWUSER) to regain capabilities, mount
  or pivot), and, without capabilities in this namespace, cannot raise the limit again."""
  if os.read(mapped_fd, 1) != b"m":
    raise OSError("init did not map the harness's user namespace")
  with open("/proc/sys/user/max_user_namespaces", "w") as f:
    f.write("0")


def drop_capabilities():
  """Empties every capability set (a uid change does that only from root to non-root; a caller uid
  stays 0 in its user namespace). No new privileges then keeps an execve from getting any back."""
  header = (ctypes.c_uint32 * 2)(_LINUX_CAPABILITY_VERSION_3, 0)
  syscalls.call("capset", header, (ctypes.c_uint32 * 6)())


def give_up(job, info):
  """Drops every privilege that the program must not have, in the order that allows each drop;
  records what it did in `info` (the isolation facts)."""
  if job["uid"] is not None and "exposed" not in info:  # the explicit fallback: no mount namespace
    if any(mounts.others_can_enter(p) for p in job["python_paths"]):
      for name in PREIMPORT:
        __import__(name)
      info["preimported_only"] = True
  # No setuid binary (su, sudo, ...) may give the program back any privilege.
  syscalls.call("prctl", syscalls.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
  info["seccomp_keys"] = seccomp.close_keyrings()
  if job["uid"] is not None:
    os.setgroups([])
    os.setgid(job["uid"])
    os.setuid(job["uid"])
  if "user_namespaces" in info:
    drop_capabilities()
  # Files the program creates in a shared /tmp (the fallback's) stay unreadable to concurrent runs.
  os.umask(0o077)
  # Explicit (a uid change does it only while fs.suid_dumpable is 0): a process of the sandbox uid
  # may not ptrace or read /proc/<pid>/{mem,fd} of this harness or of the processes it forks.
  syscalls.call("prctl", syscalls.PR_SET_DUMPABLE, 0, 0, 0, 0)
  # RLIMIT_NPROC counts every process of the real uid: enforceable for a uid of our own (root drops
  # to one) or inside a new user namespace, not for a caller uid shared with the trainer's own
  # threads.
  if job["uid"] is not None or info["userns"]:
    resource.setrlimit(resource.RLIMIT_NPROC, (job["nproc"], job["nproc"]))
    info["nproc"] = job["nproc"]
  info["uid"] = os.getuid()
