"""Scope 2 of the entropy stage: magnitude contexts (formats/ANS.md §3.1).

The class of a symbol is computed by encoder and decoder from symbols already coded; every
path (native C, the pure-integer reference) must agree bit for bit, and bad metadata must be
refused before decoding.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec import native
from kvcodec.entropy import EntropyStage
from kvcodec.entropy.stage import StageLayout, ctx_row_table_bits, ideal_bits, magnitude_classes
from kvcodec.errors import ConfigError, FormatError, StreamError
from kvcodec.quant.packing import pack_bits, unpack_bits

from conftest import make_cache

V1 = Path(__file__).resolve().parents[1] / "formats" / "vectors" / "v1"
needs_native = pytest.mark.skipif(not native.available(), reason="no C compiler for the native coder")


def naive_classes(x, g, thresholds, center):
    r, n = x.shape
    out = np.zeros((r, n), dtype=np.uint8)
    for row in range(r):
        k = row % g
        for t in range(n):
            if k == 0:
                continue
            a = sum(abs(int(x[j, t]) - center) for j in range(row - k, row))
            out[row, t] = sum(1 for th in thresholds if 8 * a >= th * k)
    return out


def scale_mixture(r, n, a, seed):
    """Symbols whose spread changes from token to token, as per-token steps make kvc's codes."""
    rng = np.random.default_rng(seed)
    scale = rng.choice([0.3, 1.5, 5.0], size=n)
    c = (a - 1) // 2
    return np.clip(np.round(rng.laplace(size=(r, n)) * scale[None]) + c, 0, a - 1).astype(np.int32)


@pytest.mark.parametrize("g,thresholds", [(1, [4]), (3, [0, 8]), (5, [3, 8, 20]), (40, [1, 2, 3, 50, 65536])])
def test_classes_match_the_definition(g, thresholds):
    x = np.random.default_rng(g).integers(0, 9, size=(23, 17))
    assert np.array_equal(magnitude_classes(x, g, thresholds, 4), naive_classes(x, g, thresholds, 4))


@pytest.mark.parametrize("r,n,a,g,chunk", [(37, 301, 20, 5, 0), (37, 301, 20, 16, 64), (9, 40, 2, 4, 7),
                                          (12, 33, 300, 5, 0), (64, 1, 16, 64, 0), (3, 0, 8, 2, 0)])
def test_ctx_round_trip_every_path(r, n, a, g, chunk):
    x = scale_mixture(r, n, a, seed=r + n)
    st = EntropyStage(precision=12, chunk=chunk, rows_per_stream=g, tables="cluster", n_tables=6, scope="ctx",
                      thresholds=[3, 8, 20])
    ref = st.encode(x, alphabet=a, method="constriction")  # the pure-integer reference encoder
    lay = StageLayout(ref["meta"])  # the [Q, R] row table bit-packed, ceil(log2 K) bits per entry
    assert lay.Q == 4 and ref["row_table"].dtype == np.uint8
    assert ref["row_table"].shape == ((4 * r * ctx_row_table_bits(lay.K) + 7) // 8,)
    assert np.array_equal(st.decode(ref, method="reference"), x)
    if native.available():
        nat = st.encode(x, alphabet=a, method="native")
        assert sorted(nat) == sorted(ref) and all(np.array_equal(nat[k], ref[k]) for k in ref)
        nat_t = st.encode(np.ascontiguousarray(x.T), alphabet=a, layout="tokens")
        assert all(np.array_equal(nat_t[k], ref[k]) for k in ref)
        assert np.array_equal(st.decode(ref, method="native"), x)
        assert np.array_equal(st.decode(ref, method="native", layout="tokens").T, x)
    for m in ("numpy", "constriction"):  # scope 2 without native: lockstep (numpy) or the scalar decoder
        assert np.array_equal(st.decode(ref, method=m), x)
    if n:  # the words are within ~1% (plus each stream's flush) of the tables' ideal code length
        s = StageLayout(ref["meta"]).n_streams
        assert 32 * ref["words"].size <= ideal_bits(x, ref) * 1.01 + 64 * s


def test_ctx_is_smaller_on_a_mixture_of_scales():
    x = scale_mixture(64, 600, 40, seed=1)
    plain = EntropyStage(precision=12, rows_per_stream=64, tables="cluster", n_tables=8).encode(x, alphabet=40)
    ctx = EntropyStage(precision=12, rows_per_stream=64, tables="cluster", n_tables=8, scope="ctx",
                       thresholds=[3, 8, 20]).encode(x, alphabet=40)
    assert ctx["words"].size < 0.9 * plain["words"].size  # 13 % smaller here


def test_ctx_config_is_checked():
    for bad in ({"scope": "ctx"}, {"scope": "ctx", "thresholds": [5, 5]}, {"scope": "ctx", "thresholds": [-1]},
                {"scope": "ctx", "thresholds": [70000]}, {"scope": "ctx", "thresholds": list(range(16))},
                {"scope": "ctx", "thresholds": [4], "tables": "row"}, {"thresholds": [4]},
                {"scope": "ctx", "thresholds": [1.5]}, {"scope": "ctx", "thresholds": "4"}):
        with pytest.raises(ConfigError):
            EntropyStage(**{"tables": "cluster", **bad})
    with pytest.raises(ConfigError, match="ctx"):
        kvcodec.get_codec({"id": "kvc", "ctx": [8, 4]})


def _planes():
    x = scale_mixture(10, 50, 12, seed=4)
    st = EntropyStage(precision=12, rows_per_stream=5, tables="cluster", n_tables=4, scope="ctx", thresholds=[4, 12])
    return x, st, st.encode(x, alphabet=12)


@pytest.mark.parametrize("method", ["reference", pytest.param("native", marks=needs_native)])
def test_ctx_bad_meta_and_planes_are_refused(method):
    x, st, planes = _planes()
    meta = planes["meta"]
    bad_metas = [
        np.concatenate([meta[:10], [12, 4]]).astype(np.uint32),  # thresholds not increasing
        np.concatenate([meta[:10], [4, 70000]]).astype(np.uint32),  # threshold too large
        meta[:10],  # scope 2 without thresholds
        np.concatenate([meta[:8], [0, meta[9]], [4]]).astype(np.uint32),  # thresholds with scope 0
        np.concatenate([meta[:9], [0], meta[10:]]).astype(np.uint32),  # scope 2 without a row_table
        np.concatenate([meta, np.arange(20, 40)]).astype(np.uint32),  # more than 15 thresholds
    ]
    for m in bad_metas:
        with pytest.raises(FormatError):
            st.decode({**planes, "meta": m}, method=method)
    with pytest.raises(FormatError, match="row_table|packed"):
        st.decode({**planes, "row_table": planes["row_table"][:2]}, method=method)
    lay = StageLayout(meta)
    b = ctx_row_table_bits(lay.K)
    rt = unpack_bits(planes["row_table"], b, lay.Q * lay.R)
    with pytest.raises(FormatError, match="row_table"):  # unpacked [Q, R] is not the scope-2 layout
        st.decode({**planes, "row_table": rt.reshape(lay.Q, lay.R)}, method=method)
    with pytest.raises(FormatError, match="row_table"):
        st.decode({**planes, "row_table": planes["row_table"].astype(np.uint16)}, method=method)
    assert (lay.Q * lay.R * b) % 8  # the last byte has padding bits: they must be zero
    pad = planes["row_table"].copy()
    pad[-1] |= 0x80
    with pytest.raises(FormatError, match="padding"):
        st.decode({**planes, "row_table": pad}, method=method)
    # an index the packing can hold but the table set lacks (K = 3 tables, 2 bits)
    st3 = EntropyStage(precision=12, rows_per_stream=5, tables="cluster", n_tables=3, scope="ctx", thresholds=[4, 12])
    p3 = st3.encode(x, alphabet=12)
    lay3 = StageLayout(p3["meta"])
    assert lay3.K == 3 and ctx_row_table_bits(3) == 2
    rt3 = unpack_bits(p3["row_table"], 2, lay3.Q * lay3.R)
    rt3[7] = 3
    with pytest.raises(FormatError, match="outside"):
        st3.decode({**p3, "row_table": pack_bits(rt3, 2)}, method=method)
    words = planes["words"].copy()
    words[len(words) // 2] ^= 0x10001
    try:  # a damaged stream either fails its exact-consumption check or decodes other symbols
        out = st.decode({**planes, "words": words}, method=method)
        assert not np.array_equal(out, x)
    except StreamError:
        pass


def test_ctx_different_thresholds_decode_differently():
    """The thresholds are part of the model: the same words read with others are not the data."""
    x, st, planes = _planes()
    other = np.concatenate([planes["meta"][:10], [2, 12]]).astype(np.uint32)
    try:
        assert not np.array_equal(st.decode({**planes, "meta": other}, method="reference"), x)
    except StreamError:
        pass


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_kvc_ctx_is_lossless_and_matches_without_native(dtype, monkeypatch):
    cache = make_cache(layers=2, tokens=70, heads=2, dim=24, dtype=dtype, seed=9)
    plain = kvcodec.get_codec({"id": "kvc-near", "recent_ramp": 32})
    # unpacked planes, so that the file header shows the stage metadata's shape
    ctx = kvcodec.get_codec({"id": "kvc-near", "recent_ramp": 32, "ctx": [3, 8, 20], "rows_per_stream": 24, "pack": 0})
    blob = ctx.encode(cache)
    head = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    metas = [k for k in head if k.endswith(".ans_meta")]
    assert metas and all(head[k]["shape"] == [13] for k in metas)  # 10 words + 3 thresholds
    out = kvcodec.decode(blob)
    assert out.equal(kvcodec.decode(plain.encode(cache)))  # the same codes: the same values
    monkeypatch.setenv("KVCODEC_NATIVE", "0")
    assert not native.available()
    assert ctx.encode(cache) == blob
    assert kvcodec.decode(blob).equal(out)


def test_kvc_codes_contexts_only_on_tensors_with_a_recency_ramp():
    """Magnitude contexts (scope 2: ans_meta of 10 words + thresholds) pay where the ramp makes
    steps vary along the tokens; elsewhere (a part of a sequence that does not end it) kvc codes
    the tensor with scope 0 (10 words), whatever ``ctx`` says."""
    cache = make_cache(layers=2, tokens=70, heads=2, dim=24, dtype=torch.float16, seed=9)

    def meta_shapes(config):
        blob = kvcodec.get_codec(config).encode(cache)
        head = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
        return {tuple(v["shape"]) for k, v in head.items() if k.endswith(".ans_meta")}

    base = {"id": "kvc-near", "ctx": [3, 8, 20], "rows_per_stream": 24, "pack": 0}
    assert meta_shapes({**base, "recent_ramp": 32}) == {(13,)}
    assert meta_shapes({**base, "recent_ramp": 0}) == {(10,)}
    near = kvcodec.get_codec({**base, "recent_ramp": 32})
    assert meta_shapes(near.part_config(first=True, last=False)) == {(10,)}
    assert meta_shapes(near.part_config(first=False, last=True)) == {(13,)}


def test_golden_ctx_vector_decodes_like_the_plain_preset():
    rec = json.loads((V1 / "kvc-near.ctx.json").read_text())
    plain = json.loads((V1 / "kvc-near.json").read_text())
    assert rec["decoded_sha256"] == plain["decoded_sha256"]
    blob = (V1 / "kvc-near.ctx.kvc").read_bytes()
    head = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    assert all(v["shape"] == [13] for k, v in head.items() if k.endswith(".ans_meta"))  # scope 2, 3 thresholds


@pytest.mark.skipif(not native.available(), reason="native coder not built here")
def test_native_encoder_takes_the_histogram_pass_classes_and_refuses_bad_ones():
    rng = np.random.default_rng(7)
    x = rng.integers(0, 9, size=(70, 40)).astype(np.uint16)  # tokens layout [N, R]
    stage = EntropyStage(precision=12, chunk=32, rows_per_stream=16, tables="cluster", n_tables=3,
                         scope="ctx", thresholds=[3, 8])
    planes = stage.encode(x, alphabet=9, layout="tokens")
    lay = StageLayout(planes["meta"])
    hist, cls = native.ctx_histograms(x, 9, "tokens", 16, [3, 8], classes=True)
    # the classes are the rule's (magnitude_classes works on [R, N])
    np.testing.assert_array_equal(cls.T, magnitude_classes(x.T, 16, [3, 8], 4))
    np.testing.assert_array_equal(hist, native.ctx_histograms(x, 9, "tokens", 16, [3, 8]))
    from kvcodec.entropy.tables import decode_tables

    tsets = decode_tables(planes["tables"], lay.P)
    rts = unpack_bits(planes["row_table"], ctx_row_table_bits(lay.K), lay.Q * lay.R).astype(np.int64).reshape(lay.Q, lay.R)
    w1, o1 = native.encode_stage(lay, x, tsets, rts, layout="tokens", classes=cls)
    w0, o0 = native.encode_stage(lay, x, tsets, rts, layout="tokens")
    np.testing.assert_array_equal(w1, planes["words"])
    np.testing.assert_array_equal(w0, planes["words"])
    bad = cls.copy()
    bad[5, 3] = 3  # Q = 3 classes: 0..2
    with pytest.raises(StreamError, match="classes"):
        native.encode_stage(lay, x, tsets, rts, layout="tokens", classes=bad)


@pytest.mark.parametrize("r,n,a,g,chunk", [(37, 301, 20, 5, 0), (37, 301, 20, 2, 64), (9, 40, 2, 4, 7),
                                          (12, 33, 300, 5, 0), (3, 0, 8, 2, 0)])
def test_ctx_fallback_decoders_agree_with_the_reference_on_good_and_damaged_streams(r, n, a, g, chunk):
    """The two decoders kvcodec uses without the native coder (scalar; lockstep over streams)
    give the reference's symbols, and on damaged words the reference's outcome: the same symbols
    or the same StreamError."""
    from kvcodec.entropy import ans_vec
    from kvcodec.entropy.stage import _decode_ctx_reference, parse_planes

    x = scale_mixture(r, n, a, seed=7 * r + n)
    st = EntropyStage(precision=12, chunk=chunk, rows_per_stream=g, tables="cluster", n_tables=6, scope="ctx",
                      thresholds=[3, 8, 20])
    planes = st.encode(x, alphabet=a, method="constriction")
    rng = np.random.default_rng(r * n + 1)
    decoders = (_decode_ctx_reference, ans_vec.decode_ctx_fast, ans_vec.decode_stage_fast)
    for trial in range(12):
        words = planes["words"].copy()
        if trial and words.size:
            words[rng.integers(words.size)] ^= np.uint32(1 << int(rng.integers(32)))
        lay, w, off, ts, rt = parse_planes({**planes, "words": words})
        got = []
        for dec in decoders:
            try:
                got.append(("ok", dec(lay, w, off, ts, rt).tolist()))
            except StreamError as e:
                got.append(("error", str(e)))
        assert got[1] == got[0] and got[2][0] == got[0][0], (trial, [g_[0] for g_ in got])
        if got[0][0] == "ok":
            assert got[2] == got[0]
        if not trial:
            assert got[0] == ("ok", x.tolist())
