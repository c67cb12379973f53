#!/usr/bin/env python
"""How much does the calibration text's domain matter to a kvc profile?

For one model (SmolLM2-135M by default): a profile from each built-in calibration domain alone
(prose, code, documentation, dialogue: one window searched, one held out) and from all four (the
default of ``kvcodec calibrate``); then each profile's kvc-near and kvc-aggressive on the
evaluation texts (prose, code, docs; never used by calibration), context 1536, 512 scored tokens:
mean KL against the target, and bits. A profile from one domain is only as good as that domain is
like the user's text; the four-domain default takes the worst window, so it should hold on all.

Writes ``<out>.json`` and ``<out>.md`` (default ``eval/results/kvc_cal_domain``).

Usage:
    python eval/studies/kvc_cal_domain.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch

from kvcodec.harness.results import provenance, write_result

LEVELS = {"kvc-near": 0.01, "kvc-aggressive": 0.05}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--continuation", type=int, default=512)
    ap.add_argument("--out", default="eval/results/kvc_cal_domain")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    from kvcodec.codecs.kvc.calibration import save_query_statistics
    from kvcodec.harness.evaluate import Evaluator
    from kvcodec.harness.models import load_model
    from kvcodec.harness.profile import build_profile
    from kvcodec.harness.texts import CALIBRATION_DOMAINS, calibration_text, eval_text

    torch.set_num_threads(2)
    t0 = time.perf_counter()
    model, tok = load_model(args.model)
    evs = {d: Evaluator(model, tok, eval_text(d), args.context, args.continuation, attn_queries=1)
           for d in ("prose", "code", "docs")}
    rows: list[dict[str, Any]] = []
    tmpdir = tempfile.mkdtemp(prefix="kvcodec-caldomain-")
    for source in [*CALIBRATION_DOMAINS, "all four"]:
        texts = ({d: calibration_text(d) for d in CALIBRATION_DOMAINS} if source == "all four"
                 else {source: calibration_text(source)})
        t1 = time.perf_counter()
        stats = build_profile(model, tok, texts, text_name=source)
        secs = time.perf_counter() - t1
        path = os.path.join(tmpdir, "p.safetensors")
        save_query_statistics(stats, path)
        for preset, target in LEVELS.items():
            kls, bits = {}, {}
            for d, ev in evs.items():
                r = ev.score_next_token({"id": preset, "calibration": path})
                kls[d], bits[d] = r["next_token"]["kl_mean"], r["bits_per_element"]
            lv = next(x for x in stats.profile["levels"] if x["target_kl"] == target)
            rows.append({"calibration": source, "preset": preset, "target_kl": target, "k_step": lv["k_step"],
                         "kv_ratio": stats.profile["kv_ratio"], "eval_kl": kls, "eval_bits": bits,
                         "mean_kl": sum(kls.values()) / len(kls), "worst_kl": max(kls.values()),
                         "mean_bits": sum(bits.values()) / len(bits), "calibration_seconds": secs})
            print(f"[{time.perf_counter() - t0:5.0f} s] {source:9s} {preset:15s} k_step {lv['k_step']:.4f} "
                  f"mean KL {rows[-1]['mean_kl']:.5f} worst {rows[-1]['worst_kl']:.5f} bits {rows[-1]['mean_bits']:.3f}",
                  flush=True)
    doc = {"model": args.model, "context": args.context, "continuation": args.continuation, "rows": rows}
    lines = ["# kvc profiles: how much the calibration text's domain matters", "",
             f"{args.model}; a profile per calibration source; scored on the evaluation texts prose, code and docs "
             f"(context {args.context}, {args.continuation} scored tokens).", "",
             "| calibration text | preset | target | k_step | v/k | mean KL | worst KL | bits | met |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        met = r["mean_kl"] <= r["target_kl"] and r["worst_kl"] <= 1.2 * r["target_kl"]
        lines.append(f"| {r['calibration']} | {r['preset']} | {r['target_kl']} | {r['k_step']:.4f} | {r['kv_ratio']:.2f} | "
                     f"{r['mean_kl']:.5f} | {r['worst_kl']:.5f} | {r['mean_bits']:.3f} | {'yes' if met else 'NO'} |")
    write_result(args.out, doc, "\n".join(lines) + "\n", prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
