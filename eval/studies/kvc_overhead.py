"""Where the bits of a kvc file go: the coded symbols against everything else, per plane kind.

Encodes the built-in SmolLM2 cache with each kvc preset (the -cal presets with a calibration
file, recorded on held-out tokens 8192– of the built-in text as in eval/studies/kvc_rd.py) and splits the
file's size into the safetensors header (index and manifest), the ANS words (the coded symbols)
and every other plane kind, in bits per cached element (a packed tensor's plane is split into its
pieces by its directory, a zstd-compressed piece by its stored bytes; the gaps between them
count as ``pad``).

    python eval/studies/kvc_overhead.py --context 1536 --out eval/results/kvc_overhead
"""

from __future__ import annotations

import argparse
import collections
import json
import struct
import sys

from kvcodec.harness.results import provenance, write_result

PRESETS = ["kvc-transparent", "kvc-near", "kvc-aggressive", "kvc-transparent-cal", "kvc-near-cal", "kvc-aggressive-cal"]


def split(blob: bytes, elements: int) -> dict[str, float]:
    """Bits per element of each part of a KVC file: ``header``, then each plane kind (the last
    component of the plane name; ``pad`` for alignment padding), and ``total``."""
    from kvcodec.codecs.kvc import PACK_PIECES
    from kvcodec.format.pack import stored_bytes

    (n,) = struct.unpack("<Q", blob[:8])
    head = json.loads(blob[8:8 + n])
    layers = json.loads(head["__metadata__"]["manifest"])["layers"]
    sizes: collections.Counter = collections.Counter()
    for name, entry in head.items():
        if name == "__metadata__":
            continue
        kind = "pad" if name.startswith("pad.") else name.split(".")[-1]
        a, b = entry["data_offsets"]
        parts = name.split(".")
        if kind == "pack" and len(parts) == 4:  # a packed kvc tensor: split it by its directory
            (chunk,) = layers[int(parts[1])]["tensors"][parts[2]]["chunks"]
            used = 0
            for e in chunk["params"]["pk"]:
                size = stored_bytes(e)
                sizes[PACK_PIECES[e[0]]] += size
                used += size
            sizes["pad"] += (b - a) - used  # the alignment gaps inside the packed plane
            continue
        sizes[kind] += b - a
    out = {"header": 8.0 * (n + 8) / elements}
    out.update({k: 8.0 * v / elements for k, v in sizes.most_common()})
    out["total"] = 8.0 * len(blob) / elements
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    import kvcodec
    from kvcodec.harness.capture import default_cache
    from kvcodec.harness.studies import held_out_calibration

    cache = default_cache(context=args.context)
    cal = held_out_calibration(args.context)
    rows = {}
    for p in PRESETS:
        cfg = {"id": p, "calibration": str(cal)} if p.endswith("-cal") else p
        rows[p] = split(kvcodec.get_codec(cfg).encode(cache), cache.num_elements)
        r = rows[p]
        print(f"{p:22s} total {r['total']:.4f}  symbols {r.get('ans_words', 0):.4f}  "
              f"other {r['total'] - r.get('ans_words', 0):.4f}", flush=True)
    kinds = sorted({k for r in rows.values() for k in r} - {"total", "ans_words"},
                   key=lambda k: -max(r.get(k, 0.0) for r in rows.values()))
    res = {
        "context": args.context, "calibration": str(cal), "rows": rows,
    }
    lines = [f"# Where the bits of a kvc file go (SmolLM2-135M, built-in cache, {args.context} tokens)", "",
             "- bits per cached element; `ans_words` are the coded symbols, everything else is side "
             "information: `header` (safetensors index + manifest), `ans_tables` / `ans_row_table` / "
             "`ans_offsets` / `ans_meta` (the entropy stage's tables and index), `esc` (escaped codes, raw, "
             "in the narrowest integer type), `protect` (token 0 exact, plus the detected sinks of the "
             "plain presets), `side` (K channel means and step codes), `token_ids` / "
             "`positions` (the container's), `pred` (token-delta rows), `pad` (64-byte alignment, and the 4-byte gaps inside packed planes).", "",
             "| preset | total | ans_words | all other | " + " | ".join(kinds) + " |",
             "|---|---|---|---|" + "---|" * len(kinds)]
    for p, r in rows.items():
        other = r["total"] - r.get("ans_words", 0.0)
        lines.append(f"| {p} | {r['total']:.4f} | {r.get('ans_words', 0):.4f} | {other:.4f} ({100 * other / r['total']:.0f} %) | "
                     + " | ".join(f"{r.get(k, 0.0):.4f}" for k in kinds) + " |")
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        write_result(args.out, res, md, prov=prov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
