"""`kvcodec codecs` shows what files measure beside the nominal bits (issue 22): the numbers come
from kvcodec/data/measured_bits.json, which must cover every preset and match fresh encodes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import kvcodec
from kvcodec.commands.codecs import measured_bits


def test_every_preset_that_needs_nothing_is_measured():
    bits = measured_bits()
    for name in kvcodec.list_codecs():
        c = kvcodec.get_codec(name)
        if c.requires:
            assert name not in bits
        else:
            assert 0 < bits[name] < 17, name
    # the file's own numbers where the old nominal figure misled most (2.5 and 5.0)
    assert 3.5 < bits["cachegen"] < 4.5 and 3.5 < bits["cachegen-lmcache"] < 4.5


def test_codecs_table_and_json_show_the_measured_bits():
    out = subprocess.run([sys.executable, "-m", "kvcodec.cli", "codecs"], capture_output=True, text=True,
                         check=True).stdout
    assert "SmolLM2 b" in out.splitlines()[0]
    row = next(ln for ln in out.splitlines() if ln.startswith("cachegen "))
    assert f"{measured_bits()['cachegen']:.2f}" in row.split()
    js = json.loads(subprocess.run([sys.executable, "-m", "kvcodec.cli", "codecs", "--json"], capture_output=True,
                                   text=True, check=True).stdout)
    by = {r["name"]: r for r in js}
    assert by["kvc-near"]["measured_bits"] == measured_bits()["kvc-near"]
    assert by["kvc-near-cal"]["measured_bits"] is None


@pytest.mark.model
@pytest.mark.parametrize("name", ["fp8-e4m3", "cachegen", "cachegen-lmcache", "kivi-4-ans", "kvc-near"])
def test_measured_bits_match_a_fresh_encode(name):
    """Encoders are deterministic: a change to a codec's bytes must rerun eval/make_measured_bits.py.
    Exactly where the fresh reference cache is the one measured (its digest recorded); a CPU whose
    kernels round the model's forward pass differently (AVX2 against AVX-512: measured 0.0001 b
    apart) gets another cache, and the bits agree within 0.002."""
    from kvcodec.harness.capture import default_cache
    from kvcodec.harness.studies import cache_sha256, preset_bits

    doc = json.loads((Path(kvcodec.__file__).parent / "data" / "measured_bits.json").read_text())
    fresh = preset_bits([name])[name]
    if cache_sha256(default_cache(doc["context"])) == doc["cache_sha256"]:
        assert fresh == measured_bits()[name]
    else:
        assert abs(fresh - measured_bits()[name]) <= 0.002, (fresh, measured_bits()[name])


def test_the_measured_cache_digest_is_the_studies_own():
    """cache_sha256 tells caches apart by any bit, and the file records one."""
    import torch

    from kvcodec.harness.studies import cache_sha256

    a = kvcodec.KVCache.from_tensors([(torch.zeros(4, 1, 8, dtype=torch.float16),) * 2])
    b = kvcodec.KVCache.from_tensors([(torch.zeros(4, 1, 8, dtype=torch.float16),) * 2])
    assert cache_sha256(a) == cache_sha256(b)
    b.layers[0]["v"][3, 0, 7] = torch.finfo(torch.float16).tiny
    assert cache_sha256(a) != cache_sha256(b)
    doc = json.loads((Path(kvcodec.__file__).parent / "data" / "measured_bits.json").read_text())
    assert len(doc["cache_sha256"]) == 64
