"""GPU decode throughput of every codec with a GPU decoder, against a device-to-device copy and
against the CPU reference decoder, measured in one run.

For each codec a K tensor ``[T_unit, 8, 128]`` (fp16, K-like: per-channel offsets) is encoded on
the CPU by the codec itself; its planes are then tiled along the tokens to ``T = reps * T_unit``
(about ``--size-mb`` of fp16 output), which is a valid encoding of the tiled tensor (fixed-width
planes repeat; ANS stages gain whole token chunks, every stream and table intact). The device
decode of the big tensor is timed with CUDA events (warm-up, then the median of ``--repeats``
runs; planes already on the device, so only kernels are timed), and checked bit for bit: every
tile must equal the CPU reference decode of the unit tensor, which is also timed (CPU GB/s).

GB/s counts fp16 output bytes (2 per element) per second. The copy baseline moves a tensor of
the same byte size with ``dst.copy_(src)``; its GB/s counts the bytes written (a copy reads as
many, so read+write is twice that).

kvc tensors are not tiled (their token-delta rows would run on across tiles): the unit tensor
itself is timed.

An end-to-end row decodes a whole multi-layer cache with ``kvcodec.decode(..., device="cuda")``
(uploads and Python included) against ``device="cpu"``.

Chunk objects (when a real cache is carried in .whl/, eval/gpu_prepare.sh): the real SmolLM2
cache cut into LMCache's 256-token chunks, each coded as the kvcodec serde stores it (a frame,
kvcodec.integrations.lmcache.ChunkCoder; the kvc levels with the carried profile), decoded with
``ChunkCoder.decode_into`` into a CUDA chunk against a CPU one: ms per chunk, bit-exactness.

Usage:
    python eval/bench_gpu.py [--out DIR] [--stem gpu_bench] [--size-mb 1024] [--repeats 10] [--budget-s 200]
Writes ``<stem>.json`` and ``<stem>.md`` to ``--out`` (default ``$OUT`` or eval/results/) with
:func:`kvcodec.harness.results.write_result`; ``device`` keeps the GPU, SM count and CUDA/NVRTC versions.
Run with the repository on ``PYTHONPATH`` (eval/gpu_check.sh sets it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import kvcodec
from kvcodec import gpu
from kvcodec.codec import EncodedTensor, TensorContext
from kvcodec.harness.results import provenance, write_result
from kvcodec.testing import spelled_out

H, D = 8, 128

#: (label, preset name or config, tokens of the unit tensor: a multiple of every chunk / group)
CODECS = [
    ("fp8-e4m3", "fp8-e4m3", 8192),
    ("fp8-e5m2", "fp8-e5m2", 8192),
    ("nvfp4", "nvfp4", 8192),
    ("kivi-4", "kivi-4", 8192),
    ("kivi-2", "kivi-2", 8192),
    ("kivi-4-ans", "kivi-4-ans", 8192),
    ("kivi-2-ans", "kivi-2-ans", 8192),
    ("kivi-4-ans chunk=1024", {"id": "kivi-ans", "bits": 4, "chunk": 1024}, 8192),
    ("kivi-4-ans tables=row", {"id": "kivi-ans", "bits": 4, "tables": "row"}, 8192),
    ("cachegen-lmcache", "cachegen-lmcache", 8192),
    ("cachegen", "cachegen", 40960),
    ("kivi-4-delta-ans", "kivi-4-delta-ans", 32768),  # anchors (1 in 8) fill whole 4096-token chunks
    # kvc: not tiled (token-delta rows run across tiles, and the planes are packed): one tensor
    # coded whole. Few streams per tensor (rows_per_stream x chunk symbols each), so this is the
    # per-tensor rate; the -cal preset is coded without a calibration file (same stage layout:
    # magnitude contexts, 64-row streams, k_tok rows)
    ("kvc-near", "kvc-near", 8192),
    ("kvc-near-cal (no cal file)", "kvc-near-cal", 8192),
    ("kvc-near-cal chunk=256 (no cal file)", {"id": "kvc-near-cal", "chunk": 256}, 8192),  # 8x the streams
    # more, shorter streams (lossless settings): what kvc's GPU decode gains and what it costs in bits
    ("kvc-near-cal rows=16 chunk=512 (no cal file)", {"id": "kvc-near-cal", "rows_per_stream": 16, "chunk": 512}, 8192),
    ("kvc-near-cal rows=8 chunk=256 (no cal file)", {"id": "kvc-near-cal", "rows_per_stream": 8, "chunk": 256}, 8192),
    ("kvc-near-cal rows=4 chunk=128 (no cal file)", {"id": "kvc-near-cal", "rows_per_stream": 4, "chunk": 128}, 8192),
]
#: Codecs whose unit tensor is decoded as it is instead of tiled.
UNTILED = ("kvc",)


def k_like(t: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, D, generator=g) * 1.3 + torch.randn(1, H, D, generator=g) * 4
    return x.half()


# ---------------------------------------------------------------------------- tiling
def _tile_stage(planes: dict[str, np.ndarray], prefix: str, reps: int) -> dict[str, np.ndarray]:
    """Tile an ANS stage (formats/ANS.md §3) along its tokens: needs N % C == 0."""
    meta = planes[prefix + "meta"].copy()
    n, c, scope = int(meta[2]), int(meta[3]), int(meta[8])
    assert n % c == 0, f"{prefix}: {n} tokens not a multiple of the {c}-token chunk"
    meta[2] = n * reps
    words, off = planes[prefix + "words"], planes[prefix + "offsets"].astype(np.int64)
    w = int(off[-1])
    big_off = np.concatenate([off[:-1] + k * w for k in range(reps)] + [np.array([reps * w])])
    assert big_off[-1] < 2**32
    out = {prefix + "meta": meta, prefix + "words": np.tile(words, reps), prefix + "offsets": big_off.astype(np.uint32)}
    for name in ("tables", "row_table"):
        if prefix + name in planes:
            a = planes[prefix + name]
            out[prefix + name] = np.concatenate([a] * reps, axis=0) if scope == 1 else a
    return out


def tile_encoded(codec, enc: EncodedTensor, t_unit: int, reps: int) -> EncodedTensor:
    """The planes of the tensor made of ``reps`` copies of the unit tensor along the tokens."""
    p = dict(enc.planes)
    cid = codec.codec_id
    tile0 = lambda a: np.concatenate([a] * reps, axis=0)  # noqa: E731
    if cid == "fp8":
        assert p["scale"].shape[0] == 1, "bench uses per-head scales"
        p["codes"] = tile0(p["codes"])
    elif cid == "nvfp4":
        p["codes"], p["block_scale"] = tile0(p["codes"]), tile0(p["block_scale"])
    elif cid == "kivi":
        assert enc.params["recent"] == 0 and t_unit % enc.params["group"] == 0
        p["codes"] = np.tile(p["codes"], reps)  # whole bytes: t_unit * H * D * bits % 8 == 0
        p["scale"], p["zero"] = tile0(p["scale"]), tile0(p["zero"])
    elif cid == "kivi-ans":
        p["scale"], p["zero"] = tile0(p["scale"]), tile0(p["zero"])
        for pre in ("ans_", "anc_"):
            if pre + "meta" in p:
                p.update(_tile_stage(p, pre, reps))
    elif cid in ("cachegen", "cachegen-lmcache"):
        p["scale"] = np.tile(p["scale"], reps)
        for pre in ("ans_", "anc_"):
            if pre + "meta" in p:
                p.update(_tile_stage(p, pre, reps))
    else:
        raise ValueError(f"no tiling for {cid}")
    return EncodedTensor(p, dict(enc.params))


# ---------------------------------------------------------------------------- timing
def cuda_time(fn, repeats: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` on the current stream, by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def wall_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bits_view(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)


# ---------------------------------------------------------------------------- main
def bench_codec(name: str, config, t_unit: int, size_mb: float, repeats: int, copy_gbs: float) -> dict:
    codec = kvcodec.get_codec(config)
    x = k_like(t_unit, seed=1)
    cache = kvcodec.KVCache.from_tensors([(x, x)] * 4)
    ctx = TensorContext(layer=1, role="k", shape=tuple(x.shape), dtype=torch.float16,
                        globals=codec.encode_globals(cache))
    t0 = time.perf_counter()
    enc = codec.encode_tensor(x, ctx)
    enc_s = time.perf_counter() - t0
    bits = 8.0 * enc.nbytes / x.numel()
    t0 = time.perf_counter()
    ref = codec.decode_tensor(enc, ctx)
    cpu_s = time.perf_counter() - t0
    unit_bytes = x.numel() * 2
    reps = 1 if codec.codec_id in UNTILED else max(1, int(round(size_mb * 2**20 / unit_bytes)))
    big = enc if reps == 1 else tile_encoded(codec, enc, t_unit, reps)
    bctx = TensorContext(layer=1, role="k", shape=(t_unit * reps, H, D), dtype=torch.float16, globals=ctx.globals)
    plan = gpu.prepare_decode(codec, big, bctx, "cuda")
    out = plan()  # checked run (stream status included)
    ok = bool(torch.equal(bits_view(out.view(reps, t_unit, H, D)), bits_view(ref.cuda()).expand(reps, -1, -1, -1)))
    del out
    gpu_s = cuda_time(lambda: plan(check=False), repeats)
    out_bytes = unit_bytes * reps
    row = {
        "codec": name, "bits_per_element": round(bits, 3), "tokens": t_unit * reps, "shape": [t_unit * reps, H, D],
        "output_GB": round(out_bytes / 1e9, 3), "gpu_ms": round(gpu_s * 1e3, 3),
        "gpu_GBps": round(out_bytes / gpu_s / 1e9, 1), "pct_of_copy": round(100 * out_bytes / gpu_s / 1e9 / copy_gbs, 1),
        "cpu_ref_GBps": round(unit_bytes / cpu_s / 1e9, 3), "speedup_vs_cpu": round(cpu_s / unit_bytes * out_bytes / gpu_s, 1),
        "encode_unit_s": round(enc_s, 2), "bit_exact": ok,
    }
    del plan, big
    torch.cuda.empty_cache()
    return row


def bench_end_to_end(name: str, layers: int, tokens: int) -> dict:
    # spelled out: a -cal preset is coded without its calibration file (same stage layout)
    codec = spelled_out(name)
    pairs = [(k_like(tokens, 10 + i), k_like(tokens, 100 + i)) for i in range(layers)]
    cache = kvcodec.KVCache.from_tensors(pairs)
    blob = codec.encode(cache)
    kvcodec.decode(blob, device="cuda")  # warm (compiles/loads kernels once)
    torch.cuda.synchronize()
    gpu_s = wall_time(lambda: (kvcodec.decode(blob, device="cuda"), torch.cuda.synchronize()), repeats=3)
    cpu_s = wall_time(lambda: kvcodec.decode(blob), repeats=1)
    b = cache.num_elements * 2
    return {"codec": name, "layers": layers, "shape": [tokens, H, D], "fp16_GB": round(b / 1e9, 3),
            "gpu_e2e_GBps": round(b / gpu_s / 1e9, 2), "cpu_e2e_GBps": round(b / cpu_s / 1e9, 3),
            "speedup": round(cpu_s / gpu_s, 1)}


def _carried(pattern: str) -> str | None:
    found = sorted(Path(__file__).resolve().parent.parent.glob(f".whl/{pattern}"))
    return str(found[0]) if found else None


def bench_chunk_objects(path: str, profile: str | None, repeats: int = 3) -> list[dict]:
    """Decode time of LMCache chunk frames (256 tokens) of a real cache, CUDA against CPU."""
    from kvcodec.integrations.lmcache import ChunkCoder, to_chunks

    full = kvcodec.KVCache.from_safetensors(path)
    k0 = full.layers[0]["k"]
    chunks = to_chunks(full, 256)
    rows = []
    for name in ("kvc-transparent", "kvc-near", "kvc-aggressive", "kivi-4-ans", "fp8-e4m3"):
        kvc = name.startswith("kvc-")
        if kvc and profile is None:
            continue
        coder = ChunkCoder(name, num_kv_heads=k0.shape[1], head_dim=k0.shape[2], profile=profile if kvc else None)
        frames = [coder.encode(c) for c in chunks]
        outs_cpu = [torch.empty_like(c) for c in chunks]
        outs_gpu = [torch.empty(c.shape, dtype=c.dtype, device="cuda") for c in chunks]

        def on(outs):
            for f, o in zip(frames, outs):
                coder.decode_into(f, o)

        on(outs_gpu)  # warm: kernels compiled and loaded
        torch.cuda.synchronize()
        gpu_s = wall_time(lambda: (on(outs_gpu), torch.cuda.synchronize()), repeats)
        cpu_s = wall_time(lambda: on(outs_cpu), repeats)
        same = all(torch.equal(bits_view(a.cuda()), bits_view(b)) for a, b in zip(outs_cpu, outs_gpu))
        n = sum(c.numel() for c in chunks)
        rows.append({"codec": name, "chunks": len(chunks), "chunk_shape": list(chunks[0].shape),
                     "bits_per_element": round(8 * sum(len(f) for f in frames) / n, 3),
                     "gpu_ms_per_chunk": round(gpu_s / len(chunks) * 1e3, 2),
                     "cpu_ms_per_chunk": round(cpu_s / len(chunks) * 1e3, 2),
                     "speedup": round(cpu_s / gpu_s, 2), "bit_exact": same})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    ap.add_argument("--size-mb", type=float, default=1024.0)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=200.0, help="skip remaining codecs past this")
    ap.add_argument("--codecs", default="", help="comma-separated labels (default: all)")
    ap.add_argument("--stem", default="gpu_bench", help="file name of the result, without suffix")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device; nothing measured", file=sys.stderr)
        return 2
    start = time.perf_counter()
    dev = torch.cuda.get_device_properties(0)
    nbytes = int(args.size_mb * 2**20) // 2 * 2
    src = torch.randn(nbytes // 2, device="cuda").half()
    dst = torch.empty_like(src)
    copy_s = cuda_time(lambda: dst.copy_(src), args.repeats)
    copy_gbs = nbytes / copy_s / 1e9
    del src, dst
    torch.cuda.empty_cache()
    rows, e2e, skipped = [], [], []
    wanted = set(filter(None, args.codecs.split(",")))
    for name, config, t_unit in CODECS:
        if wanted and name not in wanted:
            continue
        if time.perf_counter() - start > args.budget_s:
            skipped.append(name)
            continue
        try:
            rows.append(bench_codec(name, config, t_unit, args.size_mb, args.repeats, copy_gbs))
        except Exception as e:  # noqa: BLE001 - record and go on: one codec must not hide the others
            rows.append({"codec": name, "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps(rows[-1]), flush=True)
    # kvc's streams are few per tensor: a whole model's cache (24 layers) shows how far decoding
    # all tensors at once (gpu.batched_decode) fills the device
    for name, layers in (("fp8-e4m3", 4), ("kivi-4-ans", 4), ("cachegen-lmcache", 4), ("kvc-near", 4),
                         ("kvc-near-cal", 4), ("kvc-near-cal", 24)):
        if time.perf_counter() - start > args.budget_s:
            skipped.append(f"e2e:{name}x{layers}")
            continue
        try:
            e2e.append(bench_end_to_end(name, layers=layers, tokens=2048))
        except Exception as e:  # noqa: BLE001
            e2e.append({"codec": name, "layers": layers, "error": f"{type(e).__name__}: {e}"[:300]})
        print(json.dumps(e2e[-1]), flush=True)
    chunk_rows: list[dict] = []
    real = _carried("real_cache_*.safetensors")
    if real and time.perf_counter() - start <= args.budget_s:
        try:
            chunk_rows = bench_chunk_objects(real, _carried("*.qstats.safetensors"))
        except Exception as e:  # noqa: BLE001
            chunk_rows = [{"codec": "chunk objects", "error": f"{type(e).__name__}: {e}"[:300]}]
    elif real:
        skipped.append("chunk objects")
    try:
        major, minor = gpu.nvrtc_version()
        nvrtc = f"{major}.{minor}"
    except Exception:  # noqa: BLE001
        nvrtc = "?"
    prov["machine"] += f", GPU {dev.name}" if "GPU" not in prov["machine"] else ""
    result = {
        "device": {"gpu": dev.name, "sms": dev.multi_processor_count, "torch": torch.__version__,
                    "cuda": torch.version.cuda, "nvrtc": nvrtc, "cpu_threads": torch.get_num_threads(),
                    "python": platform.python_version(), "host": platform.machine()},
        "copy": {"bytes": nbytes, "ms": round(copy_s * 1e3, 3), "GBps_written": round(copy_gbs, 1),
                 "GBps_read_plus_written": round(2 * copy_gbs, 1)},
        "codecs": rows, "end_to_end": e2e, "chunk_objects": chunk_rows, "skipped_for_time": skipped,
        "elapsed_s": round(time.perf_counter() - start, 1),
    }
    write_result(Path(args.out) / args.stem, result, to_markdown(result, prov["date"]), prov=prov, echo=True)
    return 0 if all(r.get("bit_exact") for r in rows + chunk_rows) else 1


def to_markdown(r: dict, date: str) -> str:
    m = r["device"]
    lines = [
        f"# GPU decode throughput ({m['gpu']}, {date})", "",
        f"Device: {m['gpu']} ({m['sms']} SMs), torch {m['torch']} (CUDA {m['cuda']}), NVRTC {m['nvrtc']}, "
        f"{m['cpu_threads']} CPU threads for the reference.  ",
        f"Copy baseline (`dst.copy_(src)`, {r['copy']['bytes'] / 1e9:.2f} GB fp16): {r['copy']['GBps_written']} GB/s written "
        f"({r['copy']['GBps_read_plus_written']} GB/s read+written).", "",
        "GB/s = fp16 output bytes per second (kernels only, planes on the device, median of CUDA-event timings). "
        "CPU ref = the codec's reference decode_tensor on the unit tensor. bit-exact: every tile equals the CPU "
        "reference decode.", "",
        "| codec | bits/elem | output GB | GPU ms | GPU GB/s | % of copy | CPU ref GB/s | speedup | bit-exact |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["codecs"]:
        if "error" in row:
            lines.append(f"| {row['codec']} | error: {row['error']} | | | | | | | |")
            continue
        lines.append(f"| {row['codec']} | {row['bits_per_element']} | {row['output_GB']} | {row['gpu_ms']} | "
                     f"{row['gpu_GBps']} | {row['pct_of_copy']} | {row['cpu_ref_GBps']} | {row['speedup_vs_cpu']}x | "
                     f"{'yes' if row['bit_exact'] else 'NO'} |")
    if r["end_to_end"]:
        lines += ["", "End to end, `kvcodec.decode(blob, device=...)` of a whole cache of [2048, 8, 128] K and V "
                  "per layer (uploads, Python, all layers):", "",
                  "| codec | layers | fp16 GB | GPU GB/s | CPU GB/s | speedup |", "|---|---|---|---|---|---|"]
        for row in r["end_to_end"]:
            if "error" in row:
                lines.append(f"| {row['codec']} | {row.get('layers', '')} | error: {row['error']} | | | |")
            else:
                lines.append(f"| {row['codec']} | {row['layers']} | {row['fp16_GB']} | {row['gpu_e2e_GBps']} | {row['cpu_e2e_GBps']} | {row['speedup']}x |")
    if r.get("chunk_objects"):
        lines += ["", "Chunk objects: the real SmolLM2 cache (.whl/) in LMCache's 256-token chunks, each a kvcodec "
                  "serde frame (kvc levels with the carried profile), decoded by `ChunkCoder.decode_into` into a "
                  "chunk on the device (wall time of all chunks, best of 3):", "",
                  "| codec | chunks | bits/elem | GPU ms/chunk | CPU ms/chunk | speedup | bit-exact |",
                  "|---|---|---|---|---|---|---|"]
        for row in r["chunk_objects"]:
            if "error" in row:
                lines.append(f"| {row['codec']} | error: {row['error']} | | | | | |")
            else:
                lines.append(f"| {row['codec']} | {row['chunks']} | {row['bits_per_element']} | {row['gpu_ms_per_chunk']} | "
                             f"{row['cpu_ms_per_chunk']} | {row['speedup']}x | {'yes' if row['bit_exact'] else 'NO'} |")
    if r["skipped_for_time"]:
        lines += ["", f"Skipped (time budget): {', '.join(r['skipped_for_time'])}"]
    lines += ["", f"Elapsed: {r['elapsed_s']} s", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
