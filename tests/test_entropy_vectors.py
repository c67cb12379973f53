"""Golden ANS vectors (formats/vectors/ans/*.json): written once, decoded forever.

A vector is only generated when missing *and* ``KVCODEC_WRITE_VECTORS=1``; otherwise a missing
vector fails. Each holds the table, the symbols and the expected words, so a third-party decoder
can check itself against them (formats/ANS.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from kvcodec.entropy import (
    EntropyStage,
    ans_decode_segments,
    ans_decode_segments_reference,
    ans_encode_segments,
    ans_encode_segments_reference,
    build_table,
)

VEC_DIR = Path(__file__).resolve().parent.parent / "formats" / "vectors" / "ans"


def _laplace(rng, n, a, center, b):
    return np.clip(np.round(rng.laplace(center, b, size=n)), 0, a - 1).astype(np.int64)


def _make_stream_vector(name: str) -> dict:
    """Deterministic contents of each stream vector (seeded numpy + integer table building)."""
    rng = np.random.default_rng(sum(map(ord, name)))
    specs = {
        "single_p12_a16": [(16, 12, 300)],
        "single_p24_a5": [(5, 24, 200)],
        "single_p16_a32_skewed": [(32, 16, 500)],
        "two_symbols_p1": [(2, 1, 64)],
        "segments_mixed_precision": [(16, 12, 100), (4, 8, 77), (31, 16, 50)],
        "all_zero_symbols": [(8, 10, 40)],
        "empty": [(4, 8, 0)],
    }[name]
    segs = []
    for a, p, n in specs:
        if name == "all_zero_symbols":
            s = np.zeros(n, dtype=np.int64)
            f = build_table(np.bincount(s, minlength=a) + 1, p)
        else:
            s = _laplace(rng, n, a, a / 3, max(0.3, a / 10))
            f = build_table(np.bincount(s, minlength=a), p)
        segs.append({"precision": p, "freqs": f.tolist(), "symbols": s.tolist()})
    words = ans_encode_segments_reference([(np.array(g["symbols"]), np.array(g["freqs"], np.uint32)) for g in segs])
    return {"kind": "stream", "name": name, "segments": segs, "words": words.tolist(),
            "note": "words are uint32, stored in this order; the decoder reads them from the end"}


def _make_stage_vector(name: str) -> dict:
    rng = np.random.default_rng(sum(map(ord, name)))
    cfg = {"stage_row_chunk8": ({"chunk": 8, "precision": 10}, (3, 19, 6)),
           "stage_cluster_rows2": ({"chunk": 5, "rows_per_stream": 2, "tables": "cluster", "n_tables": 2}, (5, 12, 4)),
           "stage_chunk_scope_p16": ({"chunk": 6, "scope": "chunk", "precision": 16}, (2, 13, 8))}[name]
    r, n, a = cfg[1]
    x = np.stack([_laplace(rng, n, a, (i % a), 1.0) for i in range(r)])
    planes = EntropyStage(**cfg[0]).encode(x, alphabet=a)
    return {"kind": "stage", "name": name, "config": cfg[0], "symbols": x.tolist(),
            "planes": {k: {"dtype": str(v.dtype), "shape": list(v.shape), "data": v.ravel().tolist()}
                       for k, v in planes.items()}}


STREAM_VECTORS = ["single_p12_a16", "single_p24_a5", "single_p16_a32_skewed", "two_symbols_p1",
                  "segments_mixed_precision", "all_zero_symbols", "empty"]
STAGE_VECTORS = ["stage_row_chunk8", "stage_cluster_rows2", "stage_chunk_scope_p16"]


def _dump(obj: dict) -> str:
    """JSON with one top-level key (and one segment / plane) per line: diffable, compact."""
    lines = []
    for k, v in obj.items():
        if isinstance(v, list) and v and isinstance(v[0], dict):
            inner = ",\n  ".join(json.dumps(e) for e in v)
            lines.append(f" {json.dumps(k)}: [\n  {inner}\n ]")
        elif isinstance(v, dict) and k == "planes":
            inner = ",\n  ".join(f"{json.dumps(pk)}: {json.dumps(pv)}" for pk, pv in v.items())
            lines.append(f" {json.dumps(k)}: {{\n  {inner}\n }}")
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def _load(name: str, maker) -> dict:
    path = VEC_DIR / f"{name}.json"
    if not path.exists():
        if os.environ.get("KVCODEC_WRITE_VECTORS") != "1":
            pytest.fail(f"golden vector {path} is missing (generate once with KVCODEC_WRITE_VECTORS=1)")
        VEC_DIR.mkdir(parents=True, exist_ok=True)
        path.write_text(_dump(maker(name)))
    return json.loads(path.read_text())


@pytest.mark.parametrize("name", STREAM_VECTORS)
def test_stream_vector(name):
    v = _load(name, _make_stream_vector)
    segs_enc = [(np.array(g["symbols"], dtype=np.int64), np.array(g["freqs"], dtype=np.uint32)) for g in v["segments"]]
    segs_dec = [(f, len(s)) for s, f in segs_enc]
    words = np.array(v["words"], dtype=np.uint32)
    want = np.concatenate([s for s, _ in segs_enc]) if segs_enc else np.zeros(0)
    for g in v["segments"]:
        assert sum(g["freqs"]) == 1 << g["precision"]
    assert np.array_equal(ans_encode_segments(segs_enc), words)
    assert np.array_equal(ans_encode_segments_reference(segs_enc), words)
    assert np.array_equal(ans_decode_segments(words, segs_dec), want)
    assert np.array_equal(ans_decode_segments_reference(words, segs_dec), want)


@pytest.mark.parametrize("name", STAGE_VECTORS)
def test_stage_vector(name):
    v = _load(name, _make_stage_vector)
    planes = {k: np.array(p["data"], dtype=p["dtype"]).reshape(p["shape"]) for k, p in v["planes"].items()}
    x = np.array(v["symbols"], dtype=np.int64)
    st = EntropyStage(**v["config"])
    from kvcodec import native

    for method in ("constriction", "reference", "numpy") + (("native",) if native.available() else ()):
        assert np.array_equal(st.decode(planes, method=method), x)
    for enc_method in ("constriction",) + (("native",) if native.available() else ()):
        again = st.encode(x, alphabet=int(planes["meta"][6]), method=enc_method)
        assert sorted(again) == sorted(planes)
        for k in planes:
            assert again[k].dtype == planes[k].dtype and np.array_equal(again[k], planes[k]), k
