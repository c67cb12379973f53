"""Files written by the encoder before issue 19 (tests/data/corpus_pre19, see make_corpus.py there)
decode to the recorded tensors, and today's encoder writes them again: byte for byte on the
corpus's machine, and elsewhere to the same decoded values at the same size within 1 %."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import kvcodec
from kvcodec.cache import KVCache, LayerInfo
from kvcodec import vectors

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "tests" / "data" / "corpus_pre19"
INDEX = json.loads((CORPUS / "index.json").read_text())["files"]
_INPUTS: dict[str, KVCache] = {}


def _input(row) -> KVCache:
    if row["input"] not in _INPUTS:
        c = KVCache.from_safetensors(CORPUS / row["input"])
        c.layer_info = [LayerInfo(k, w) for k, w in row["layer_kinds"]]
        _INPUTS[row["input"]] = c
    return _INPUTS[row["input"]]


@pytest.mark.parametrize("row", INDEX, ids=[r["file"] for r in INDEX])
def test_pre19_file_decodes_and_reencodes_byte_for_byte(row, monkeypatch):
    monkeypatch.chdir(ROOT)  # calibrated entries name their calibration file relative to the root
    blob = (CORPUS / row["file"]).read_bytes()
    assert hashlib.sha256(blob).hexdigest() == row["kvc_sha256"], "corpus file changed on disk"
    assert vectors.decoded_sha256(kvcodec.decode(blob)) == row["decoded_sha256"]
    with kvcodec.open(blob) as r:
        stored = r.manifest["codec"]
    again = kvcodec.get_codec(stored).encode(_input(row), tokens_per_chunk=row["tokens_per_chunk"])
    if again == blob:
        return
    # The encoder's lossless choices (ANS table clustering, packing) compare float code lengths;
    # on another CPU (AVX2 against AVX-512: SIMD log, BLAS kernels) a near-tie can fall the other
    # way. That changes bytes, never values: the file must decode to exactly the same tensors,
    # with the same config, at nearly the same size. Byte identity holds on the corpus's machine.
    with kvcodec.open(again) as r:
        assert r.manifest["codec"] == stored
    a, b = kvcodec.decode(blob), kvcodec.decode(again)
    for i, (la, lb) in enumerate(zip(a.layers, b.layers)):
        for role in la:
            assert torch.equal(la[role], lb[role]), f"{row['file']}: layer {i} {role} decodes to other values"
    assert abs(len(again) - len(blob)) <= 0.01 * len(blob), \
        f"{row['file']}: re-encoded {len(again)} bytes, the corpus file has {len(blob)}"
