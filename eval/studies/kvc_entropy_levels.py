#!/usr/bin/env python
"""The level presets with a profile: which lossless entropy settings, and does sink detection pay?

A profile's search (kvcodec/harness/profile.py) codes with magnitude contexts in streams of 64
rows of at most 2048 tokens (``SEARCH_ENTROPY``) and without sink detection, while the level
presets (kvc-transparent, -near, -aggressive) used to code with kvc's defaults: no contexts, 16
rows per stream, 4096 tokens, and the caller's ``sink_v_ratio`` 0.3 (the V-small tokens of every
layer stored exactly). So the bits an encode with a profile spends were not the bits its search
measured. This study encodes each evaluation text with each model's profile (the level presets
with ``calibration``; profiles made or reused as eval/studies/kvc_profile.py does) under each
variant of those settings, and reports KL and bits.

Variants: ``before`` is the presets as they were (a copy of the profile without its
``sink_v_ratio``, so the caller's 0.3 applies, and kvc's default entropy settings); the others
code with the profile's ``sink_v_ratio`` 0 and the entropy settings they name. Entropy settings
are lossless (same KL); sink detection is not.

Writes ``<out>.json`` and ``<out>.md`` (default ``eval/results/kvc_entropy_levels``).

Usage:
    python eval/studies/kvc_entropy_levels.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--context 1536]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Any

import numpy as np
import torch

from kvcodec.harness.results import provenance, write_result

PLAIN = {"ctx": [], "rows_per_stream": 16, "chunk": 4096}  # kvc's defaults
CTX = {"ctx": [3, 8, 20], "rows_per_stream": 64, "chunk": 2048}
CTX_LOW = {"ctx": [2, 5, 12], "rows_per_stream": 64, "chunk": 2048}
VARIANTS: dict[str, dict[str, Any]] = {
    "before": PLAIN,
    "no sinks": PLAIN,
    "no sinks + ctx": CTX,
    "no sinks + ctx low": CTX_LOW,
    "no sinks + ctx + max_level 48": {**CTX, "max_level": 48},
    "no sinks + ctx low + max_level 16": {**CTX_LOW, "max_level": 16},
}
LEVELS = {"kvc-transparent": 0.002, "kvc-near": 0.01, "kvc-aggressive": 0.05}


def without_sink_setting(path: Any, out: str) -> None:
    """A copy of the profile at ``path`` whose settings leave ``sink_v_ratio`` to the caller."""
    from kvcodec.codecs.kvc.calibration import load_query_statistics, save_query_statistics

    stats = load_query_statistics(path)
    stats.profile = {**stats.profile, "settings": {k: v for k, v in stats.profile["settings"].items()
                                                   if k != "sink_v_ratio"}}
    save_query_statistics(stats, out)


def report(doc: dict[str, Any]) -> str:
    """The markdown of a result ``doc``."""
    lines = ["# kvc level presets with a profile: entropy settings and sink detection", "",
             f"Each model's profile (kvc-<level> with `calibration`), context {doc['context']}, "
             f"{doc['continuation']} scored tokens of each evaluation text ({', '.join(doc['domains'])}); "
             "KL against the fp16 cache; bits all-in. `before`: the presets as they coded until this study "
             "(sink_v_ratio 0.3, no contexts, 16 rows per stream, 4096-token streams).", "",
             "Mean over the domains (bits relative to `before`):", "",
             "| model | level | variant | mean KL | bits | vs before |", "|---|---|---|---|---|---|"]
    by: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in doc["rows"]:
        by.setdefault((r["model"], r["codec"], r["variant"]), []).append(r)
    for m in doc["models"]:
        for c in doc["levels"]:
            base = by.get((m, c, "before"))
            b0 = float(np.mean([r["bits"] for r in base])) if base else None
            for v in doc["variants"]:
                rs = by.get((m, c, v))
                if not rs:
                    continue
                b = float(np.mean([r["bits"] for r in rs]))
                rel = f"{b / b0 - 1:+.1%}" if b0 else ""
                lines.append(f"| {m} | {c} | {v} | {np.mean([r['kl'] for r in rs]):.5f} | {b:.3f} | {rel} |")
    lines += ["", "Every window:", "", "| model | domain | level | variant | KL | bits |", "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['model']} | {r['domain']} | {r['codec']} | {r['variant']} | {r['kl']:.5f} | {r['bits']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--continuation", type=int, default=512)
    ap.add_argument("--domains", default="prose,code,docs")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="eval/results/kvc_entropy_levels")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    from kvcodec.harness.evaluate import Evaluator
    from kvcodec.harness.models import load_model
    from kvcodec.harness.studies import model_profile
    from kvcodec.harness.texts import eval_text

    torch.set_num_threads(2)
    variants = {v: VARIANTS[v] for v in args.variants.split(",")}
    rows: list[dict[str, Any]] = []
    seconds: dict[str, float | None] = {}
    for name in args.models.split(","):
        model, tok = load_model(name)
        path, secs = model_profile(name, model, tok, log=lambda m: print(m, flush=True))  # remade when the search changed
        seconds[name] = secs
        fd, old = tempfile.mkstemp(prefix="kvcodec-profile-before-", suffix=".safetensors")
        os.close(fd)
        try:
            without_sink_setting(path, old)
            for dom in args.domains.split(","):
                ev = Evaluator(model, tok, eval_text(dom), args.context, args.continuation, attn_queries=1)
                for c in LEVELS:
                    for v, extra in variants.items():
                        cal = old if v == "before" else str(path)
                        r = ev.score_next_token({"id": c, "calibration": cal, **extra})
                        rows.append({"model": name, "domain": dom, "codec": c, "variant": v,
                                     "kl": r["next_token"]["kl_mean"], "bits": r["bits_per_element"]})
                        print(json.dumps(rows[-1]), flush=True)
                del ev
        finally:
            os.unlink(old)
        del model, tok
    doc = {"models": args.models.split(","), "context": args.context, "continuation": args.continuation,
           "domains": args.domains.split(","), "levels": LEVELS, "variants": list(variants),
           "profile_seconds": seconds, "rows": rows}
    write_result(args.out, doc, report(doc), prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
