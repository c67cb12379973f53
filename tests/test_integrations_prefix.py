"""A cache offloaded as prefix-hash-chained chunk objects (kvcodec.integrations.stores.prefix):
the documented hash, reloading the longest stored prefix, models and tenants kept apart, a
damaged or misplaced chunk refused; against a real redis-server and fsspec's memory store."""

from __future__ import annotations

import doctest
import hashlib

import pytest
import torch

import kvcodec
from kvcodec.errors import FormatError, InputError
from kvcodec.integrations.stores import open_store, prefix
from kvcodec.integrations.stores.prefix import chunk_keys, get_prefix, put_prefix

from conftest import make_cache

pytest.importorskip("fsspec")


@pytest.fixture(params=["memory", "redis"])
def store(request, tmp_path):
    if request.param == "redis":
        s = open_store(request.getfixturevalue("redis_url"), prefix=f"{request.node.name}/")
    else:
        s = open_store(f"memory://prefix-test/{tmp_path.name}")
    yield s
    s.close()


def test_keys_follow_the_documented_chain():
    ids = torch.arange(10, dtype=torch.int64)
    h0 = hashlib.sha256(b"kvcodec-prefix-v1\x00m\x00s\x00" + ids[:4].numpy().astype("<i8").tobytes()).digest()
    h1 = hashlib.sha256(h0 + ids[4:8].numpy().astype("<i8").tobytes()).digest()
    assert chunk_keys(ids, 4, "m", "s") == [f"kvc/{h0.hex()}", f"kvc/{h1.hex()}"]
    assert chunk_keys(ids, 4, "m", "t")[0] != chunk_keys(ids, 4, "m", "s")[0]
    assert chunk_keys(ids, 4, "n", "s")[0] != chunk_keys(ids, 4, "m", "s")[0]
    other = ids.clone()
    other[1] = 99  # a change in chunk 0 changes every later key
    assert not set(chunk_keys(other, 4, "m", "s")) & set(chunk_keys(ids, 4, "m", "s"))
    with pytest.raises(InputError):
        chunk_keys(ids, 0)


def test_longest_stored_prefix_reloads(store):
    cache = make_cache(layers=2, tokens=100, heads=2, dim=16, seed=3)  # token_ids 0..99
    assert put_prefix(store, cache, "raw", chunk_tokens=32, model="m") == 3  # 96 tokens; 4 left over
    longer = torch.cat([cache.token_ids, torch.tensor([5, 6, 7])])
    got = get_prefix(store, longer, chunk_tokens=32, model="m")
    assert got.num_tokens == 96 and torch.equal(got.token_ids, cache.token_ids[:96])
    for i in range(2):
        for r in ("k", "v"):
            assert torch.equal(got.layers[i][r], cache.layers[i][r][:96])  # raw: lossless
    # a new request that diverges in chunk 1 reuses chunk 0 only
    fork = cache.token_ids.clone()
    fork[40] += 1
    assert get_prefix(store, fork, chunk_tokens=32, model="m").num_tokens == 32
    assert get_prefix(store, fork, chunk_tokens=32, model="other") is None


def test_chunks_of_kvc_are_parts_and_a_misplaced_chunk_is_refused(store):
    cache = make_cache(layers=2, tokens=96, heads=2, dim=16, seed=4)
    put_prefix(store, cache, "kvc-near", chunk_tokens=32, model="m")
    keys = chunk_keys(cache.token_ids, 32, "m")
    kinds = []
    for key in keys:
        with kvcodec.open(store.get(key)) as r:
            kinds.append((r.manifest["codec"]["sinks"], r.manifest["codec"]["recent_ramp"]))
    assert kinds == [(1, 0), (0, 0), (0, 128)]  # the sink in the first, the recency ramp in the last
    got = get_prefix(store, cache.token_ids, chunk_tokens=32, model="m")
    assert got.num_tokens == 96
    store.put(keys[0], store.get(keys[1]))  # chunk 1 under chunk 0's key
    with pytest.raises(FormatError, match="other tokens"):
        get_prefix(store, cache.token_ids, chunk_tokens=32, model="m")


def test_put_prefix_needs_token_ids(store):
    cache = make_cache(layers=1, tokens=40)
    cache.token_ids = None
    with pytest.raises(InputError, match="token ids"):
        put_prefix(store, cache, "raw", chunk_tokens=8)


def test_docstring_example():
    res = doctest.testmod(prefix, optionflags=doctest.ELLIPSIS)
    assert res.attempted and res.failed == 0
