"""Files and object stores as a KVC object store, through fsspec.

A key is a relative path under the root (``root/key``). On a local filesystem a put writes a
temporary file beside the target and renames it over the target (``os.replace``: atomic on POSIX),
so readers never see a partial object; object stores (S3, GCS, ...) replace an object atomically
with one PUT, which is what ``pipe_file`` does there.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from ...errors import DependencyError, StoreError
from .base import Store


def _fsspec() -> Any:
    try:
        import fsspec
    except ImportError:
        raise DependencyError("the file/object store needs fsspec; install it with pip install 'kvcodec[fsspec]'") from None
    return fsspec


class FsspecStore(Store):
    """KVC objects as files under ``root`` (a local path or any fsspec URL).

    Args:
        root: a directory path or URL (``/var/cache/kvc``, ``file:///...``, ``s3://bucket/kvc``).
        storage_options: passed to the fsspec filesystem (credentials, endpoint, ...).
    """

    kind = "fsspec"

    def __init__(self, root: str, **storage_options: Any) -> None:
        fsspec = _fsspec()
        try:
            self.fs, path = fsspec.core.url_to_fs(root, **storage_options)
        except (ValueError, ImportError) as e:
            raise StoreError(f"fsspec cannot open {root!r}: {e}") from e
        self.root = path.rstrip("/")
        protocols = self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,)
        self.local = "file" in protocols or "local" in protocols
        try:
            self.fs.makedirs(self.root or "/", exist_ok=True)
        except OSError as e:
            raise StoreError(f"cannot create the store directory {root!r}: {e}") from e

    def _path(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def _put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        try:
            parent = path.rpartition("/")[0]
            if parent:
                self.fs.makedirs(parent, exist_ok=True)
            if self.local:
                tmp = f"{path}.tmp-{uuid.uuid4().hex}"
                try:
                    with open(tmp, "wb") as f:
                        f.write(data)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, path)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            else:
                self.fs.pipe_file(path, data)
        except OSError as e:
            raise StoreError(f"writing {path!r} failed: {e}") from e

    def _get(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            return self.fs.cat_file(path)
        except FileNotFoundError:
            return None
        except IsADirectoryError as e:
            raise StoreError(f"{path!r} is a directory, not a stored object") from e
        except OSError as e:
            raise StoreError(f"reading {path!r} failed: {e}") from e

    def _exists(self, key: str) -> bool:
        return bool(self.fs.isfile(self._path(key)))

    def _delete(self, key: str) -> bool:
        path = self._path(key)
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise StoreError(f"deleting {path!r} failed: {e}") from e
        return True
