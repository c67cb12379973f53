#!/usr/bin/env python
"""What do more, shorter entropy streams cost kvc in bits on real caches? kvc's GPU decoder runs one
thread per stream, and the levels' layout (64 rows x 2048 tokens per stream) leaves a GPU idle
(eval/results/gpu_kvc_streams.md: 8 x 256 decodes a tensor 22x faster). Lossless settings: only the
bits change, so no model is run on the decoded caches.

For each model and evaluation domain (kvcodec.harness.texts): a cache of ``--context`` tokens from
the text's start, coded whole by each kvc level with the model's profile at each layout
(``rows_per_stream`` x ``chunk``); bits all-in, and the number of streams of one K tensor.

Writes ``<out>.json`` and ``<out>.md`` (default ``eval/results/kvc_gpu_layout``).

Usage:
    python eval/studies/kvc_gpu_layout.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--layouts 64x2048,16x512,8x256,4x128]
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np
import torch

from kvcodec.harness.results import provenance, write_result

LEVELS = ["kvc-transparent", "kvc-near", "kvc-aggressive"]


def report(doc: dict[str, Any]) -> str:
    lays = doc["layouts"]
    lines = ["# kvc entropy-stream layout: bits on real caches", "",
             f"Caches of {doc['context']} tokens from the start of each evaluation text ({', '.join(doc['domains'])}), "
             "coded whole with each model's profile; bits all-in, mean over the domains, and the change against "
             f"the levels' layout ({lays[0]}). Streams: of one K tensor (rows = heads x head_dim + step rows).", "",
             "| model | codec | " + " | ".join(lays) + " |", "|---|---|" + "---|" * len(lays)]
    by: dict[tuple, list] = {}
    for r in doc["rows"]:
        by.setdefault((r["model"], r["codec"], r["layout"]), []).append(r)
    for m in doc["models"]:
        for c in LEVELS:
            base = by.get((m, c, lays[0]))
            if not base:
                continue
            b0 = float(np.mean([r["bits"] for r in base]))
            cells = []
            for lay in lays:
                rs = by.get((m, c, lay), [])
                b = float(np.mean([r["bits"] for r in rs]))
                cells.append(f"{b:.4f} b ({b / b0 - 1:+.1%}, {rs[0]['streams']} streams)")
            lines.append(f"| {m} | {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--layouts", default="64x2048,16x512,8x256,4x128", help="rows_per_stream x chunk")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--domains", default="prose,code,docs")
    ap.add_argument("--out", default="eval/results/kvc_gpu_layout")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    import kvcodec
    from kvcodec.harness.studies import profiled_domain_caches

    torch.set_num_threads(2)
    layouts = args.layouts.split(",")
    rows: list[dict[str, Any]] = []
    for name, path, dom, cache in profiled_domain_caches(args.models.split(","), args.domains.split(","),
                                                         args.context, dtype=torch.float16):
        h, d = cache.layers[0]["k"].shape[1:]
        for level in LEVELS:
            for lay in layouts:
                g, c = (int(x) for x in lay.split("x"))
                blob = kvcodec.get_codec({"id": level, "calibration": str(path), "rows_per_stream": g,
                                          "chunk": c}).encode(cache)
                streams = math.ceil((h * d + h) / g) * math.ceil(cache.num_tokens / c)
                rows.append({"model": name, "domain": dom, "codec": level, "layout": lay, "streams": streams,
                             "bits": 8.0 * len(blob) / cache.num_elements})
                print(json.dumps(rows[-1]), flush=True)
    doc = {"models": args.models.split(","), "context": args.context, "domains": args.domains.split(","),
           "layouts": layouts, "rows": rows}
    write_result(args.out, doc, report(doc), prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
