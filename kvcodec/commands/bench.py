"""``kvcodec bench``: size, error and CPU speed of every codec on one cache.

By default the cache is the built-in one (SmolLM2-135M on the vendored Jargon File text, needs the
[eval] extra); ``--input RAW.safetensors`` benchmarks any raw dump instead.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from typing import Any

from . import codes_with_fixed_steps, format_table, positive_int, print_json

COLUMNS = ["codec", "bits_per_element", "ratio_vs_fp16", "rel_err_k", "rel_err_v", "encode_MBps", "decode_MBps"]
#: with a reference codec in the run: each codec's best encode / decode time over the reference's,
#: and the median over rounds of its time over the reference's in the same round
REF_COLUMNS = ["encode_x_ref", "decode_x_ref", "encode_x_ref_med", "decode_x_ref_med"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="bits/element, error and CPU MB/s of codecs on one cache",
        description="Encode and decode one KV cache with each codec (torch on one thread; a codec that "
        "codes tensors side by side, such as kvc, on up to its own thread count, at most the CPUs); print each "
        "codec's bits per element, size ratio to fp16, relative error of K and V, and encode and "
        "decode MB/s (of fp16-equivalent input). Without --input the cache is the built-in one "
        "(SmolLM2-135M on a text excerpt: loads the model, needs the [eval] extra).",
        epilog="examples:\n"
        "  kvcodec bench --input kv.safetensors --codecs fp8-e4m3,kivi-4,kvc-near --repeat 5\n"
        "  kvcodec bench --context 2048 --out runs/bench")
    p.add_argument("--input", help="raw safetensors dump (default: the built-in SmolLM2 cache)")
    p.add_argument("--context", type=positive_int, default=1024, help="tokens of the built-in cache")
    p.add_argument("--codecs", default="all", help="comma-separated preset names (`kvcodec codecs`), or 'all'")
    p.add_argument("--repeat", type=positive_int, default=3,
                   help="timed rounds; each round runs every codec once (interleaved, so a machine "
                   "whose speed drifts skews no codec more than another); the fastest is kept")
    p.add_argument("--reference", default="cachegen",
                   help="codec whose times the others' are divided by (columns encode_x_ref, "
                   "decode_x_ref; default cachegen, when it is in the run)")
    p.add_argument("--calibration", metavar="FILE",
                   help="calibration file (kvcodec calibrate): the kvc presets ending in -cal need one "
                   "('all' leaves them out without it) and their encode time then includes its use; when "
                   "it holds a profile, kvc-transparent, kvc-near and kvc-aggressive also run with it "
                   "('<name> +profile')")
    p.add_argument("--out", help="write bench.json and bench.md into this directory")
    p.add_argument("--json", action="store_true", help="print JSON to stdout")
    p.set_defaults(func=run)


def relative_error(cache, out, role: str) -> float:
    """sqrt(sum |x - y|^2 / sum |x|^2) over every tensor of one role (``k``, ``v`` or ``kv``)."""
    num = den = 0.0
    for (_, r, a), (_, _, b) in zip(cache.tensors(), out.tensors()):
        if r != role:
            continue
        a32, b32 = a.double(), b.double()
        num += float(((a32 - b32) ** 2).sum())
        den += float((a32**2).sum())
    return (num / den) ** 0.5 if den > 0 else 0.0


def _timed_round_trip(codec: Any, cache) -> tuple[float, float, bytes, Any]:
    from .. import decode

    t0 = time.perf_counter()
    blob = codec.encode(cache)
    t1 = time.perf_counter()
    out = decode(blob)
    return t1 - t0, time.perf_counter() - t1, blob, out


def bench_codec(name: str, cache, repeat: int = 3, codec: Any = None) -> dict[str, Any]:
    """Encode and decode ``cache`` with codec ``name`` (or ``codec``, shown as ``name``); return
    one table row."""
    from ..codec import get_codec

    codec = get_codec(name) if codec is None else codec
    return bench_interleaved([(name, codec)], cache, repeat, reference=None)[0]


def bench_interleaved(settings: list[tuple[str, Any]], cache, repeat: int = 3,
                      reference: str | None = "cachegen", progress: Any = None) -> list[dict[str, Any]]:
    """Rows for ``settings`` (``(name, codec)`` pairs), timed in ``repeat`` rounds that each run
    every codec once, keeping each codec's fastest encode and decode. On a machine whose speed
    drifts (shared cores, thermal limits) consecutive runs of one codec would all land in one
    phase of the drift; interleaved, every codec samples every phase, so the ratios between
    codecs hold even when the absolute times do not. With ``reference`` among the names, every
    row also gets ``encode_x_ref`` / ``decode_x_ref``: its fastest time over the reference's
    fastest, and ``encode_x_ref_med`` / ``decode_x_ref_med``: the median over the rounds of its
    time over the reference's in the same round (paired: a slow phase that hits a whole round
    cancels; the fastest times instead favour the codec that needs fewer cores when a shared
    machine lends its other cores now and then)."""
    rows: list[dict[str, Any]] = []
    times: list[list[tuple[float, float]]] = [[] for _ in settings]  # per setting, per round
    for rnd in range(max(1, repeat)):
        for i, (name, codec) in enumerate(settings):
            if progress is not None:
                progress(f"bench: round {rnd + 1}/{max(1, repeat)}: {name} ...")
            te, td, blob, out = _timed_round_trip(codec, cache)
            if rnd == 0:  # size and error from the first round (the output is the same every time)
                rows.append(_row(name, codec, cache, blob, out, te, td))
            times[i].append((te, td))
            del blob, out
    best = [(min(te for te, _ in t), min(td for _, td in t)) for t in times]
    mb = cache.fp16_bytes() / 1e6
    for row, (te, td) in zip(rows, best):
        row["encode_MBps"], row["decode_MBps"] = round(mb / te, 1), round(mb / td, 1)
    ref = next((i for i, (name, _) in enumerate(settings) if name == reference), None)
    if ref is not None:
        import statistics

        for row, (te, td), own in zip(rows, best, times):
            row["encode_x_ref"] = round(te / best[ref][0], 3)
            row["decode_x_ref"] = round(td / best[ref][1], 3)
            for k, col in ((0, "encode_x_ref_med"), (1, "decode_x_ref_med")):
                row[col] = round(statistics.median(a[k] / b[k] for a, b in zip(own, times[ref])), 3)
    return rows


def _row(name: str, codec: Any, cache, blob: bytes, out: Any, enc_s: float, dec_s: float) -> dict[str, Any]:
    mb = cache.fp16_bytes() / 1e6
    roles = {"k", "v"} if any("k" in layer for layer in cache.layers) else {"kv"}
    return {
        "codec": name,
        "config": codec.get_config(),
        "bytes": len(blob),
        "bits_per_element": round(8 * len(blob) / max(1, cache.num_elements), 4),
        "ratio_vs_fp16": round(cache.fp16_bytes() / max(1, len(blob)), 3),
        "rel_err_k": round(relative_error(cache, out, "k" if "k" in roles else "kv"), 6),
        "rel_err_v": round(relative_error(cache, out, "v"), 6) if "v" in roles else None,
        "encode_MBps": round(mb / enc_s, 1),
        "decode_MBps": round(mb / dec_s, 1),
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from ..cache import KVCache
    from ..codec import list_codecs

    if args.input:
        cache = KVCache.from_safetensors(args.input)
        source = os.fspath(args.input)
    else:
        from ..harness.capture import default_cache

        cache = default_cache(context=args.context)
        source = f"built-in SmolLM2-135M cache, {cache.num_tokens} tokens"
    names = list_codecs() if args.codecs == "all" else [c.strip() for c in args.codecs.split(",") if c.strip()]
    torch.set_num_threads(1)  # MB/s per core, comparable across codecs
    from .. import native

    st = native.status()
    native_status = "native C coder" if st["available"] else f"constriction + numpy (native coder off: {st['error'] or 'KVCODEC_NATIVE=0'})"
    print(f"bench: entropy coding through the {native_status}", file=sys.stderr, flush=True)
    from ..codec import get_codec
    from ..harness.evaluate import with_calibration

    # with a calibration file the kvc presets tuned for one (*-cal) use it: rows "<name> +calibration"
    settings, skipped = with_calibration([(name, get_codec(name)) for name in names], args.calibration,
                                         skip_uncalibrated=args.codecs == "all")
    fixed = [name for name, codec in settings if codes_with_fixed_steps(codec)]
    if fixed and not args.calibration:
        print(f"bench: warning: {', '.join(fixed)}: no calibration file, so fixed steps measured on "
              "SmolLM2-135M and Qwen2.5-Coder-0.5B, not on this model; give --calibration FILE (from "
              "kvcodec calibrate)", file=sys.stderr, flush=True)
    if skipped:
        print(f"bench: left out {', '.join(skipped)} (tuned for a calibration file: give one with "
              "--calibration FILE, from kvcodec calibrate)", file=sys.stderr, flush=True)
    rows = bench_interleaved(settings, cache, args.repeat, args.reference,
                             progress=lambda msg: print(msg, file=sys.stderr, flush=True))
    has_ref = any("encode_x_ref" in r for r in rows)
    cpus = os.cpu_count() or 1
    codec_threads = {}
    for _, codec in settings:  # what each codec's calls may use (kvc's calibrated calls: see the note)
        codec_threads[codec.codec_id] = {"encode": min(int(getattr(codec, "encode_threads", 1)), cpus),
                                         "decode": min(int(getattr(codec, "decode_threads", 1)), cpus)}
    threads_note = ("Torch threads: 1. Codec threads (tensors coded side by side, at most the "
                    f"{cpus} CPUs): " + ", ".join(f"{k} encode {v['encode']} / decode {v['decode']}"
                                                   for k, v in codec_threads.items())
                    + (" (a kvc encode with a profile: 2 when the profile predicts across layers, else 1)"
                       if "kvc" in codec_threads else "") + ".")
    from ..harness.results import SCHEMA, provenance, with_provenance_block

    command = "kvcodec " + shlex.join(getattr(args, "argv", ["bench"]))
    result = {
        # the header every eval/results file carries; command, date and machine stay below as well
        "schema": SCHEMA,
        "provenance": provenance(command=command),
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.system()}",
        "threads": 1,
        "codec_threads": codec_threads,
        "source": source,
        "layers": cache.num_layers,
        "tokens": cache.num_tokens,
        "source_dtype": str(cache.dtype).replace("torch.", ""),
        "fp16_MB": round(cache.fp16_bytes() / 1e6, 3),
        "native": native_status,
        "reference": args.reference if has_ref else None,
        "rows": rows,
    }
    table = format_table(rows, COLUMNS + (REF_COLUMNS if has_ref else []))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(args.out, "bench.md"), "w") as f:
            f.write(with_provenance_block(
                f"# kvcodec bench\n\n{threads_note}  \nEntropy coding: {native_status}  \nCache: {source}, "
                f"{cache.num_layers} layers, {result['source_dtype']}, {result['fp16_MB']} MB as fp16\n\n"
                "MB/s are of fp16-equivalent input (2 bytes per element), fastest of "
                f"{args.repeat} interleaved rounds (each round runs every codec once); the decode "
                "column includes container parsing and validation."
                + (f" `*_x_ref`: fastest time over `{args.reference}`'s fastest in the same run; "
                   f"`*_x_ref_med`: the median over rounds of the time over `{args.reference}`'s in the "
                   "same round." if has_ref else "")
                + "\n\n"
                "```\n" + table + "\n```\n", result["provenance"]
            ))
    if args.json:
        print_json(result)
    else:
        print(table)
    return 0
