"""EntropyStage: many independent streams with an index; three decoders agree bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from kvcodec import native
from kvcodec.entropy import EntropyStage, StageLayout, ideal_bits, side_info_bits
from kvcodec.errors import ConfigError, FormatError, InputError, StreamError

#: Every decoder must agree (the native C one where a C compiler exists: tests/test_native.py
#: checks that it builds wherever one does).
DECODERS = ("constriction", "reference", "numpy") + (("native",) if native.available() else ())

CONFIGS = [
    {},
    {"chunk": 16},
    {"chunk": 7, "rows_per_stream": 3},
    {"tables": "cluster", "n_tables": 3, "chunk": 10},
    {"tables": "shared"},
    {"scope": "chunk", "chunk": 9, "precision": 16},
    {"scope": "chunk", "chunk": 9, "tables": "cluster", "n_tables": 2},
    {"precision": 20, "chunk": 0},
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
def test_three_decoders_agree(cfg):
    rng = np.random.default_rng(0)
    for r, n in [(5, 37), (1, 1), (4, 0), (12, 50)]:
        # skewed, row-dependent distributions like quantized channels
        x = np.clip(np.round(rng.normal(2.5 + (np.arange(r)[:, None] % 3), 1.0, size=(r, n))), 0, 5).astype(np.int64)
        st = EntropyStage(**cfg)
        planes = st.encode(x, alphabet=6)
        lay = StageLayout(planes["meta"])
        assert planes["offsets"].shape == (lay.n_streams + 1,)
        assert lay.symbol_counts().sum() == r * n
        for method in DECODERS:
            assert np.array_equal(st.decode(planes, method=method), x), (cfg, r, n, method)
        assert EntropyStage.from_config(st.get_config()) == st


def test_external_tables():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 4, size=(6, 40))
    st = EntropyStage(tables="cluster", n_tables=2, chunk=16)
    tables, row_table = st.fit_tables(x, 4)
    planes = st.encode(x, alphabet=4, tables=tables, row_table=row_table)
    assert "tables" not in planes and "row_table" not in planes
    for method in DECODERS:
        assert np.array_equal(st.decode(planes, tables=tables, row_table=row_table, method=method), x)
    with pytest.raises(FormatError, match="external"):
        st.decode(planes)


def test_coded_size_near_ideal_and_side_info():
    rng = np.random.default_rng(2)
    x = np.clip(np.round(rng.laplace(7, 1.5, size=(64, 4096))), 0, 15).astype(np.int64)
    st = EntropyStage(chunk=4096, precision=12)
    planes = st.encode(x, alphabet=16)
    ideal = ideal_bits(x, planes)
    words_bits = 32 * planes["words"].size
    assert words_bits <= 1.01 * ideal
    b = side_info_bits(planes)
    assert b["tables"] == 64 * 16 * 16 and b["offsets"] == 32 * 65
    assert b["side"] == b["meta"] + b["offsets"] + b["tables"]


def test_bad_inputs_and_corrupt_planes():
    st = EntropyStage(chunk=8)
    x = np.random.default_rng(3).integers(0, 5, size=(3, 20))
    with pytest.raises(InputError):
        st.encode(x.astype(np.float32))
    with pytest.raises(InputError):
        st.encode(x, alphabet=4)
    with pytest.raises(InputError):
        st.encode(-x - 1)
    with pytest.raises(ConfigError):
        EntropyStage(precision=25)
    with pytest.raises(ConfigError):
        EntropyStage(tables="nope")
    with pytest.raises(ConfigError):
        EntropyStage(bogus=1)
    planes = st.encode(x, alphabet=5)
    for mutate, err in [
        (lambda p: p.pop("words"), FormatError),
        (lambda p: p.__setitem__("meta", p["meta"][:5]), FormatError),
        (lambda p: p["meta"].__setitem__(0, 9), FormatError),
        (lambda p: p["meta"].__setitem__(5, 30), FormatError),
        (lambda p: p.__setitem__("offsets", p["offsets"][::-1].copy()), FormatError),
        (lambda p: p.__setitem__("words", p["words"][:-1].copy()), FormatError),
        (lambda p: p["tables"].__setitem__((0, 0, 0), p["tables"][0, 0, 0] + 1), FormatError),
    ]:
        bad = {k: v.copy() for k, v in planes.items()}
        mutate(bad)
        for method in DECODERS:
            with pytest.raises(err):
                st.decode(bad, method=method)
    # move one word from stream 1 to stream 0 (index lies): every decoder must refuse
    bad = {k: v.copy() for k, v in planes.items()}
    bad["offsets"][1] += 1
    for method in DECODERS:
        with pytest.raises(StreamError):
            st.decode(bad, method=method)


def test_random_bitflips_same_verdict_all_decoders():
    rng = np.random.default_rng(4)
    x = rng.integers(0, 6, size=(4, 60))
    st = EntropyStage(chunk=20)
    planes = st.encode(x, alphabet=6)
    for _ in range(15):
        bad = {k: v.copy() for k, v in planes.items()}
        i = int(rng.integers(bad["words"].size))
        bad["words"][i] ^= np.uint32(1 << int(rng.integers(32)))
        res = []
        for method in DECODERS:
            try:
                res.append(st.decode(bad, method=method).tolist())
            except StreamError:
                res.append("err")
        assert all(v == res[0] for v in res)
        assert res[0] != x.tolist()


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st_  # noqa: E402

from kvcodec.errors import KVCodecError  # noqa: E402


@settings(max_examples=120, deadline=None)
@given(st_.data())
def test_fuzz_planes_never_crash_and_decoders_agree(data):
    """Random (mostly invalid) planes: every decoder raises a KVCodecError or returns the same
    symbols; nothing else escapes, and nothing large is allocated (R, N are small here)."""
    r, n = data.draw(st_.integers(0, 6)), data.draw(st_.integers(0, 20))
    meta = np.array([data.draw(st_.sampled_from([1, 1, 1, 2])), r, n, data.draw(st_.integers(0, 8)),
                     data.draw(st_.integers(0, 3)), data.draw(st_.integers(0, 25)), data.draw(st_.integers(0, 6)),
                     data.draw(st_.integers(0, 7)), data.draw(st_.integers(0, 2)), data.draw(st_.integers(0, 4))],
                    dtype=np.uint32)
    words = np.array(data.draw(st_.lists(st_.integers(0, 2**32 - 1), max_size=12)), dtype=np.uint32)
    offsets = np.array(data.draw(st_.lists(st_.integers(0, 12), max_size=10)), dtype=np.uint32)
    a = max(2, int(meta[6]))
    tables = np.array(data.draw(st_.lists(st_.integers(0, 70000), min_size=a, max_size=a * 3)), dtype=np.int64)
    tables = tables[: (len(tables) // a) * a].reshape(1, -1, a)
    planes = {"meta": meta, "words": words, "offsets": offsets,
              "tables": tables.astype(np.uint16 if int(meta[5]) <= 16 else np.uint32)}
    if data.draw(st_.booleans()):
        planes["row_table"] = np.array(data.draw(st_.lists(st_.integers(0, 3), min_size=r, max_size=r)),
                                       dtype=np.uint8)[None]
    verdicts = []
    for method in DECODERS:
        try:
            verdicts.append(EntropyStage().decode(planes, method=method).tolist())
        except KVCodecError:
            verdicts.append("error")
    assert all(v == verdicts[0] for v in verdicts)
