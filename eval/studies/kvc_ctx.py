#!/usr/bin/env python
"""Magnitude contexts (formats/ANS.md §3.1) in kvc's calibrated presets: what they save, what they cost.

For each ``kvc-*-cal`` preset, on the built-in model's cache (SmolLM2-135M, built-in text, first
``--context`` tokens) and with a calibration file, the exact file size in bits per element:

* contexts off (``ctx: []``, one row table per row, streams of 16 rows: the stage as before);
* the preset as shipped (contexts on, streams of 64 rows);
* contexts on in streams of 48 rows (four streams to a 192-row matrix, which the decoder runs
  side by side, against three of 64 rows and a ragged one: the trade-off the presets settled).

Contexts are lossless: the decoded caches are checked equal across the three. Then the CPU
encode and decode time of each preset against ``cachegen``'s, single-threaded, the codecs
interleaved and the best of ``--repeat`` kept (timings on a shared machine are noisy: read the
ratios, measured in one run).

The calibration file is the one ``eval/studies/kvc_rd.py`` writes for the same context (built on tokens
8192.. of the text, held out from these), or ``--calibration PATH``.

Writes ``<out>.json`` and ``<out>.md`` (default ``eval/results/kvc_ctx``).

Usage:
    python eval/studies/kvc_rd.py --quick --context 1536 --out /tmp/rd   # once: writes the calibration file
    python eval/studies/kvc_ctx.py --context 1536 --repeat 5
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from kvcodec.harness.results import provenance, write_result

PRESETS = ["kvc-transparent-cal", "kvc-near-cal", "kvc-aggressive-cal"]
ALT_ROWS = 48


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--calibration", default=None, help="calibration file (default: eval/studies/kvc_rd.py's for --context)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="eval/results/kvc_ctx")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    import kvcodec
    from kvcodec.codec import get_codec
    from kvcodec.harness.capture import default_cache
    from kvcodec.harness.studies import calibration_path

    cal = Path(args.calibration or calibration_path(args.context))
    if not cal.is_file():
        ap.error(f"no calibration file {cal}: run `python eval/studies/kvc_rd.py --quick --context {args.context}` "
                 "first or pass --calibration")
    torch.set_num_threads(1)
    cache = default_cache(args.context)
    n = cache.num_elements
    sizes = []
    for p in PRESETS:
        base = get_codec(p).get_config()
        variants = {"off": {"ctx": [], "rows_per_stream": 16}, "shipped": {}, "alt": {"rows_per_stream": ALT_ROWS}}
        row = {"preset": p, "ctx": base["ctx"], "rows_per_stream": base["rows_per_stream"]}
        decoded = {}
        for name, over in variants.items():
            codec = get_codec({**base, **over, "calibration": str(cal)})
            blob = codec.encode(cache)
            row[name] = 8.0 * len(blob) / n
            decoded[name] = kvcodec.decode(blob)
        ref = decoded["off"]
        for name in ("shipped", "alt"):
            for (_, _, a), (_, _, b) in zip(ref.tensors(), decoded[name].tensors()):
                if not torch.equal(a, b):
                    raise SystemExit(f"{p} {name}: decoded cache differs from contexts off (contexts must be lossless)")
        row["saving_pct"] = 100.0 * (1.0 - row["shipped"] / row["off"])
        row["alt_vs_shipped_pct"] = 100.0 * (row["alt"] / row["shipped"] - 1.0)
        sizes.append(row)
        print(f"{p:22s} off {row['off']:.4f}  shipped {row['shipped']:.4f} ({-row['saving_pct']:+.2f} %)  "
              f"{ALT_ROWS} rows {row['alt']:.4f}", flush=True)

    codecs = {"cachegen": get_codec("cachegen")}
    for p in PRESETS:
        codecs[p] = get_codec({**get_codec(p).get_config(), "calibration": str(cal)})
    near = {**get_codec("kvc-near-cal").get_config(), "calibration": str(cal)}
    codecs["kvc-near-cal, contexts off"] = get_codec({**near, "ctx": [], "rows_per_stream": 16})
    codecs[f"kvc-near-cal, {ALT_ROWS} rows"] = get_codec({**near, "rows_per_stream": ALT_ROWS})
    blobs = {k: c.encode(cache) for k, c in codecs.items()}
    enc = {k: float("inf") for k in codecs}
    dec = dict(enc)
    for _ in range(args.repeat):
        for k, c in codecs.items():
            t0 = time.perf_counter()
            c.encode(cache)
            enc[k] = min(enc[k], time.perf_counter() - t0)
            t0 = time.perf_counter()
            kvcodec.decode(blobs[k])
            dec[k] = min(dec[k], time.perf_counter() - t0)
    speed = [{"codec": k, "bits_per_element": 8.0 * len(blobs[k]) / n, "encode_s": enc[k], "decode_s": dec[k],
              "encode_ratio": enc[k] / enc["cachegen"], "decode_ratio": dec[k] / dec["cachegen"]} for k in codecs]
    for s in speed:
        print(f"{s['codec']:22s} enc {s['encode_s'] * 1e3:7.1f} ms ({s['encode_ratio']:.2f}x)  "
              f"dec {s['decode_s'] * 1e3:7.1f} ms ({s['decode_ratio']:.2f}x)", flush=True)

    res = {"threads": 1, "context": args.context, "tokens": cache.num_tokens,
           "calibration": cal.name, "sizes": sizes, "speed": speed}
    js, md = write_result(args.out, res, markdown(res), prov=prov)
    print(f"wrote {js} and {md}")
    return 0


def markdown(res: dict) -> str:
    lines = [f"# kvc magnitude contexts: size and speed ({res['context']} tokens)", "",
             f"{res['threads']} torch thread; calibration `{res['calibration']}` (held-out text).", "",
             "Bits per element, all-in (decoded caches equal in all three: contexts are lossless):", "",
             f"| preset | contexts off | as shipped | saving | streams of {ALT_ROWS} rows |",
             "|---|---:|---:|---:|---:|"]
    for r in res["sizes"]:
        lines.append(f"| `{r['preset']}` (ctx {r['ctx']}, {r['rows_per_stream']} rows) | {r['off']:.4f} | "
                     f"{r['shipped']:.4f} | {r['saving_pct']:.2f} % | {r['alt']:.4f} ({r['alt_vs_shipped_pct']:+.2f} %) |")
    lines += ["", "CPU time, best of the repeats (ratios to `cachegen` measured in the same run):", "",
              "| codec | b/e | encode ms | × cachegen | decode ms | × cachegen |", "|---|---:|---:|---:|---:|---:|"]
    for s in res["speed"]:
        lines.append(f"| `{s['codec']}` | {s['bits_per_element']:.3f} | {s['encode_s'] * 1e3:.1f} | "
                     f"{s['encode_ratio']:.2f} | {s['decode_s'] * 1e3:.1f} | {s['decode_ratio']:.2f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
