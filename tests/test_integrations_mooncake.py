"""Mooncake Store as a KVC object store, against a real mooncake_master on loopback (started and
stopped here, one per module) and one client (protocol tcp, no metadata server)."""

from __future__ import annotations

import importlib
import os
import threading
import time

import pytest
import torch

import kvcodec
from kvcodec.errors import ChecksumError, ConfigError, FormatError, InputError, StoreError
from kvcodec.integrations.stores import open_store
from kvcodec.integrations.stores.mooncake_store import MooncakeStore

from conftest import make_cache
from servers import free_port, missing, mooncake_master

MiB = 1 << 20
SEGMENT, BUFFER = 64 * MiB, 16 * MiB


@pytest.fixture(scope="module")
def master_url(tmp_path_factory):
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # Mooncake's glog INFO lines, before it loads
    try:
        importlib.import_module("mooncake.store")
    except ImportError as e:
        missing(f"Mooncake's client ({e}; pip install 'kvcodec[mooncake]' and Debian libibverbs1 librdmacm1 libnuma1)")
    with mooncake_master(str(tmp_path_factory.mktemp("mooncake"))) as url:
        yield url


@pytest.fixture(scope="module")
def client_store(master_url):
    s = open_store(master_url, global_segment_size=SEGMENT, local_buffer_size=BUFFER)
    yield s
    s.close()  # before the master stops


@pytest.fixture
def store(client_store, request):
    # the module's client under a namespace of this test's own (closing it is the module's job)
    s = MooncakeStore(client_store.client, prefix=f"t{request.node.name}/", max_object_size=BUFFER)
    s.master = client_store.master
    return s


def test_open_store_gives_a_mooncake_store(client_store):
    assert isinstance(client_store, MooncakeStore) and client_store.kind == "mooncake"
    assert client_store.max_object_size == BUFFER


def test_bytes_round_trip_missing_replace_delete(store):
    data = bytes(range(256)) * 1000 + b"\x00"
    assert store.get("m/1") is None and not store.exists("m/1")
    store.put("m/1", data)
    assert store.exists("m/1") and store.get("m/1") == data and store.stored_bytes("m/1") == len(data)
    store.put("m/1", b"second")  # Mooncake's own put would keep the first value
    assert store.get("m/1") == b"second"
    store.put("m/1", data)  # replace by a bigger object, while a read lease is held
    assert store.get("m/1") == data
    assert store.delete("m/1") is True and store.delete("m/1") is False  # under a lease: forced
    assert store.get("m/1") is None and not store.exists("m/1") and store.stored_bytes("m/1") == 0


def test_empty_objects_are_refused(store):
    with pytest.raises(InputError, match="empty"):
        store.put("m/empty", b"")
    assert store.get("m/empty") is None


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


def test_objects_larger_than_the_local_buffer_are_a_store_error(store):
    with pytest.raises(StoreError, match="local buffer"):
        store.put("big", b"\1" * (BUFFER + 1))
    # without the size known up front, Mooncake's own refusal (a code) is the error
    raw = MooncakeStore(store.client, prefix=store.prefix)
    with pytest.raises(StoreError, match="-600"):
        raw.put("big", b"\1" * (BUFFER + 1))
    assert not store.exists("big")
    store.put("big", b"\2" * BUFFER)  # exactly the buffer fits
    assert store.get("big") == b"\2" * BUFFER
    store.delete("big")


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


def _race(store, key, objects, reads=200):
    """A writer replacing ``key`` by each of ``objects`` in turn while 3 threads read it; returns
    what the readers got (a list) and the number of writes."""
    store.put(key, objects[0])
    stop = threading.Event()
    got, errors, writes = [], [], [0]

    def writer():
        i = 0
        try:
            while not stop.is_set():
                store.put(key, objects[i % len(objects)])
                i += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"writer: {e!r}")
        writes[0] = i

    def reader():
        try:
            for _ in range(reads):
                got.append(store.get(key))
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
    assert writes[0] > 10
    return got, writes[0]


@pytest.mark.parametrize("size,reads", [(250_000, 200), (4 * MiB, 40)])
def test_readers_see_whole_objects_while_a_writer_replaces_by_the_same_size(store, size, reads):
    a, b = b"A" * size, b"B" * size
    got, _ = _race(store, "race", [a, b], reads)
    bad = [len(g) if g is not None else None for g in got if g not in (a, b)]
    assert not bad, f"readers saw missing or partial objects: {bad[:5]}"


def test_a_replace_by_another_size_is_a_miss_or_refused_bytes_never_wrong_tensors(store):
    # not atomic (module docstring): a reader may find no object, or torn bytes, which
    # decoding refuses (checksums)
    codec = kvcodec.get_codec("kvc-near")
    blobs = [codec.encode(make_cache(tokens=n, seed=n)) for n in (40, 25)]
    assert len(blobs[0]) != len(blobs[1])
    got, _ = _race(store, "race2", blobs)
    torn = [g for g in got if g is not None and g not in blobs]
    print(f"replace by another size: {len(got)} reads, {got.count(None)} misses, {len(torn)} torn")
    for g in torn:
        with pytest.raises(FormatError):
            kvcodec.decode(g)
    assert sum(g in blobs for g in got) > len(got) // 2


def test_replacing_by_other_sizes_does_not_leak_pool_space(store):
    # Mooncake's upsert of a new size never frees the old object's space: 30 such replaces of
    # 5-6 MiB would fill the 64 MiB pool for good (puts failing with code -200, the keeper evicted)
    store.put("keep", b"k" * MiB)
    for i in range(30):
        store.put("grow", bytes([i]) * ((5 + i % 2) * MiB))
    assert store.get("grow") == bytes([29]) * (6 * MiB)
    assert store.get("keep") == b"k" * MiB
    store.delete("grow")
    store.delete("keep")


def test_a_full_pool_makes_room_for_new_objects(store):
    # 8 x 12 MiB > the 64 MiB pool: Mooncake refuses a put while it evicts (code -200), the store
    # retries it; older objects are evicted silently (a cache, not a durable store). Only objects
    # whose lease (1 s here: written or read within it) ran out are evicted: wait longer
    store.retry_s = 10.0  # generous: eviction runs in the master's background, slower on a busy machine
    blob = b"\3" * (12 * MiB)
    for i in range(8):
        store.put(f"full/{i}", blob)
    held = [store.exists(f"full/{i}") for i in range(8)]
    assert held[-1] and not all(held)
    assert store.get("full/7") == blob
    for i in range(8):
        store.delete(f"full/{i}")


def test_unreachable_master_is_a_quick_store_error(master_url):
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="not reachable"):
        open_store(f"mooncake://127.0.0.1:{free_port()}", connect_timeout=1.0)
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("url", ["mooncake://", "mooncake://host", "mooncake://host:0", "mooncake://host:99999",
                                 "mooncake://host:port", "mooncake://host:1/path", "mooncake://u@host:1",
                                 "mooncake://host:1?x=1"])
def test_bad_urls_are_config_errors(url):
    with pytest.raises(ConfigError):
        open_store(url)


def test_closed_store_is_a_store_error():
    s = MooncakeStore(object())
    s._closed = True
    with pytest.raises(StoreError, match="closed"):
        s.get("k")
    s.close()  # twice is fine
