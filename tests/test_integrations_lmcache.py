"""kvcodec as a serde inside the real LMCache (0.5.6, multiprocess StorageManager on CPU): chunks
written to L1 go through the kvcodec serde into the ``fs`` store and into a real redis-server
(``resp``), come back through prefetch and decode bit-exactly as kvcodec's own decoder does;
a damaged or misplaced object is a miss with a logged reason, never wrong tensors."""

from __future__ import annotations

import hashlib
import logging
import os
import time
import warnings

import pytest
import torch

from kvcodec.errors import ConfigError
from kvcodec.integrations import lmcache as kl
from servers import missing, redis_server

# lmcache 0.5.6 builds an opentelemetry LoggingHandler per logger, which that package deprecates
_OTEL = "ignore:`LoggingHandler` in `opentelemetry-sdk` is deprecated:DeprecationWarning"
pytestmark = pytest.mark.filterwarnings(_OTEL)
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", "`LoggingHandler` in `opentelemetry-sdk`", DeprecationWarning)
    try:
        import lmcache  # noqa: F401
        import lmcache.v1.distributed.storage_manager  # noqa: F401
        import lmcache.v1.distributed.l2_adapters.fs_l2_adapter  # noqa: F401
        import lmcache.v1.distributed.l2_adapters.resp_l2_adapter  # noqa: F401
    except ImportError:
        missing("lmcache (pip install 'kvcodec[lmcache]')")

from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec  # noqa: E402
from lmcache.v1.distributed.config import (  # noqa: E402
    EvictionConfig,
    L1ManagerConfig,
    L1MemoryManagerConfig,
    StorageManagerConfig,
)
from lmcache.v1.distributed.l2_adapters.config import L2AdaptersConfig  # noqa: E402
from lmcache.v1.distributed.l2_adapters.fs_l2_adapter import FSL2AdapterConfig  # noqa: E402
from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import RESPL2AdapterConfig  # noqa: E402
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor, get_registered_serde_types  # noqa: E402
from lmcache.v1.distributed.storage_manager import StorageManager  # noqa: E402

HEADS, DIM, LAYERS, TOKENS = 3, 64, 4, 256  # SmolLM2's KV geometry, 4 layers, LMCache's chunk size
SHAPE = torch.Size([2, LAYERS, TOKENS, HEADS * DIM])
DTYPE = torch.bfloat16
LAYOUT = MemoryLayoutDesc(shapes=[SHAPE], dtypes=[DTYPE])
SERDE = {"codec": "kvc-near", "num_kv_heads": HEADS, "head_dim": DIM, "budget_bits": 3.0}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    kl.register()
    kl.register()  # idempotent


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory):
    with redis_server(str(tmp_path_factory.mktemp("redis"))) as url:
        yield int(url.rsplit(":", 1)[1].split("/")[0])


def _chunks(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):  # K with per-channel offsets (as real K has), V plain
        k = torch.randn(LAYERS, TOKENS, HEADS * DIM, generator=g) + 2 * torch.randn(LAYERS, 1, HEADS * DIM, generator=g)
        out.append(torch.stack([k, torch.randn(LAYERS, TOKENS, HEADS * DIM, generator=g)]).to(DTYPE))
    return out


def _keys(n, tag):
    rank = ObjectKey.ComputeKVRank(world_size=1, global_rank=0, local_world_size=1, local_rank=0)
    return [ObjectKey(chunk_hash=hashlib.sha256(f"{tag}-{i}".encode()).digest(), model_name="HuggingFaceTB/SmolLM2-135M",
                      kv_rank=rank) for i in range(n)]


def _wait(pred, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def _manager(adapter):
    l1 = L1ManagerConfig(memory_config=L1MemoryManagerConfig(size_in_bytes=128 << 20, use_lazy=False, shm_name=""))
    return StorageManager(StorageManagerConfig(l1_manager_config=l1, eviction_config=EvictionConfig(eviction_policy="LRU"),
                                               l2_adapter_config=L2AdaptersConfig(adapters=[adapter])))


def _store(sm, keys, data, stored):
    objs = sm.reserve_write(keys, LAYOUT)
    assert len(objs) == len(keys)
    for k, d in zip(keys, data):
        objs[k].tensor.copy_(d)
    sm.finish_write(keys)

    def idle():
        st = sm.report_status()["store_controller"]
        return st["pending_keys_count"] == 0 and st["in_flight_task_count"] == 0

    assert _wait(lambda: len(stored()) == len(keys)), f"L2 holds {len(stored())} of {len(keys)} chunks"
    assert _wait(idle)
    sm.clear(force=True)


def _prefetch(sm, keys):
    """Indices of the chunks LMCache found, and their tensors."""
    h = sm.submit_prefetch_task(PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=LAYOUT)]))
    assert sm.wait_prefetch_status(h, timeout=60)
    res = sm.query_prefetch_status(h)
    hits = res.hit_cells[0].get_indices_list()
    got = []
    if hits:
        hk = [keys[i] for i in hits]
        with sm.read_prefetched_results(hk, res.l1_owners or None) as objs:
            assert objs is not None
            got = [o.tensor.clone() for o in objs]
        sm.finish_read_prefetched(hk, l1_owners=res.l1_owners or None)
    return hits, got


def _backend(kind, tmp_path, redis_port):
    if kind == "fs":
        base = str(tmp_path / "l2")
        os.makedirs(base)

        def sizes():
            return {f: os.path.getsize(os.path.join(base, f)) for f in os.listdir(base) if f.endswith(".data")}

        def read(i):
            return open(os.path.join(base, sorted(sizes())[i]), "rb").read()

        return FSL2AdapterConfig(base_path=base), sizes, None
    import redis

    cli = redis.Redis(host="127.0.0.1", port=redis_port)
    cli.flushall()
    return (RESPL2AdapterConfig(host="127.0.0.1", port=redis_port, num_workers=2),
            lambda: {k: cli.strlen(k) for k in cli.keys("*")}, cli)


def test_registered_under_its_name_with_checked_kwargs():
    assert "kvcodec" in get_registered_serde_types()
    proc = create_serde_processor(SerdeConfig(type="kvcodec", kwargs=dict(SERDE)))
    try:
        assert proc.estimate_serialized_size(LAYOUT) == kl.FRAME_HEADER.size + 3 * SHAPE.numel() // 8
    finally:
        proc.close()
    with pytest.raises(ConfigError, match="budget_bits"):
        create_serde_processor(SerdeConfig(type="kvcodec", kwargs={"num_kv_heads": 3, "head_dim": 64}))
    with pytest.raises(ConfigError, match="unknown kwargs"):
        create_serde_processor(SerdeConfig(type="kvcodec", kwargs={**SERDE, "heads": 3}))


@pytest.mark.parametrize("kind", ["fs", "resp"])
def test_chunks_round_trip_through_lmcache_bit_exact(kind, tmp_path, redis_port):
    adapter, stored, _ = _backend(kind, tmp_path, redis_port)
    adapter.serde_config = SerdeConfig(type="kvcodec", kwargs=dict(SERDE))
    keys, data = _keys(3, kind), _chunks(3)
    sm = _manager(adapter)
    try:
        _store(sm, keys, data, stored)
        sizes = stored()
        hits, got = _prefetch(sm, keys)
    finally:
        sm.close()
    coder = kl.coder_from_kwargs(dict(SERDE))
    budget = coder.max_bytes(SHAPE, DTYPE)
    assert sorted(sizes.values()) == [budget] * 3, "each object is stored at exactly the budget"
    assert budget * 8 / SHAPE.numel() < 3.001
    assert hits == [0, 1, 2]
    for key, chunk, out in zip(keys, data, got):
        want = torch.zeros_like(chunk)
        coder.decode_into(coder.encode(chunk, key), want, key)  # kvcodec's reference path
        assert torch.equal(out, want)
        err = float((out.float() - chunk.float()).norm() / chunk.float().norm())
        assert 0 < err < 0.2


def test_fp8_serde_beside_it_holds_8_bits(tmp_path, redis_port):
    adapter, stored, _ = _backend("resp", tmp_path, redis_port)
    adapter.serde_config = SerdeConfig(type="fp8", kwargs={})
    keys, data = _keys(2, "fp8"), _chunks(2)
    sm = _manager(adapter)
    try:
        _store(sm, keys, data, stored)
        sizes = stored()
    finally:
        sm.close()
    assert sorted(sizes.values()) == [SHAPE.numel()] * 2  # 8 bits per element; kvcodec above: 3


def test_damaged_or_misplaced_object_is_a_logged_miss(tmp_path, redis_port, caplog):
    adapter, stored, cli = _backend("resp", tmp_path, redis_port)
    adapter.serde_config = SerdeConfig(type="kvcodec", kwargs=dict(SERDE))
    keys, data = _keys(2, "bad"), _chunks(2, seed=1)
    sm = _manager(adapter)
    try:
        _store(sm, keys, data, stored)
        names = sorted(stored())
        by_hash = {k.chunk_hash.hex(): k for k in keys}
        name_of = {by_hash[n.decode().rsplit("@", 1)[-1]].chunk_hash: n for n in names}
        first, second = name_of[keys[0].chunk_hash], name_of[keys[1].chunk_hash]
        # damage a payload byte of chunk 0
        value = bytearray(cli.get(first))
        value[len(value) // 2] ^= 0x20
        cli.set(first, bytes(value))
        caplog.set_level(logging.WARNING, logger="kvcodec.integrations.lmcache")
        hits, _ = _prefetch(sm, keys[:1])
        assert hits == []
        assert any("unusable" in r.getMessage() and "checksum" in r.getMessage().lower() for r in caplog.records), \
            [r.getMessage() for r in caplog.records]
        # chunk 1's object stored under chunk 0's key: the frame's key digest refuses it
        cli.set(first, cli.get(second))
        caplog.clear()
        hits, _ = _prefetch(sm, keys[:1])
        assert hits == []
        assert any("another key" in r.getMessage() for r in caplog.records)
        # chunk 1 itself is intact and still loads
        hits, got = _prefetch(sm, keys[1:])
        assert hits == [0] and float((got[0].float() - data[1].float()).norm() / data[1].float().norm()) < 0.2
    finally:
        sm.close()


def test_launcher_starts_an_lmcache_server_with_the_serde(tmp_path):
    """`python -m kvcodec.integrations.lmcache server ...` (the kvcodec-lmcache script) registers the
    serde before LMCache builds its storage manager; plain `lmcache server` would refuse the config
    ("Unknown serde type 'kvcodec'")."""
    import subprocess
    import sys

    from servers import free_port, stop, wait_port

    port, http = free_port(), free_port()
    adapter = ('{"type": "fs", "base_path": "%s", "serde": {"type": "kvcodec", "codec": "kvc-near", '
               '"num_kv_heads": 3, "head_dim": 64, "budget_bits": 3}}' % (tmp_path / "l2"))
    os.makedirs(tmp_path / "l2")
    env = {**os.environ, "LMCACHE_DISABLE_BANNER": "1", "LMCACHE_LOG_LEVEL": "WARNING", "PYTHONWARNINGS": "ignore"}
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "kvcodec.integrations.lmcache", "server", "--host", "127.0.0.1",
                             "--port", str(port), "--http-host", "127.0.0.1", "--http-port", str(http),
                             "--l1-size-gb", "0.1", "--eviction-policy", "LRU", "--no-l1-use-lazy",
                             "--l2-adapter", adapter, "--disable-observability"],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        try:
            wait_port(http, proc, timeout=120)
        except RuntimeError as e:
            raise AssertionError(f"{e}\n{(tmp_path / 'server.log').read_text()[-3000:]}") from None
        assert proc.poll() is None
    finally:
        stop(proc)
        log.close()
    assert "Unknown serde" not in (tmp_path / "server.log").read_text()
