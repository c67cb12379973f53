"""`kvcodec codecs` shows what files measure beside the nominal bits (issue 22): the numbers come
from kvcodec/data/measured_bits.json, which must cover every preset and match fresh encodes."""

from __future__ import annotations

import json
import subprocess
import sys

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
    """Encoders are deterministic: a change to a codec's bytes must rerun eval/make_measured_bits.py."""
    from kvcodec.harness.studies import preset_bits

    assert preset_bits([name]) == {name: measured_bits()[name]}
