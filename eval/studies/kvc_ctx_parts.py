#!/usr/bin/env python
"""Do kvc's magnitude contexts pay on chunks? File bits of kvc-near and kvc-aggressive (each model's
profile) with their contexts (formats/ANS.md §3.1) against without, for caches stored as
independent chunks (LMCache frames, kvcodec.integrations.lmcache.ChunkCoder), coded as parts of a
sequence that do not end it (no recency ramp: ``part_config(first=False, last=False)``) and as
parts that do (ramp: ``last=True``; the serde's default codes every chunk like this). Lossless:
the contexts change the bits only, so no model is run on the decoded cache.

For each model and evaluation domain (kvcodec.harness.texts): a cache of ``--context`` tokens from
the text's start (one prefill), cut into ``--chunks`` token chunks; bits all-in (frames).

Since kvc's encoder codes contexts only on tensors with a recency ramp (the rule this study
measured), the "no ramp, contexts on" column equals "off" by construction at later commits; the
committed result was measured before the rule (its provenance commit).

Writes ``<out>.json`` and ``<out>.md`` (default ``eval/results/kvc_ctx_parts``).

Usage:
    python eval/studies/kvc_ctx_parts.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--chunks 256,1024]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import torch

from kvcodec.harness.results import provenance, write_result

LEVELS = ["kvc-near", "kvc-aggressive"]


def report(doc: dict[str, Any]) -> str:
    lines = ["# kvc magnitude contexts on chunks: do they pay with and without a recency ramp?", "",
             f"Caches of {doc['context']} tokens from the start of each evaluation text ({', '.join(doc['domains'])}), "
             "stored as independent chunks (kvcodec chunk frames, bits all-in); each model's profile. "
             "\"contexts\": the level's `ctx`; \"off\": `ctx` []. Mean over the domains.", "",
             "| model | chunk | codec | ramp | bits, contexts | bits, off | off vs contexts |", "|---|---|---|---|---|---|---|"]
    by: dict[tuple, list] = {}
    for r in doc["rows"]:
        by.setdefault((r["model"], r["chunk"], r["codec"], r["ramp"]), []).append(r)
    for (m, n, c, ramp), rs in by.items():
        on = float(np.mean([r["bits_ctx"] for r in rs]))
        off = float(np.mean([r["bits_off"] for r in rs]))
        lines.append(f"| {m} | {n} | {c} | {'yes' if ramp else 'no'} | {on:.4f} | {off:.4f} | {off / on - 1:+.2%} |")
    lines += ["", "Every cache:", "", "| model | domain | chunk | codec | ramp | bits, contexts | bits, off |",
              "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['model']} | {r['domain']} | {r['chunk']} | {r['codec']} | {'yes' if r['ramp'] else 'no'} | "
                     f"{r['bits_ctx']:.4f} | {r['bits_off']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--chunks", default="256,1024")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--domains", default="prose,code,docs")
    ap.add_argument("--out", default="eval/results/kvc_ctx_parts")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    import kvcodec
    from kvcodec.harness.studies import profiled_domain_caches
    from kvcodec.integrations.lmcache import ChunkCoder, to_chunks

    torch.set_num_threads(2)
    rows: list[dict[str, Any]] = []
    for name, path, dom, cache in profiled_domain_caches(args.models.split(","), args.domains.split(","),
                                                         args.context, dtype=torch.float16):
        heads, dim = int(cache.layers[0]["k"].shape[1]), int(cache.layers[0]["k"].shape[2])
        for n in (int(x) for x in args.chunks.split(",")):
            parts = to_chunks(cache, n)
            elems = sum(p.numel() for p in parts)
            for level in LEVELS:
                codec = kvcodec.get_codec({"id": level, "calibration": str(path)})
                for ramp in (False, True):
                    cfg = codec.part_config(first=False, last=ramp)
                    bits = {}
                    for label, over in (("ctx", {}), ("off", {"ctx": []})):
                        coder = ChunkCoder({**cfg, **over}, num_kv_heads=heads, head_dim=dim, model=name)
                        bits[label] = 8.0 * sum(len(coder.encode(p)) for p in parts) / elems
                    rows.append({"model": name, "domain": dom, "chunk": n, "codec": level, "ramp": ramp,
                                 "ctx": list(cfg["ctx"]), "bits_ctx": bits["ctx"], "bits_off": bits["off"]})
                    print(json.dumps(rows[-1]), flush=True)
    doc = {"models": args.models.split(","), "context": args.context, "domains": args.domains.split(","),
           "chunks": [int(x) for x in args.chunks.split(",")], "rows": rows}
    write_result(args.out, doc, report(doc), prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
