"""Redis (and any RESP server: Valkey, KeyDB) as a KVC object store, through redis-py.

One object is one Redis string: ``SET`` replaces it atomically, so readers see the old object or
the new one; redis-py's connection pool makes one :class:`RedisStore` safe for concurrent readers
in threads. Objects are limited by the server's ``proto-max-bulk-len`` (512 MB by default).
"""

from __future__ import annotations

from typing import Any

from ...errors import DependencyError, StoreError
from .base import Store


def _redis() -> Any:
    try:
        import redis
    except ImportError:
        raise DependencyError("the Redis store needs redis-py; install it with pip install 'kvcodec[redis]'") from None
    return redis


class RedisStore(Store):
    """KVC objects in Redis, under ``prefix + key``.

    Args:
        client: a ``redis.Redis`` client (its ``decode_responses`` must be off).
        prefix: prepended to every key (a namespace such as ``"kvc/"``).
    """

    kind = "redis"

    def __init__(self, client: Any, prefix: str = "") -> None:
        if getattr(client, "get_encoder", None) and client.get_encoder().decode_responses:
            raise StoreError("the Redis client decodes responses to str; KVC objects need bytes "
                             "(create it with decode_responses=False)")
        self.client = client
        self.prefix = prefix

    @classmethod
    def from_url(cls, url: str, prefix: str = "", **client_options: Any) -> "RedisStore":
        """A store on the server ``url`` names (``redis://host:port/db``), checked with a PING."""
        redis = _redis()
        client = redis.Redis.from_url(url, **client_options)
        try:
            client.ping()
        except redis.exceptions.RedisError as e:
            client.close()
            raise StoreError(f"Redis at {url} did not answer PING: {e}") from e
        return cls(client, prefix=prefix)

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        redis = _redis()
        try:
            return fn(*args)
        except redis.exceptions.RedisError as e:
            raise StoreError(f"Redis {what} {args[0]!r} failed: {e}") from e

    def _put(self, key: str, data: bytes) -> None:
        self._call("SET", self.client.set, self.prefix + key, data)

    def _get(self, key: str) -> bytes | None:
        return self._call("GET", self.client.get, self.prefix + key)

    def _exists(self, key: str) -> bool:
        return bool(self._call("EXISTS", self.client.exists, self.prefix + key))

    def _delete(self, key: str) -> bool:
        return bool(self._call("DEL", self.client.delete, self.prefix + key))

    def stored_bytes(self, key: str) -> int:
        """Bytes the server holds for the object's value (``STRLEN``; 0 if missing)."""
        return int(self._call("STRLEN", self.client.strlen, self.prefix + key))

    def close(self) -> None:
        self.client.close()
