"""Stores for KVC objects against the real thing: redis-server on loopback (started and stopped
here), a local directory and fsspec's memory filesystem. Mooncake Store: tests/test_integrations_mooncake.py."""

from __future__ import annotations

import doctest
import threading
import time

import pytest
import torch

import kvcodec
from kvcodec.errors import ChecksumError, FormatError, InputError, StoreError
from kvcodec.integrations import stores
from kvcodec.integrations.stores import open_store

from conftest import make_cache
from servers import free_port

pytest.importorskip("fsspec")


@pytest.fixture(params=["redis", "dir", "memory"])
def store(request, tmp_path):
    if request.param == "redis":
        url = request.getfixturevalue("redis_url")
        s = open_store(url, prefix=f"t{request.node.name}/")
    elif request.param == "dir":
        s = open_store(str(tmp_path / "kvc"))
    else:
        s = open_store(f"memory://kvcodec-test/{tmp_path.name}")
    yield s
    s.close()


def test_bytes_round_trip_missing_replace_delete(store):
    data = bytes(range(256)) * 1000 + b"\x00"
    assert store.get("m/1") is None and not store.exists("m/1")
    store.put("m/1", data)
    assert store.exists("m/1") and store.get("m/1") == data
    store.put("m/1", b"second")
    assert store.get("m/1") == b"second"
    store.put("m/empty", b"")
    assert store.get("m/empty") == b""
    assert store.delete("m/1") is True and store.delete("m/1") is False
    assert store.get("m/1") is None


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "a/./b", "sp ace", "x" * 513, "é", "a\nb", 7, b"k"])
def test_bad_keys_are_refused(store, key):
    with pytest.raises(InputError):
        store.put(key, b"x")
    with pytest.raises(InputError):
        store.get(key)


def test_only_bytes_are_stored(store):
    with pytest.raises(InputError, match="bytes"):
        store.put("k", "text")
    store.put("k", bytearray(b"ab"))
    store.put("k2", memoryview(b"cd"))
    assert store.get("k") == b"ab" and store.get("k2") == b"cd"


def test_cache_round_trip_and_damage_is_an_error(store):
    cache = make_cache(layers=2, tokens=40, heads=2, dim=16)
    codec = kvcodec.get_codec("kvc-near")
    n = store.put_cache("c/1", cache, codec=codec)
    blob = store.get("c/1")
    assert len(blob) == n == len(codec.encode(cache))
    got = store.get_cache("c/1")
    want = codec.decode(blob)
    assert all(torch.equal(got.layers[i][r], want.layers[i][r]) for i in range(2) for r in ("k", "v"))
    assert store.get_cache("c/none") is None
    bad = bytearray(blob)
    bad[len(bad) // 2] ^= 0x40  # a payload byte: the checksum catches it
    store.put("c/bad", bytes(bad))
    with pytest.raises(ChecksumError):
        store.get_cache("c/bad")
    store.put("c/short", blob[: len(blob) // 3])
    with pytest.raises(FormatError):
        store.get_cache("c/short")


def race(store, key, objects, reads=200, pause=0.0, min_writes=11, on_write=lambda: None):
    """A writer replacing ``key`` by each of ``objects`` in turn (``pause`` s apart, calling
    ``on_write`` after each) while 3 threads read it (``reads`` times each, and on until
    ``min_writes`` writes are done); returns what the readers got (a list) and the number of
    writes. Any exception in a thread fails the test."""
    store.put(key, objects[0])
    stop = threading.Event()
    got, errors, writes = [], [], [0]

    def writer():
        try:
            while not stop.is_set():
                store.put(key, objects[writes[0] % len(objects)])
                writes[0] += 1
                on_write()
                time.sleep(pause)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"writer: {e!r}")

    def reader():
        try:
            n = 0
            while n < reads or (writes[0] < min_writes and not errors):
                got.append(store.get(key))
                n += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    w = threading.Thread(target=writer)
    readers = [threading.Thread(target=reader) for _ in range(3)]
    w.start()
    for r in readers:
        r.start()
    for r in readers:
        r.join()
    stop.set()
    w.join()
    assert not errors, errors[:5]
    assert writes[0] >= min_writes
    return got, writes[0]


def test_readers_see_whole_objects_while_a_writer_replaces(store):
    a, b = b"A" * 300_000, b"B" * 200_000
    got, _ = race(store, "race", [a, b], reads=40, min_writes=1)
    partial = [len(g) if g is not None else None for g in got if g not in (a, b)]
    assert not partial, f"readers saw partial or missing objects: {partial[:5]}"


def test_redis_holds_exactly_the_object(redis_url):
    s = open_store(redis_url, prefix="size/")
    blob = kvcodec.get_codec("kivi-4-ans").encode(make_cache())
    s.put("one", blob)
    assert s.stored_bytes("one") == len(blob) and s.stored_bytes("none") == 0
    s.close()


def test_redis_unreachable_and_text_client_are_clear_errors():
    pytest.importorskip("redis")
    import redis

    with pytest.raises(StoreError, match="did not answer PING"):
        open_store(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5)
    with pytest.raises(StoreError, match="decode_responses"):
        stores.redis_store.RedisStore(redis.Redis(decode_responses=True))


def test_open_store_rejects_empty_url():
    with pytest.raises(kvcodec.errors.ConfigError):
        open_store("")


def test_local_put_leaves_no_temporary_files(tmp_path):
    s = open_store(str(tmp_path))
    for i in range(5):
        s.put("d/x", bytes([i]) * 10)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["x"]


def test_docstring_example():
    res = doctest.testmod(stores, optionflags=doctest.ELLIPSIS)
    assert res.attempted and res.failed == 0
