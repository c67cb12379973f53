#!/usr/bin/env python
"""The level presets' fixed steps (no profile): the finest any real model we have needs.

Without a profile a level preset (kvc-transparent, kvc-near, kvc-aggressive) codes with fixed
steps. Issue 20 asks that they then still meet their level on every real model we have, on
several kinds of text. For each model and level, the closed loop of
:func:`kvcodec.harness.profile.search_levels` runs on the preset's own settings without a
calibration file (its K/V step ratio kept): one window of each built-in calibration domain
(prose, code, documentation, dialogue; 1024 cached tokens, 256 scored), a step meets a target when
the mean KL over the windows is at most 0.8x the target and the worst window's at most the
target. The fixed step is the finest over the models. Evaluation text is never used.

Writes ``<out>.json`` and ``<out>.md`` (default ``eval/results/kvc_fixed_steps``).

Usage:
    python eval/studies/kvc_fixed_steps.py
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from kvcodec.harness.results import provenance, write_result

LEVELS = {"kvc-transparent": 0.002, "kvc-near": 0.01, "kvc-aggressive": 0.05}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen2.5-coder-0.5b,smollm2-135m")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--max-evals", type=int, default=4)
    ap.add_argument("--out", default="eval/results/kvc_fixed_steps")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    import kvcodec
    from kvcodec.harness.evaluate import Evaluator
    from kvcodec.harness.models import load_model
    from kvcodec.harness.profile import DEFAULT_MARGIN, score_windows, search_levels, split_windows
    from kvcodec.harness.texts import CALIBRATION_DOMAINS, calibration_text

    torch.set_num_threads(2)
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {msg}", flush=True)

    per_model: dict[str, Any] = {}
    for model_name in args.models.split(","):
        model, tok = load_model(model_name)
        search, _ = split_windows(tok, {d: calibration_text(d) for d in CALIBRATION_DOMAINS}, args.context,
                                  args.continuation)
        evs = [Evaluator(model, tok, "", args.context, args.continuation, attn_queries=1, token_ids=w)
               for _, w in search]
        log(f"{model_name}: {len(evs)} windows ready")
        per_model[model_name] = {}
        for preset, target in LEVELS.items():
            cfg = kvcodec.get_codec(preset).get_config()
            ratio = cfg["v_step"] / cfg["k_step"]

            def score(k: float, cfg: dict[str, Any] = cfg, ratio: float = ratio) -> tuple[float, list[float], float]:
                return score_windows(evs, {**cfg, "k_step": k, "v_step": k * ratio}, DEFAULT_MARGIN)

            points, detail, chosen = search_levels(score, {preset: target}, ratio, args.max_evals,
                                                   lambda m: log(f"  {model_name} {m}"), t0)
            per_model[model_name][preset] = {**chosen[preset], "ratio": ratio, "shipped_k_step": cfg["k_step"],
                                             "points": [list(p) for p in sorted(points)],
                                             "window_kl": {str(k): v for k, v in detail.items()}}
        evs.clear()
        del model, tok
    fixed = {p: {"k_step": min(m[p]["k_step"] for m in per_model.values()),
                 "ratio": next(iter(per_model.values()))[p]["ratio"]} for p in LEVELS}
    for p in fixed:
        fixed[p]["v_step"] = fixed[p]["k_step"] * fixed[p]["ratio"]
    doc = {"models": args.models.split(","), "context": args.context, "continuation": args.continuation,
           "windows": [n for n, _ in search], "margin": DEFAULT_MARGIN, "per_model": per_model, "fixed": fixed}
    lines = ["# kvc level presets: fixed steps that meet each level on every real model we have", "",
             f"Windows: {', '.join(doc['windows'])} of the built-in calibration texts ({args.context} cached, "
             f"{args.continuation} scored tokens); a step meets a target when the mean KL is at most "
             f"{DEFAULT_MARGIN}x the target and the worst window's at most the target. Preset settings, no "
             "calibration file, the preset's v/k ratio kept.", "",
             "| preset | model | k_step found | mean KL | worst KL | bits | shipped k_step before |",
             "|---|---|---|---|---|---|---|"]
    for p in LEVELS:
        for m, rows in per_model.items():
            r = rows[p]
            lines.append(f"| {p} | {m} | {r['k_step']:.4f} | {r['kl_search']:.5f} | {r['kl_search_worst']:.5f} | "
                         f"{r['bits']:.3f} | {r['shipped_k_step']} |")
    lines += ["", "Fixed steps (the finest over the models):", ""]
    lines += [f"- {p}: k_step {f['k_step']:.4f}, v_step {f['v_step']:.4f}" for p, f in fixed.items()]
    write_result(args.out, doc, "\n".join(lines) + "\n", prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
