"""``kvcodec encode RAW.safetensors OUT.kvc --codec NAME``."""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("encode", help="compress a raw safetensors KV dump into a KVC file")
    p.add_argument("input", help="raw dump with tensors layers.<i>.k / layers.<i>.v [T, H, D]")
    p.add_argument("output", help="KVC file to write (atomically)")
    p.add_argument("--codec", default="fp8-e4m3", help="codec name or JSON config (default fp8-e4m3)")
    p.add_argument("--tokens-per-chunk", type=int, default=0,
                   help="split each tensor into chunks of this many tokens (0: one chunk)")
    p.add_argument("--json", action="store_true", help="print a JSON summary to stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..cache import KVCache
    from ..codec import get_codec
    from ..format import write_file

    codec = get_codec(args.codec)
    if (codec.params.get("target_kl") and not codec.params.get("calibration")
            and codec.params.get("fallback") == "steps" and "calibration" not in codec.requires):
        # a level preset without a profile: its fixed steps, not a measurement on this model
        print(f"kvcodec encode: note: {codec.preset or codec.codec_id} has no profile of this model, so it codes "
              f"with fixed steps (measured on SmolLM2-135M and Qwen2.5-Coder-0.5B only); for a level met on your "
              f"model run `kvcodec calibrate --model M --out F` and add \"calibration\": F", file=sys.stderr)
    cache = KVCache.from_safetensors(args.input)
    t0 = time.perf_counter()
    # streams layer by layer into a spool beside the output, then renames atomically
    nbytes = write_file(codec, cache, args.output, tokens_per_chunk=args.tokens_per_chunk)
    dt = time.perf_counter() - t0
    summary = {
        "input": os.fspath(args.input),
        "output": os.fspath(args.output),
        "codec": codec.get_config(),
        "layers": cache.num_layers,
        "tokens": cache.num_tokens,
        "bytes": nbytes,
        "bits_per_element": 8 * nbytes / max(1, cache.num_elements),
        "ratio_vs_fp16": cache.fp16_bytes() / max(1, nbytes),
        "seconds": dt,
    }
    if args.json:
        print_json(summary)
    else:
        print(
            f"{summary['output']}: {nbytes} bytes, {summary['bits_per_element']:.3f} bits/element, "
            f"{summary['ratio_vs_fp16']:.2f}x smaller than fp16 ({codec.codec_id}, {dt:.2f} s)"
        )
    return 0
