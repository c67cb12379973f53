"""``kvcodec calibrate``: record a model's query statistics for the ``kvc`` encoder.

The file is optional input to the encoder only (``{"id": "kvc", ..., "calibration": FILE}``); the
decoder never needs it. Calibrate on text you do not evaluate on.

Example::

    kvcodec calibrate --skip-tokens 8192 --out smollm2.qstats.safetensors   # built-in model and text
    kvcodec calibrate --model ./my-model --text other.txt --context 2048 --out my.qstats.safetensors
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="record query statistics of a model for the kvc encoder (calibration file)",
        description="Prefill a transformers decoder model on a calibration text and write per-layer "
        "query statistics (channel energy, sampled queries) and, scoring the next tokens on top of "
        "that cache, each layer and head's sensitivity (the Fisher information of the next-token "
        "distribution) as safetensors. kvc uses them, when named by its 'calibration' parameter, "
        "to weight K channels, set per-token steps and give sensitive heads finer steps. "
        "Needs the [eval] extra.",
    )
    p.add_argument("--model", default=None,
                   help="a known model (smollm2-135m, qwen2.5-coder-0.5b), a local model directory or a .gguf file (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: built-in Jargon File excerpt)")
    p.add_argument("--context", type=int, default=1536, help="calibration tokens (default 1536)")
    p.add_argument("--skip-tokens", type=int, default=0,
                   help="skip this many tokens of the text first (keep evaluation text out)")
    p.add_argument("--samples", type=int, default=64, help="queries sampled per layer and head (default 64)")
    p.add_argument("--sensitivity", type=int, default=4, metavar="DRAWS",
                   help="Fisher draws for the per-(layer, head) sensitivities (default 4, ~10 s each for "
                   "SmolLM2 on one CPU core; 0 = skip: a query-only file as before)")
    p.add_argument("--continuation", type=int, default=512,
                   help="scored tokens after the context for the sensitivities (default 512)")
    p.add_argument("--out", required=True, help="safetensors file to write (atomically)")
    p.add_argument("--json", action="store_true", help="print a JSON summary to stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import InputError
    from ..harness.calibration import query_statistics, save_query_statistics
    from ..harness.capture import read_text
    from ..harness.models import load_model, require_eval

    require_eval()
    if (args.context < 2 or args.skip_tokens < 0 or args.samples < 1 or args.sensitivity < 0
            or args.continuation < 1):
        raise InputError("--context must be >= 2, --skip-tokens >= 0, --samples >= 1, --sensitivity >= 0 "
                         "and --continuation >= 1")
    text = read_text(args.text)
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    def progress(done: int, total: int) -> None:
        if not args.json:
            print(f"\rsensitivity: draw {done}/{total} ({time.perf_counter() - t0:.0f} s)",
                  end="\n" if done == total else "", file=sys.stderr, flush=True)

    stats = query_statistics(model, tok, text, context=args.context, skip_tokens=args.skip_tokens,
                             samples=args.samples, sensitivity_samples=args.sensitivity,
                             continuation=args.continuation, progress=progress)
    save_query_statistics(stats, args.out)
    summary = {"output": os.fspath(args.out), "layers": stats.num_layers, "context": args.context,
               "skip_tokens": args.skip_tokens, "samples": args.samples,
               "sensitivity_draws": args.sensitivity, "continuation": args.continuation if args.sensitivity else 0,
               "rope_theta": stats.rope_theta, "seconds": round(time.perf_counter() - t0, 2)}
    if args.json:
        print_json(summary)
    else:
        print(f"wrote {summary['output']}: {stats.num_layers} layers, {args.context} tokens "
              f"after {args.skip_tokens}", file=sys.stderr)
    return 0
