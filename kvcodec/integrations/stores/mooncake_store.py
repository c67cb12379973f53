"""Mooncake Store (a distributed in-memory KV cache pool) as a KVC object store.

The store is a ``mooncake_master`` plus clients that each lend memory (``global_segment_size``) to
a shared pool; :class:`MooncakeStore` is one such client, through ``MooncakeDistributedStore``
(``pip install 'kvcodec[mooncake]'``; the CPU build needs the Debian/Ubuntu packages
``libibverbs1 librdmacm1 libnuma1`` even with ``protocol="tcp"``).

Mooncake cannot replace an object of another size atomically (measured on
mooncake-transfer-engine 0.3.13: ``put`` on an existing key returns success and keeps the OLD
value; ``upsert`` of a new size leaks the old object's space in the pool for good; a forced
``remove`` then ``put`` lets a reader whose copy is in flight get torn bytes from the reused
memory). So the store keeps a versioned pointer per key:

* the data of ``key`` lives under a version key ``prefix + key + "#v" + ID`` (``ID``: 32 random
  hex digits; ``#`` never occurs in a store key, so version keys never meet user keys), written
  once with a plain ``put``;
* ``prefix + key`` holds a pointer: the 36 bytes ``b"KVCP" + ID``. A put writes the new version,
  then upserts the pointer (always the same size, so Mooncake rewrites it in place: readers get
  the old or the new pointer, waiting out code -703 while it is written), then removes the
  previous version WITHOUT force. A reader that fetched that version holds a lease on it (the
  master's ``--default_kv_lease_ttl``, 5 s by default; ``get_size`` and ``is_exist`` take one
  too, a put does not), which refuses the removal (code -706) while its copy may still be in
  flight; the store then retries the removal on its later puts and deletes (and at once when
  the pool is full) until the lease has run out. A version left over anyway (a store closed
  first, two writers racing on one key) is unreferenced and the master's eviction reclaims it;
* a get reads the pointer, then the version it names. If that version is gone (replaced and
  removed between the two reads), it reads the pointer again and follows the new one; a pointer
  that still names a missing version means the version was evicted: ``None``, a cache miss.

So ``put`` is atomic for readers, as the :class:`Store` contract asks: a concurrent ``get`` sees the
old object or the new one, never a part, never ``None`` while the key is there. The cost: two
round trips per get (and per ``exists`` and ``stored_bytes``), four per put, a pointer object per
key, and room in the pool for the versions readers still hold: a key replaced while it is read
keeps each version a reader fetched until that lease runs out, up to the lease TTL times the
rate at which the key's objects are written. A pool without that room evicts (the newest
version too: a miss, which a cache may give); keys written once (content-addressed, the usual
KV cache practice) cost nothing of the kind. An object at ``prefix + key`` that is not such a
pointer (written by another client, or by kvcodec before this scheme) is a :class:`StoreError`
naming it; :meth:`~Store.delete` removes it. Two writers racing on one key leave one of the
objects. Further semantics, as measured on 0.3.13:

* Mooncake cannot hold an empty object, so an empty ``data`` is refused
  (:class:`~kvcodec.errors.InputError`; KVC objects are never empty). A get of a missing key
  returns no bytes, which is told from a stored object by asking ``get_size``;
* a delete removes the pointer with force (the lease a reader took would otherwise refuse it: a
  reader racing a delete gets the object or ``None``), then the version without force (above);
* an object must fit the client's local buffer (``local_buffer_size``) and one segment of the
  pool; a larger one is refused with :class:`StoreError`;
* it is a cache, not a durable store: the master evicts objects silently to make room (only
  objects whose lease has run out), objects in a client's segment leave the pool when that
  client closes, and all objects are lost when the master stops. A ``get`` returns ``None`` when
  the pointer or its version was evicted, so callers treat a miss as "recompute", never as an
  error;
* a put into a full pool fails with code -200 (NO_AVAILABLE_HANDLE), which makes the master
  evict: the store tries again for ``retry_s`` (1 s) before it raises :class:`StoreError`. A pool
  full of objects read within the lease TTL has nothing to evict until their leases run out:
  set ``retry_s`` above the TTL to wait that out;
* every other negative return code of the client becomes a :class:`StoreError` naming the code.

One :class:`MooncakeStore` is safe for concurrent readers and writers in threads. Close it
before the master stops: a client whose master is gone takes seconds per call, and its
``close`` waits for its own timeouts.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections import deque
from typing import Any, Callable
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
_HAS_LEASE = -706
_NO_ROOM = -200
_INVALID_PARAMS = -600  # also: the local buffer is taken by concurrent transfers for now

MiB = 1 << 20

# The object under a key: b"KVCP" + the 32 hex digits of the version that holds the data.
POINTER_MAGIC = b"KVCP"
POINTER_SIZE = len(POINTER_MAGIC) + 32
VERSION_SEP = "#v"  # prefix + key + "#v" + id: the version key ('#' is never in a store key)
_HEX = frozenset(b"0123456789abcdef")
_FOLLOW_TRIES = 5  # pointer reads a get makes while the versions it names are replaced away
_MAX_RETIRED = 4096  # versions whose removal waits for a lease; older ones are left to eviction


def _code(rc: int) -> str:
    name = _CODES.get(rc)
    return f"{rc} ({name})" if name else str(rc)


def _pointer(version: str) -> bytes:
    return POINTER_MAGIC + version.encode("ascii")


def _version_of(blob: bytes) -> str | None:
    """The version id a pointer object names, or ``None`` if ``blob`` is not a pointer."""
    if len(blob) != POINTER_SIZE or not blob.startswith(POINTER_MAGIC):
        return None
    hexid = blob[len(POINTER_MAGIC):]
    return hexid.decode("ascii") if _HEX.issuperset(hexid) else None


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
    """KVC objects in Mooncake Store: a pointer under ``prefix + key``, the data under a version
    key next to it (module docstring).

    Args:
        client: a ``mooncake.store.MooncakeDistributedStore`` whose ``setup`` succeeded; the
            store closes it in :meth:`close`.
        prefix: prepended to every key (a namespace such as ``"kvc/"``).
        max_object_size: the client's ``local_buffer_size`` if known: larger objects are refused
            before they reach the client.
        retry_s: how long an operation waits out a passing state of the pool before it raises
            :class:`StoreError`: a put while the pool has no room (code -200; a failed allocation
            makes the master evict), while the client's local buffer is taken by concurrent
            transfers (code -600 for an object within ``max_object_size``) or another put writes
            the key's pointer (code -703); a get while the pointer is being written (code -703).
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
        # (next try, version key, tries) of replaced versions whose removal a lease refused
        self._retired: deque[tuple[float, str, int]] = deque()
        self._retired_lock = threading.Lock()

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

    def _retrying(self, fn: Callable[..., int], *args: Any, also: tuple[int, ...] = ()) -> int:
        """``fn(*args)``, called again (with short pauses, for up to ``retry_s``) while it fails
        with code -200 (no room in the pool yet: replaced versions whose lease has run out are
        removed first) or a code in ``also``."""
        deadline = time.monotonic() + self.retry_s
        pause = 0.02
        rc = fn(*args)
        while (rc == _NO_ROOM or rc in also) and time.monotonic() + pause <= deadline:
            if rc == _NO_ROOM:
                self._reap(everything=True)
            time.sleep(pause)
            pause = min(pause * 2, 0.2)
            rc = fn(*args)
        return rc

    # ------------------------------------------------------------------ replaced versions
    def _retire(self, vkey: str) -> None:
        """Remove a version no pointer names any more, or (a reader's lease refuses it) queue it
        for a later try: never forced, as a reader holding the lease may still be copying it."""
        rc = self.client.remove(vkey, False)
        if rc == _HAS_LEASE:
            with self._retired_lock:
                self._retired.append((time.monotonic() + 0.05, vkey, 1))
                while len(self._retired) > _MAX_RETIRED:
                    self._retired.popleft()  # unreferenced: the master's eviction reclaims it
        # any other failure leaves it to eviction too: the put or delete itself has succeeded

    def _reap(self, everything: bool = False) -> None:
        """Try again to remove queued versions that are due (``everything``: all of them)."""
        now = time.monotonic()
        with self._retired_lock:
            due = [e for e in self._retired if everything or e[0] <= now]
            if not due:
                return
            if len(due) == len(self._retired):
                self._retired.clear()
            else:
                keep = [e for e in self._retired if not (everything or e[0] <= now)]
                self._retired = deque(keep)
        try:
            codes = self.client.batch_remove([e[1] for e in due], False)
        except Exception:  # noqa: BLE001 - cleanup is best effort: queue them again
            codes = [_HAS_LEASE] * len(due)
        again = [(now + min(0.05 * 2 ** tries, 0.2), vkey, tries + 1)
                 for (_, vkey, tries), rc in zip(due, codes) if rc == _HAS_LEASE]
        if again:
            with self._retired_lock:
                self._retired.extend(again)
                while len(self._retired) > _MAX_RETIRED:
                    self._retired.popleft()

    # ------------------------------------------------------------------ reads
    def _read(self, k: str, key: str) -> bytes | None:
        """The bytes of Mooncake object ``k`` (for ``key``), or ``None`` if it is missing; waits
        out code -703 (being written) for up to ``retry_s``."""
        client = self._client()
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

    def _version(self, key: str, foreign_ok: bool = False) -> str | None:
        """The version id the pointer of ``key`` names, or ``None`` if there is no pointer (or,
        with ``foreign_ok``, the object there is not a pointer).

        Raises:
            StoreError: the object under the key is not a pointer (read twice: a reader racing a
                delete may copy a pointer whose memory is being reused).
        """
        k = self.prefix + key
        blob = self._read(k, key)
        if blob is None:
            return None
        version = _version_of(blob)
        if version is None:
            time.sleep(0.005)
            again = self._read(k, key)
            if again is None:
                return None
            version = _version_of(again)
            if version is None and not foreign_ok:
                raise StoreError(
                    f"the Mooncake object {k!r} on {self.master} is not a kvcodec pointer ({len(again)} bytes "
                    f"starting {again[:8]!r}, expected {POINTER_SIZE} bytes starting {POINTER_MAGIC!r}): "
                    "written by another client or an older kvcodec? delete() removes it")
        return version

    def _version_key(self, key: str, version: str) -> str:
        return f"{self.prefix}{key}{VERSION_SEP}{version}"

    def _follow(self, key: str, fetch: Callable[[str], Any]) -> Any:
        """``fetch(version key)`` of the version the pointer of ``key`` names, or ``None`` if the
        key is missing or its version was evicted (``fetch`` returns ``None`` for a missing one)."""
        version = self._version(key)
        for _ in range(_FOLLOW_TRIES):
            if version is None:
                return None
            got = fetch(self._version_key(key, version))
            if got is not None:
                return got
            # Replaced (and removed) since the pointer was read, or evicted: the pointer says which.
            again = self._version(key)
            if again == version:
                return None  # still named: evicted, a cache miss
            version = again
        return None  # replaced faster than read, every time: a miss

    def _version_size(self, key: str) -> Callable[[str], int | None]:
        def size(vkey: str) -> int | None:
            rc = self._client().get_size(vkey)
            if rc == _NOT_FOUND:
                return None
            if rc < 0:
                raise self._fail("get_size", key, rc)
            return int(rc)
        return size

    # ------------------------------------------------------------------ the Store API
    def _put(self, key: str, data: bytes) -> None:
        if not data:
            raise InputError("Mooncake Store cannot hold an empty object")
        if self.max_object_size is not None and len(data) > self.max_object_size:
            raise StoreError(f"a {len(data)}-byte object does not fit the Mooncake client's local buffer "
                             f"({self.max_object_size} bytes, local_buffer_size)")
        client = self._client()
        old = self._version(key)  # a foreign object under the key is refused here, before any write
        version = uuid.uuid4().hex
        vkey = self._version_key(key, version)
        # A key never written before: a plain put is fine. An object known to fit the local buffer
        # is refused with -600 only while concurrent gets and puts of this client fill it.
        busy = (_INVALID_PARAMS,) if self.max_object_size is not None else ()
        rc = self._retrying(client.put, vkey, data, also=busy)
        if rc != 0:
            raise self._fail(f"put ({len(data)} bytes)", key, rc)
        # Point the key at it: a pointer of the same size every time, which upsert rewrites in
        # place (readers wait while it is written, then get the old or the new one).
        try:
            rc = self._retrying(client.upsert, self.prefix + key, _pointer(version), also=(_NOT_READY,))
            if rc != 0:
                raise self._fail("upsert of the pointer", key, rc)
        except BaseException:
            self._retire(vkey)  # unnamed (unless the failed upsert landed after all): not forced
            raise
        if old is not None and old != version:
            self._retire(self._version_key(key, old))
        self._reap()

    def _get(self, key: str) -> bytes | None:
        return self._follow(key, lambda vkey: self._read(vkey, key))

    def _exists(self, key: str) -> bool:
        return self._follow(key, self._version_size(key)) is not None

    def _delete(self, key: str) -> bool:
        client, k = self._client(), self.prefix + key
        old = self._version(key, foreign_ok=True)  # a foreign object is removed all the same
        # Forced: a reader's lease on the pointer would refuse it for the TTL.
        rc = client.remove(k, True)
        if rc not in (0, _NOT_FOUND):
            raise self._fail("remove", key, rc)
        if old is not None:
            self._retire(self._version_key(key, old))
        self._reap()
        return rc == 0

    def stored_bytes(self, key: str) -> int:
        """Bytes the pool holds for the object's data (0 if missing); the pointer's 36 bytes are
        not counted."""
        from .base import check_key

        size = self._follow(check_key(key), self._version_size(key))
        return 0 if size is None else size

    def close(self) -> None:
        """Close the client (its lent segment leaves the pool, with the objects stored in it).
        Replaced versions still waiting for a lease to run out are left to the master's eviction."""
        if self._closed:
            return
        self._closed = True
        rc = self.client.close()
        if isinstance(rc, int) and rc != 0:
            raise StoreError(f"closing the Mooncake client of {self.master} failed with code {_code(rc)}")
