#!/usr/bin/env python
"""Does a profile's KL depend on how long the cache is? The same scored tokens after caches of
several lengths.

A profile's steps are searched on windows of 1024 cached tokens; the evaluation texts at 1536
and 4096 then sit at 35-60 % of each level's target (eval/results/kvc_profile.md), while at 1024
they sit at 55-90 % (eval/results/kvc_profile_ctx1024.md). Those runs score different tokens at
each context, so length and text are confounded. Here the scored tokens are fixed: for each
evaluation domain, tokens ``[P, P + continuation)`` of its text (``P`` = ``--position``) are
scored after a cache of the ``L`` tokens before them (a window that starts with BOS where the
tokenizer has one), for each ``L`` of ``--lengths``, with each model's profile (the level presets
with ``calibration``: the cached profiles of eval/studies/kvc_profile.py).

Writes ``<out>.json`` and ``<out>.md`` (default ``eval/results/kvc_length``).

Usage:
    python eval/studies/kvc_length.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--lengths 512,1024,2048,4096]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import torch

from kvcodec.harness.results import provenance, write_result


def window(ids: torch.Tensor, bos: int | None, position: int, length: int, continuation: int) -> torch.Tensor:
    """``length`` cached ids ending before ``position`` (the first replaced by BOS when the
    tokenizer has one, as a text's first window starts), then ``continuation + 1`` ids from
    ``position``."""
    w = ids[position - length: position + continuation + 1].clone()
    if bos is not None:
        w[0] = bos
    return w


def report(doc: dict[str, Any]) -> str:
    """The markdown of a result ``doc``."""
    lines = ["# kvc profiles: KL against the cache's length, same scored tokens", "",
             f"Scored tokens {doc['position']}..{doc['position'] + doc['continuation']} of each evaluation text "
             f"(domains {', '.join(doc['domains'])}), after the {', '.join(map(str, doc['lengths']))} tokens "
             "before them; each model's profile (kvc-<level> with `calibration`); KL against the fp16 cache; "
             "bits all-in.", "",
             "Mean KL over the domains (as a fraction of the level's target) and bits:", "",
             "| model | level | " + " | ".join(f"L={n}" for n in doc["lengths"]) + " |",
             "|---|---|" + "---|" * len(doc["lengths"])]
    by = {}
    for r in doc["rows"]:
        by.setdefault((r["model"], r["codec"], r["length"]), []).append(r)
    for m in doc["models"]:
        for c, t in doc["levels"].items():
            cells = []
            for n in doc["lengths"]:
                rs = by.get((m, c, n), [])
                if not rs:
                    cells.append("")
                    continue
                kl = float(np.mean([r["kl"] for r in rs]))
                cells.append(f"{kl:.5f} ({kl / t:.0%}), {np.mean([r['bits'] for r in rs]):.3f} b")
            lines.append(f"| {m} | {c} | " + " | ".join(cells) + " |")
    lines += ["", "Every window:", "", "| model | level | domain | L | KL | top-1 | bits |", "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['model']} | {r['codec']} | {r['domain']} | {r['length']} | {r['kl']:.5f} | "
                     f"{r['top1']:.4f} | {r['bits']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--lengths", default="512,1024,2048,4096")
    ap.add_argument("--position", type=int, default=4096, help="the first scored token (>= the longest length)")
    ap.add_argument("--continuation", type=int, default=512)
    ap.add_argument("--domains", default="prose,code,docs")
    ap.add_argument("--levels", default="kvc-near,kvc-aggressive")
    ap.add_argument("--out", default="eval/results/kvc_length")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    from kvcodec.codecs.kvc.profile import LEVELS as TARGETS
    from kvcodec.harness.capture import tokenize
    from kvcodec.harness.evaluate import Evaluator
    from kvcodec.harness.models import load_model
    from kvcodec.harness.studies import profile_dir
    from kvcodec.harness.texts import eval_text

    torch.set_num_threads(2)
    lengths = [int(x) for x in args.lengths.split(",")]
    if max(lengths) > args.position:
        raise SystemExit(f"--position {args.position} must be at least the longest length {max(lengths)}")
    levels = {c: TARGETS[c.removeprefix("kvc-")] for c in args.levels.split(",")}
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        path = profile_dir() / f"{name}.profile.safetensors"  # made by eval/studies/kvc_profile.py
        if not path.is_file():
            raise SystemExit(f"no profile at {path}: run eval/studies/kvc_profile.py first")
        model, tok = load_model(name)
        bos = getattr(tok, "bos_token_id", None)
        for dom in args.domains.split(","):
            ids = tokenize(tok, eval_text(dom), None)
            if ids.numel() < args.position + args.continuation + 1:
                raise SystemExit(f"{dom}: {ids.numel()} tokens, {args.position + args.continuation + 1} needed")
            for n in lengths:
                ev = Evaluator(model, tok, "", n, args.continuation, attn_queries=1,
                               token_ids=window(ids, bos, args.position, n, args.continuation))
                for c in levels:
                    r = ev.score_next_token({"id": c, "calibration": str(path)})
                    rows.append({"model": name, "domain": dom, "length": n, "codec": c,
                                 "kl": r["next_token"]["kl_mean"], "top1": r["next_token"]["top1_agreement"],
                                 "bits": r["bits_per_element"]})
                    print(json.dumps(rows[-1]), flush=True)
                del ev
        del model, tok
    doc = {"models": args.models.split(","), "lengths": lengths, "position": args.position,
           "continuation": args.continuation, "domains": args.domains.split(","), "levels": levels, "rows": rows}
    write_result(args.out, doc, report(doc), prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
