#!/usr/bin/env python
"""What kvc's GPU decode path costs before any kernel runs, and how much sequential work its
kernels get — measured on the CPU, for reading a GPU run (eval/bench_gpu.py) or planning one.

For the built-in SmolLM2 cache (``--context`` tokens, 30 layers, K and V) coded with kvc presets:

* CPU decode: ``kvcodec.decode(blob)`` (what ``device="cpu"`` runs), fastest of ``--repeat``;
* GPU-path host preparation: for every tensor, the validation, table building and upload
  arguments that ``kvcodec.gpu.prepare_decode`` does before launching (run here with the
  uploads going to CPU memory: on a GPU each upload is a small host-to-device copy on top);
* stage geometry: ANS streams per tensor and symbols per stream, for the shipped presets and
  for kvc-near-cal with shorter token chunks (``--chunks``: the stage setting that multiplies the
  streams for a small cost in bits; eval/results/kvc_chunk.md). One GPU thread decodes one
  stream symbol after symbol, so the longest stream bounds a tensor's kernel time, and the
  streams of the whole file (decoded side by side, ``gpu.batched_decode``) bound how many
  threads are busy.

    python eval/studies/kvc_gpu_host.py --out eval/results/kvc_gpu_host
"""

from __future__ import annotations

import argparse
import json
import time

from kvcodec.harness.results import provenance, write_result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, default=1536)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--chunks", type=lambda v: [int(x) for x in v.split(",") if x], default=[512, 256, 128],
                    help="token chunks to try on kvc-near-cal besides the shipped 2048")
    ap.add_argument("--out", default="eval/results/kvc_gpu_host")
    args = ap.parse_args(argv)
    prov = provenance(argv)
    import numpy as np
    import torch

    import kvcodec
    from kvcodec import gpu
    from kvcodec.codec import EncodedTensor, TensorContext
    from kvcodec.entropy.stage import StageLayout
    from kvcodec import open as open_kvc
    from kvcodec.harness.capture import default_cache
    from kvcodec.harness.studies import held_out_calibration

    cache = default_cache(context=args.context)
    cal = held_out_calibration(1536)
    presets = [("kvc-near", "kvc-near"), ("kvc-near-cal", {"id": "kvc-near-cal", "calibration": str(cal)}),
               ("kvc-aggressive-cal", {"id": "kvc-aggressive-cal", "calibration": str(cal)})]
    # shorter token chunks: more, shorter streams (more GPU threads, less sequential work each)
    presets += [(f"kvc-near-cal chunk={c}", {"id": "kvc-near-cal", "calibration": str(cal), "chunk": c})
                for c in args.chunks]
    rows = []
    real_resolve = gpu.device._resolve_device
    for label, config in presets:
        codec = kvcodec.get_codec(config)
        blob = codec.encode(cache)
        cpu_s = float("inf")
        for _ in range(args.repeat):
            t = time.perf_counter()
            kvcodec.decode(blob)
            cpu_s = min(cpu_s, time.perf_counter() - t)
        r = open_kvc(blob)
        items = []
        for i in range(r.num_layers):
            lm = r._layer(i)
            for ti in lm.tensors.values():
                for c in ti.chunks:
                    planes = {p: r.read_plane(n) for p, n in c.planes.items()}
                    ctx = TensorContext(layer=lm.index, role=ti.role, shape=(c.tokens, ti.shape[1], ti.shape[2]),
                                        dtype=r.dtype, layer_kind=lm.kind, globals=r.globals())
                    items.append((EncodedTensor(planes, c.params), ctx))
        gpu.device._resolve_device = lambda device: torch.device("cpu")
        try:
            prep_s = float("inf")
            for _ in range(args.repeat):
                t = time.perf_counter()
                for enc, ctx in items:
                    gpu.prepare_decode(codec, enc, ctx, "cuda")
                prep_s = min(prep_s, time.perf_counter() - t)
        finally:
            gpu.device._resolve_device = real_resolve
        streams, longest = [], 0
        for enc, ctx in items:
            meta = codec.parse_tensor(enc, ctx).stage_planes["meta"]
            lay = StageLayout(meta)
            streams.append(lay.n_streams)
            longest = max(longest, int(lay.symbol_counts().max()) if lay.n_streams else 0)
        rows.append({"preset": label, "bits_per_element": round(8 * len(blob) / cache.num_elements, 3),
                     "tensors": len(items), "cpu_decode_ms": round(cpu_s * 1e3, 1),
                     "host_prep_ms": round(prep_s * 1e3, 1), "host_prep_ms_per_tensor": round(prep_s * 1e3 / len(items), 2),
                     "streams_per_tensor": sorted(set(streams)), "streams_in_file": int(np.sum(streams)),
                     "longest_stream_symbols": longest})
        print(json.dumps(rows[-1]), flush=True)
    res = {"context": args.context, "torch_threads": torch.get_num_threads(), "rows": rows}
    lines = [f"# kvc's GPU decode path on the host (SmolLM2-135M, {args.context} tokens)", "",
             f"Run on the CPU ({res['torch_threads']} torch threads; no GPU).", "",
             "CPU decode = `kvcodec.decode(blob)`; host prep = `gpu.prepare_decode` of every tensor (validation, tables, "
             "upload arguments; uploads to CPU memory here), fastest of the repeats. Streams: ANS streams per tensor and "
             "in the whole file; one GPU thread decodes one stream, so the longest stream's symbol count is the "
             "sequential work that bounds the kernel time. The times are this shared machine's (they swung by "
             "a third between rows and runs of the same code); bits and stream counts are exact.", "",
             "| preset | bits/elem | tensors | CPU decode ms | host prep ms | per tensor ms | streams/tensor | "
             "streams in file | longest stream (symbols) |", "|---|---|---|---|---|---|---|---|---|"]
    for x in rows:
        lines.append(f"| {x['preset']} | {x['bits_per_element']} | {x['tensors']} | {x['cpu_decode_ms']} | "
                     f"{x['host_prep_ms']} | {x['host_prep_ms_per_tensor']} | {', '.join(map(str, x['streams_per_tensor']))} | "
                     f"{x['streams_in_file']} | {x['longest_stream_symbols']} |")
    write_result(args.out, res, "\n".join(lines), prov=prov, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
