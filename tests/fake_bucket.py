"""A fake object store for epath: `fake://bucket/key` URLs over the local folder named by
$SPARROW_FAKE_BUCKET, so that processes share it and no network is needed.

It behaves as an object store where the trainer could tell: no append, a rename is a copy then a
delete (not atomic), a written object appears whole on close (an upload), and no flock (nothing
here offers one). It does not model eventual listing or object-store directories (a folder is a
real folder). tensorstore, which writes orbax's arrays with its own drivers (file, gcs, s3) and not
through epath, is pointed at the same folder (`install`), so a checkpoint's array bytes land in
the bucket too; every other checkpoint file (metadata, the commit's rename) goes through epath.

Import and call `install()` in each process that uses fake:// paths.
"""

import io
import os
import tempfile

from etils.epath import backend, gpath, register
import fsspec
from fsspec.implementations.local import LocalFileSystem
from orbax.checkpoint._src.serialization import tensorstore_utils

SCHEME = "fake"
ROOT_VAR = "SPARROW_FAKE_BUCKET"


def local(url: str) -> str:
  """The bucket folder's path of `url` (fake://a/b -> $SPARROW_FAKE_BUCKET/objects/a/b)."""
  key = str(url).removeprefix(f"{SCHEME}://").removeprefix(f"/{SCHEME}/").lstrip("/")
  return os.path.join(os.environ[ROOT_VAR], "objects", key)


def _key(path: str) -> str:
  """The key of the bucket folder's `path` (the inverse of `local`)."""
  return os.path.relpath(path, os.path.join(os.environ[ROOT_VAR], "objects"))


class _Upload(io.BytesIO):
  """A written object: buffered, then put in place whole on close."""

  def __init__(self, path: str):
    super().__init__()
    self.path = path

  def close(self):
    if not self.closed:
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      with tempfile.NamedTemporaryFile(dir=os.environ[ROOT_VAR], delete=False) as f:
        f.write(self.getvalue())
      os.replace(f.name, self.path)
    super().close()


class FakeBucketFS(LocalFileSystem):
  protocol = SCHEME

  @classmethod
  def _strip_protocol(cls, path):
    return local(path) if str(path).startswith(f"{SCHEME}://") else super()._strip_protocol(path)

  def _open(self, path, mode="rb", **kwargs):
    if "a" in mode or "+" in mode:
      raise NotImplementedError(f"an object store has no append ({path!r}, mode {mode!r})")
    if "w" in mode:
      return _Upload(self._strip_protocol(path))
    return super()._open(path, mode, **kwargs)

  def glob(self, path, **kwargs):  # keys, as epath prefixes them with fake://
    return [_key(p) for p in super().glob(path, **kwargs)]

  def mv(self, path1, path2, recursive=False, **kwargs):
    self.copy(path1, path2, recursive=True)
    self.rm(path1, recursive=True)


class _Backend(backend._FileSystemSpecBackend):  # epath's fsspec backend, on this file system
  def fs(self, path):
    return FakeBucketFS()


def _tensorstore_path(normalize):
  """orbax's path normalizer, mapping fake:// to the bucket's folder for tensorstore."""
  return lambda path: normalize(local(path) if str(path).startswith(f"{SCHEME}:/") else path)


def install() -> None:
  """Registers fake:// with epath (as gpath does gs://) and with fsspec; points tensorstore's
  writes of orbax arrays at the bucket's folder."""
  if SCHEME in gpath._URI_SCHEMES:
    return
  prefix = f"{SCHEME}://"
  gpath._URI_PREFIXES += (prefix,)
  gpath._URI_SCHEMES = gpath._URI_SCHEMES | {SCHEME}
  gpath._URI_MAP_ROOT[prefix] = f"/{SCHEME}/"
  gpath._PREFIX_TO_BACKEND[SCHEME] = _Backend()
  register.register_path_cls(prefix)(gpath.PosixGPath)
  fsspec.register_implementation(SCHEME, FakeBucketFS, clobber=True)
  tensorstore_utils._normalize_path = _tensorstore_path(tensorstore_utils._normalize_path)


def bucket(tmp_path, monkeypatch) -> str:
  """A fresh bucket for a test: its root folder in $SPARROW_FAKE_BUCKET, the fake installed."""
  monkeypatch.setenv(ROOT_VAR, str(tmp_path / "bucket"))
  os.makedirs(os.path.join(tmp_path, "bucket", "objects"))
  install()
  return f"{SCHEME}://bucket"
