#!/usr/bin/env python
"""What LMCache's chunking costs each codec: the whole cache as one object against 1024-, 512- and
256-token chunks, each chunk an independent object (a kvcodec chunk frame, formats/lmcache-frame.md,
as the LMCache serde stores it, variable size), bits all-in and next-token KL. A kvc level ``L``
codes every object as a whole cache (the serde's default: each with an exact first token and
finer steps for its last tokens); ``L/part`` codes every object as a part of a longer sequence
(neither: ``KVCCodec.part_config``); ``L/pos`` as parts too, but the first keeps its sink token
and the last, which ends the cache, its recency ramp, and every part's attention estimates take
the queries at the cache's end (``query_pos``); ``L/seq`` as parts placed like ``L/pos``, every
part's attention estimates being the whole cache's (``ChunkCoder.encode_sequence``,
``KVCCodec.encode_parts``; what ``stores.prefix.put_prefix`` does since stop 31); ``L/seq@F``
the same at the level's target times ``F`` (a second point, to compare bits at equal KL).
The whole cache (chunk 0) of ``L/part`` and ``L/pos`` is coded as ``L``.

For each model and evaluation domain (kvcodec.harness.texts, never used by calibration): a cache of
``--context`` tokens from the text's start, ``--continuation`` scored tokens after it; each codec
codes the cache whole and in chunks; the chunks' frames are decoded, concatenated and scored
against the fp16 cache. The kvc levels use each model's profile (kvc-<level> with
``calibration``: the cached profiles of eval/studies/kvc_profile.py, made here when missing).

Writes ``<out>.json`` and ``<out>.md`` (default ``eval/results/lmcache_chunks``).

Usage:
    python eval/studies/lmcache_chunks.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--chunks 0,1024,512,256]
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np
import torch

from kvcodec.codecs.kvc.profile import LEVELS as PROFILE_LEVELS
from kvcodec.harness.results import provenance, write_result

BASELINES = ["fp8-e4m3", "kivi-4-ans", "cachegen", "cachegen-lmcache"]
LEVELS = ["kvc-transparent", "kvc-near", "kvc-aggressive"]
PARTS = [f"{c}/{m}" for m in ("part", "pos", "seq") for c in LEVELS]
LEVEL_KL = {f"kvc-{name}": kl for name, kl in PROFILE_LEVELS.items()}


def equal_kl(doc: dict[str, Any]) -> list[str]:
    """Markdown: for each ``L/seq`` measured at two targets (``L/seq`` and ``L/seq@F``), the bits of
    the last chunk size at the whole cache's KL, per domain by linear interpolation in log KL
    between the two measured points (extrapolated, and said so, when the whole's KL lies outside),
    then the mean over the domains."""
    by = {(r["model"], r["domain"], r["codec"], r["chunk"]): r for r in doc["rows"]}
    n = doc["chunks"][-1]
    out = []
    for m in doc["models"]:
        for c in doc["codecs"]:
            if not c.endswith("/seq"):
                continue
            others = [x for x in doc["codecs"] if x.startswith(c + "@")]
            base = c.split("/")[0]
            cells, outside = [], False
            for dom in doc["domains"]:
                w, a = by.get((m, dom, base, 0)), by.get((m, dom, c, n))
                b = next((by[(m, dom, x, n)] for x in others if (m, dom, x, n) in by), None)
                if not (w and a and b) or a["kl"] == b["kl"]:
                    continue
                t = (math.log(w["kl"]) - math.log(a["kl"])) / (math.log(b["kl"]) - math.log(a["kl"]))
                outside |= not 0 <= t <= 1
                cells.append((w["bits"], a["bits"] + t * (b["bits"] - a["bits"]), w["kl"]))
            if cells:
                wb, sb = float(np.mean([x[0] for x in cells])), float(np.mean([x[1] for x in cells]))
                out.append(f"| {m} | {c} | {wb:.3f} | {float(np.mean([x[2] for x in cells])):.5f} | {sb:.3f} | "
                           f"{sb / wb - 1:+.1%} | {len(cells)}{' (extrapolated)' if outside else ''} |")
    if not out:
        return []
    return ["## At equal KL", "", f"Bits of {n}-token chunks coded as a sequence (`L/seq`) at the whole cache's KL: "
            "per domain, interpolated in log KL between `L/seq` and `L/seq@F` (the level's target times F), "
            "both measured; mean over the domains.", "",
            "| model | codec | whole bits | whole KL | chunks at that KL | overhead | domains |",
            "|---|---|---|---|---|---|---|", *out, ""]


def report(doc: dict[str, Any]) -> str:
    """The markdown of a result ``doc``."""
    chunks = doc["chunks"]
    head = ["whole" if c == 0 else f"{c}-token chunks" for c in chunks]
    lines = ["# LMCache chunking: bits and KL, whole cache against independent chunks", "",
             *([] if doc.get("complete", True) else ["**Incomplete: the run stopped before every model and domain "
                                                      "was measured.**", ""]),
             f"Context {doc['context']} tokens from the start of each evaluation text ({', '.join(doc['domains'])}), "
             f"{doc['continuation']} scored tokens; each chunk one kvcodec chunk frame (32-byte header + KVC file, "
             "variable size), bits all-in over the whole cache; KL against the fp16 cache. kvc levels with the "
             "model's profile. Mean over the domains: bits, mean KL, and the bits' overhead against the whole "
             "cache.", ""]
    by: dict[tuple, list] = {}
    for r in doc["rows"]:
        by.setdefault((r["model"], r["codec"], r["chunk"]), []).append(r)
    for m in doc["models"]:
        lines += [f"## {m}", "", "| codec | " + " | ".join(head) + " |", "|---|" + "---|" * len(chunks)]
        for c in doc["codecs"]:
            whole = by.get((m, c, chunks[0]))
            base = float(np.mean([r["bits"] for r in whole])) if whole else None
            cells = []
            for n in chunks:
                rs = by.get((m, c, n), [])
                if not rs:
                    cells.append("")
                    continue
                b = float(np.mean([r["bits"] for r in rs]))
                kl = float(np.mean([r["kl"] for r in rs]))
                extra = f", {b / base - 1:+.1%}" if base and n != chunks[0] else ""
                cells.append(f"{b:.3f} b, KL {kl:.5f}{extra}")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += equal_kl(doc)
    lines += ["Every window:", "", "| model | domain | codec | chunk | bits | KL | top-1 |", "|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['model']} | {r['domain']} | {r['codec']} | {r['chunk'] or 'whole'} | {r['bits']:.3f} | "
                     f"{r['kl']:.5f} | {r['top1']:.4f} |")
    return "\n".join(lines) + "\n"


def code_in_chunks(cache: Any, coders: dict[str, Any], chunk: int) -> tuple[int, Any]:
    """Total frame bytes and the decoded cache when ``cache`` is stored as independent chunks of
    ``chunk`` tokens (0: one object), each coded by ``coders["whole"]``, or by ``"first"``,
    ``"mid"`` and ``"last"`` by its place (one chunk alone is both first and last: ``"whole"``),
    or all at once by ``coders["seq"].encode_sequence``."""
    from kvcodec.integrations.lmcache import from_chunks, to_chunks

    parts = to_chunks(cache, chunk or cache.num_tokens)
    if "seq" in coders and len(parts) > 1:  # the whole sequence at once
        coders_of = [coders["seq"]] * len(parts)
        frames = coders["seq"].encode_sequence(parts)
    else:
        coders_of = [coders["whole" if len(parts) == 1 or "mid" not in coders else
                            "first" if i == 0 else "last" if i == len(parts) - 1 else "mid"] for i in range(len(parts))]
        frames = [coder.encode(part) for coder, part in zip(coders_of, parts)]
    decoded = []
    for coder, part, frame in zip(coders_of, parts, frames):
        out = torch.empty_like(part)
        coder.decode_into(frame, out)
        decoded.append(out)
    return sum(len(f) for f in frames), from_chunks(decoded, coders_of[0].num_kv_heads, coders_of[0].head_dim)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--chunks", default="0,1024,512,256", help="tokens per chunk; 0 = the whole cache")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--continuation", type=int, default=512)
    ap.add_argument("--domains", default="prose,code,docs")
    ap.add_argument("--codecs", default=",".join(BASELINES + LEVELS + PARTS),
                    help="codecs; a kvc level with /part, /pos or /seq: objects as parts of a longer sequence (docstring)")
    ap.add_argument("--out", default="eval/results/lmcache_chunks")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    from kvcodec.harness.evaluate import Evaluator
    from kvcodec.harness.models import load_model
    from kvcodec.harness.studies import model_profile, profile_dir
    from kvcodec.harness.texts import eval_text
    from kvcodec.integrations.lmcache import ChunkCoder

    torch.set_num_threads(2)
    chunks = [int(x) for x in args.chunks.split(",")]
    codecs = args.codecs.split(",")
    rows: list[dict[str, Any]] = []

    def save(complete: bool) -> None:
        """Write what was measured so far (after each domain: an interrupted run keeps it)."""
        doc = {"models": args.models.split(","), "chunks": chunks, "context": args.context,
               "continuation": args.continuation, "domains": args.domains.split(","), "codecs": codecs,
               "rows": rows, "complete": complete}
        write_result(args.out, doc, report(doc), prov=prov, echo=complete)

    for name in args.models.split(","):
        model, tok = load_model(name)
        path, _ = model_profile(name, model, tok, profile_dir())  # reused, or made (minutes)
        for dom in args.domains.split(","):
            ev = Evaluator(model, tok, eval_text(dom), args.context, args.continuation, attn_queries=1,
                           text_name=dom)
            ref = ev.reference
            heads, dim = int(ref.layers[0]["k"].shape[1]), int(ref.layers[0]["k"].shape[2])
            for c in codecs:
                base, _, mode = c.partition("/")
                mode, _, scale = mode.partition("@")  # L/seq@F: the level's target times F
                kw = dict(num_kv_heads=heads, head_dim=dim, profile=str(path) if base in LEVELS else None, model=name)
                coders = {"whole": ChunkCoder(base, **kw)}
                if mode == "seq":
                    cfg = {"id": base, "target_kl": LEVEL_KL[base] * float(scale)} if scale else base
                    coders["seq"] = ChunkCoder(cfg, **kw)
                elif mode:  # parts: no sink token or ramp of their own; /pos: the first and the last keep theirs
                    pos = {"query_pos": ref.num_tokens} if mode == "pos" else {}
                    coders.update(first=ChunkCoder(base, part=True, first=mode == "pos", **pos, **kw),
                                  mid=ChunkCoder(base, part=True, **pos, **kw),
                                  last=ChunkCoder(base, part=True, last=mode == "pos", **pos, **kw))
                for n in chunks:
                    same = [r for r in rows if mode and n == 0 and (r["model"], r["domain"], r["codec"], r["chunk"])
                            == (name, dom, base, 0)]
                    if same:  # one object is coded whole in every mode: measured on the L row
                        rows.append({**same[0], "codec": c})
                        continue
                    size, decoded = code_in_chunks(ref, coders, n)
                    nt = ev.score_cache(decoded)
                    rows.append({"model": name, "domain": dom, "codec": c, "chunk": n,
                                 "bits": 8.0 * size / ref.num_elements, "kl": nt["kl_mean"],
                                 "top1": nt["top1_agreement"]})
                    print(json.dumps(rows[-1]), flush=True)
            del ev
            save(False)
        del model, tok
    save(True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
