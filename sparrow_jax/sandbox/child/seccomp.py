"""The kernel's key store closed to the program: a new empty session keyring, and a seccomp filter
that also kills a syscall made through another architecture's table."""

import ctypes
import errno
import os

import syscalls

# The kernel key syscalls (add_key, request_key, keyctl) and the seccomp audit arch, per machine.
KEY_SYSCALLS = {"x86_64": ((248, 249, 250), 0xC000003E), "aarch64": ((217, 218, 219), 0xC00000B7)}
KEYCTL_JOIN_SESSION_KEYRING, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 22, 2
SECCOMP_RET_KILL_PROCESS = 0x80000000


def close_keyrings():
  """A new empty session keyring (the grader's keys stay out of reach), then a seccomp filter that
  fails add_key, request_key and keyctl with EPERM (and every x32-ABI syscall on x86_64, which would
  reach them under other numbers) and kills the process on a syscall of any other architecture
  (i386's int 0x80 on x86_64, arm32 on aarch64: other tables, other numbers). Returns whether the
  filter is in place (False on a machine with no known syscall numbers, or where seccomp is refused:
  the new keyring still holds)."""
  numbers, arch = KEY_SYSCALLS.get(os.uname().machine, ((), None))
  if numbers:
    syscalls.libc.syscall(
      ctypes.c_long(numbers[2]), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), None
    )
  if arch is None:
    return False
  ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
  allow, refuse, kill = 0x7FFF0000, 0x00050000 | errno.EPERM, SECCOMP_RET_KILL_PROCESS
  add_key, request_key, keyctl = numbers
  program = [
    (ld, 0, 0, 4),
    (jeq, 1, 0, arch),
    (ret, 0, 0, kill),  # another arch (int 0x80, compat entry points): its own syscall numbers
    (ld, 0, 0, 0),
    (jge, 4, 0, 0x40000000),
    (jeq, 3, 0, add_key),
    (jeq, 2, 0, request_key),
    (jeq, 1, 0, keyctl),
    (ret, 0, 0, allow),
    (ret, 0, 0, refuse),
  ]

  class Filter(ctypes.Structure):
    _fields_ = [
      ("code", ctypes.c_uint16),
      ("jt", ctypes.c_uint8),
      ("jf", ctypes.c_uint8),
      ("k", ctypes.c_uint32),
    ]

  class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

  filters = (Filter * len(program))(*[Filter(*f) for f in program])
  try:
    syscalls.call(
      "prctl",
      PR_SET_SECCOMP,
      SECCOMP_MODE_FILTER,
      ctypes.byref(Program(len(program), filters)),
      0,
      0,
    )
  except OSError:
    return False
  return True
