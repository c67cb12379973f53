"""Did a change make kvcodec slower? `kvcodec bench` of two checkouts, run alternately on one input.

Each round runs the bench of checkout A, then of checkout B (each in its own process, with
``PYTHONPATH`` pointing at the checkout), on the same raw cache, codecs and calibration file. The
best time of each codec over the rounds is kept per checkout, and the report gives B's encode and
decode MB/s over A's: ratios measured in one run, so the machine's drift over the run affects both
checkouts alike. File sizes must be identical (the same bytes); the script says so when they are not.

``--before`` / ``--after`` are checkout folders or git revisions (a revision is checked out into a
temporary worktree, removed at the end). Without ``--input`` the built-in SmolLM2 cache of
``--context`` tokens is captured once (loads the model).

Usage (issue 19's before/after run):
    python eval/studies/speed_compare.py --before 8760b98 --after 7f35430 --context 1536 \
        --codecs fp8-e4m3,nvfp4,kivi-2,kivi-4-ans,cachegen,cachegen-lmcache,kvc-near,kvc-aggressive \
        --rounds 7 --out eval/results/speed_issue19
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvcodec.harness.results import provenance, write_result

CODECS = "fp8-e4m3,nvfp4,kivi-2,kivi-4-ans,cachegen,cachegen-lmcache,kvc-near,kvc-aggressive,kvc-near-cal,kvc-aggressive-cal"


def _run_in(tree: str, cmd: list[str]) -> str:
    """``cmd`` (a Python command) run with ``tree``'s kvcodec: from inside the tree, with it on
    ``PYTHONPATH``. (``python -m`` puts the working directory first on the path: run from
    another checkout, the "before" side imported that checkout's kvcodec instead of its own.)"""
    root = str(Path(tree).resolve())
    env = {**os.environ, "PYTHONPATH": root}
    return subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, check=True).stdout


def _check_import(tree: str) -> None:
    """Raise unless a Python started as :func:`bench` starts it imports ``tree``'s kvcodec."""
    got = Path(_run_in(tree, [sys.executable, "-c", "import kvcodec; print(kvcodec.__file__)"]).strip()).resolve()
    if Path(tree).resolve() not in got.parents:
        raise SystemExit(f"speed_compare: {tree} imports kvcodec from {got}, not its own")


def bench(tree: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, "-m", "kvcodec.cli", "bench", "--input", args.input, "--codecs", args.codecs,
           "--repeat", "1", "--json"]
    if args.calibration:
        cmd += ["--calibration", args.calibration]
    return {r["codec"]: r for r in json.loads(_run_in(tree, cmd))["rows"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", required=True, help="checkout A (the baseline)")
    p.add_argument("--after", required=True, help="checkout B")
    p.add_argument("--input", default=None, help="raw safetensors cache (default: capture the built-in one)")
    p.add_argument("--context", type=int, default=1536, help="tokens of the captured cache (without --input)")
    p.add_argument("--codecs", default=CODECS)
    p.add_argument("--calibration", default=None, help="calibration file for the -cal presets")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", required=True, help="result stem (writes .json and .md)")
    args = p.parse_args(argv)
    prov = provenance(argv if argv is not None else sys.argv[1:], prog="python eval/studies/speed_compare.py")
    tmp = Path(tempfile.mkdtemp(prefix="kvcodec-speed-"))
    for side in ("before", "after"):
        if not Path(getattr(args, side)).is_dir():  # a revision: check it out beside
            tree = tmp / side
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), getattr(args, side)], check=True,
                           capture_output=True)
            setattr(args, side, str(tree))
    if args.input is None:
        args.input = str(tmp / f"smollm2_{args.context}.safetensors")
        subprocess.run([sys.executable, "-m", "kvcodec.cli", "capture", "--context", str(args.context),
                        "--out", args.input], check=True)
    args.input = str(Path(args.input).resolve())  # the benches run from inside each checkout
    if args.calibration:
        args.calibration = str(Path(args.calibration).resolve())
    try:
        for side in ("before", "after"):
            _check_import(getattr(args, side))
        return _run(args, prov)
    finally:
        for side in ("before", "after"):
            if Path(getattr(args, side)).parent == tmp:
                subprocess.run(["git", "worktree", "remove", "--force", getattr(args, side)], capture_output=True)


def _run(args: argparse.Namespace, prov: dict) -> int:
    best: dict[str, dict[str, dict[str, float]]] = {"before": {}, "after": {}}
    sizes: dict[str, dict[str, float]] = {"before": {}, "after": {}}
    for rnd in range(args.rounds):
        for side in ("before", "after"):
            print(f"round {rnd + 1}/{args.rounds}: {side}", file=sys.stderr, flush=True)
            for name, r in bench(getattr(args, side), args).items():
                b = best[side].setdefault(name, {"encode_MBps": 0.0, "decode_MBps": 0.0})
                b["encode_MBps"] = max(b["encode_MBps"], r["encode_MBps"])
                b["decode_MBps"] = max(b["decode_MBps"], r["decode_MBps"])
                sizes[side][name] = r["bits_per_element"]
    rows = []
    for name in best["after"]:
        a, b = best["before"].get(name), best["after"][name]
        if a is None:
            continue
        rows.append({"codec": name, "bits_before": sizes["before"][name], "bits_after": sizes["after"][name],
                     "encode_MBps_before": a["encode_MBps"], "encode_MBps_after": b["encode_MBps"],
                     "encode_after_over_before": round(b["encode_MBps"] / a["encode_MBps"], 3),
                     "decode_MBps_before": a["decode_MBps"], "decode_MBps_after": b["decode_MBps"],
                     "decode_after_over_before": round(b["decode_MBps"] / a["decode_MBps"], 3)})
    same = all(r["bits_before"] == r["bits_after"] for r in rows)
    commits = {side: subprocess.run(["git", "-C", getattr(args, side), "rev-parse", "--short", "HEAD"],
                                    capture_output=True, text=True).stdout.strip() or "unknown"
               for side in ("before", "after")}
    md = ["# Speed before and after (kvcodec bench, alternating checkouts)", "",
          f"Input `{args.input}`, {args.rounds} rounds, best of the rounds per checkout; before = "
          f"`{args.before}` ({commits['before']}), after = `{args.after}` ({commits['after']}). "
          f"Ratios > 1: the after checkout is faster. "
          f"File sizes {'identical' if same else 'DIFFER'} on every codec.", "",
          "| codec | bits/elem | encode MB/s before | after | after/before | decode MB/s before | after | after/before |",
          "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['codec']} | {r['bits_after']} | {r['encode_MBps_before']} | {r['encode_MBps_after']} | "
                  f"{r['encode_after_over_before']} | {r['decode_MBps_before']} | {r['decode_MBps_after']} | "
                  f"{r['decode_after_over_before']} |")
    write_result(args.out, {"input": args.input, "rounds": args.rounds, "commits": commits, "same_sizes": same, "rows": rows},
                 "\n".join(md) + "\n", prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
