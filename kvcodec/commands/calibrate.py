"""``kvcodec calibrate``: measure a model's kvc profile (and its query statistics).

The file is input to the encoder (``{"id": "kvc-near", "calibration": FILE}``, or
``{"id": "kvc", "target_kl": 0.005, "calibration": FILE}``). Its profile also holds cross-layer
predictors (kvc ``xpred``), and files coded with it decode only where the same profile is (the
path the encoder read, ``~/.cache/kvcodec/profiles``, ``$KVCODEC_PROFILES`` or ``kvcodec decode
--profile``); ``--no-xpred`` makes a profile whose files decode anywhere. By
default the command runs the closed loop of :mod:`kvcodec.harness.profile` on the built-in
calibration text (four domains, none of it evaluated on): every quality level, and any target,
then maps to steps measured on this model. ``--no-profile`` writes the statistics only.

Example::

    kvcodec calibrate --out smollm2.profile.safetensors                        # built-in model and text
    kvcodec calibrate --model qwen2.5-coder-0.5b --out qwen.profile.safetensors
    kvcodec calibrate --model ./my-model --text other.txt --out my.profile.safetensors
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import int_at_least, non_negative_int, positive_int, print_json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate",
        help="measure a model's kvc profile: its quality levels mapped to steps (calibration file)",
        description="Prefill a transformers decoder model on a calibration text; record per-layer "
        "query statistics and each layer and head's sensitivity (the Fisher information of the "
        "next-token distribution); then, closed loop, encode the cache at several step scales and "
        "score the real next-token KL until each quality level (kvc-transparent 0.002, kvc-near "
        "0.01, kvc-aggressive 0.05) is met with a margin, and check it on a second window of the "
        "text. kvc reads the profile when named by its 'calibration' parameter: the level "
        "presets, and any {\"id\": \"kvc\", \"target_kl\": T}, then code with this model's steps. "
        "The profile holds cross-layer predictors fitted on this model: files coded with it predict each "
        "layer from the one before and decode only where the profile is (kvcodec decode --profile FILE, or "
        "~/.cache/kvcodec/profiles); --no-xpred for files that decode anywhere. "
        "About 2.5 minutes for SmolLM2-135M and 4.5 for Qwen2.5-Coder-0.5B on 2 cores, with progress; a "
        "model with more KV values a token takes longer, up to --time-budget (then it stops refining the K/V "
        "balance: the levels are met, at a few more bits). "
        "Needs the [eval] extra.",
    )
    p.add_argument("--model", default=None,
                   help="a known model (smollm2-135m, qwen2.5-coder-0.5b), a local model directory or a .gguf file (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--text", default=None,
                   help="UTF-8 text file (default: the built-in calibration text: prose, code, documentation "
                   "and dialogue that no evaluation scores)")
    p.add_argument("--context", type=int_at_least(2), default=None,
                   help="cached tokens per window (default 1024 for a profile, 1536 with --no-profile)")
    p.add_argument("--skip-tokens", type=non_negative_int, default=0,
                   help="skip this many tokens of the text first (keep evaluation text out)")
    p.add_argument("--samples", type=positive_int, default=64, help="queries sampled per layer and head (default 64)")
    p.add_argument("--sensitivity", type=non_negative_int, default=2, metavar="DRAWS",
                   help="Fisher draws for the per-(layer, head) sensitivities (default 2; 0 = skip, "
                   "only with --no-profile)")
    p.add_argument("--continuation", type=positive_int, default=512,
                   help="scored tokens after the context (sensitivities and the KL the search measures, as "
                   "the levels are defined: default 512)")
    p.add_argument("--no-profile", action="store_true",
                   help="write the query statistics only (no closed-loop search; the level presets then "
                   "code with their fixed steps)")
    p.add_argument("--no-xpred", action="store_true",
                   help="no cross-layer predictors: files coded with this profile decode without it (they "
                   "cost more bits at each level)")
    p.add_argument("--margin", type=_fraction, default=None,
                   help="a step meets a target when the mean KL over the search windows is at most this "
                   "fraction of it (and the worst window at most 1.2x the target; default 0.8)")
    p.add_argument("--time-budget", type=non_negative_int, default=None, metavar="SECONDS",
                   help="seconds the closed loop may take before it stops refining the K/V balance (the "
                   "levels are always met; the budget can only cost bits; default 540, 0 = no bound)")
    p.add_argument("--out", required=True, help="safetensors file to write (atomically)")
    p.add_argument("--json", action="store_true", help="print a JSON summary to stdout")
    p.set_defaults(func=run)


def _fraction(text: str) -> float:
    """An argparse ``type=``: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in (0, 1], got {text!r}")
    return value


def run(args: argparse.Namespace) -> int:
    from ..errors import InputError
    from ..harness.calibration import query_statistics, save_query_statistics
    from ..harness.capture import read_text
    from ..harness.models import load_model, require_eval

    if args.context is None:
        args.context = 1536 if args.no_profile else 1024
    if not args.no_profile and (args.sensitivity < 1 or args.skip_tokens):
        raise InputError("a profile needs --sensitivity >= 1 and no --skip-tokens (cut the text instead), "
                         "or give --no-profile")
    require_eval()
    if args.text is None:
        from ..harness.texts import CALIBRATION_DOMAINS, calibration_text

        text_name = "built-in calibration texts"
        # statistics only: the mixed text; a profile: one text per domain (a window of each searched)
        text = calibration_text() if args.no_profile else {d: calibration_text(d) for d in CALIBRATION_DOMAINS}
    else:
        text, text_name = read_text(args.text), os.path.basename(args.text)
    t0 = time.perf_counter()
    model, tok = load_model(args.model)

    def say(msg: str) -> None:
        if not args.json:
            print(f"calibrate: {msg}", file=sys.stderr, flush=True)

    def progress(done: int, total: int) -> None:
        say(f"sensitivity draw {done}/{total} ({time.perf_counter() - t0:.0f} s)")

    if args.no_profile:
        assert isinstance(text, str)
        stats = query_statistics(model, tok, text, context=args.context, skip_tokens=args.skip_tokens,
                                 samples=args.samples, sensitivity_samples=args.sensitivity,
                                 continuation=args.continuation, progress=progress)
    else:
        from ..harness.profile import DEFAULT_MARGIN, TIME_BUDGET, build_profile

        budget = TIME_BUDGET if args.time_budget is None else (args.time_budget or None)
        stats = build_profile(model, tok, text, context=args.context, continuation=args.continuation,
                              samples=args.samples, sensitivity_samples=args.sensitivity,
                              margin=args.margin or DEFAULT_MARGIN, text_name=text_name, progress=say,
                              xpred=not args.no_xpred, time_budget=budget)
    save_query_statistics(stats, args.out)
    summary = {"output": os.fspath(args.out), "layers": stats.num_layers, "context": args.context,
               "skip_tokens": args.skip_tokens, "samples": args.samples,
               "sensitivity_draws": args.sensitivity, "continuation": args.continuation if args.sensitivity else 0,
               "rope_theta": stats.rope_theta, "seconds": round(time.perf_counter() - t0, 2)}
    if stats.profile is not None:
        summary["profile"] = {"kv_ratio": stats.profile["kv_ratio"], "margin": stats.profile["search_margin"],
                              "levels": stats.profile["levels"]}
    if args.json:
        print_json(summary)
    else:
        print(f"wrote {summary['output']}: {stats.num_layers} layers, {args.context} tokens "
              f"after {args.skip_tokens}, {summary['seconds']:.0f} s", file=sys.stderr)
        for row in (stats.profile or {}).get("levels", []):
            print(f"  kvc-{row['name']}: KL <= {row['target_kl']:g}: k_step {row['k_step']:.4f}, v_step "
                  f"{row['v_step']:.4f}, {row['bits']:.3f} b; KL {row['kl_search']:.5f} (search), "
                  f"{row['kl_holdout']:.5f} (held out, mean over windows)", file=sys.stderr)
    return 0
