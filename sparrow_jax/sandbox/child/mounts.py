"""The program's file system: a new read-only root holding only the interpreter, its libraries, a
few devices, a fresh /proc and private size-capped /tmp and /dev/shm, pivoted into so that no path
leads back to the host's files."""

import ctypes
import os
import stat

import syscalls

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC = 4096, 16384
MS_PRIVATE, MS_RELATIME, MS_STRICTATIME = 1 << 18, 1 << 21, 1 << 24
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # glibc has no wrapper
# What the program's root holds besides the interpreter's own directories (job["python_paths"]): the
# shared libraries that the interpreter and its extension modules load. Missing ones are skipped;
# top-level symlinks (merged /usr: /lib -> usr/lib) are recreated as symlinks.
SYSTEM_PATHS = (
  "/usr",
  "/bin",
  "/sbin",
  "/lib",
  "/lib32",
  "/lib64",
  "/libx32",
  "/etc/ld.so.cache",
  "/etc/localtime",
)
DEVICES = ("null", "zero", "full", "random", "urandom")


def _mount(source, target, fstype, flags, data=None):
  enc = lambda s: None if s is None else s.encode()
  syscalls.call("mount", enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))


def others_can_enter(path):
  """Whether a uid with no special rights can traverse every directory down to `path` and read
  it."""
  parts = os.path.realpath(path).split(os.sep)
  for i in range(1, len(parts) + 1):
    mode = os.stat(os.sep.join(parts[:i]) or os.sep).st_mode
    if not mode & stat.S_IXOTH:
      return os.sep.join(parts[:i]) or os.sep
  return None if os.stat(path).st_mode & stat.S_IROTH else path


def _bind_read_only(source, target):
  _mount(source, target, None, MS_BIND | MS_REC)
  # A remount must repeat the flags that a user namespace locked on the source mount (EPERM
  # otherwise); these ST_ statvfs flags have the values of their MS_ mount flags, the atime modes do
  # not.
  flags = os.statvfs(target).f_flag
  kept = flags & (os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME)
  atime = 0 if flags & os.ST_NOATIME else MS_RELATIME if flags & os.ST_RELATIME else MS_STRICTATIME
  _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV | kept | atime)


def _expose(root, paths, optional, uid):
  """Bind-mounts each of `paths` read-only at its own path under `root` (the interpreter's RUNPATH
  and sys.path stay valid), creating the directories on the way in root's tmpfs with mode 0755, so
  that a directory others may not enter (pyenv or conda under a 0700 /root) hides nothing but the
  rest of it. A missing path is skipped if `optional`, else an error, as is one that `uid` (if not
  None) could not read. Returns the paths exposed."""
  exposed = []
  for path in paths:
    target = root + path
    if os.path.islink(path) and os.path.dirname(path) == os.sep:
      os.symlink(os.readlink(path), target)
      continue
    if not os.path.exists(path):
      if optional:
        continue
      raise OSError(f"{path} does not exist, so the sandbox cannot expose it")
    if uid is not None and others_can_enter(path) == path:
      raise OSError(f"{path} itself is not readable by others, so sandbox uid {uid} cannot use it")
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if os.path.isdir(path):
      os.makedirs(target, mode=0o755, exist_ok=True)
    elif not os.path.exists(target):
      os.close(os.open(target, os.O_CREAT | os.O_WRONLY, 0o644))
    _bind_read_only(path, target)
    exposed.append(path)
  return exposed


def _pivot(root):
  """Makes `root` the root of the mount namespace and detaches the old one: unlike chroot, no path
  and no chroot escape leads back to the host's files."""
  number = SYS_PIVOT_ROOT.get(os.uname().machine)
  if number is None:
    raise OSError(f"no pivot_root syscall number known for machine {os.uname().machine!r}")
  os.chdir(root)
  syscalls.call("syscall", ctypes.c_long(number), b".", b".")  # the old root ends up stacked on "/"
  syscalls.call("umount2", b".", MNT_DETACH)
  os.chdir("/")


def mount_private(job, info):
  """The program's whole file system: a new read-only root (a tmpfs mounted over our work directory)
  holding read-only binds of the interpreter, its libraries and SYSTEM_PATHS, a few devices, a fresh
  /proc of the new pid namespace and size-capped tmpfs /tmp and /dev/shm; nothing else of the host
  (project tree, data, home directories, other runs' temp files) exists in it."""
  _mount(None, "/", None, MS_REC | MS_PRIVATE)
  root = os.getcwd()
  _mount("tmpfs", root, "tmpfs", MS_NOSUID, "size=1m,mode=0755")
  # The temp directories first: the checkout or venv may live under /tmp, exposed on top of them.
  for path in ("/tmp", "/dev/shm"):
    os.makedirs(root + path, mode=0o755)
    _mount(
      "tmpfs", root + path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={job['tmpfs_mb']}m,mode=1777"
    )
  info["private_tmp"] = True
  info["exposed"] = _expose(root, job["python_paths"], optional=False, uid=job["uid"])
  _expose(root, SYSTEM_PATHS, optional=True, uid=None)
  # Each exposed site-packages becomes an empty directory holding only the solution packages.
  info["solution_packages"] = []
  for site in job["site_packages"]:
    if os.path.isdir(root + site):
      _mount("tmpfs", root + site, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
      inside = [p for p in job["solution_paths"] if p.startswith(site + os.sep)]
      info["solution_packages"] += _expose(root, inside, optional=False, uid=job["uid"])
      _mount(None, root + site, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
  for name in DEVICES:
    os.close(os.open(f"{root}/dev/{name}", os.O_CREAT | os.O_WRONLY, 0o666))
    _mount(f"/dev/{name}", f"{root}/dev/{name}", None, MS_BIND)
  for name, fd in (("stdin", 0), ("stdout", 1), ("stderr", 2)):
    os.symlink(f"/proc/self/fd/{fd}", f"{root}/dev/{name}")
  os.symlink("/proc/self/fd", f"{root}/dev/fd")
  os.mkdir(root + "/proc", 0o555)
  _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
  info["private_proc"] = True
  _pivot(root)
  _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID)
  info["private_root"] = True
  # Work in the size-capped tmpfs, so that files a program writes cannot fill the disk either.
  os.mkdir("/tmp/work", 0o700)
  if job["uid"] is not None:
    os.chown("/tmp/work", job["uid"], job["uid"])
  os.chdir("/tmp/work")
