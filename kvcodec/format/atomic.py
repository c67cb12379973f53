"""Atomic file writes: a good file is never replaced by a partial one."""

from __future__ import annotations

import os
import tempfile
from typing import Iterable


def atomic_write_chunks(path: str | os.PathLike[str], chunks: Iterable[bytes | memoryview]) -> int:
    """Write ``chunks`` to a temporary file beside ``path``, fsync it, then rename it over ``path``.

    Returns the number of bytes written. On any error the temporary file is removed and the
    old ``path`` (if any) is left untouched.
    """
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".kvc-", suffix=".tmp", dir=d)
    n = 0
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file the usual mode
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
                n += len(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:  # make the rename durable too
        dfd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return n


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> int:
    """Atomically replace ``path`` with ``data``."""
    return atomic_write_chunks(path, [data])
