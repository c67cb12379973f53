#!/usr/bin/env python
"""What k_recon and the zstd pieces of ``pack: 2`` cost a calibrated kvc encode, and what they save.

Encodes the built-in SmolLM2 cache (1536 tokens) with kvc-near-cal and kvc-transparent-cal as
shipped and with one setting switched back (``k_recon`` 0; ``pack`` 1; zstd level 19 instead of
the shipped level), fastest of ``--repeat`` interleaved rounds on one thread (compare the
columns of one run only: this machine's timings drift between runs).

    python eval/studies/kvc_encode_cost.py --out eval/results/kvc_encode_cost
"""

from __future__ import annotations

import argparse
import time

from kvcodec.harness.results import provenance, write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="eval/results/kvc_encode_cost")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    import torch

    import kvcodec
    import kvcodec.codecs.kvc.codec as kvc  # PACK_ZSTD_LEVEL is read there
    from kvcodec.harness.capture import default_cache
    from kvcodec.harness.studies import held_out_calibration

    torch.set_num_threads(1)
    cache = default_cache(context=1536)
    cal = held_out_calibration(1536)
    shipped_level = kvc.PACK_ZSTD_LEVEL
    rows = []  # (preset, variant, codec, zstd level)
    for p in ("kvc-near-cal", "kvc-transparent-cal"):
        base = {"id": p, "calibration": str(cal)}
        rows += [(p, "as shipped", kvcodec.get_codec(base), shipped_level),
                 (p, "k_recon 0", kvcodec.get_codec({**base, "k_recon": 0}), shipped_level),
                 (p, "pack 1 (no zstd pieces)", kvcodec.get_codec({**base, "pack": 1}), shipped_level),
                 (p, "zstd level 19", kvcodec.get_codec(base), 19)]
    best = [float("inf")] * len(rows)
    sizes = [0] * len(rows)
    try:
        for _ in range(args.repeat):
            for i, (_, _, codec, level) in enumerate(rows):
                kvc.PACK_ZSTD_LEVEL = level
                t = time.perf_counter()
                blob = codec.encode(cache)
                best[i] = min(best[i], time.perf_counter() - t)
                sizes[i] = len(blob)
    finally:
        kvc.PACK_ZSTD_LEVEL = shipped_level
    lines = ["# What k_recon and the zstd pieces cost a calibrated kvc encode (SmolLM2, 1536 tokens)", "",
             f"- timing: one torch thread; fastest of {args.repeat} interleaved rounds (compare within this "
             "run only)",
             f"- shipped zstd level: {shipped_level}", "",
             "| preset | variant | bits/elem | encode s | Δ s vs shipped |", "|---|---|---|---|---|"]
    out_rows = []
    for i, (p, v, _, _) in enumerate(rows):
        ref = next(j for j, r in enumerate(rows) if r[0] == p and r[1] == "as shipped")
        out_rows.append({"preset": p, "variant": v, "bits_per_element": 8 * sizes[i] / cache.num_elements,
                         "encode_s": best[i], "delta_s_vs_shipped": best[i] - best[ref]})
        lines.append(f"| {p} | {v} | {8 * sizes[i] / cache.num_elements:.4f} | {best[i]:.3f} | "
                     f"{best[i] - best[ref]:+.3f} |")
    doc = {"context": 1536, "threads": 1, "repeat": args.repeat, "shipped_zstd_level": shipped_level,
           "rows": out_rows}
    write_result(args.out, doc, "\n".join(lines), prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
