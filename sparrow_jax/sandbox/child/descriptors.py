"""The descriptors of a case's processes: memory files for their streams, read back from the start,
and placed at 0, 1, 2, ... in a forked process."""

import fcntl
import os


def read(fd, limit):
  """Up to `limit` bytes of `fd` from its start, as text (undecodable bytes replaced)."""
  os.lseek(fd, 0, os.SEEK_SET)
  chunks, left = [], limit
  while left > 0:
    chunk = os.read(fd, min(left, 1 << 16))
    if not chunk:
      break
    chunks.append(chunk)
    left -= len(chunk)
  return b"".join(chunks).decode("utf-8", "replace")


def memfd(name, content=b""):
  """A new memory file named `name` holding `content`, read from its start."""
  fd = os.memfd_create(name, 0)
  os.write(fd, content)
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


def place(fds):
  """Puts fds[i] at descriptor i and closes every other one. Copies above the targets come first, so
  that no source is overwritten before it is placed."""
  high = [fcntl.fcntl(fd, fcntl.F_DUPFD, len(fds)) for fd in fds]
  for target, fd in enumerate(high):
    os.dup2(fd, target)
  os.closerange(len(fds), 1 << 16)
