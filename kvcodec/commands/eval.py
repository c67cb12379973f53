"""``kvcodec eval``: score codecs on a real model (bits per element, attention errors, KL, ΔPPL).

Example::

    kvcodec eval --codecs raw,fp8-e4m3,kivi-2 --context 512 --continuation 128 --json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ..errors import ConfigError, InputError
from . import non_negative_int, positive_int, print_json

#: Defaults of the built-in suite (the published results use the same lengths).
DEFAULT_CONTEXT = 2048
DEFAULT_CONTINUATION = 512


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="score codecs on a real model: bits/element, attention error, next-token KL, ΔPPL",
        description="Prefill a context, compress its KV cache with each codec, and score the "
        "continuation against the uncompressed cache. Writes results.json, results.md and "
        "results_rd.png into a run directory. Needs the [eval] extra.",
    )
    p.add_argument("--model", default=None,
                   help="a known model (smollm2-135m, qwen2.5-coder-0.5b), a local model directory or a .gguf file (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--text", default=None, help="UTF-8 text file (default: built-in Jargon File excerpt)")
    p.add_argument("--codecs", default=None,
                   help="comma-separated presets (default: every registered preset); "
                   "'all' means every registered preset")
    p.add_argument("--suite", default=None,
                   help="suite JSON (eval/suites/*.json): codecs, context, continuation, sweep")
    p.add_argument("--context", type=positive_int, default=None, help=f"context tokens (default {DEFAULT_CONTEXT})")
    p.add_argument("--continuation", type=positive_int, default=None,
                   help=f"scored continuation tokens (default {DEFAULT_CONTINUATION})")
    p.add_argument("--sweep", action="store_true", help="also run each codec family's settings sweep")
    p.add_argument("--attn-queries", type=non_negative_int, default=64,
                   help="continuation queries per layer for the attention metrics (default 64; 0 = all)")
    p.add_argument("--cache-dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                   help="dtype of the reference cache the codecs compress (default float16)")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="calibration file (kvcodec calibrate) for the kvc presets tuned for one (names ending "
                   "in -cal); without it those presets are left out of 'all', and naming one is an error. "
                   "When it holds a profile, each kvc level preset is also scored with it ('+profile')")
    p.add_argument("--out", default=None, help="run directory (default runs/eval-<UTC time>)")
    p.add_argument("--stem", default="results", help="file name stem in the run directory")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--json", action="store_true", help="print the results JSON to stdout")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def load_suite(path: str) -> dict[str, Any]:
    """Read a suite JSON: ``{"codecs": [...] | "all", "context": N, "continuation": M, "sweep": bool}``."""
    try:
        with open(path, encoding="utf-8") as f:
            suite = json.load(f)
    except OSError as e:
        raise InputError(f"cannot read suite {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ConfigError(f"suite {path} is not valid JSON: {e}") from None
    if not isinstance(suite, dict):
        raise ConfigError(f"suite {path} must be a JSON object")
    unknown = set(suite) - {"name", "description", "codecs", "context", "continuation", "sweep",
                            "attn_queries", "cache_dtype", "model", "text"}
    if unknown:
        raise ConfigError(f"suite {path}: unknown keys {sorted(unknown)}")
    return suite


def run(args: argparse.Namespace) -> int:
    import torch

    from ..cache import SOURCE_DTYPES
    from ..codec import list_codecs
    from ..harness.capture import read_text
    from ..harness.evaluate import Evaluator, expand_settings, run_suite, with_calibration
    from ..harness.models import is_default, load_model, require_eval
    from ..harness.report import SCHEMA, machine_info, versions, write_run

    require_eval()
    suite = load_suite(args.suite) if args.suite else {}
    context = _first(args.context, suite.get("context"), DEFAULT_CONTEXT)
    continuation = _first(args.continuation, suite.get("continuation"), DEFAULT_CONTINUATION)
    sweep = bool(args.sweep or suite.get("sweep", False))
    model_arg = args.model if args.model is not None else suite.get("model")
    text_arg = args.text if args.text is not None else suite.get("text")
    if args.codecs:
        codecs: list[Any] = [c.strip() for c in args.codecs.split(",") if c.strip()]
    else:
        codecs = suite.get("codecs", "all")
    every = codecs == "all" or codecs == ["all"]
    if every:
        codecs = list_codecs()
    if not isinstance(codecs, list) or not codecs:
        raise ConfigError("no codecs to evaluate")
    if not isinstance(context, int) or not isinstance(continuation, int) or context < 1 or continuation < 1:
        raise InputError(f"context and continuation must be >= 1 tokens (got {context!r}, {continuation!r})")
    settings = expand_settings(codecs, sweep=sweep)  # fail fast on unknown names
    if args.calibration:
        from ..harness.calibration import load_query_statistics

        load_query_statistics(args.calibration)  # fail fast on a missing or malformed file
    settings, skipped = with_calibration(settings, args.calibration, skip_uncalibrated=every)
    if skipped:
        print(f"kvcodec eval: left out {', '.join(skipped)} (tuned for a calibration file: "
              "give one with --calibration FILE, from kvcodec calibrate)", file=sys.stderr)

    t0, cpu0 = time.perf_counter(), time.process_time()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(f"kvcodec eval: loading model and reference run (context {context}, "
          f"continuation {continuation}) ...", file=sys.stderr)
    model, tok = load_model(model_arg)
    text = read_text(text_arg)
    torch.manual_seed(0)
    aq = args.attn_queries if args.attn_queries > 0 else None
    ev = Evaluator(model, tok, text, context, continuation, cache_dtype=SOURCE_DTYPES[args.cache_dtype],
                   attn_queries=aq,
                   text_name="jargon-4.4.7-excerpt" if text_arg is None else Path(text_arg).name)
    results = run_suite(ev, settings, progress=not args.quiet)
    from ..harness.results import provenance

    command = ("kvcodec " + " ".join(shlex.quote(a) for a in sys.argv[1:])
               if Path(sys.argv[0]).name in ("kvcodec", "__main__.py", "cli.py") else _command_from_args(args))
    doc = {
        "schema": SCHEMA,
        # the header every eval/results file carries (kvcodec.harness.results); command, date and
        # machine stay below as well, where kvcodec.eval/1 readers find them
        "provenance": provenance(command=command),
        "command": command,
        "date": date,
        "wall_seconds": time.perf_counter() - t0,
        # CPU time of all our threads: on a shared machine wall time also counts other jobs.
        "cpu_seconds": time.process_time() - cpu0,
        "machine": machine_info(),
        "versions": versions(),
        "run": {**ev.describe(), "default_model": is_default(model_arg), "sweep": sweep,
                "suite": args.suite, "left_out": skipped, "calibration": args.calibration},
        "results": results,
    }
    out = Path(args.out) if args.out else Path("runs") / ("eval-" + date.replace(":", "").replace("-", ""))
    paths = write_run(doc, out, stem=args.stem, plot=not args.no_plot)
    failed = [r["name"] for r in results if r.get("error")]
    if args.json:
        from ..harness.report import _clean

        print_json(_clean(doc))
    else:
        from ..harness.report import markdown_table

        print(markdown_table(results))
    print(f"kvcodec eval: {len(results)} settings in {doc['wall_seconds']:.0f} s; wrote "
          f"{', '.join(paths.values())}" + (f"; failed: {', '.join(failed)}" if failed else ""),
          file=sys.stderr)
    return 0


def _first(*values: Any) -> Any:
    """The first value that is not None (0 is a value, and an invalid one we report)."""
    return next(v for v in values if v is not None)


def _command_from_args(args: argparse.Namespace) -> str:
    """The equivalent command line when eval runs through ``main([...])`` (tests, scripts)."""
    parts = ["kvcodec", "eval"]
    for name in ("model", "text", "codecs", "suite", "context", "continuation", "out"):
        v = getattr(args, name)
        if v is not None:
            parts += [f"--{name}", str(v)]
    if args.sweep:
        parts.append("--sweep")
    if args.json:
        parts.append("--json")
    return " ".join(shlex.quote(p) for p in parts)
