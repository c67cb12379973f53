"""The :class:`Store` contract and key rules (the package docstring explains them)."""

from __future__ import annotations

import abc
import re
from typing import Any

from ...errors import InputError

# Keys name objects in every store alike: a path-like string that is safe as a Redis key, a
# Mooncake key and a file name (no "..", no leading "/", no control characters or spaces).
_KEY_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._:@=+\-/]{0,511}")


def check_key(key: Any) -> str:
    """Return ``key`` if it is a valid store key, else raise :class:`InputError` saying why.

    A key is 1-512 characters of letters, digits and ``. _ : @ = + - /``, starting with a letter,
    digit or ``_``, with no empty or ``..`` path segment.
    """
    if not isinstance(key, str):
        raise InputError(f"a store key is a str, not {type(key).__name__}")
    if not _KEY_RE.fullmatch(key):
        raise InputError(f"store key {key[:80]!r} is not 1-512 characters of letters, digits and "
                         "'._:@=+-/' starting with a letter, digit or '_'")
    if any(seg in ("", ".", "..") for seg in key.split("/")):
        raise InputError(f"store key {key[:80]!r} has an empty, '.' or '..' path segment")
    return key


def _check_data(data: Any) -> bytes:
    if isinstance(data, (bytearray, memoryview)):
        data = bytes(data)
    if not isinstance(data, bytes):
        raise InputError(f"a stored object is bytes, not {type(data).__name__}")
    return data


class Store(abc.ABC):
    """A key -> bytes store for KVC objects (module docstring: the contract)."""

    #: short name of the adapter, for messages and results
    kind: str = "store"

    @abc.abstractmethod
    def _put(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def _get(self, key: str) -> bytes | None: ...

    @abc.abstractmethod
    def _exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def _delete(self, key: str) -> bool: ...

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store ``data`` under ``key``, replacing any object there, atomically for readers."""
        self._put(check_key(key), _check_data(data))

    def get(self, key: str) -> bytes | None:
        """The bytes stored under ``key``, or ``None`` if there are none."""
        return self._get(check_key(key))

    def exists(self, key: str) -> bool:
        """Whether an object is stored under ``key``."""
        return self._exists(check_key(key))

    def delete(self, key: str) -> bool:
        """Remove the object under ``key``; return whether there was one."""
        return self._delete(check_key(key))

    def close(self) -> None:
        """Release the client's connections (the store's data stays)."""

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ KVC objects
    def put_cache(self, key: str, cache: Any, codec: Any = "kvc-near", **encode_kwargs: Any) -> int:
        """Encode ``cache`` with ``codec`` (a name, config dict or :class:`~kvcodec.codec.Codec`)
        and store the KVC bytes under ``key``; return their size in bytes."""
        from ...codec import Codec, get_codec

        c = codec if isinstance(codec, Codec) else get_codec(codec)
        blob = c.encode(cache, **encode_kwargs)
        self.put(key, blob)
        return len(blob)

    def get_cache(self, key: str, device: str = "cpu") -> Any:
        """Fetch and decode the KVC object under ``key`` (whatever codec wrote it), or ``None``.

        Raises:
            FormatError: the stored bytes are not a valid KVC file (damaged, foreign, truncated).
        """
        from ...api import decode

        blob = self.get(key)
        return None if blob is None else decode(blob, device=device)
