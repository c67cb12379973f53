#!/usr/bin/env python
"""How wide may kvc's per-(layer, head) and per-token step multipliers range? A closed-loop
measurement on each model's own calibration windows.

The profile search codes with fixed allocation settings (``SEARCH_SETTINGS`` in
kvcodec/harness/profile.py): per-(layer, head) multipliers from the model's Fisher
sensitivities clipped to ``[1/sens_clip, sens_coarse]``, per-token attention multipliers clipped
to ``[1/attn_clip, attn_coarse]``. On the measured sensitivities, reverse water-filling at high
rate predicts that the clip costs bits (the spread of the (layer, head) sensitivities is 3 decades
on both models). This study scores each variant at two overall scales on the search windows of
a profile (one window per calibration domain, 1024 cached + 512 scored tokens) with the
statistics, sensitivities and K/V ratio of the model's cached profile (made by
eval/studies/kvc_profile.py; they do not depend on the search settings), and reports the bits
each needs at a common KL, interpolated log-linearly between its two points.

Writes ``<out>.json`` and ``<out>.md`` (default ``eval/results/kvc_alloc``).

Usage:
    python eval/studies/kvc_alloc.py [--models smollm2-135m,qwen2.5-coder-0.5b]
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np
import torch

from kvcodec.harness.results import provenance, write_result

VARIANTS: dict[str, dict[str, Any]] = {
    "search settings": {},
    "sens clip 4/4": {"sens_clip": 4.0, "sens_coarse": 4.0},
    "sens clip 8/8": {"sens_clip": 8.0, "sens_coarse": 8.0},
    "sens clip 4/2": {"sens_clip": 4.0, "sens_coarse": 2.0},
    "attn coarse 1.5": {"attn_coarse": 1.5},
    "k_qgamma 2": {"k_qgamma": 2.0},
    "sens clip 4/1.5": {"sens_clip": 4.0},
    "sens clip 8/2": {"sens_clip": 8.0, "sens_coarse": 2.0},
    "sens 4/2 + v/k x0.7": {"sens_clip": 4.0, "sens_coarse": 2.0, "_ratio": 0.7},
    "sens 4/2 + v/k x1.4": {"sens_clip": 4.0, "sens_coarse": 2.0, "_ratio": 1.4},
    "sens 4/2 + k_qgamma 1": {"sens_clip": 4.0, "sens_coarse": 2.0, "k_qgamma": 1.0},
    "sens 8/2 + k_qgamma 1": {"sens_clip": 8.0, "sens_coarse": 2.0, "k_qgamma": 1.0},
    "sens 8/1.5 + k_qgamma 1": {"sens_clip": 8.0, "sens_coarse": 1.5, "k_qgamma": 1.0},
    "sens 8/2 + k_qgamma 1 + v/k x1.4": {"sens_clip": 8.0, "sens_coarse": 2.0, "k_qgamma": 1.0, "_ratio": 1.4},
    "recent off": {"recent_ramp": 0},
    "recent ramp 64": {"recent_ramp": 64},
    "recent ramp 256": {"recent_ramp": 256},
    "recent fine 2": {"recent_fine": 2.0},
    "recent fine 8": {"recent_fine": 8.0},
    # the K/V balance at coarse steps (profiles balance each level closed loop since 2026-12-06):
    # "_scale" multiplies both scales, so finer V is measured where its KL is near the target
    "v/k x0.4": {"_ratio": 0.4, "_scale": 1.5},
    "v/k x0.6": {"_ratio": 0.6, "_scale": 1.4},
    "v/k x0.75": {"_ratio": 0.75, "_scale": 1.25},
    "v/k x1.6": {"_ratio": 1.6, "_scale": 0.8},
    # one stage off at a time (docs/kvc-design.md): rotating K means (k_rope_mean, 2026-12-05)
    "rotating means off": {"k_rope_mean": 0},
}


#: The first scale: each model's near-lossless k_step in its profile before this study (search
#: settings of commit 4dbc87a; the statistics the study reads do not depend on them).
FIRST_SCALE = {"smollm2-135m": 0.6616716386039265, "qwen2.5-coder-0.5b": 0.21471718485059346}


def bits_at(points: list[tuple[float, float]], kl: float) -> float:
    """Bits at ``kl`` by log-linear interpolation (or extrapolation) through two (kl, bits) points."""
    (k0, b0), (k1, b1) = sorted(points)[:2]
    if abs(math.log(k1 / k0)) < 1e-9:
        return b0
    return b0 + (b1 - b0) * math.log(kl / k0) / math.log(k1 / k0)


def _search_point(prof: dict[str, Any], level: str) -> float:
    """The coarsest point of the profile's step search (all at ``kv_ratio``) that meets ``level``'s
    target: the level's step before its balance probes."""
    from kvcodec.codecs.kvc.profile import LEVELS

    met = [p[0] for p in prof["points"] if p[1] <= LEVELS[level]]
    return max(met) if met else min(p[0] for p in prof["points"])


def report(doc: dict[str, Any]) -> str:
    """The markdown of a result ``doc``."""
    at_kl = doc["at_kl"]
    scales = doc.get("k_steps") or f"each profile's {doc.get('level')} k_step"
    lines = ["# kvc: how wide the step multipliers may range (closed loop, per model)", "",
             f"Search windows of the built-in calibration texts (prose, code, docs, dialogue; 1024 cached + 512 "
             f"scored tokens), with the statistics, sensitivities and K/V ratio of each model's profile; scales: "
             f"`{scales}` and {doc['factor']}x it (times a variant's `_scale`). Bits at KL {at_kl}: log-linear "
             "between the two points.", "",
             f"Bits at KL {at_kl} (lower is better):", "",
             "| variant | " + " | ".join(doc["models"]) + " |", "|---|" + "---|" * len(doc["models"])]
    at = {(r["model"], r["variant"]): r["bits_at_kl"] for r in doc["rows"]}
    for v in doc["variants"]:
        lines.append(f"| {v} | " + " | ".join(f"{at[(m, v)]:.3f}" if (m, v) in at else "" for m in doc["models"])
                     + " |")
    lines += ["", "Every point:", "",
              f"| model | variant | settings | k_step | mean KL | worst KL | bits | bits at KL {at_kl} |",
              "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['model']} | {r['variant']} | `{json.dumps(doc['variants'][r['variant']])}` | "
                     f"{r['k_step']:.4f} | {r['kl_mean']:.5f} | {r['kl_worst']:.5f} | {r['bits']:.3f} | "
                     f"{r['bits_at_kl']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--k-steps", default=",".join(f"{m}={k!r}" for m, k in FIRST_SCALE.items()),
                    help="the first scale per model (default: the near-lossless k_step of each model's "
                    "profile made with the search settings before this study), or a level's name "
                    "(transparent, near, aggressive): the k_step of that level's search point at the "
                    "profile's kv_ratio (before any balance probe)")
    ap.add_argument("--factor", type=float, default=1.6, help="the second scale, as a multiple of the first")
    ap.add_argument("--at-kl", type=float, default=0.006, help="the common KL the bits are compared at")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="eval/results/kvc_alloc")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    from kvcodec.codecs.kvc.calibration import load_query_statistics
    from kvcodec.harness.evaluate import Evaluator
    from kvcodec.harness.models import load_model
    from kvcodec.harness.profile import SEARCH_ENTROPY, SEARCH_SETTINGS, score_windows, split_windows
    from kvcodec.harness.studies import profile_dir
    from kvcodec.harness.texts import CALIBRATION_DOMAINS, calibration_text

    torch.set_num_threads(2)
    rows: list[dict[str, Any]] = []
    for name in args.models.split(","):
        path = str(profile_dir() / f"{name}.profile.safetensors")  # made by eval/studies/kvc_profile.py
        prof = load_query_statistics(path).profile
        if "=" in args.k_steps:
            first = dict(kv.split("=") for kv in args.k_steps.split(","))[name]
        else:  # the level's point of the step search, at kv_ratio (the stage before the balance)
            first = _search_point(prof, args.k_steps)
        ratio = float(prof["kv_ratio"])
        model, tok = load_model(name)
        t = prof["text"]
        search, _ = split_windows(tok, {d: calibration_text(d) for d in CALIBRATION_DOMAINS}, t["context"], t["continuation"], 4, 1)
        evs = [Evaluator(model, tok, "", t["context"], t["continuation"], attn_queries=1, token_ids=w)
               for _, w in search]
        for var in args.variants.split(","):
            pts = []
            over = dict(VARIANTS[var])
            vk = ratio * over.pop("_ratio", 1.0)  # a multiple of the profile's v_step / k_step
            scale = over.pop("_scale", 1.0)  # a multiple of both scales
            for s in (float(first) * scale, float(first) * scale * args.factor):
                cfg = {"id": "kvc", **SEARCH_ENTROPY, **SEARCH_SETTINGS, **over, "k_step": s,
                       "v_step": s * vk, "calibration": path}
                _, kls, bits = score_windows(evs, cfg, 1.0)
                pts.append((float(np.mean(kls)), bits))
                rows.append({"model": name, "variant": var, "k_step": s, "kl_mean": float(np.mean(kls)),
                             "kl_worst": max(kls), "kl_windows": kls, "bits": bits})
                print(json.dumps(rows[-1]), flush=True)
            rows[-1]["bits_at_kl"] = rows[-2]["bits_at_kl"] = bits_at(pts, args.at_kl)
        del model, tok, evs
    doc = {"models": args.models.split(","), "k_steps": args.k_steps, "factor": args.factor, "at_kl": args.at_kl,
           "variants": {v: VARIANTS[v] for v in args.variants.split(",")}, "rows": rows}
    write_result(args.out, doc, report(doc), prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
