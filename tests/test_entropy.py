"""Integer tables and ANS streams: constriction, the pure-integer reference, and their agreement."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.entropy import (
    ans_decode,
    ans_decode_reference,
    ans_decode_segments,
    ans_decode_segments_reference,
    ans_encode,
    ans_encode_reference,
    ans_encode_segments,
    ans_encode_segments_reference,
    build_table,
    build_tables,
    cross_entropy_bits,
    entropy_bits,
)
from kvcodec.entropy.tables import decode_tables, encode_tables
from kvcodec.errors import ConfigError, FormatError, StreamError


def _random_case(rng, a_max=40, n_max=600):
    a = int(rng.integers(2, a_max))
    p = int(rng.integers(max(1, int(np.ceil(np.log2(a)))), 25))
    h = rng.integers(0, 1000, a) * (rng.random(a) < 0.7)
    f = build_table(h, p)
    s = rng.choice(a, size=int(rng.integers(0, n_max)), p=f / f.sum())
    return f, s


def test_build_table_invariants_and_vectorised_equal():
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = int(rng.integers(2, 64))
        p = int(rng.integers(max(1, int(np.ceil(np.log2(a)))), 25))
        h = rng.integers(0, 10**6, a) * (rng.random(a) < 0.5)
        f = build_table(h, p)
        assert f.dtype == np.uint32 and int(f.sum()) == 1 << p and int(f.min()) >= 1
        assert np.array_equal(build_tables(h[None, :], p)[0], f)
    # proportional when exact
    assert build_table(np.array([1, 1, 2]), 4).tolist() == [4, 4, 8]
    assert build_table(np.array([0, 0]), 1).tolist() == [1, 1]


def test_build_table_rejects_bad_input():
    for h, p in [(np.array([1]), 8), (np.array([1, 2, 3]), 1), (np.array([1, -1]), 8), (np.array([1, 1]), 25),
                 (np.array([1, 1]), 0)]:
        with pytest.raises(ConfigError):
            build_table(h, p)


def test_constriction_equals_reference_on_random_tables():
    rng = np.random.default_rng(1)
    for _ in range(150):
        f, s = _random_case(rng)
        w = ans_encode(s, f)
        assert np.array_equal(w, ans_encode_reference(s, f))
        assert np.array_equal(ans_decode(w, f, len(s)), s)
        assert np.array_equal(ans_decode_reference(w, f, len(s)), s)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_segments_bit_exact_hypothesis(data):
    nseg = data.draw(st.integers(0, 4))
    segs = []
    for _ in range(nseg):
        a = data.draw(st.integers(2, 20))
        p = data.draw(st.integers(int(np.ceil(np.log2(a))) or 1, 24))
        h = np.array(data.draw(st.lists(st.integers(0, 50), min_size=a, max_size=a)))
        f = build_table(h, p)
        s = np.array(data.draw(st.lists(st.integers(0, a - 1), max_size=80)), dtype=np.int64)
        segs.append((s, f))
    w = ans_encode_segments(segs)
    assert np.array_equal(w, ans_encode_segments_reference(segs))
    dsegs = [(f, len(s)) for s, f in segs]
    want = np.concatenate([s for s, _ in segs]) if segs else np.zeros(0)
    assert np.array_equal(ans_decode_segments(w, dsegs), want)
    assert np.array_equal(ans_decode_segments_reference(w, dsegs), want)


def test_stream_not_consumed_or_corrupt_raises():
    rng = np.random.default_rng(2)
    f = build_table(np.array([50, 30, 15, 5]), 12)
    s = rng.choice(4, size=500, p=f / f.sum())
    w = ans_encode(s, f)
    assert len(w) > 4
    for dec in (ans_decode, ans_decode_reference):
        with pytest.raises(StreamError):
            dec(w, f, 400)  # too few symbols: words left
        with pytest.raises(StreamError):
            dec(np.concatenate([np.array([7], np.uint32), w]), f, 500)  # extra word
        with pytest.raises(StreamError):
            dec(w[1:], f, 500)  # truncated
        bad = w.copy()
        bad[-1] = 0
        with pytest.raises(StreamError):
            dec(bad, f, 500)  # a stream never ends in a zero word
    with pytest.raises(StreamError):
        ans_encode(np.array([0, 4]), f)
    with pytest.raises(StreamError):
        ans_encode_reference(np.array([-1]), f)


def test_corruption_detected_or_changes_output():
    """Flipping a bit never crashes; it raises StreamError or decodes to different symbols,
    and the reference and constriction agree on which."""
    rng = np.random.default_rng(3)
    f = build_table(np.array([60, 25, 10, 5]), 12)
    s = rng.choice(4, size=300, p=f / f.sum())
    w = ans_encode(s, f)
    for i in range(20):
        bad = w.copy()
        bad[int(rng.integers(len(w)))] ^= np.uint32(1 << int(rng.integers(32)))
        res = []
        for dec in (ans_decode, ans_decode_reference):
            try:
                res.append(dec(bad, f, 300).tolist())
            except StreamError:
                res.append("err")
        assert res[0] == res[1]
        assert res[0] != s.tolist()


def test_coded_size_within_one_percent_of_cross_entropy():
    rng = np.random.default_rng(4)
    p = np.array([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
    s = rng.choice(8, size=200_000, p=p)
    f = build_table(np.bincount(s, minlength=8), 12)
    w = ans_encode(s, f)
    ideal = cross_entropy_bits(s, f)
    assert 32 * len(w) <= ideal * 1.01 + 64
    assert ideal <= entropy_bits(np.bincount(s)) * 1.001  # 12-bit table costs < 0.1%


def test_table_storage_roundtrip_and_validation():
    t = np.stack([build_table(np.array([5, 0, 1]), 16), build_table(np.array([0, 0, 9]), 16)])
    st16 = encode_tables(t, 16)
    assert st16.dtype == np.uint16
    assert np.array_equal(decode_tables(st16, 16), t)
    t20 = np.stack([build_table(np.array([5, 1]), 20)])
    assert np.array_equal(decode_tables(encode_tables(t20, 20), 20), t20)
    bad = st16.copy()
    bad[0, 0] += 1
    with pytest.raises(FormatError, match="sums to"):
        decode_tables(bad, 16)
    with pytest.raises(FormatError):
        decode_tables(st16.astype(np.uint32), 16)
