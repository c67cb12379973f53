"""Differential test of the spec: formats/kvc_min_reader.py, a reader written from formats/SPEC.md
alone (stdlib + numpy, no kvcodec), must accept and reject the same files as kvcodec's reader, with
the same error category, and read the same planes."""

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec.testing import spelled_out
from kvcodec.testing import load_file_module
from kvcodec.errors import (ChecksumError, ConfigError, FormatError, KVCodecError, TruncatedError,
                            UnknownCodecError, VersionError)

from conftest import make_cache
from test_format_hostile import BLOB, _CHUNKED, _mutate

ROOT = Path(__file__).resolve().parents[1]
minr = load_file_module("kvc_min_reader", ROOT / "formats" / "kvc_min_reader.py")

CATEGORY = [(TruncatedError, "truncated"), (VersionError, "version"), (ChecksumError, "checksum"),
            (UnknownCodecError, "codec"), (FormatError, "format")]


def kvcodec_outcome(data):
    try:
        with kvcodec.open(data) as r:
            r.verify(decode=False)
            return {n: r.read_plane(n) for n in r.tensor_names()}
    except ConfigError as e:
        if isinstance(e, UnknownCodecError):
            return "codec"
        return "config"  # codec parameters: the minimal reader runs no codecs
    except KVCodecError as e:
        return next(c for t, c in CATEGORY if isinstance(e, t))


def min_outcome(data):
    try:
        return minr.read(bytes(data), known_codecs=set(kvcodec.codec_ids()))[1]
    except minr.Reject as e:
        return e.category


def agree(data):
    a, b = kvcodec_outcome(data), min_outcome(data)
    if a == "config":
        return
    if isinstance(a, dict) or isinstance(b, dict):
        assert isinstance(a, dict) and isinstance(b, dict), (a if isinstance(a, str) else "accepted",
                                                             b if isinstance(b, str) else "accepted")
        assert sorted(a) == sorted(b)
        for k in a:
            assert a[k].dtype == b[k].dtype and np.array_equal(a[k], b[k]), k
    else:
        assert a == b


@pytest.mark.parametrize("path", sorted((ROOT / "formats" / "vectors" / "v1").glob("*.kvc")), ids=lambda p: p.name)
def test_minimal_reader_reads_every_golden_vector_like_kvcodec(path):
    data = path.read_bytes()
    assert isinstance(min_outcome(data), dict)
    agree(data)


@pytest.mark.parametrize("name", kvcodec.list_codecs())
def test_minimal_reader_reads_every_preset(name):
    for chunk in (0, 7):
        agree(spelled_out(name).encode(make_cache(layers=2, tokens=15, dim=32), tokens_per_chunk=chunk))


def test_agree_on_every_truncation_and_bit_flip_of_a_small_file():
    for n in range(len(BLOB)):
        agree(BLOB[:n])
    for i in range(len(BLOB)):
        for bit in range(8):
            b = bytearray(BLOB)
            b[i] ^= 1 << bit
            agree(bytes(b))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_agree_on_mutated_files(data):
    agree(_mutate(data.draw(st.sampled_from([BLOB, _CHUNKED])), data))
