"""CacheGen codecs and entropy-coded KIVI: arithmetic, recorded bins, side information,
and (marked ``model``) bit-exact decoders on a real SmolLM2 cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.codec import TensorContext
from kvcodec.codecs.cachegen import symmetric_token_dequantize, symmetric_token_quantize
from kvcodec.entropy import EntropyStage, StageLayout, ideal_bits, side_info_bits
from kvcodec.entropy.stage import take_prefix
from kvcodec.errors import ConfigError, FormatError

from conftest import make_cache


def _ctx(codec, cache, i, role):
    t = cache.layers[i][role]
    return TensorContext(layer=i, role=role, shape=tuple(t.shape), dtype=t.dtype,
                         globals=codec.encode_globals(cache))


def test_symmetric_quantizer_error_bound():
    x = torch.randn(50, 96) * torch.linspace(0.1, 5, 50)[:, None]
    for levels in (3, 15, 31, 255):
        codes, s = symmetric_token_quantize(x, levels)
        assert int(codes.min()) >= 0 and int(codes.max()) < levels
        xh = symmetric_token_dequantize(codes, s, levels)
        err = (x - xh).abs().amax(dim=1)
        assert bool((err <= s.float() / 2 * (1 + 1e-5) + 1e-7).all()), levels
    codes, s = symmetric_token_quantize(torch.zeros(2, 4), 15)
    assert codes.eq(7).all() and s.eq(0).all()


def test_lmcache_bins_rule_and_recorded_in_file():
    c = kvcodec.get_codec("cachegen-lmcache")
    bins = c.layer_bins(30)
    assert bins[:, 0].tolist() == [32] * 10 + [16] * 20
    assert bins[:, 1].tolist() == [32] * 2 + [16] * 28
    cache = make_cache(layers=12, tokens=20, dim=16)
    info = kvcodec.open(c.encode(cache)) if hasattr(kvcodec, "open") else None
    g = c.encode_globals(cache)["cachegen_bins"]
    assert g.dtype == np.int32 and g.shape == (12, 2)
    if info is not None:
        assert np.array_equal(info.globals()["cachegen_bins"], g)
    enc = c.encode_tensor(cache.layers[11]["k"], _ctx(c, cache, 11, "k"))
    assert enc.params == {"bins": 16}
    lay = StageLayout(enc.planes["ans_meta"])
    assert (lay.P, lay.C, lay.scope, lay.A, lay.K) == (16, 256, 1, 16, 32)
    # decoding without the recorded bins, or with other bins, is refused (never recomputed)
    ctx = _ctx(c, cache, 11, "k")
    with pytest.raises(FormatError, match="missing"):
        c.decode_tensor(enc, TensorContext(11, "k", ctx.shape, ctx.dtype))
    other = {"cachegen_bins": np.full((12, 2), 32, np.int32)}
    with pytest.raises(FormatError, match="disagree"):
        c.decode_tensor(enc, TensorContext(11, "k", ctx.shape, ctx.dtype, globals=other))


def test_lmcache_error_bound_per_token():
    cache = make_cache(layers=3, tokens=300, heads=2, dim=32, dtype=torch.float32)
    c = kvcodec.get_codec("cachegen-lmcache")
    out = kvcodec.decode(c.encode(cache))
    for (i, r, a), (_, _, b) in zip(cache.tensors(), out.tensors()):
        bins = 32 if (r == "k" and i < 10) or (r == "v" and i < 2) else 16
        amax = a.reshape(a.shape[0], -1).abs().amax(1)
        step = amax / (bins // 2 - 1)
        err = (a - b).reshape(a.shape[0], -1).abs().amax(1)
        assert bool((err <= step * 0.5 * 1.002 + 1e-6).all()), (i, r)


def test_cachegen_levels_by_layer_group_and_deltas():
    c = kvcodec.get_codec("cachegen")
    assert c.layer_levels(30)[:, 0].tolist() == [31] * 10 + [15] * 20
    assert c.layer_levels(4)[:, 0].tolist() == [31, 31, 15, 15]
    cache = make_cache(layers=6, tokens=45, heads=2, dim=16, dtype=torch.float32)
    out = kvcodec.decode(c.encode(cache))
    for (i, r, a), (_, _, b) in zip(cache.tensors(), out.tensors()):
        # anchors (every 10th token) are 8-bit: much closer than the 15/31-level deltas
        ea = (a[::10] - b[::10]).abs().max() / a[::10].abs().max()
        assert ea < 0.01, (i, r)
        # every token: error <= half its step (anchor step or delta step, stored in 'scale')
        sc = torch.from_numpy(c.encode_tensor(a, _ctx(c, cache, i, r)).planes["scale"].astype(np.float32))
        err = (a - b).reshape(a.shape[0], -1).abs().amax(1)
        assert bool((err <= sc / 2 * 1.001 + 1e-5).all()), (i, r)
    enc = c.encode_tensor(cache.layers[5]["v"], _ctx(c, cache, 5, "v"))
    assert enc.params == {"levels": 15, "group": 10, "anchor_levels": 255}
    assert StageLayout(enc.planes["anc_meta"]).N == 5 and StageLayout(enc.planes["ans_meta"]).N == 40
    with pytest.raises(ConfigError):
        kvcodec.get_codec({"id": "cachegen", "levels": [30]})
    with pytest.raises(ConfigError):
        kvcodec.get_codec({"id": "cachegen", "levels": []})


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("delta", [0, 8])
def test_kivi_ans_equals_kivi_values_and_is_smaller(bits, delta):
    cache = make_cache(layers=2, tokens=200, heads=2, dim=32)
    a = kvcodec.get_codec({"id": "kivi-ans", "bits": bits, "delta": delta})
    b = kvcodec.get_codec(f"kivi-{bits}")
    blob_a, blob_b = a.encode(cache), b.encode(cache)
    assert kvcodec.decode(blob_a).equal(kvcodec.decode(blob_b))


def test_stage_planes_decode_bit_exact_with_reference_on_codec_output():
    cache = make_cache(layers=2, tokens=70, heads=2, dim=16)
    for name in ("cachegen", "cachegen-lmcache", "kivi-4-ans", "kivi-2-delta-ans"):
        c = kvcodec.get_codec(name)
        for i, r, t in cache.tensors():
            enc = c.encode_tensor(t, _ctx(c, cache, i, r))
            for prefix in ("ans_", "anc_"):
                sub = take_prefix(enc.planes, prefix)
                if sub:
                    a = EntropyStage().decode(sub)
                    assert np.array_equal(a, EntropyStage().decode(sub, method="reference")), (name, prefix)
                    assert np.array_equal(a, EntropyStage().decode(sub, method="numpy")), (name, prefix)


@pytest.mark.model
def test_real_smollm2_cache_bit_exact_and_near_entropy():
    """On a real SmolLM2-135M cache: the native C decoder, constriction, the integer reference and
    the numpy decoder agree bit for bit on every codec's streams; the payload is within 1% of the ideal code length
    under the coded tables (plus ~32-46 bits per stream of ANS flush)."""
    pytest.importorskip("transformers")
    from kvcodec.harness import default_cache

    cache = default_cache(context=512)
    for name in ("cachegen", "cachegen-lmcache", "kivi-4-ans", "kivi-2-ans", "kivi-4-delta-ans"):
        c = kvcodec.get_codec(name)
        for i in (0, 13, 29):
            for r in ("k", "v"):
                t = cache.layers[i][r]
                enc = c.encode_tensor(t, _ctx(c, cache, i, r))
                for prefix in ("ans_", "anc_"):
                    sub = take_prefix(enc.planes, prefix)
                    if not sub:
                        continue
                    x = EntropyStage().decode(sub)  # native where it builds
                    ref_rows = slice(0, 48)  # the pure-Python reference on a subset of streams: speed
                    assert np.array_equal(EntropyStage().decode(sub, method="numpy"), x)
                    assert np.array_equal(EntropyStage().decode(sub, method="constriction"), x)
                    lay = StageLayout(sub["meta"])
                    sub_small = _restrict(sub, lay, ref_rows)
                    assert np.array_equal(EntropyStage().decode(sub_small, method="reference"), x[ref_rows]), (name, i, r)
                    ideal = ideal_bits(x, sub)
                    bits = side_info_bits(sub)["words"]
                    assert bits <= ideal * 1.01 + 46 * lay.n_streams, (name, i, r, bits, ideal)


def _restrict(sub, lay, rows):
    """The planes of a stage restricted to the streams of the first rows (G = 1, one chunk set)."""
    assert lay.G == 1
    r0, r1 = rows.start, rows.stop
    keep = [s for s in range(lay.n_streams) if r0 <= lay.stream(s)[0] < r1]
    off = sub["offsets"].astype(np.int64)
    words = np.concatenate([sub["words"][off[s]:off[s + 1]] for s in keep]).astype(np.uint32)
    new_off = np.concatenate([[0], np.cumsum([off[s + 1] - off[s] for s in keep])]).astype(np.uint32)
    meta = sub["meta"].copy()
    meta[1] = r1 - r0
    out = {"meta": meta, "words": words, "offsets": new_off}
    k_is_r = "row_table" not in sub and lay.K == lay.R
    if k_is_r:
        meta[7] = r1 - r0
        out["tables"] = sub["tables"][:, r0:r1]
    else:
        out["tables"] = sub["tables"]
        if "row_table" in sub:
            out["row_table"] = sub["row_table"][:, r0:r1]
    return out


def test_codec_rejects_forged_stage_shape_and_corrupt_words():
    cache = make_cache(layers=1, tokens=40, heads=2, dim=16)
    for name in ("cachegen-lmcache", "kivi-4-ans"):
        c = kvcodec.get_codec(name)
        ctx = _ctx(c, cache, 0, "v")
        enc = c.encode_tensor(cache.layers[0]["v"], ctx)
        forged = dict(enc.planes)
        forged["ans_meta"] = enc.planes["ans_meta"].copy()
        forged["ans_meta"][2] = 2**31  # claims 2**31 tokens: refused before any allocation
        with pytest.raises(FormatError, match="expected"):
            c.decode_tensor(type(enc)(forged, enc.params), ctx)
        bad = dict(enc.planes)
        bad["ans_words"] = enc.planes["ans_words"].copy()
        bad["ans_words"][-1] = 0
        from kvcodec.errors import StreamError

        with pytest.raises(StreamError, match="layers.0.v"):
            c.decode_tensor(type(enc)(bad, enc.params), ctx)


def test_lmcache_code_past_the_levels_is_one_error_on_every_path(monkeypatch):
    """A stage may hold the symbol bins - 1, which the encoder never writes (codes lie in
    [0, bins - 2]): the native and the reference decoder raise the same FormatError."""
    cache = make_cache(layers=1, tokens=30, heads=2, dim=16)
    c = kvcodec.get_codec("cachegen-lmcache")
    ctx = _ctx(c, cache, 0, "k")
    enc = c.encode_tensor(cache.layers[0]["k"], ctx)
    bins = enc.params["bins"]
    codes = np.full((30, 32), bins // 2, dtype=np.uint16)
    codes[7, 3] = bins - 1
    forged = dict(enc.planes)
    forged.update({f"ans_{k}": v for k, v in c._stage().encode(codes, alphabet=bins, layout="tokens").items()})
    msg = f"layers.0.k: code {bins - 1} outside the {bins - 1} levels"
    with pytest.raises(FormatError) as native_err:
        c.decode_tensor(type(enc)(forged, enc.params), ctx)
    monkeypatch.setenv("KVCODEC_NATIVE", "0")
    with pytest.raises(FormatError) as ref_err:
        c.decode_tensor(type(enc)(forged, enc.params), ctx)
    assert str(native_err.value) == str(ref_err.value) == msg
