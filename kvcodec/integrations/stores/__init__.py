"""Stores that hold KVC objects by key: Redis, Mooncake Store, and files or object stores (fsspec).

kvcodec does not grow a store of its own: these are thin adapters over the clients users already
run, with one contract (:class:`Store`):

* ``put(key, data)`` is atomic for readers: a concurrent ``get`` sees the old object or the new
  one, never a part (Redis, files, object stores, and Mooncake Store, where the key holds a
  fixed-size pointer to a version object written once: mooncake_store.py);
* ``get(key)`` returns the bytes or ``None`` for a missing key; concurrent readers are safe;
* ``exists``, ``delete``, ``close``; failures of the store itself raise :class:`StoreError`.

On top, :meth:`Store.put_cache` encodes a :class:`~kvcodec.cache.KVCache` with a codec and stores
the KVC bytes; :meth:`Store.get_cache` fetches and decodes them (``None`` when missing; a damaged
object raises :class:`~kvcodec.errors.FormatError`, it never decodes to wrong tensors: KVC files
are checksummed, formats/SPEC.md).

:mod:`kvcodec.integrations.stores.prefix` offloads a cache as chunk objects keyed by a
prefix-hash chain (``put_prefix`` / ``get_prefix``: any stored prefix reloads on its own).

:func:`open_store` picks the adapter from a URL: ``redis://`` / ``rediss://`` / ``unix://``
(extra ``[redis]``), ``mooncake://MASTER_HOST:PORT`` (extra ``[mooncake]``), anything else a path
or an fsspec URL (``file://``, ``memory://``, ``s3://`` with its fsspec package; extra
``[fsspec]``).

Example:
    >>> import torch, kvcodec
    >>> from kvcodec.integrations.stores import open_store
    >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(16, 2, 8), torch.randn(16, 2, 8))])
    >>> store = open_store("memory://kvcodec-doc")
    >>> n = store.put_cache("chat/0001", cache, codec="kivi-4-ans")
    >>> store.get_cache("chat/0001").num_tokens, store.get_cache("chat/0002")
    (16, None)
"""

from __future__ import annotations

from typing import Any

from ...errors import ConfigError
from .base import Store, check_key

def open_store(url: str, **options: Any) -> Store:
    """Open the store a URL names (module docstring); ``options`` go to the adapter.

    Raises:
        ConfigError: the URL is empty or names no adapter; DependencyError: its extra is missing;
        StoreError: the store cannot be reached.
    """
    if not isinstance(url, str) or not url:
        raise ConfigError("open_store needs a URL or a path, e.g. redis://127.0.0.1:6379/0")
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("redis", "rediss", "unix"):
        from .redis_store import RedisStore

        return RedisStore.from_url(url, **options)
    if scheme == "mooncake":
        from .mooncake_store import MooncakeStore

        return MooncakeStore.from_url(url, **options)
    from .fsspec_store import FsspecStore

    return FsspecStore(url, **options)


__all__ = ["Store", "check_key", "open_store"]
