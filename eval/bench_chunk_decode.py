"""Decoding a prefix stored as 256-token chunk files (what the vLLM connector and the LMCache
serde load), CPU, by schedule.

A 2,048-token SmolLM2 cache (bf16, the built-in text) is coded as 256-token parts
(``KVCCodec.encode_parts``, each level, with the given profile) and decoded five ways, in
interleaved rounds, with the calling thread bound to one CPU as vLLM's CPU worker binds itself
(``--no-bind``: not bound) and decode threads free to use every CPU:

* ``seq/tensor``: one file after another, each tensor its own native call (``read_layers(threads=1)``);
* ``2 side by side/tensor``: two threads, each decoding whole files that way: the connector
  before ``kvcodec.decode_many``;
* ``2 side by side/file``: two threads, each file's tensors checked, then decoded in one native
  call (``kvcodec.decode(blob, threads=1)``: ``KVCReader.staged_cache``);
* ``many/1`` and ``many/2``: ``kvcodec.decode_many`` with one or two decode threads: the calling
  thread checks each file while they decode the files before it (the connector now).

Every schedule's values are checked equal, bit for bit. Reports medians and quartiles of the
rounds' wall times (a shared 2-vCPU machine is noisy: compare schedules within one run).

Usage:
    python eval/bench_chunk_decode.py --profile P [--levels kvc-near,...] [--rounds 15] [--out chunk_decode]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import kvcodec
from kvcodec.harness.capture import default_cache
from kvcodec.harness.results import provenance, write_result

ROOT = Path(__file__).resolve().parents[1]
SCHEDULES = ("seq/tensor", "2 side by side/tensor", "2 side by side/file", "many/1", "many/2")


def _unbind() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


def _per_tensor(blob: bytes) -> list:
    with kvcodec.open(blob) as r:
        return list(r.read_layers(threads=1))


def _layers(x) -> list:
    return x.layers if isinstance(x, kvcodec.KVCache) else x


def _runs(blobs: list[bytes]) -> dict:
    def side_by_side(fn):
        with ThreadPoolExecutor(2, initializer=_unbind) as p:
            return list(p.map(fn, blobs))

    return {
        "seq/tensor": lambda: [_per_tensor(b) for b in blobs],
        "2 side by side/tensor": lambda: side_by_side(_per_tensor),
        "2 side by side/file": lambda: side_by_side(lambda b: kvcodec.decode(b, threads=1)),
        "many/1": lambda: kvcodec.decode_many(blobs, threads=1, initializer=_unbind),
        "many/2": lambda: kvcodec.decode_many(blobs, threads=2, initializer=_unbind),
    }


def _same(outs: dict) -> bool:
    ref = [_layers(x) for x in next(iter(outs.values()))]
    for got in outs.values():
        for a, b in zip(ref, [_layers(x) for x in got]):
            for la, lb in zip(a, b):
                if any(not torch.equal(la[r].view(torch.int16), lb[r].view(torch.int16)) for r in la):
                    return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default=None, help="the model's profile (kvcodec calibrate); default: none")
    ap.add_argument("--levels", default="kvc-transparent,kvc-near,kvc-aggressive")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--no-bind", action="store_true")
    ap.add_argument("--out", default="chunk_decode")
    args = ap.parse_args()
    prov = provenance()
    if args.profile:
        os.environ["KVCODEC_PROFILES"] = os.pathsep.join([args.profile, os.environ.get("KVCODEC_PROFILES", "")])
    cache = default_cache(args.context, torch.bfloat16)
    bound = not args.no_bind and hasattr(os, "sched_setaffinity") and (os.cpu_count() or 1) > 1
    if bound:
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    rows = []
    for level in args.levels.split(","):
        cfg = {"id": level, "calibration": args.profile} if args.profile else level
        blobs = kvcodec.get_codec(cfg).encode_parts(cache, args.chunk)
        runs = _runs(blobs)
        outs = {name: fn() for name, fn in runs.items()}  # also the warm-up
        if not _same(outs):
            raise SystemExit(f"{level}: the schedules decoded different values")
        del outs
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["2 side by side/tensor"])
        for name in SCHEDULES:
            q = statistics.quantiles(times[name], n=4)
            rows.append({"level": level, "schedule": name, "files": len(blobs), "bytes": sum(map(len, blobs)),
                         "median_s": statistics.median(times[name]), "q1_s": q[0], "q3_s": q[2],
                         "vs_side_by_side_tensor": statistics.median(times[name]) / base, "times_s": times[name]})
        print(f"{level}: " + ", ".join(f"{r['schedule']} {r['median_s']:.3f}" for r in rows[-len(SCHEDULES):]),
              flush=True)
    doc = {"context": args.context, "chunk": args.chunk, "rounds": args.rounds, "profile": args.profile,
           "caller_bound_to_one_cpu": bound, "cpus": os.cpu_count(), "rows": rows}
    md = [f"# Decoding a {args.context}-token prefix stored as {args.chunk}-token chunk files, by schedule", "",
          f"SmolLM2-135M, bf16, the built-in text; profile `{Path(args.profile).name if args.profile else 'none'}`; "
          f"{os.cpu_count()} CPUs, the calling thread {'bound to one CPU (as vLLM' + chr(39) + 's CPU worker)' if bound else 'not bound'}; "
          f"{args.rounds} interleaved rounds: median wall seconds (quartiles), and the median against two threads "
          "decoding whole files side by side, tensor by tensor (the vLLM connector before kvcodec.decode_many). "
          "Every schedule decodes the same values, bit for bit (checked).", "",
          "| level | bytes | " + " | ".join(SCHEDULES) + " |", "|---|---|" + "---|" * len(SCHEDULES)]
    for level in args.levels.split(","):
        rs = [r for r in rows if r["level"] == level]
        md.append(f"| {level} | {rs[0]['bytes']:,} | " + " | ".join(
            f"{r['median_s']:.3f} ({r['q1_s']:.3f}–{r['q3_s']:.3f}) {r['vs_side_by_side_tensor']:.2f}×" for r in rs) + " |")
    write_result(ROOT / "eval" / "results" / args.out, doc, "\n".join(md) + "\n", prov=prov, echo=True)


if __name__ == "__main__":
    sys.exit(main())
