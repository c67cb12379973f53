"""Atomic file writes: a good file is never replaced by a partial one.

Example:
    >>> import os, tempfile
    >>> p = os.path.join(tempfile.mkdtemp(), "x.bin")
    >>> atomic_write_bytes(p, b"hello")
    5
    >>> os.path.getsize(p)
    5
"""

from __future__ import annotations

import os
import tempfile
from typing import Iterable

from ..errors import InputError


def atomic_write_chunks(path: str | os.PathLike[str], chunks: Iterable[bytes | memoryview]) -> int:
    """Write ``chunks`` to a temporary file beside ``path``, fsync it, then rename it over ``path``.

    Returns the number of bytes written. On any error the temporary file is removed and the
    old ``path`` (if any) is left untouched.

    Raises:
        InputError: the destination cannot be written (missing directory, permissions, disk full).
    """
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".kvc-", suffix=".tmp", dir=d)
    except OSError as e:
        raise InputError(f"cannot write {path}: {e.strerror or e}") from None
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
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise InputError(f"cannot write {path}: {e.strerror or e}") from None
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
    """The process umask, read without changing it where /proc allows (no race with threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> int:
    """Atomically replace ``path`` with ``data``; return the number of bytes written."""
    return atomic_write_chunks(path, [data])
