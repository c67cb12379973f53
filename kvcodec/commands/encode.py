"""``kvcodec encode RAW.safetensors OUT.kvc --codec NAME``."""

from __future__ import annotations

import argparse
import os
import time

from . import print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("encode", help="compress a raw safetensors KV dump into a KVC file")
    p.add_argument("input", help="raw dump with tensors layers.<i>.k / layers.<i>.v [T, H, D]")
    p.add_argument("output", help="KVC file to write (atomically)")
    p.add_argument("--codec", default="fp8-e4m3", help="codec name or JSON config (default fp8-e4m3)")
    p.add_argument("--json", action="store_true", help="print a JSON summary to stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..cache import KVCache
    from ..codec import get_codec

    codec = get_codec(args.codec)
    cache = KVCache.from_safetensors(args.input)
    t0 = time.perf_counter()
    data = codec.encode(cache, path=args.output)
    dt = time.perf_counter() - t0
    summary = {
        "input": os.fspath(args.input),
        "output": os.fspath(args.output),
        "codec": codec.get_config(),
        "layers": cache.num_layers,
        "tokens": cache.num_tokens,
        "bytes": len(data),
        "bits_per_element": 8 * len(data) / max(1, cache.num_elements),
        "ratio_vs_fp16": cache.fp16_bytes() / max(1, len(data)),
        "seconds": dt,
    }
    if args.json:
        print_json(summary)
    else:
        print(
            f"{summary['output']}: {len(data)} bytes, {summary['bits_per_element']:.3f} bits/element, "
            f"{summary['ratio_vs_fp16']:.2f}x smaller than fp16 ({codec.codec_id}, {dt:.2f} s)"
        )
    return 0
