"""Mooncake Store (a distributed in-memory KV cache pool) as a KVC object store.

The store is a ``mooncake_master`` plus clients that each lend memory (``global_segment_size``) to
a shared pool; :class:`MooncakeStore` is one such client, through ``MooncakeDistributedStore``
(``pip install 'kvcodec[mooncake]'``; the CPU build needs the Debian/Ubuntu packages
``libibverbs1 librdmacm1 libnuma1`` even with ``protocol="tcp"``). Semantics, as measured on
mooncake-transfer-engine 0.3.13:

* a put is NOT atomic for readers when the object changes size. Mooncake's ``put`` on an
  existing key returns success and keeps the OLD value, and its ``upsert`` of a new size leaks
  the old object's space in the pool for good (0.3.13: the master's allocated bytes never shrink
  back, and the pool ends up refusing puts). So a put of the same size upserts in place (readers
  that meet the object while it is written wait for it; in the tests they always got the old or
  the new object), and a put of another size force-removes the old object, then puts the new
  one: a reader in between gets ``None`` (a cache miss), and a reader whose copy was in flight
  can get torn bytes when the new object lands where the old one was (seen in the tests).
  :meth:`~Store.get_cache` refuses those (KVC checksums: :class:`~kvcodec.errors.FormatError`),
  so use it, or never replace a key that is being read (content-addressed keys, the usual KV
  cache practice, are written once). Two writers racing on one key leave one of the objects;
* a get of a missing key returns no bytes, which is told from a stored object by asking
  ``get_size``; Mooncake cannot hold an empty object, so an empty ``data`` is refused
  (:class:`~kvcodec.errors.InputError`; KVC objects are never empty). ``exists`` says ``False``
  while an object is being written;
* a delete is a forced ``remove``: a get (and a put) grants a lease (the master's
  ``--default_kv_lease_ttl``, 5 s by default) which would otherwise refuse the removal; a reader
  racing a delete gets ``None``, or torn bytes if a new object reuses the space at once (above);
* an object must fit the client's local buffer (``local_buffer_size``) and one segment of the
  pool; a larger one is refused with :class:`StoreError`;
* it is a cache, not a durable store: the master evicts objects silently to make room (only
  objects whose lease has run out), objects in a client's segment leave the pool when that
  client closes, and all objects are lost when the master stops. A ``get`` returns ``None`` for
  an evicted object, so callers treat a miss as "recompute", never as an error;
* a put into a full pool fails with code -200 (NO_AVAILABLE_HANDLE), which makes the master
  evict: the store tries again for ``retry_s`` (1 s) before it raises :class:`StoreError`. A pool
  full of objects written or read within the lease TTL has nothing to evict until their leases
  run out: set ``retry_s`` above the TTL to wait that out;
* every other negative return code of the client becomes a :class:`StoreError` naming the code.

One :class:`MooncakeStore` is safe for concurrent readers and writers in threads. Close it
before the master stops: a client whose master is gone takes seconds per call, and its
``close`` waits for its own timeouts.
"""

from __future__ import annotations

import socket
import time
from typing import Any
from urllib.parse import urlsplit

from ...errors import ConfigError, DependencyError, InputError, StoreError
from .base import Store

# Mooncake's ErrorCode (mooncake-store/include/types.h), the ones a client meets.
_CODES = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE: no room in the pool", -400: "INVALID_KEY", -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT", -700: "INVALID_WRITE", -701: "INVALID_READ",
    -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL: master unreachable?", -901: "RPC_TIMEOUT",
}
_NOT_FOUND = -704
_NOT_READY = -703
_NO_ROOM = -200

MiB = 1 << 20


def _code(rc: int) -> str:
    name = _CODES.get(rc)
    return f"{rc} ({name})" if name else str(rc)


def _mooncake() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise DependencyError(
            "the Mooncake store needs Mooncake's client; install it with pip install 'kvcodec[mooncake]' "
            f"(and on Linux the packages libibverbs1 librdmacm1 libnuma1): {e}") from None
    return MooncakeDistributedStore


def _master_address(url: str) -> tuple[str, int]:
    """``(host, port)`` of a ``mooncake://HOST:PORT`` URL, or :class:`ConfigError` saying why not."""
    if not isinstance(url, str):
        raise ConfigError(f"a Mooncake URL is a str, not {type(url).__name__}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise ConfigError(f"bad Mooncake URL {url!r} ({e}); expected mooncake://MASTER_HOST:PORT") from None
    if parts.scheme.lower() != "mooncake":
        raise ConfigError(f"a Mooncake URL starts with mooncake://, not {url!r}")
    if (not parts.hostname or port is None or port == 0 or parts.username is not None
            or parts.password is not None or parts.path not in ("", "/") or parts.query or parts.fragment):
        raise ConfigError(f"bad Mooncake URL {url!r}; expected mooncake://MASTER_HOST:PORT (the master's "
                          "RPC address, e.g. mooncake://127.0.0.1:50051)")
    return parts.hostname, port


class MooncakeStore(Store):
    """KVC objects in Mooncake Store, under ``prefix + key``.

    Args:
        client: a ``mooncake.store.MooncakeDistributedStore`` whose ``setup`` succeeded; the
            store closes it in :meth:`close`.
        prefix: prepended to every key (a namespace such as ``"kvc/"``).
        max_object_size: the client's ``local_buffer_size`` if known: larger objects are refused
            before they reach the client.
        retry_s: how long an operation waits out a passing state of the pool before it raises
            :class:`StoreError`: a put while the pool has no room (code -200; a failed allocation
            makes the master evict), a get while the object is being written (code -703).
    """

    kind = "mooncake"

    def __init__(self, client: Any, prefix: str = "", max_object_size: int | None = None,
                 retry_s: float = 1.0) -> None:
        self.client = client
        self.prefix = prefix
        self.max_object_size = max_object_size
        self.retry_s = retry_s
        self.master = "?"
        self._closed = False

    @classmethod
    def from_url(cls, url: str, prefix: str = "", local_hostname: str = "127.0.0.1",
                 metadata_server: str = "P2PHANDSHAKE", protocol: str = "tcp",
                 global_segment_size: int = 512 * MiB, local_buffer_size: int = 256 * MiB,
                 device_name: str = "", connect_timeout: float = 5.0,
                 retry_s: float = 1.0) -> "MooncakeStore":
        """A client of the master ``url`` names (``mooncake://MASTER_HOST:PORT``).

        Args:
            local_hostname: this client's address as the other clients reach it (not loopback
                when the pool spans machines).
            metadata_server: ``"P2PHANDSHAKE"`` (no metadata server), or an ``http://`` /
                ``etcd://`` metadata server address.
            protocol: ``"tcp"``, or ``"rdma"`` with ``device_name`` (e.g. ``"mlx5_0"``).
            global_segment_size: bytes this client lends to the pool (0: lends none).
            local_buffer_size: bytes of this client's transfer buffer: the largest object it
                can put or get.
            connect_timeout: seconds to wait for the master's TCP port before giving up; Mooncake's
                own setup retries an unreachable master for about 90 s.
            retry_s: see the class.

        Raises:
            ConfigError: a bad URL; DependencyError: Mooncake's client is not installed;
            StoreError: the master is unreachable or the client setup fails.
        """
        host, port = _master_address(url)
        master = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        client_cls = _mooncake()
        try:
            socket.create_connection((host, port), timeout=connect_timeout).close()
        except OSError as e:
            raise StoreError(f"the Mooncake master at {master} ({url}) is not reachable: {e}") from e
        client = client_cls()
        rc = client.setup(local_hostname, metadata_server, int(global_segment_size), int(local_buffer_size),
                          protocol, device_name, master)
        if rc != 0:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - the setup error is the one to report
                pass
            raise StoreError(f"Mooncake client setup against the master at {master} failed with code "
                             f"{_code(rc)} (local_hostname={local_hostname!r}, metadata_server="
                             f"{metadata_server!r}, protocol={protocol!r})")
        store = cls(client, prefix=prefix, max_object_size=int(local_buffer_size), retry_s=retry_s)
        store.master = master
        return store

    def _client(self) -> Any:
        if self._closed:
            raise StoreError(f"the Mooncake store on {self.master} is closed")
        return self.client

    def _fail(self, what: str, key: str, rc: int) -> StoreError:
        return StoreError(f"Mooncake {what} of {key!r} on {self.master} failed with code {_code(rc)}")

    def _retrying(self, fn: Any, *args: Any) -> int:
        """``fn(*args)``, called again (with short pauses, for up to ``retry_s``) while it fails
        with code -200 (no room in the pool yet)."""
        deadline = time.monotonic() + self.retry_s
        pause = 0.02
        rc = fn(*args)
        while rc == _NO_ROOM and time.monotonic() + pause <= deadline:
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
            rc = fn(*args)
        return rc

    def _put(self, key: str, data: bytes) -> None:
        if not data:
            raise InputError("Mooncake Store cannot hold an empty object")
        if self.max_object_size is not None and len(data) > self.max_object_size:
            raise StoreError(f"a {len(data)}-byte object does not fit the Mooncake client's local buffer "
                             f"({self.max_object_size} bytes, local_buffer_size)")
        client, k = self._client(), self.prefix + key
        size = client.get_size(k)
        if size == len(data):
            # same size: upsert rewrites the object in place (readers wait while it is written)
            rc = self._retrying(client.upsert, k, data)
            if rc != 0:
                raise self._fail(f"upsert ({len(data)} bytes)", key, rc)
            return
        # A new size: an upsert would leak the old object's space in the pool (Mooncake 0.3.13:
        # the master's allocated bytes never shrink back), so remove it and put anew. Forced,
        # as a put or get holds a lease on it for the TTL: a reader in flight may get torn
        # bytes (module docstring).
        if size >= 0 or size == _NOT_READY:
            rc = client.remove(k, True)
            if rc not in (0, _NOT_FOUND):
                raise self._fail("remove (to replace it)", key, rc)
        elif size != _NOT_FOUND:
            raise self._fail("get_size", key, size)
        rc = self._retrying(client.put, k, data)
        if rc != 0:
            raise self._fail(f"put ({len(data)} bytes)", key, rc)

    def _get(self, key: str) -> bytes | None:
        client, k = self._client(), self.prefix + key
        deadline, pause = None, 0.005
        while True:
            data = client.get(k)
            if data:
                return bytes(data)
            # No bytes: a missing (or evicted) object, one being written, or a failed get (the
            # client says which only in its log); get_size tells them apart (is_exist says 0
            # while an object is being written).
            size = client.get_size(k)
            if size == _NOT_FOUND:
                return None
            if size < 0 and size != _NOT_READY:
                raise self._fail("get", key, size)
            if deadline is None:
                deadline = time.monotonic() + self.retry_s
            elif time.monotonic() >= deadline:
                what = "is still being written" if size == _NOT_READY else f"holds {size} bytes"
                raise StoreError(f"Mooncake get of {key!r} on {self.master} returned no bytes for "
                                 f"{self.retry_s} s while the object {what} (the client's log says why)")
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def _exists(self, key: str) -> bool:
        rc = self._client().is_exist(self.prefix + key)
        if rc < 0:
            raise self._fail("is_exist", key, rc)
        return rc == 1

    def _delete(self, key: str) -> bool:
        rc = self._client().remove(self.prefix + key, True)
        if rc == 0:
            return True
        if rc == _NOT_FOUND:
            return False
        raise self._fail("remove", key, rc)

    def stored_bytes(self, key: str) -> int:
        """Bytes the pool holds for the object (0 if missing)."""
        from .base import check_key

        rc = self._client().get_size(self.prefix + check_key(key))
        if rc == _NOT_FOUND:
            return 0
        if rc < 0:
            raise self._fail("get_size", key, rc)
        return int(rc)

    def close(self) -> None:
        """Close the client (its lent segment leaves the pool, with the objects stored in it)."""
        if self._closed:
            return
        self._closed = True
        rc = self.client.close()
        if isinstance(rc, int) and rc != 0:
            raise StoreError(f"closing the Mooncake client of {self.master} failed with code {_code(rc)}")
