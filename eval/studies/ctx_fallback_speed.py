"""How fast do magnitude-context ANS stages decode without the native coder?

Times the three pure-Python decoders of a scope-2 stage on the same planes (random symbols with a
per-token scale mixture, precision 14, thresholds 3/8/20, 8 tables): the reference
(``stage_reference._decode_ctx_reference``, which was the fallback before issue 19), the scalar
fast path (``ans_vec.decode_ctx_fast``) and the lockstep one (``ans_vec.decode_stage_fast``), over
stream counts from 4 (kvc's -cal presets on a 1536-token SmolLM2 tensor) to ~100; and a whole
one-layer 1536-token kvc-near-cal file (random fp16 K/V, SmolLM2 geometry) through
``kvcodec.decode`` with the native coder off. Every decoder's output is checked equal.

Usage:
    KVCODEC_NATIVE=0 python eval/studies/ctx_fallback_speed.py --repeat 3 --out eval/results/ctx_fallback_speed
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

import kvcodec
from kvcodec.entropy import EntropyStage, ans_vec
from kvcodec.entropy.stage import _decode_ctx_reference, parse_planes
from kvcodec.harness.results import provenance, write_result
from kvcodec.testing import spelled_out

GEOMETRIES = [(195, 1536, 64, 32), (195, 1536, 8, 32), (195, 1536, 2, 32), (40, 300, 8, 9)]


def best(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return min(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    prov = provenance(argv if argv is not None else sys.argv[1:], prog="python eval/studies/ctx_fallback_speed.py")
    if os.environ.get("KVCODEC_NATIVE") != "0":
        print("run with KVCODEC_NATIVE=0 (the file row measures the fallback)", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    rows = []
    for r, n, g, a in GEOMETRIES:
        lv = a // 2
        scale = 1 + (np.arange(n) % 7 == 0) * 3
        x = (np.clip(np.round(rng.laplace(0, 1.0, size=(r, n)) * scale), -lv + 1, lv - 1) + lv - 1).astype(np.int64)
        st = EntropyStage(scope="ctx", thresholds=[3, 8, 20], rows_per_stream=g, tables="cluster", n_tables=8,
                          precision=14, chunk=2048)
        lay, w, off, ts, rt = parse_planes(st.encode(x, alphabet=a))
        row = {"rows": r, "tokens": n, "rows_per_stream": g, "streams": lay.n_streams}
        for name, dec in (("reference", _decode_ctx_reference), ("fast_scalar", ans_vec.decode_ctx_fast),
                          ("fast_lockstep", ans_vec.decode_stage_fast)):
            assert np.array_equal(dec(lay, w, off, ts, rt), x), name
            row[f"{name}_us_per_symbol"] = round(best(lambda: dec(lay, w, off, ts, rt), args.repeat) / x.size * 1e6, 3)
        rows.append(row)
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(1536, 3, 64, generator=g) * 2 + 3 * torch.randn(1, 3, 64, generator=g)).half()
    v = (torch.randn(1536, 3, 64, generator=g) * (0.5 + torch.rand(1536, 3, 1, generator=g))).half()
    cache = kvcodec.KVCache.from_tensors([(k, v)])
    blob = spelled_out("kvc-near-cal").encode(cache)
    t = best(lambda: kvcodec.decode(blob), args.repeat)
    file_row = {"bytes": len(blob), "elements": cache.num_elements, "decode_s": round(t, 3),
                "us_per_element": round(t / cache.num_elements * 1e6, 3)}
    md = ["# Magnitude-context stages without the native coder", "",
          "Per symbol, best of the repeats; all three decoders give the same symbols.", "",
          "| rows | tokens | rows/stream | streams | reference µs | fast scalar µs | fast lockstep µs |",
          "|---|---|---|---|---|---|---|"]
    md += [f"| {r['rows']} | {r['tokens']} | {r['rows_per_stream']} | {r['streams']} | "
           f"{r['reference_us_per_symbol']} | {r['fast_scalar_us_per_symbol']} | {r['fast_lockstep_us_per_symbol']} |"
           for r in rows]
    md += ["", f"Whole file, `kvcodec.decode` with KVCODEC_NATIVE=0: one layer of a 1536-token random fp16 "
               f"cache (3 KV heads, head_dim 64) coded with kvc-near-cal settings (no calibration), "
               f"{file_row['bytes']} bytes: {file_row['decode_s']} s, {file_row['us_per_element']} µs per element. "
               "The stage decoder picks the lockstep path from 80 streams on, the scalar one below."]
    write_result(args.out, {"stages": rows, "file": file_row}, "\n".join(md) + "\n", prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
