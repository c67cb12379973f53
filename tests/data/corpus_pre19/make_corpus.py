"""Write the encoder corpus of tests/data/corpus_pre19 (run once, at commit 8760b98, before issue 19).

Every registered preset and every extra golden-vector config, on two inputs (the golden-vector
input, fp16 with a sliding layer; a bf16 input with head_dim 24), unchunked (and the first also in chunks
of 32 tokens), plus the -cal presets with a synthetic calibration file. ``index.json`` records, per file,
its config, encode arguments, SHA-256 and the SHA-256 of its decoded tensors. tests/test_corpus.py
decodes every file and re-encodes every input: both must match byte for byte forever.

Usage: python tests/data/corpus_pre19/make_corpus.py   (refuses to overwrite an existing index)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

import kvcodec
from kvcodec.cache import KVCache, LayerInfo, ModelIdentity
from kvcodec import vectors

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def input_b() -> KVCache:
    g = torch.Generator().manual_seed(20261203)
    layers = []
    for _ in range(3):
        k = torch.randn(70, 1, 24, generator=g) * 2 + 5 * torch.randn(1, 1, 24, generator=g)
        v = torch.randn(70, 1, 24, generator=g) * (0.3 + torch.rand(70, 1, 1, generator=g))
        layers.append({"k": k.bfloat16(), "v": v.bfloat16()})
    return KVCache(layers=layers, layer_info=[LayerInfo("full")] * 3, model=ModelIdentity("kvcodec/corpus-b"))


def calibration(cache: KVCache, path: Path) -> None:
    from kvcodec.harness.calibration import QueryStats, save_query_statistics

    rng = np.random.default_rng(7)
    h, d = cache.layers[0]["k"].shape[1:]
    energy = [rng.uniform(0.1, 4.0, (h, d)).astype(np.float32) for _ in cache.layers]
    sample = [rng.normal(size=(4, 8, d)).astype(np.float32) for _ in cache.layers]
    save_query_statistics(QueryStats(energy, sample, q_position=200, rope_theta=10000.0,
                                     meta={"model": "corpus"}), path)


def main() -> int:
    os.chdir(ROOT)
    index = HERE / "index.json"
    if index.exists():
        print("index.json exists; the corpus is written once", file=sys.stderr)
        return 1
    a = vectors.vector_input()
    b = input_b()
    a.to_safetensors(HERE / "input_a.safetensors")
    b.to_safetensors(HERE / "input_b.safetensors")
    calibration(a, HERE / "cal_a.safetensors")
    configs = [(n, n) for n in kvcodec.list_codecs() if not n.endswith("-cal")]
    configs += [(n, cfg) for n, (cfg, kw) in vectors.EXTRA_VECTORS.items() if not kw]
    configs += [(n, n) for n in kvcodec.list_codecs() if n.endswith("-cal")]  # uncalibrated, as today
    configs += [(n + "+cal", {"id": n, "calibration": "cal_a.safetensors"})
                for n in kvcodec.list_codecs() if n.endswith("-cal")]
    rows = []
    for inp_name, cache in (("input_a", a), ("input_b", b)):
        for name, cfg in configs:
            if "+cal" in name and inp_name != "input_a":
                continue
            for tpc in ((0, 32) if inp_name == "input_a" else (0,)):
                c = cfg
                if isinstance(cfg, dict) and "calibration" in cfg:
                    # relative to the repository root (the tests run there): the path is in the manifest
                    c = {**cfg, "calibration": str((HERE / cfg["calibration"]).relative_to(ROOT))}
                codec = kvcodec.get_codec(c)
                blob = codec.encode(cache, tokens_per_chunk=tpc)
                fname = f"{inp_name}.{name}.t{tpc}.kvc"
                (HERE / fname).write_bytes(blob)
                out = kvcodec.decode(blob)
                rows.append({"file": fname, "input": inp_name + ".safetensors",
                             "layer_kinds": [[i.kind, i.window] for i in cache.layer_info],
                             "config": cfg, "tokens_per_chunk": tpc,
                             "kvc_sha256": hashlib.sha256(blob).hexdigest(),
                             "decoded_sha256": vectors.decoded_sha256(out)})
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip()
    index.write_text(json.dumps({"commit": commit, "files": rows}, indent=1) + "\n")
    print(f"{len(rows)} files, {sum((HERE / r['file']).stat().st_size for r in rows)} bytes")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
