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
import sys
import time
from typing import Any

from . import format_table, print_json

COLUMNS = ["codec", "bits_per_element", "ratio_vs_fp16", "rel_err_k", "rel_err_v", "encode_MBps", "decode_MBps"]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="bits/element, error and CPU MB/s of codecs on one cache")
    p.add_argument("--input", help="raw safetensors dump (default: the built-in SmolLM2 cache)")
    p.add_argument("--context", type=int, default=1024, help="tokens of the built-in cache (default 1024)")
    p.add_argument("--codecs", default="all", help="comma-separated codec names, or 'all'")
    p.add_argument("--repeat", type=int, default=3, help="timed runs per codec; the fastest is kept")
    p.add_argument("--calibration", metavar="FILE",
                   help="calibration file (kvcodec calibrate) for the kvc presets tuned for one (names "
                   "ending in -cal): their encode time then includes the encoder's use of it")
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


def bench_codec(name: str, cache, repeat: int = 3, codec: Any = None) -> dict[str, Any]:
    """Encode and decode ``cache`` with codec ``name`` (or ``codec``, shown as ``name``); return
    one table row."""
    from .. import decode
    from ..codec import get_codec

    codec = get_codec(name) if codec is None else codec
    enc_t, dec_t = [], []
    blob = b""
    out = None
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        blob = codec.encode(cache)
        t1 = time.perf_counter()
        out = decode(blob)
        t2 = time.perf_counter()
        enc_t.append(t1 - t0)
        dec_t.append(t2 - t1)
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
        "encode_MBps": round(mb / min(enc_t), 1),
        "decode_MBps": round(mb / min(dec_t), 1),
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
    settings, _ = with_calibration([(name, get_codec(name)) for name in names], args.calibration)
    rows = []
    for name, codec in settings:
        print(f"bench: {name} ...", file=sys.stderr, flush=True)
        rows.append(bench_codec(name, cache, args.repeat, codec))
    result = {
        "command": "kvcodec " + " ".join(getattr(args, "argv", ["bench"])),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.processor() or platform.system()}",
        "threads": 1,
        "source": source,
        "layers": cache.num_layers,
        "tokens": cache.num_tokens,
        "source_dtype": str(cache.dtype).replace("torch.", ""),
        "fp16_MB": round(cache.fp16_bytes() / 1e6, 3),
        "native": native_status,
        "rows": rows,
    }
    table = format_table(rows, COLUMNS)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(result, f, indent=2)
        with open(os.path.join(args.out, "bench.md"), "w") as f:
            f.write(
                f"# kvcodec bench\n\nCommand: `{result['command']}`  \nDate: {result['date']}  \n"
                f"Machine: {result['machine']}, torch threads: 1  \nEntropy coding: {native_status}  \nCache: {source}, "
                f"{cache.num_layers} layers, {result['source_dtype']}, {result['fp16_MB']} MB as fp16\n\n"
                "MB/s are of fp16-equivalent input (2 bytes per element), fastest of "
                f"{args.repeat} runs; the decode column includes container parsing and validation.\n\n"
                "```\n" + table + "\n```\n"
            )
    if args.json:
        print_json(result)
    else:
        print(table)
    return 0
