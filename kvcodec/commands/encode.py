"""``kvcodec encode RAW.safetensors OUT.kvc --codec NAME``."""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import codes_with_fixed_steps, non_negative_int, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "encode", help="compress a raw safetensors KV dump into a KVC file",
        description="Compress a raw safetensors KV dump (tensors layers.<i>.k and layers.<i>.v of shape "
        "[tokens, kv_heads, head_dim], as `kvcodec capture` writes) into a KVC file.\n\n"
        "--codec takes a preset name (`kvcodec codecs` lists them, with what each promises) or a JSON "
        "config: an object whose \"id\" is a codec id or a preset name, plus parameters, which "
        "override the preset's (`kvcodec codecs --json` shows every preset's full config). The "
        "kvc presets ending in -cal, and any {\"id\": \"kvc\", \"target_kl\": T}, need a calibration "
        "file from `kvcodec calibrate`; kvc-transparent, kvc-near and kvc-aggressive use one when given.",
        epilog="examples:\n"
        "  kvcodec encode kv.safetensors kv.kvc --codec kvc-near\n"
        "  kvcodec encode kv.safetensors kv.kvc --codec '{\"id\": \"kvc-near\", \"calibration\": \"cal.safetensors\"}'\n"
        "  kvcodec encode kv.safetensors kv.kvc \\\n"
        "      --codec '{\"id\": \"kvc\", \"target_kl\": 0.005, \"calibration\": \"cal.safetensors\"}'",
    )
    p.add_argument("input", help="raw dump with tensors layers.<i>.k / layers.<i>.v [T, H, D]")
    p.add_argument("output", help="KVC file to write (atomically)")
    p.add_argument("--codec", default="fp8-e4m3", metavar="NAME|JSON",
                   help="preset name or JSON config (see above and `kvcodec codecs`)")
    p.add_argument("--tokens-per-chunk", type=non_negative_int, default=0, metavar="N",
                   help="split each tensor into chunks of N tokens that decode on their own (0: one chunk)")
    p.add_argument("--json", action="store_true", help="print a JSON summary to stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..cache import KVCache
    from ..codec import get_codec
    from ..format import write_file

    codec = get_codec(args.codec)
    codec.check_requirements()  # a -cal preset without its calibration file: say so before reading
    name = codec.preset or codec.codec_id
    if codes_with_fixed_steps(codec):
        # a level preset without a profile: its fixed steps, not a measurement on this model
        print(f"kvcodec encode: warning: {name} has no profile of this model, so it codes with fixed steps "
              f"(measured on SmolLM2-135M and Qwen2.5-Coder-0.5B only); for its level on your model run "
              f"`kvcodec calibrate --model M --out F` and add \"calibration\": F", file=sys.stderr)
    cache = KVCache.from_safetensors(args.input)
    t0 = time.perf_counter()
    # streams layer by layer into a spool beside the output, then renames atomically
    nbytes = write_file(codec, cache, args.output, tokens_per_chunk=args.tokens_per_chunk)
    dt = time.perf_counter() - t0
    summary = {
        "input": os.fspath(args.input),
        "output": os.fspath(args.output),
        "preset": codec.preset,  # the name the codec was given, when a preset (also in the file)
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
            f"{summary['ratio_vs_fp16']:.2f}x smaller than fp16 ({name}, {dt:.2f} s)"
        )
    return 0
