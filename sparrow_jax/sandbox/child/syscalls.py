"""The Linux calls that the os module lacks, made through libc, and the flags they take."""

import ctypes
import os

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38

libc = ctypes.CDLL(None, use_errno=True)


def call(name, *args):
  """Calls libc's `name`; a nonzero return raises OSError with its errno."""
  if getattr(libc, name)(*args) != 0:
    err = ctypes.get_errno()
    raise OSError(err, f"{name}: {os.strerror(err)}")
