#!/usr/bin/env python
"""What the token chunk of the entropy stage does to kvc's calibrated encoder on long caches.

Encodes and decodes the built-in SmolLM2 cache at 4096 and 1536 tokens with kvc-transparent-cal
at several ``chunk`` sizes (tokens per ANS stream; formats/ANS.md) and CacheGen, fastest of
``--repeat`` interleaved rounds on one thread, and prints time over CacheGen's and the size.
The encoder reads each stream's symbols in place, row after row over all of the chunk's tokens,
so a long chunk streams through more memory than the caches hold (compare within one run only).

    python eval/studies/kvc_chunk.py --out eval/results/kvc_chunk
"""

from __future__ import annotations

import argparse
import time

from kvcodec.harness.results import provenance, write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=4)
    ap.add_argument("--chunks", default="4096,2048,1024,512")
    ap.add_argument("--out", default="eval/results/kvc_chunk")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    import torch

    import kvcodec
    from kvcodec.harness.capture import default_cache
    from kvcodec.harness.studies import held_out_calibration

    torch.set_num_threads(1)
    chunks = [int(c) for c in args.chunks.split(",")]
    lines = ["# kvc-transparent-cal: the entropy stage's token chunk against encode and decode time", "",
             f"- timing: one torch thread; fastest of {args.repeat} interleaved rounds, times over CacheGen's "
             "in the same run", "",
             "| tokens | chunk | bits/elem | encode × cachegen | decode × cachegen |", "|---|---|---|---|---|"]
    rows = []
    for ctx in (4096, 1536):
        cache = default_cache(context=ctx)
        cal = held_out_calibration(ctx)
        codecs = {ch: kvcodec.get_codec({"id": "kvc-transparent-cal", "calibration": str(cal), "chunk": ch})
                  for ch in chunks}
        codecs["cachegen"] = kvcodec.get_codec("cachegen")
        best = {k: [float("inf"), float("inf")] for k in codecs}
        size = {}
        for _ in range(args.repeat):
            for k, c in codecs.items():
                t0 = time.perf_counter()
                blob = c.encode(cache)
                t1 = time.perf_counter()
                c.decode(blob)
                t2 = time.perf_counter()
                best[k] = [min(best[k][0], t1 - t0), min(best[k][1], t2 - t1)]
                size[k] = len(blob)
        ref = best["cachegen"]
        for ch in chunks:
            rows.append({"tokens": ctx, "chunk": ch, "bits_per_element": 8 * size[ch] / cache.num_elements,
                         "encode_x_cachegen": best[ch][0] / ref[0], "decode_x_cachegen": best[ch][1] / ref[1]})
            r = rows[-1]
            lines.append(f"| {ctx} | {ch} | {r['bits_per_element']:.4f} | {r['encode_x_cachegen']:.2f} | "
                         f"{r['decode_x_cachegen']:.2f} |")
    doc = {"preset": "kvc-transparent-cal", "threads": 1, "repeat": args.repeat, "rows": rows}
    write_result(args.out, doc, "\n".join(lines), prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
