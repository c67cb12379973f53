#!/usr/bin/env python
"""Magnitude contexts in the level presets: the bits they save against the time they cost.

For each level preset (kvc-transparent, -near, -aggressive), with SmolLM2's profile and with
the fixed steps (no profile), on the built-in model's cache (first ``--context`` tokens): the
exact size in bits per element and the CPU encode and decode time over ``cachegen``'s, with
magnitude contexts on (``ctx`` [3, 8, 20] / [2, 5, 12], 64-row streams of <= 2048 tokens) and off
(kvc's defaults: no contexts, 16-row streams of 4096 tokens), whatever the preset ships.
Single-threaded, the codecs interleaved, the best of ``--repeat`` kept (read the ratios,
measured in one run). The profile is the one eval/studies/kvc_profile.py makes (made here when
missing or stale).

Writes ``<out>.json`` and ``<out>.md`` (default ``eval/results/kvc_ctx_levels``).

Usage:
    python eval/studies/kvc_ctx_levels.py [--context 1536] [--repeat 3]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from kvcodec.harness.results import provenance, write_result

OFF = {"ctx": [], "rows_per_stream": 16, "chunk": 4096}
ON = {"kvc-transparent": {"ctx": [3, 8, 20], "rows_per_stream": 64, "chunk": 2048},
      "kvc-near": {"ctx": [3, 8, 20], "rows_per_stream": 64, "chunk": 2048},
      "kvc-aggressive": {"ctx": [2, 5, 12], "rows_per_stream": 64, "chunk": 2048}}


def report(doc: dict[str, Any]) -> str:
    """The markdown of a result ``doc``."""
    lines = ["# kvc level presets: magnitude contexts, bits against time", "",
             f"Built-in SmolLM2-135M cache, {doc['context']} tokens; SmolLM2's profile or the fixed steps; "
             f"one thread, best of {doc['repeat']} interleaved rounds; times over cachegen's in the same run.", "",
             "| level | steps | contexts | bits | encode x cachegen | decode x cachegen |", "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        if r["name"] == "cachegen":
            continue
        lines.append(f"| {r['level']} | {r['steps']} | {r['contexts']} | {r['bits_per_element']:.4f} | "
                     f"{r['encode_x_ref']:.2f} | {r['decode_x_ref']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default="eval/results/kvc_ctx_levels")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    from kvcodec.codec import get_codec
    from kvcodec.commands.bench import bench_interleaved
    from kvcodec.harness.capture import default_cache
    from kvcodec.harness.models import load_model
    from kvcodec.harness.studies import model_profile

    model, tok = load_model("smollm2-135m")
    prof, _ = model_profile("smollm2-135m", model, tok)
    del model, tok
    torch.set_num_threads(1)
    cache = default_cache(context=args.context)
    settings: list[tuple[str, Any]] = [("cachegen", get_codec("cachegen"))]
    meta: dict[str, tuple[str, str, str]] = {}
    for lv, on in ON.items():
        for steps, base in (("profile", {"calibration": str(prof)}), ("fixed", {})):
            for label, ent in (("on", on), ("off", OFF)):
                name = f"{lv} {steps} ctx {label}"
                settings.append((name, get_codec({"id": lv, **base, **ent})))
                meta[name] = (lv, steps, label)
    rows = bench_interleaved(settings, cache, args.repeat,
                             progress=lambda m: print(m, flush=True))
    for (name, _), r in zip(settings, rows):
        r["name"] = name
        if name in meta:
            r["level"], r["steps"], r["contexts"] = meta[name]
    doc = {"context": args.context, "repeat": args.repeat, "rows": rows}
    write_result(args.out, doc, report(doc), prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
