"""kvc's token-delta rows (``delta``, the ``pred`` plane): lossless, chosen per row, strictly read."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec import native
from kvcodec.codec import TensorContext
from kvcodec.codecs.kvc import delta_rows, escape_split, undelta_rows
from kvcodec.errors import ConfigError, FormatError

V1 = Path(__file__).resolve().parents[1] / "formats" / "vectors" / "v1"


def _smooth_cache(layers=2, t=400, h=2, d=32, seed=0):
    """K with half its channels slowly varying along the tokens (like low-frequency RoPE
    channels), the rest white; V white with a slowly varying per-token scale."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        walk = torch.cumsum(torch.randn(t, h, d // 2, generator=g) * 0.15, dim=0)
        k = torch.cat([walk * 4, torch.randn(t, h, d // 2, generator=g)], dim=2) + 3 * torch.randn(1, h, d, generator=g)
        scale = 1 + 0.5 * torch.sin(torch.arange(t, dtype=torch.float32) / 40)[:, None, None]
        v = torch.randn(t, h, d, generator=g) * scale
        out.append((k.half(), v.half()))
    return kvcodec.KVCache.from_tensors(out)


def test_delta_rows_picks_slow_rows_and_native_agrees_with_numpy():
    rng = np.random.default_rng(3)
    n = 500
    slow = np.cumsum(rng.integers(-1, 2, size=(n, 6)), axis=0)
    white = rng.integers(-3, 4, size=(n, 6))
    wide = rng.integers(-10**6, 10**6, size=(n, 2))  # clipped in the estimate, escapes in the file
    c = np.concatenate([slow, white, wide], axis=1)
    ref = delta_rows(c, method="numpy")
    assert ref[:6].all() and not ref[6:12].any()
    if native.available():
        hc, he = native.delta_histograms(c)
        e = c.copy()
        e[1:] -= c[:-1]
        rows = 128 * np.arange(c.shape[1])[None, :]
        for got, x in ((hc, c), (he, e)):
            want = np.bincount((np.clip(x, -64, 63) + 64 + rows).ravel(), minlength=128 * c.shape[1])
            assert np.array_equal(got.ravel(), want)
        assert np.array_equal(delta_rows(c), ref)
        # sampled statistics (every 5th token) agree too
        assert np.array_equal(delta_rows(c, sample=100), delta_rows(c, method="numpy", sample=100))
    # the saving must pay for the plane, unless told otherwise
    assert not delta_rows(c[:20, :1]).any()
    assert delta_rows(c[:20, :1], min_gain_bits=0).tolist() == [True]
    assert not delta_rows(c[:1]).any()


def test_native_escape_split_and_join_with_deltas_match_the_reference():
    if not native.available():
        pytest.skip("native coder not built here (reference path covered elsewhere)")
    from kvcodec.codecs.kvc import escape_join

    rng = np.random.default_rng(5)
    c = np.cumsum(rng.integers(-40, 41, size=(300, 23)), axis=0)
    use = rng.random(23) < 0.5
    d = c.copy()
    d[1:, use] = np.diff(c[:, use], axis=0)
    for lvl in (4, 16, 32):
        sym, esc, lv = native.escape_split_tokens(c, lvl, use)
        s2, e2, l2 = escape_split(d.T, lvl)
        assert np.array_equal(sym, s2.T) and np.array_equal(esc, e2) and lv == l2
        ref = undelta_rows(escape_join(sym.T, esc, lv).T, np.packbits(use))
        assert np.array_equal(ref, c)
        assert np.array_equal(native.escape_join_tokens(sym, esc, lv, use), c)
        assert np.array_equal(native.escape_join_tokens(sym, esc, lv), escape_join(sym.T, esc, lv).T)


def test_undelta_inverts_and_reads_the_plane_strictly():
    c = np.arange(30).reshape(10, 3) ** 2
    use = np.array([True, False, True])
    e = c.copy()
    e[1:, use] = np.diff(c[:, use], axis=0)
    assert np.array_equal(undelta_rows(e, np.packbits(use)), c)
    with pytest.raises(FormatError, match="uint8"):
        undelta_rows(e, None)
    with pytest.raises(FormatError, match="uint8"):
        undelta_rows(e, np.packbits(use).astype(np.int8))
    with pytest.raises(FormatError, match="uint8"):
        undelta_rows(e, np.zeros(2, np.uint8))
    with pytest.raises(FormatError, match="padding"):
        undelta_rows(e, np.array([0b10100001], np.uint8))


@pytest.mark.parametrize("preset", ["kvc-near", "kvc-aggressive"])
def test_delta_is_lossless_and_saves_bits_on_slow_channels(preset):
    cache = _smooth_cache()
    # unpacked planes, so that the file header shows which tensors carry a pred plane
    plain = kvcodec.get_codec({"id": preset, "delta": 0, "pack": 0})
    delta = kvcodec.get_codec({"id": preset, "pack": 0})
    assert delta.params["delta"] == 1
    b0, b1 = plain.encode(cache), delta.encode(cache)
    head = json.loads(b1[8:8 + int.from_bytes(b1[:8], "little")])
    assert any(k.endswith(".k.pred") for k in head) and not any(k.endswith(".pred") for k in
                                                                  json.loads(b0[8:8 + int.from_bytes(b0[:8], "little")]))
    assert len(b1) < 0.9 * len(b0), (len(b1), len(b0))
    o0, o1 = kvcodec.decode(b0), kvcodec.decode(b1)
    for a, b in zip(o0.layers, o1.layers):
        assert torch.equal(a["k"], b["k"]) and torch.equal(a["v"], b["v"])


def test_hostile_pred_params_and_planes_are_refused():
    cache = _smooth_cache(layers=1)
    codec = kvcodec.get_codec("kvc-near")
    k = cache.layers[0]["k"]
    ctx = TensorContext(0, "k", tuple(k.shape), k.dtype)
    enc = codec.encode_planes(k, ctx)
    assert enc.params["pred"] == 1
    good = codec.decode_tensor(enc, ctx)
    assert torch.equal(good, kvcodec.get_codec({"id": "kvc-near", "delta": 0}).decode_tensor(
        kvcodec.get_codec({"id": "kvc-near", "delta": 0}).encode_planes(k, ctx), ctx))
    for bad in (2, True, 1.0, "1"):
        enc.params["pred"] = bad
        with pytest.raises(FormatError, match="pred"):
            codec.decode_tensor(enc, ctx)
    enc.params["pred"] = 0  # a plane the params do not announce
    with pytest.raises(FormatError, match="pred"):
        codec.decode_tensor(enc, ctx)
    enc.params["pred"] = 1
    plane = enc.planes.pop("pred")
    with pytest.raises(FormatError, match="pred"):
        codec.decode_tensor(enc, ctx)
    enc.planes["pred"] = plane[:-1]
    with pytest.raises(FormatError, match="pred"):
        codec.decode_tensor(enc, ctx)


def test_delta_config_is_checked():
    for bad in (3, -1, 0.5, "yes"):
        with pytest.raises(ConfigError, match="delta"):
            kvcodec.get_codec({"id": "kvc", "delta": bad})


def test_golden_delta_vector_decodes_like_the_plain_preset():
    rec = json.loads((V1 / "kvc-near.delta.json").read_text())
    plain = json.loads((V1 / "kvc-near.json").read_text())
    blob = (V1 / "kvc-near.delta.kvc").read_bytes()
    head = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    assert sum(k.endswith(".pred") for k in head) >= 2  # the vector exercises the plane
    assert rec["decoded_sha256"] == plain["decoded_sha256"]  # same values as the file without deltas


def test_escapes_are_stored_in_the_narrowest_integer_type():
    from kvcodec.codecs.kvc import _narrowest

    assert _narrowest(np.array([-128, 127], np.int64)).dtype == np.int8
    assert _narrowest(np.array([-129, 5], np.int64)).dtype == np.int16
    assert _narrowest(np.array([40000], np.int64)).dtype == np.int32
    # a tensor with a few large values: its escapes fit int8 / int16, and it round-trips
    g = torch.Generator().manual_seed(4)
    for scale, want in ((4.0, np.int8), (30.0, np.int16)):
        k = torch.randn(200, 2, 16, generator=g)
        k[::17, 0, 3] *= scale
        cache = kvcodec.KVCache.from_tensors([(k.half(), torch.randn(200, 2, 16, generator=g).half())])
        codec = kvcodec.get_codec({"id": "kvc-near", "max_level": 8})
        enc = codec.encode_planes(cache.layers[0]["k"], TensorContext(0, "k", (200, 2, 16), torch.float16))
        assert enc.planes["esc"].dtype == want and enc.planes["esc"].size > 0
        out = kvcodec.decode(codec.encode(cache))
        ref = kvcodec.get_codec({"id": "kvc-near", "max_level": 8}).decode_tensor(enc, TensorContext(0, "k", (200, 2, 16), torch.float16))
        assert torch.equal(out.layers[0]["k"], ref)
        enc.planes["esc"] = enc.planes["esc"].astype(np.int64)  # not a type the format allows
        with pytest.raises(FormatError, match="esc"):
            codec.decode_tensor(enc, TensorContext(0, "k", (200, 2, 16), torch.float16))
