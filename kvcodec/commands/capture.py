"""``kvcodec capture``: prefill a model on a text and write its KV cache as a raw safetensors dump.

Example::

    kvcodec capture --context 2048 --out smollm2.safetensors      # built-in model and text
    kvcodec capture --model ./my-model --text book.txt --context 4096 --out kv.safetensors
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import positive_int, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "capture",
        help="capture a model's KV cache on a text into a raw safetensors dump",
        description="Run one prefill of a transformers decoder model and write its KV cache "
        "(tensors layers.<i>.k / layers.<i>.v [T, H, D], token ids, identity metadata). "
        "Needs the [eval] extra.",
    )
    p.add_argument("--model", default=None,
                   help="a known model (smollm2-135m, qwen2.5-coder-0.5b), a local model directory or a .gguf file (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: built-in Jargon File excerpt)")
    p.add_argument("--context", type=positive_int, default=2048, help="tokens to prefill (default 2048)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="dtype of the written cache (default float16)")
    p.add_argument("--out", required=True, help="raw safetensors file to write (atomically)")
    p.add_argument("--json", action="store_true", help="print a JSON summary to stdout")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..cache import SOURCE_DTYPES
    from ..harness.capture import capture, read_text, save_raw
    from ..harness.models import load_model, require_eval

    require_eval()
    text = read_text(args.text)
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    t1 = time.perf_counter()
    cache = capture(model, tok, text, context=args.context, dtype=SOURCE_DTYPES[args.dtype])
    t2 = time.perf_counter()
    save_raw(cache, args.out)
    first = cache.layers[0].get("k", cache.layers[0].get("kv"))
    summary = {
        "output": os.fspath(args.out),
        "model": cache.model.to_dict(),
        "layers": cache.num_layers,
        "tokens": cache.num_tokens,
        "kv_heads": int(first.shape[1]),
        "head_dim": int(first.shape[2]),
        "layer_kinds": [f"{li.kind}:{li.window}" if li.window else li.kind for li in cache.layer_info],
        "dtype": args.dtype,
        "rope_applied": cache.rope_applied,
        "bytes": os.path.getsize(args.out),
        "load_seconds": t1 - t0,
        "prefill_seconds": t2 - t1,
    }
    if args.json:
        print_json(summary)
    else:
        print(f"{summary['output']}: {cache.num_layers} layers x {cache.num_tokens} tokens x "
              f"{summary['kv_heads']} KV heads x {summary['head_dim']} ({args.dtype}), "
              f"{summary['bytes']} bytes; model {cache.model.model_id} "
              f"(load {t1 - t0:.1f} s, prefill {t2 - t1:.1f} s)", file=sys.stdout)
    return 0
