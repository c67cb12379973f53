"""Mooncake Store as a KVC object store, against a real mooncake_master on loopback (started and
stopped here, one per module) and one client (protocol tcp, no metadata server)."""

from __future__ import annotations

import importlib
import os
import time

import pytest

import kvcodec
from kvcodec.errors import ConfigError, InputError, StoreError
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
    yield s
    # Leave the pool empty for the next test: this store's replaced versions that a lease kept
    # (removed on its later puts, which will not come) and its objects; no reader is left, so forced
    pattern = "".join("\\" + c if c in ".^$*+?()[]{}|\\" else c for c in s.prefix)
    s.client.remove_by_regex("^" + pattern, True)


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
    assert store.stored_bytes("m/1") == len(data)
    assert store.delete("m/1") is True and store.delete("m/1") is False  # under a lease: forced
    assert store.get("m/1") is None and not store.exists("m/1") and store.stored_bytes("m/1") == 0


def test_empty_objects_are_refused(store):
    with pytest.raises(InputError, match="empty"):
        store.put("m/empty", b"")
    assert store.get("m/empty") is None


# the store contract's key and data checks, run here on this module's Mooncake store fixture
from test_integrations_stores import (  # noqa: E402,F401
    race,
    test_bad_keys_are_refused,
    test_cache_round_trip_and_damage_is_an_error,
    test_only_bytes_are_stored,
)


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


def _race(store, key, objects, reads=200, pause=0.0, min_writes=11):
    """The store contract's race (test_integrations_stores.race), recording the most old
    versions waiting for removal at once (``store.most_retired``)."""
    store.most_retired = 0

    def on_write():
        store.most_retired = max(store.most_retired, len(store._retired))

    return race(store, key, objects, reads, pause, min_writes, on_write)


# A version a reader fetched stays in the pool until its lease (1 s here) runs out: a writer keeps
# up to a second's worth of versions (at full speed, more than the 64 MiB pool holds, and the
# master would evict the newest one: a miss, as a cache may; module docstring). The writers are
# paced to keep them well within the pool on a fast machine too.
@pytest.mark.parametrize("size,reads,pause,min_writes", [(250_000, 200, 0.01, 60), (4 * MiB, 40, 0.15, 11)])
def test_readers_see_whole_objects_while_a_writer_replaces_by_the_same_size(store, size, reads, pause, min_writes):
    a, b = b"A" * size, b"B" * size
    got, writes = _race(store, "race", [a, b], reads, pause, min_writes)
    bad = [len(g) if g is not None else None for g in got if g not in (a, b)]
    print(f"replace by the same size: {len(got)} reads during {writes} writes: {len(bad)} missing or torn; "
          f"at most {store.most_retired} replaced versions waiting for a lease")
    assert not bad, f"readers saw missing or partial objects: {bad[:5]}"


def _kvc_pair():
    codec = kvcodec.get_codec("kvc-near")
    return [codec.encode(make_cache(tokens=n, seed=n)) for n in (40, 25)]


@pytest.mark.parametrize("objects,reads,pause,min_writes", [
    (lambda: [b"A" * 300_000, b"B" * 200_000], 200, 0.01, 60),
    (_kvc_pair, 200, 0.0, 60),
    (lambda: [b"C" * (4 * MiB), b"D" * (3 * MiB + 17)], 40, 0.15, 11),
], ids=["bytes", "kvc", "4MiB"])
def test_readers_see_whole_objects_while_a_writer_replaces_by_another_size(store, objects, reads, pause, min_writes):
    # the versioned pointer (module docstring): a reader gets the old object or the new one,
    # never a part and never None, while the key is replaced by objects of other sizes
    objects = objects()
    assert len(objects[0]) != len(objects[1])
    got, writes = _race(store, "race2", objects, reads, pause, min_writes)
    torn = [len(g) for g in got if g is not None and g not in objects]
    misses = got.count(None)
    print(f"replace by another size: {len(got)} reads during {writes} writes: {misses} misses, {len(torn)} torn, "
          f"{[sum(g == o for g in got) for o in objects]} of each object; at most {store.most_retired} "
          "replaced versions waiting for a lease")
    assert not misses and not torn, f"readers saw missing or partial objects: {misses} None, torn {torn[:5]}"


def _version_keys(store, key):
    """The version key the raw pointer of ``key`` names (module docstring)."""
    blob = store.client.get(store.prefix + key)
    assert len(blob) == 36 and blob.startswith(b"KVCP"), blob[:8]
    return f"{store.prefix}{key}#v{blob[4:].decode()}"


def test_an_object_is_a_pointer_and_a_version(store):
    store.put("p/1", b"x" * 1000)
    vkey = _version_keys(store, "p/1")  # reads the pointer only: a read of the version takes a lease
    assert store.client.get_size(store.prefix + "p/1") == 36
    store.put("p/1", b"y" * 10)
    assert store.client.get_size(store.prefix + "p/1") == 36  # the pointer keeps its size: rewritten in place
    assert store.client.is_exist(vkey) == 0  # the replaced version is gone (no reader held it)
    new = _version_keys(store, "p/1")
    assert new != vkey and store.get("p/1") == b"y" * 10
    assert store.delete("p/1") is True
    assert store.client.is_exist(store.prefix + "p/1") == 0
    time.sleep(1.2)  # the lease our get took on the version (TTL 1 s here) runs out; the next put removes it
    store.put("p/other", b"z")
    assert store.client.is_exist(new) == 0 and not store._retired


def test_a_pointer_to_an_evicted_version_is_a_miss(store):
    assert store.client.put(store.prefix + "ev", b"KVCP" + b"0" * 32) == 0
    assert store.get("ev") is None and not store.exists("ev") and store.stored_bytes("ev") == 0
    store.put("ev", b"back")  # the dangling pointer is replaced
    assert store.get("ev") == b"back"


@pytest.mark.parametrize("raw", [b"a foreign object", b"KVCP" + b"g" * 32, b"KVCP" + b"0" * 31, b"KVCQ" + b"0" * 32,
                                 b"KVCP" + b"0" * 32 + b"\n"])
def test_a_foreign_object_under_a_key_is_a_store_error(store, raw):
    # written by another client (or by kvcodec before the versioned pointer): never taken for data
    assert store.client.put(store.prefix + "foreign", raw) == 0
    for op in (store.get, store.exists, store.stored_bytes, lambda k: store.put(k, b"new")):
        with pytest.raises(StoreError, match="not a kvcodec pointer"):
            op("foreign")
    assert store.client.get(store.prefix + "foreign") == raw  # the refused put left it alone
    assert store.delete("foreign") is True  # delete clears it
    assert store.get("foreign") is None and store.client.is_exist(store.prefix + "foreign") == 0
    store.put("foreign", b"mine")
    assert store.get("foreign") == b"mine"


def test_replacing_by_other_sizes_does_not_leak_pool_space(store):
    # Mooncake's upsert of a new size never frees the old object's space, and versions nobody
    # removes would pile up: 30 replaces of 5-6 MiB (165 MiB) would fill the 64 MiB pool for
    # good (puts failing with code -200, the keeper evicted)
    store.retry_s = 0.0  # a full pool is an error here, not a wait for eviction
    store.put("keep", b"k" * MiB)
    for i in range(30):
        store.put("grow", bytes([i]) * ((5 + i % 2) * MiB))
    assert store.get("grow") == bytes([29]) * (6 * MiB)
    assert store.get("keep") == b"k" * MiB
    store.delete("grow")
    store.delete("keep")


def test_versions_readers_hold_are_removed_once_their_leases_run_out(store):
    # a reader's lease refuses the removal of the version it read (it may still be copying it):
    # the store queues it and removes it on a later put, once the lease (1 s here) has run out
    store.put("keep", b"k" * MiB)
    versions, queued = [], 0
    for i in range(30):  # 37.5 MiB in all: every version fits the 64 MiB pool while held
        data = bytes([i]) * ((2 + i % 2) * MiB // 2)
        store.put("held", data)
        queued = max(queued, len(store._retired))
        versions.append(_version_keys(store, "held"))
        assert store.get("held") == data  # a lease on this version: the next put cannot remove it
    assert queued >= 10  # refused (code -706) and queued, not forced
    time.sleep(1.3)
    store.put("held", b"last")
    assert not store._retired
    assert [v for v in versions if store.client.is_exist(v)] == []
    # the space is back: 36 MiB more fit without evicting anything (37.5 + 1 + 36 > 64 if leaked)
    store.retry_s = 0.0
    for j in range(6):
        store.put(f"fill/{j}", b"f" * (6 * MiB))
    assert store.get("keep") == b"k" * MiB and store.get("held") == b"last"
    for key in ["keep", "held"] + [f"fill/{j}" for j in range(6)]:
        store.delete(key)


def test_a_full_pool_makes_room_for_new_objects(store):
    # 8 x 12 MiB > the 64 MiB pool: Mooncake refuses a put while it evicts (code -200), the store
    # retries it; older objects are evicted silently (a cache, not a durable store). Only objects
    # whose lease (1 s here: written or read within it) ran out are evicted: wait longer
    store.retry_s = 10.0  # generous: eviction runs in the master's background, slower on a busy machine
    blob = b"\3" * (12 * MiB)
    for i in range(8):
        store.put(f"full/{i}", blob)
    held = [store.exists(f"full/{i}") for i in range(8)]
    assert held[-1] and not all(held), held
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
