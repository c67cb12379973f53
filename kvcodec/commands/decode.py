"""``kvcodec decode IN.kvc RAW.safetensors``."""

from __future__ import annotations

import argparse
import os

from . import print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "decode", help="decode a KVC file back into a raw safetensors dump",
        description="Decode a KVC file (any codec this kvcodec knows; the file names its codec and "
        "settings) back into a raw safetensors dump with tensors layers.<i>.k / layers.<i>.v, the "
        "input `kvcodec encode` takes. The file is validated before anything is decoded.")
    p.add_argument("input", help="KVC file")
    p.add_argument("output", help="raw safetensors dump to write (atomically)")
    p.add_argument("--device", default="cpu", help="cpu (the reference decoders), or cuda or cuda:N (the GPU kernels)")
    p.add_argument("--profile", action="append", default=[], metavar="FILE",
                   help="a profile (kvcodec calibrate) or a directory of them, for files coded with prediction "
                   "across layers (kvc xpred), which decode only with the profile that coded them; it is also "
                   "looked for where the encoder read it and in ~/.cache/kvcodec/profiles (repeatable)")
    p.add_argument("--json", action="store_true", help="print a JSON summary to stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .. import decode

    cache = decode(args.input, device=args.device, profiles=args.profile)
    cache.to_safetensors(args.output)
    summary = {"input": os.fspath(args.input), "output": os.fspath(args.output),
               "layers": cache.num_layers, "tokens": cache.num_tokens,
               "dtype": str(cache.dtype).replace("torch.", "")}
    if args.json:
        print_json(summary)
    else:
        print(f"{summary['output']}: {cache.num_layers} layers, {cache.num_tokens} tokens, {summary['dtype']}")
    return 0
