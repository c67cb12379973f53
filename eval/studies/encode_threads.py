#!/usr/bin/env python
"""What the writer's encode threads (``Codec.encode_threads``) save on kvc's presets.

Encodes a 1536-token fp16 cache of each model (the built-in documentation text) with each kvc
preset, tensors coded one at a time and on the writer's threads, alternating in one process
(fastest of ``--repeat`` rounds; this machine's speed drifts between processes, so only ratios
within one run mean anything). The bytes must be equal. Uncalibrated presets only: a calibrated
kvc encode codes one tensor at a time (it gained nothing on threads).

    python eval/studies/encode_threads.py --out eval/results/encode_threads
"""

from __future__ import annotations

import argparse

from kvcodec.harness.results import provenance, write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    ap.add_argument("--presets", default="kvc-transparent,kvc-near,kvc-aggressive")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default="eval/results/encode_threads")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    import os

    import torch

    import kvcodec
    import kvcodec.codecs.kvc.codec as kvc
    from kvcodec.harness import load_model
    from kvcodec.harness.capture import capture
    from kvcodec.harness.studies import timed_encodes
    from kvcodec.harness.texts import eval_text

    shipped = kvc.KVCCodec.encode_threads
    threads = min(shipped, os.cpu_count() or 1)
    rows = []
    for m in args.models.split(","):
        model, tok = load_model(m)
        cache = capture(model, tok, eval_text("docs"), context=1536, dtype=torch.float16)
        del model
        mb = cache.num_elements * 2 / 1e6
        for preset in args.presets.split(","):
            codec = kvcodec.get_codec(preset)
            best, blobs = timed_encodes({1: (codec, 1), threads: (codec, threads)}, cache, args.repeat)
            if blobs[1] != blobs[threads]:
                raise SystemExit(f"{m} {preset}: threaded encode wrote other bytes than one thread")
            rows.append({"model": m, "preset": preset, "fp16_MB": mb, "encode_s_one_thread": best[1],
                         "encode_s_threads": best[threads], "ratio": best[threads] / best[1]})
            print(rows[-1], flush=True)
    lines = ["# What the writer's encode threads save on kvc's presets (1536 tokens, fp16, docs text)", "",
             f"- threads: 1 against {threads} (`Codec.encode_threads` {shipped}, capped at the CPU count); torch "
             f"threads {torch.get_num_threads()}", f"- fastest of {args.repeat} alternating rounds in one process; "
             "the bytes are equal", "",
             "| model | preset | fp16 MB | encode s, 1 thread | encode s, threads | threads / 1 | MB/s, threads |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['preset']} | {r['fp16_MB']:.1f} | {r['encode_s_one_thread']:.3f} | "
                     f"{r['encode_s_threads']:.3f} | {r['ratio']:.2f} | {r['fp16_MB'] / r['encode_s_threads']:.0f} |")
    doc = {"threads": threads, "repeat": args.repeat, "context": 1536, "text": "eval docs", "rows": rows}
    write_result(args.out, doc, "\n".join(lines), prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
