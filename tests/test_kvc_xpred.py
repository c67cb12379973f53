"""kvc's prediction across layers (``xpred``, formats/codecs/kvc.md §13): the closed loop, the
normative arithmetic (reference and C bit for bit), profiles found by hash, and bad input."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec import native
from kvcodec.codecs.kvc import xpred
from kvcodec.codecs.kvc.calibration import load_query_statistics, save_query_statistics
from kvcodec.errors import ConfigError, FormatError
from kvc_tools import manifest_of, query_stats, rewrite


def drifting_cache(layers: int = 4, t: int = 200, h: int = 2, d: int = 16, seed: int = 0,
                   dtype: torch.dtype = torch.float16, positions: torch.Tensor | None = None):
    """Layers that each differ a little from the one before (what the predictor exploits)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, d, generator=g) * 2 + 3
    v = torch.randn(t, h, d, generator=g)
    out = []
    for _ in range(layers):
        out.append((k.to(dtype), v.to(dtype)))
        k = k + 0.1 * torch.randn(t, h, d, generator=g)
        v = v + 0.1 * torch.randn(t, h, d, generator=g)
    return kvcodec.KVCache.from_tensors(out, positions=positions)


def profile_file(path, cache, kind: str = "identity", seed: int = 3, skip: tuple[int, ...] = ()):
    """A calibration file for ``cache`` with predictors: the identity (layer l = layer l - 1) or
    random maps; none for the layers in ``skip``."""
    st = query_stats(cache)
    n = sum(x.shape[1] * x.shape[2] for x in cache.layers[0].values())
    rng = np.random.default_rng(seed)
    preds = [None]
    for i in range(1, cache.num_layers):
        if i in skip:
            preds.append(None)
        elif kind == "identity":
            preds.append((np.eye(n, dtype=np.float16), np.zeros(n, np.float32)))
        else:
            preds.append(((rng.normal(size=(n, n)) / np.sqrt(n)).astype(np.float16),
                          rng.normal(size=n).astype(np.float32)))
    st.xpred = preds
    save_query_statistics(st, path)
    return path


def cfg(path, **kw):
    return {"id": "kvc", "calibration": str(path), "xpred": 1, "k_step": 0.5, "v_step": 1.0, **kw}


def mse(a, b):
    return [float(((a.layers[i][r].float() - b.layers[i][r].float()) ** 2).mean())
            for i in range(a.num_layers) for r in ("k", "v")]


def _operands(t, n_in, n_out, rng):
    # values over many binades, so the order of the sums matters
    x = (rng.normal(size=(t, n_in)) * np.exp(rng.uniform(-8, 8, (t, n_in)))).astype(np.float32)
    w = (rng.normal(size=(n_in, n_out)) * np.exp(rng.uniform(-6, 6, (n_in, n_out)))).astype(np.float32)
    return x, w, rng.normal(size=n_out).astype(np.float32)


# 301: two threads; rows past the six-row tiles of the AVX2 kernel: 4 (130, 10), 1 (7), 3 (9), 4 + 1 (17)
SHAPES = ((1, 1, 1), (7, 33, 65), (130, 256, 128), (301, 40, 24), (9, 8, 96), (10, 24, 40), (17, 16, 17),
          (64, 48, 48))


def test_affine_reference_order_is_normative():
    rng = np.random.default_rng(0)
    for t, n_in, n_out in SHAPES[1:]:
        x, w, b = _operands(t, n_in, n_out, rng)
        ref = xpred.affine_reference(x, w, b)
        assert ref.dtype == np.float32 and ref.shape == (t, n_out)
        assert np.allclose(ref, b + x.astype(np.float64) @ w, rtol=1e-4, atol=1e-3 * np.abs(ref).max())
        # float64 sums rounded once differ somewhere: the order is part of the format
        assert not np.array_equal((b + x.astype(np.float64) @ w).astype(np.float32), ref)


def _every_kernel_equals_reference(x, w, b):
    """Every vector kernel this CPU runs (4 lanes runs everywhere) gives ``affine_reference``'s
    bits; returns those."""
    from kvcodec.native.xpred import affine as native_affine

    ref = xpred.affine_reference(x, w, b)
    ran = set()
    for lanes in (4, 8, 16):
        try:
            got = native_affine(x, w, b, lanes)
        except native.Unsupported:
            assert lanes != 4
            continue
        ran.add(lanes)
        assert np.array_equal(got.view(np.uint32), ref.view(np.uint32)), lanes
    assert 4 in ran
    return ref


@pytest.mark.skipif(native.build._compiler() is None, reason="no C compiler on this machine")
def test_affine_native_equals_reference_bit_for_bit():
    rng = np.random.default_rng(0)
    for t, n_in, n_out in SHAPES:
        x, w, b = _operands(t, n_in, n_out, rng)
        ref = _every_kernel_equals_reference(x, w, b)
        assert np.array_equal(xpred.affine(x, w, b).view(np.uint32), ref.view(np.uint32))


@pytest.mark.skipif(native.build._compiler() is None, reason="no C compiler on this machine")
def test_affine_keeps_the_sign_of_zero_as_the_reference():
    """-0 inputs stay -0 in every kernel, as in the reference: with a -0 bias and every product
    zero, an output is -0 where the products are -0 and +0 where one is +0 (a kernel that made
    its inputs +0 before multiplying turned those -0 outputs into +0)."""
    rng = np.random.default_rng(5)
    for t in (1, 6, 10, 13, 64):
        n_in, n_out = 12, 40
        x = np.where(rng.random((t, n_in)) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
        x[::3] = -0.0
        w = (rng.normal(size=(n_in, n_out)) * 3).astype(np.float32)
        w[:, ::4] = np.abs(w[:, ::4])  # columns where -0 inputs give -0 products only
        b = np.full(n_out, -0.0, dtype=np.float32)
        ref = _every_kernel_equals_reference(x, w, b)
        assert np.signbit(ref[::3, ::4]).all() and (ref == 0).all()


def _short(a, bits, rng):
    """``a`` (float32) with its mantissa truncated to ``bits`` significant bits."""
    u = a.astype(np.float32).view(np.uint32)
    drop = 24 - bits
    u = (u >> np.uint32(drop)) << np.uint32(drop)
    return u.view(np.float32)


@pytest.mark.skipif(native.build._compiler() is None, reason="no C compiler on this machine")
def test_affine_fuses_only_exact_products_and_keeps_the_bits():
    """Where every product is exact (float16-like operands: at most 11 significant bits, in
    [2^-62, 2^63)) the AVX-512 kernel fuses the multiply-adds; the sums are the same bits as the
    reference's separately rounded ones. Operands just past those limits (12 bits, or outside the
    range) must not be fused: a fused multiply-add of an inexact product would round differently
    somewhere in these sums."""
    rng = np.random.default_rng(3)
    t, n_in, n_out = 70, 96, 80
    check = _every_kernel_equals_reference
    b = rng.normal(size=n_out).astype(np.float32)
    spread = lambda shape, lo, hi: rng.normal(size=shape) * np.exp2(rng.uniform(lo, hi, shape))  # noqa: E731
    # float16 values (subnormals, zeros of both signs and the extremes among them)
    x16 = np.clip(spread((t, n_in), -20, 15), -65504, 65504).astype(np.float16)
    x16.flat[:6] = [0.0, -0.0, 6e-8, -6e-8, 65504.0, -65504.0]
    w16 = spread((n_in, n_out), -12, 4).astype(np.float16)
    check(x16.astype(np.float32), w16.astype(np.float32), b)
    # 11 significant bits at the edges of the range: products from 2^-124 to just below 2^126
    edge = np.exp2(np.where(rng.random((t, n_in)) < 0.5, -62.0, 62.0)) * (1 + rng.integers(0, 1024, (t, n_in)) / 1024)
    wedge = np.exp2(np.where(rng.random((n_in, n_out)) < 0.5, -62.0, 0.0)) * (1 + rng.integers(0, 1024, (n_in, n_out)) / 1024)
    check(edge.astype(np.float32) * rng.choice([-1, 1], (t, n_in)), wedge.astype(np.float32), b)
    top = np.float32(2.0 ** 63 - 2.0 ** 52)  # the largest value with 11 bits below 2^63: a product below 2^126
    check(np.full((5, 1), top, np.float32), np.full((1, 64), -top, np.float32), np.zeros(64, np.float32))
    # 12 and 13 significant bits: inexact products, never fused
    for bits in (12, 13):
        check(_short(spread((t, n_in), -8, 8), bits, rng), _short(spread((n_in, n_out), -6, 6), bits, rng), b)
    # bfloat16-like values below the range: products that underflow (inexact), summed with a tiny bias
    for lo in (-75, -66):
        check(_short(spread((t, n_in), lo, -62), 11, rng), _short(spread((n_in, n_out), lo, -62), 11, rng),
              (rng.normal(size=n_out) * 2.0 ** -126).astype(np.float32))


@pytest.mark.skipif(native.build._compiler() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_native_layer_pass_equals_the_reference(tmp_path, dtype):
    """The fused C pass (turn back, affine, turn forward, add, round; two threads past 256 rows)
    against :meth:`Predictors.predict` and :func:`add_reference`, bit for bit, on random
    predictors, RoPE at absolute positions and random masks; also its prediction-only mode."""
    assert native.available(), native.status()  # with a compiler the library builds
    t = 301
    pos = torch.arange(5000, 5000 + t)
    cache = drifting_cache(layers=3, t=t, dtype=dtype, positions=pos)
    prof = profile_file(tmp_path / "p.safetensors", cache, kind="random")
    from kvcodec.codecs.kvc.calibration import Calibration

    pred = xpred.Predictors.from_calibration(Calibration.load(prof))
    rng = np.random.default_rng(1)
    positions = pos.numpy()
    for layer in (1, 2):
        prev = {r: cache.layers[layer - 1][r].clone() for r in ("k", "v")}
        res = {r: (torch.randn(t, 2, 16, generator=torch.Generator().manual_seed(layer)) * 3).to(dtype)
               for r in ("k", "v")}
        masks = {r: rng.random(t) < 0.8 for r in ("k", "v")}
        shapes = {r: (2, 16) for r in ("k", "v")}
        ref_pred = pred.predict(layer, {r: xpred.as_float32(v) for r, v in prev.items()}, shapes, positions, "t")
        ref = xpred.add_reference({r: v.clone() for r, v in res.items()}, ref_pred, masks)  # float32: in place
        got = pred.add(layer, {r: v.clone() for r, v in res.items()}, prev, positions, masks, "t")
        for r in ("k", "v"):
            assert got[r].dtype == dtype
            assert torch.equal(got[r].view(torch.int16 if dtype != torch.float32 else torch.int32),
                               ref[r].view(torch.int16 if dtype != torch.float32 else torch.int32)), (layer, r)
            assert not torch.equal(got[r], res[r])  # the prediction was added
        only = pred.prediction(layer, {r: xpred.as_float32(v) for r, v in prev.items()}, shapes, positions, "t")
        for r in ("k", "v"):
            assert np.array_equal(only[r].view(np.uint32), ref_pred[r].view(np.uint32)), (layer, r)
            one = pred.prediction(layer, {q: xpred.as_float32(v) for q, v in prev.items()}, shapes, positions, "t",
                                  role=r)  # one role's columns: the encoder's threads
            assert list(one) == [r] and np.array_equal(one[r].view(np.uint32), ref_pred[r].view(np.uint32))


@pytest.mark.skipif(native.build._compiler() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("style,offset,r2", [("half", 0, 8), ("interleaved", 0, 8), ("half", 4, 4),
                                              ("interleaved", 6, 3)])
def test_native_pass_turns_every_rope_layout(style, offset, r2):
    """Both pair layouts, partial rotary (an offset, fewer pairs than channels) and different
    tables on the way in and out: :func:`kvcodec.native.xpred.xpred_pass` equals the numpy turn,
    affine and add."""
    assert native.available(), native.status()  # with a compiler the library builds
    from kvcodec.native.xpred import xpred_pass
    from kvcodec.transforms.rope import cos_sin, pairs

    rng = np.random.default_rng(7)
    t, h, d = 40, 3, 16
    positions = rng.integers(0, 10**6, t).astype(np.int64)
    steps_in = rng.integers(1, 2**31, r2).astype(np.uint32)
    steps_out = rng.integers(1, 2**31, r2).astype(np.uint32)
    k0 = torch.randn(t, h, d).half()
    v0 = torch.randn(t, h, d).half()
    w = (rng.normal(size=(2 * h * d, 2 * h * d)) / 8).astype(np.float32)
    b = rng.normal(size=2 * h * d).astype(np.float32)
    tables = []
    for steps in (steps_in, steps_out):
        c, s = cos_sin(positions, steps)
        ia, ib = pairs(r2, offset, style)
        tables.append((c, s, ia.astype(np.int32), ib.astype(np.int32)))
    ka = xpred._turn(k0.float().numpy(), positions, (steps_in, offset, style), -1)
    x = np.concatenate([ka.reshape(t, -1), v0.float().numpy().reshape(t, -1)], axis=1)
    y = xpred.affine_reference(x, w, b)
    pk = xpred._turn(np.ascontiguousarray(y[:, :h * d]).reshape(t, h, d), positions, (steps_out, offset, style), 1)
    pv = y[:, h * d:].reshape(t, h, d)
    rk, rv = torch.randn(t, h, d).half(), torch.randn(t, h, d).half()
    mk = rng.random(t) < 0.5
    want_k = rk.float().numpy().copy()
    want_k[mk] = want_k[mk] + pk[mk]
    want_v = rv.float().numpy() + pv
    ok, ov = rk.clone(), rv.clone()
    xpred_pass((0, 17), [(k0, True), (v0, False)], tables[0], w, b, [(ok, True), (ov, False)], tables[1],
               [mk.astype(np.uint8), np.ones(t, np.uint8)])
    xpred_pass((17, t), [(k0, True), (v0, False)], tables[0], w, b, [(ok, True), (ov, False)], tables[1],
               [mk.astype(np.uint8), np.ones(t, np.uint8)])
    assert torch.equal(ok, torch.from_numpy(want_k).half())
    assert torch.equal(ov, torch.from_numpy(want_v).half())
    with pytest.raises(ValueError, match="add up"):
        xpred_pass((0, t), [(k0, True)], tables[0], w, b, [(ok, True), (ov, False)], tables[1],
                   [mk.astype(np.uint8), mk.astype(np.uint8)])


def test_prediction_saves_bits_at_no_more_error_and_round_trips(tmp_path):
    cache = drifting_cache()
    prof = profile_file(tmp_path / "p.safetensors", cache)
    plain = kvcodec.get_codec({**cfg(prof), "xpred": 0})
    codec = kvcodec.get_codec(cfg(prof))
    blob = codec.encode(cache)
    m = manifest_of(blob)
    assert m["codec"]["xpred"] == 1 and m["codec"]["calibration_sha256"]
    assert "xpred" not in manifest_of(plain.encode(cache))["codec"]  # old configs unchanged
    flags = [[c["params"].get("xp") for c in m["layers"][i]["tensors"]["k"]["chunks"]] for i in range(4)]
    assert flags == [[None], [1], [1], [1]]
    dec = kvcodec.decode(blob)
    plain_blob = plain.encode(cache)
    err, err_plain = mse(dec, cache), mse(plain.decode(plain_blob), cache)
    assert err[:2] == err_plain[:2]  # layer 0 is coded as before
    # the steps follow the tensor's own RMS, not the residual's: the prediction saves bits (here
    # a third of the file) and the error stays at most the plain coding's
    assert len(blob) < 0.75 * len(plain_blob)
    assert all(e <= p for e, p in zip(err[2:], err_plain[2:]))
    # packing is lossless: the closed loop reads the same values either way
    assert kvcodec.decode(kvcodec.get_codec(cfg(prof, pack=0)).encode(cache)).equal(dec)
    # decoding twice, layer by layer, or a layer alone gives the same values
    again = kvcodec.decode(blob)
    assert again.equal(dec)
    with kvcodec.open(blob) as r:
        assert torch.equal(r.read_layer(3)["k"], dec.layers[3]["k"])
        assert [torch.equal(x["v"], y["v"]) for x, y in zip(r.read_layers(), dec.layers)] == [True] * 4


def test_decoder_equals_the_reference_arithmetic(tmp_path, monkeypatch):
    """Residuals decoded tensor by tensor plus the prediction computed by hand with the reference
    (numpy) arithmetic: the reader's output, bit for bit; random predictors, RoPE on."""
    pos = torch.arange(1000, 1000 + 150)
    cache = drifting_cache(layers=3, t=150, positions=pos)
    prof = profile_file(tmp_path / "p.safetensors", cache, kind="random")
    blob = kvcodec.get_codec(cfg(prof, k_step=0.3, v_step=0.6, sinks=2, sink_v_ratio=0.0)).encode(cache)
    dec = kvcodec.decode(blob)
    stats = load_query_statistics(prof)
    monkeypatch.setattr(xpred, "affine", xpred.affine_reference)
    with kvcodec.open(blob) as r:
        prev = None
        for i in range(3):
            res = {role: r._decode_chunk(i, role, 0, encs[0][1], "cpu") for role, encs in r.read_layer_planes(i).items()}
            if prev is None:
                now = {k: v.float().numpy() for k, v in res.items()}
            else:
                w, b = stats.xpred[i]
                rot0 = xpred.layer_rotation(stats, i - 1, 16)
                assert rot0 is not None
                ka = xpred._turn(prev["k"], pos.numpy(), rot0, -1)
                x = np.concatenate([ka.reshape(150, -1), prev["v"].reshape(150, -1)], axis=1)
                y = xpred.affine_reference(x, w.astype(np.float32), b)
                pk = xpred._turn(y[:, :32].reshape(150, 2, 16), pos.numpy(), xpred.layer_rotation(stats, i, 16), 1)
                pv = y[:, 32:].reshape(150, 2, 16)
                pk[:2] = pv[:2] = 0.0  # the two protected (sink) tokens take no prediction
                now = {"k": torch.from_numpy(res["k"].float().numpy() + pk).half().float().numpy(),
                       "v": torch.from_numpy(res["v"].float().numpy() + pv).half().float().numpy()}
                for role in ("k", "v"):  # they are stored exactly
                    assert torch.equal(dec.layers[i][role][:2], cache.layers[i][role][:2])
            for role in ("k", "v"):
                assert np.array_equal(now[role], dec.layers[i][role].float().numpy()), (i, role)
            prev = now


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_other_dtypes_and_chunks(tmp_path, dtype):
    cache = drifting_cache(dtype=dtype, t=130)
    prof = profile_file(tmp_path / "p.safetensors", cache)
    codec, plain = kvcodec.get_codec(cfg(prof)), kvcodec.get_codec(cfg(prof, xpred=0))
    whole = kvcodec.decode(codec.encode(cache))
    chunked_blob = codec.encode(cache, tokens_per_chunk=64)
    chunked = kvcodec.decode(chunked_blob)
    assert chunked.layers[3]["k"].dtype == dtype
    assert len(chunked_blob) < 0.8 * len(plain.encode(cache, tokens_per_chunk=64))
    for got, ref in ((whole, plain.decode(plain.encode(cache))),
                     (chunked, plain.decode(plain.encode(cache, tokens_per_chunk=64)))):
        assert all(e <= 1.02 * p for e, p in zip(mse(got, cache)[2:], mse(ref, cache)[2:]))
    with kvcodec.open(chunked_blob) as r:  # one chunk alone: the same rows as the whole decode
        assert torch.equal(r.read_layer(3, chunks=[1])["v"], chunked.layers[3]["v"][64:128])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_closed_loop_in_c_codes_the_references_bytes(tmp_path, monkeypatch, dtype):
    """The encoder's residual, float16 widening and decoded-plus-prediction in C
    (kvcodec.native.xpred) give the bytes of their numpy / torch references."""
    import kvcodec.native.convert as nc
    import kvcodec.native.xpred as nx

    cache = drifting_cache(dtype=dtype, t=130)
    prof = profile_file(tmp_path / "p.safetensors", cache, kind="random")
    codec = kvcodec.get_codec(cfg(prof, k_attn=1.0))
    fast = codec.encode(cache), codec.encode(cache, tokens_per_chunk=64)

    def unsupported(*a, **k):
        raise native.Unsupported("the reference")

    for mod, name in ((nx, "residual"), (nx, "prediction_sum"), (nc, "widen")):
        monkeypatch.setattr(mod, name, unsupported)
    assert (codec.encode(cache), codec.encode(cache, tokens_per_chunk=64)) == fast


def test_layers_without_a_predictor_are_coded_plain(tmp_path):
    cache = drifting_cache()
    prof = profile_file(tmp_path / "p.safetensors", cache, skip=(2,))
    m = manifest_of(kvcodec.get_codec(cfg(prof)).encode(cache))
    assert [m["layers"][i]["tensors"]["v"]["chunks"][0]["params"].get("xp") for i in range(4)] == [None, 1, None, 1]


def test_the_profile_is_found_by_hash_or_the_error_says_how(tmp_path, monkeypatch):
    cache = drifting_cache()
    prof = profile_file(tmp_path / "p.safetensors", cache)
    blob = kvcodec.get_codec(cfg(prof)).encode(cache)
    want = kvcodec.decode(blob)
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    shutil.move(prof, moved / "renamed.safetensors")
    monkeypatch.setenv("KVCODEC_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.delenv(xpred.PROFILES_ENV, raising=False)
    xpred._found.clear()
    sha = manifest_of(blob)["codec"]["calibration_sha256"]
    with pytest.raises(FormatError, match=f"layers.1: .*SHA-256 {sha}.*--profile"):
        kvcodec.decode(blob)
    assert kvcodec.decode(blob, profiles=[moved]).equal(want)  # a directory
    xpred._found.clear()
    assert kvcodec.decode(blob, profiles=[moved / "renamed.safetensors"]).equal(want)  # a file
    xpred._found.clear()
    monkeypatch.setenv(xpred.PROFILES_ENV, str(moved))
    assert kvcodec.decode(blob).equal(want)
    xpred._found.clear()
    monkeypatch.delenv(xpred.PROFILES_ENV)
    (tmp_path / "empty-cache" / "profiles").mkdir(parents=True)
    shutil.copy(moved / "renamed.safetensors", tmp_path / "empty-cache" / "profiles" / "m.safetensors")
    assert kvcodec.decode(blob).equal(want)  # the default profile directory


def test_another_profile_with_the_same_name_is_not_used(tmp_path, monkeypatch):
    cache = drifting_cache()
    prof = profile_file(tmp_path / "p.safetensors", cache)
    blob = kvcodec.get_codec(cfg(prof)).encode(cache)
    profile_file(prof, cache, kind="random")  # overwritten: another hash at the recorded path
    monkeypatch.setenv("KVCODEC_CACHE_DIR", str(tmp_path / "empty"))
    xpred._found.clear()
    with pytest.raises(FormatError, match="not here"):
        kvcodec.decode(blob)


def test_bad_input(tmp_path):
    cache = drifting_cache()
    prof = profile_file(tmp_path / "p.safetensors", cache)
    with pytest.raises(ConfigError, match="xpred must be 0 or 1"):
        kvcodec.get_codec(cfg(prof, xpred=2))
    with pytest.raises(ConfigError, match="needs a profile"):
        kvcodec.get_codec({"id": "kvc", "xpred": 1}).encode(cache)
    plain = tmp_path / "stats.safetensors"
    save_query_statistics(query_stats(cache), plain)
    with pytest.raises(ConfigError, match="no cross-layer predictors"):
        kvcodec.get_codec(cfg(plain)).encode(cache)
    wrong = load_query_statistics(prof)  # a predictor of another shape
    wrong.xpred[2] = (np.eye(8, dtype=np.float16), np.zeros(8, np.float32))
    save_query_statistics(wrong, tmp_path / "q.safetensors")
    with pytest.raises(FormatError, match="layers.2.k: .*maps 8 values to 8.*another model"):
        kvcodec.get_codec(cfg(tmp_path / "q.safetensors")).encode(cache)
    blob = kvcodec.get_codec(cfg(prof)).encode(cache)

    # xp on layer 0, and xp 0 written out, are refused
    for layer, value in ((0, 1), (1, 0), (1, True)):
        def edit(m, layer=layer, value=value):
            m["layers"][layer]["tensors"]["k"]["chunks"][0]["params"]["xp"] = value
        with pytest.raises(FormatError, match="xp"):
            kvcodec.decode(rewrite(blob, manifest=edit))


def test_profile_files_with_malformed_predictors_are_refused(tmp_path):
    from safetensors.numpy import load, save

    from kvcodec.codecs.kvc.calibration import Calibration
    from kvcodec.format import safetensors_io as sio

    cache = drifting_cache()
    prof = profile_file(tmp_path / "p.safetensors", cache)
    st = load_query_statistics(prof)
    assert st.xpred[0] is None and st.xpred[1][0].dtype == np.float16 and st.xpred[1][1].dtype == np.float32
    data = prof.read_bytes()
    meta = sio.read_raw_header(sio.as_source(data)).metadata
    tensors = load(data)
    for change, match in ((lambda t: t.update({"layers.1.xpred_w": t["layers.1.xpred_w"].astype(np.float32)}), "float16"),
                          (lambda t: t.pop("layers.2.xpred_b"), "needs xpred_w"),
                          (lambda t: t.update({"layers.0.xpred_w": t["layers.1.xpred_w"],
                                               "layers.0.xpred_b": t["layers.1.xpred_b"]}), "layers >= 1"),
                          (lambda t: t.update({"layers.3.xpred_b": t["layers.3.xpred_b"][:5]}), "needs xpred_w"),
                          (lambda t: t.update({"layers.3.xpred_w": np.full_like(t["layers.3.xpred_w"], np.inf)}),
                           "finite")):
        t = dict(tensors)
        change(t)
        bad = tmp_path / "bad.safetensors"
        bad.write_bytes(save(t, metadata=meta))
        with pytest.raises(FormatError, match=match):
            Calibration.load(bad)


def test_decode_cli_takes_a_profile(tmp_path, monkeypatch):
    from kvcodec.cli import main

    cache = drifting_cache()
    prof = profile_file(tmp_path / "p.safetensors", cache)
    kvcodec.get_codec(cfg(prof)).encode(cache, tmp_path / "a.kvc")
    want = kvcodec.decode(tmp_path / "a.kvc")
    moved = tmp_path / "m.safetensors"
    shutil.move(prof, moved)
    monkeypatch.setenv("KVCODEC_CACHE_DIR", str(tmp_path / "empty"))
    xpred._found.clear()
    assert main(["decode", str(tmp_path / "a.kvc"), str(tmp_path / "out.safetensors")]) != 0
    assert main(["decode", str(tmp_path / "a.kvc"), str(tmp_path / "out.safetensors"), "--profile", str(moved)]) == 0
    assert kvcodec.KVCache.from_safetensors(tmp_path / "out.safetensors").equal(want)


def test_fit_predictors_closed_loop_and_held_out_sets(tmp_path):
    """kvcodec calibrate's fit: a predictor per layer >= 1 that predicts well, and per cache a set
    fitted on the other caches (the search scores each window with one that never saw it)."""
    from kvcodec.harness.xpred import fit_predictors

    a, b = drifting_cache(seed=0), drifting_cache(seed=1)
    stats_file = tmp_path / "s.safetensors"
    save_query_statistics(query_stats(a), stats_file)
    stats = load_query_statistics(stats_file)
    config = {"id": "kvc", "k_step": 0.3, "v_step": 0.6}
    full, held = fit_predictors(config, str(stats_file), [a, b], stats)
    assert full[0] is None and all(p is not None for p in full[1:]) and len(held) == 2
    w, bias = full[2]
    assert w.dtype == np.float16 and bias.dtype == np.float32 and w.shape == (64, 64)
    assert np.abs(np.diag(w.astype(np.float32))).mean() > 0.8  # layer l ~ layer l - 1 here
    assert not np.array_equal(held[0][2][0], w) and not np.array_equal(held[0][2][0], held[1][2][0])
    # the same cache twice: every held-out set is the full fit (ridge scaled with the data)
    full2, held2 = fit_predictors(config, str(stats_file), [a, a], stats)
    for layer in range(1, 4):
        for h in held2:
            assert np.allclose(h[layer][0].astype(np.float32), full2[layer][0].astype(np.float32), atol=2e-3)
    # a profile file with them codes and decodes
    stats.xpred = full
    save_query_statistics(stats, tmp_path / "p.safetensors")
    blob = kvcodec.get_codec(cfg(tmp_path / "p.safetensors")).encode(a)
    assert len(blob) < 0.8 * len(kvcodec.get_codec(cfg(tmp_path / "p.safetensors", xpred=0)).encode(a))
    assert kvcodec.decode(blob).num_layers == 4


def test_closed_loop_decodes_with_the_files_config(tmp_path):
    """A caller's setting that the profile overrides and that the decoder reads (``v_center``):
    the encoder's closed loop decodes as the file's decoder will, so the file decodes."""
    cache = drifting_cache()
    prof = profile_file(tmp_path / "p.safetensors", cache)
    st = load_query_statistics(prof)
    st.profile = {"version": 1, "settings": {"v_center": False, "xpred": 1}, "kv_ratio": 2.0, "margin": 1.0,
                  "points": [[0.5, 0.01, 2.0]], "levels": [{"target_kl": 0.01, "k_step": 0.5, "v_step": 1.0}]}
    save_query_statistics(st, prof)
    blob = kvcodec.get_codec({"id": "kvc", "calibration": str(prof), "target_kl": 0.01, "v_center": True}).encode(cache)
    assert manifest_of(blob)["codec"]["v_center"] is False
    dec = kvcodec.decode(blob)
    plain = kvcodec.get_codec(cfg(prof, xpred=0))
    assert all(e <= 1.02 * p for e, p in zip(mse(dec, cache)[2:], mse(plain.decode(plain.encode(cache)), cache)[2:]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_closed_loop_reconstructs_what_the_decoder_decodes(tmp_path, monkeypatch, dtype):
    """The encoder feeds the next layer's prediction from the codes it wrote
    (``KVCCodec.reconstruct``), not by decoding its streams: the same values as
    ``decode_tensor`` on those planes, bit for bit, on every tensor of several settings
    (per-token K steps, RoPE means, token-mode V, reconstruction offsets, chunks, sinks)."""
    seen, turned, stepped = [], [], []
    real = kvcodec.codecs.kvc.codec.KVCCodec.reconstruct

    def check(self, enc, codes, ctx, means=None, steps=None):  # decoded below, once the stage's planes are in
        got = real(self, enc, codes, ctx, means, steps)
        seen.append((self, enc, ctx, got.clone()))
        turned.append(means is not None)
        stepped.append(steps is not None)
        return got

    monkeypatch.setattr(kvcodec.codecs.kvc.codec.KVCCodec, "reconstruct", check)
    cache = drifting_cache(layers=3, t=140, dtype=dtype, positions=torch.arange(7, 147))
    prof = profile_file(tmp_path / "p.safetensors", cache, kind="random")
    for kw, chunk in (({}, 0), ({"k_recon": 2, "sinks": 3}, 0), ({"v_scale": "head", "v_center": True}, 64),
                      ({"k_rope_mean": 1, "recent": 20, "recent_ramp": 64, "ctx": [3, 8, 20], "rows_per_stream": 64}, 0), ({"transform": "hadamard"}, 0)):
        seen.clear()
        blob = kvcodec.get_codec(cfg(prof, **kw)).encode(cache, tokens_per_chunk=chunk)
        assert len(seen) == 3 * 2 * (1 if not chunk else 3)
        for codec, enc, ctx, got in seen:
            want = codec.decode_tensor(enc, ctx)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (ctx.layer, ctx.role)
        assert kvcodec.decode(blob).num_layers == 3
    assert any(turned)  # the encoder's rotating means were used (k_rope_mean)
    assert all(stepped)  # and its steps, every time


@pytest.mark.parametrize("chunk", [0, 50])
def test_threads_code_the_same_bytes_and_a_failure_stops_them(tmp_path, monkeypatch, chunk):
    """The closed loop on the writer's threads (a tensor waits for the layer before on its rows):
    the bytes of one thread; an error in one tensor raises, and nothing waits forever."""
    import threading

    import kvcodec.codecs.kvc.codec as kc

    cache = drifting_cache(layers=5, t=150, positions=torch.arange(3, 153))
    prof = profile_file(tmp_path / "p.safetensors", cache, kind="random")
    codec = kvcodec.get_codec(cfg(prof, k_attn=1.0))
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    seen: set[str] = set()
    real = kc.KVCCodec.encode_tensor

    def spy(self, x, ctx):
        seen.add(threading.current_thread().name)
        return real(self, x, ctx)

    monkeypatch.setattr(kc.KVCCodec, "encode_tensor", spy)
    out = {}
    for threads in (1, 2, 3):
        monkeypatch.setattr(kc, "XPRED_ENCODE_THREADS", threads)
        seen.clear()
        out[threads] = codec.encode(cache, tokens_per_chunk=chunk)
        assert len(seen) == threads
    assert out[1] == out[2] == out[3]

    real_residual = xpred.residual

    def broken(x, pred, where, x32=None):
        if where == "layers.2.v":
            raise RuntimeError("boom")
        return real_residual(x, pred, where, x32)

    monkeypatch.setattr(xpred, "residual", broken)
    monkeypatch.setattr(kc, "XPRED_ENCODE_THREADS", 2)
    with pytest.raises(RuntimeError, match="boom"):
        codec.encode(cache, tokens_per_chunk=chunk)


class _OneLayerPredictors:
    """Predicts layer 1 from layer 0 (zeros): what XPredEncoder's waiting needs, nothing more."""

    def has(self, layer):
        return layer == 1

    def prediction(self, layer, prev, shapes, positions, where, role):
        return {role: np.zeros_like(prev[role])}


def test_a_tensor_waits_for_the_layer_before_even_before_its_thread_starts(monkeypatch):
    """The writer hands layer 0 to one pool thread and layer 1 to another; the thread of layer 1
    may enter the closed loop before the thread of layer 0 has started. It waits for it (it
    once concluded at once that layer 0 would never come), and a layer that really never comes
    still ends in a clear error after XPRED_ALONE_S."""
    import threading
    import time

    from kvcodec.errors import ConfigError

    shapes = [{"k": (2, 4)}, {"k": (2, 4)}]
    enc = xpred.XPredEncoder(_OneLayerPredictors(), np.arange(6), shapes, decoder=None)
    got: dict[str, object] = {}

    def layer1():
        try:
            with enc.coding():
                got["pred"] = enc.prediction(1, "k", (0, 6), "layers.1.k")
        except Exception as e:  # noqa: BLE001
            got["error"] = e

    t1 = threading.Thread(target=layer1)
    t1.start()
    time.sleep(0.3)  # layer 0's thread starts late
    with enc.coding():
        enc.store(0, "k", (0, 6), np.ones((6, 2, 4), np.float32))
    t1.join(10)
    assert "error" not in got, got.get("error")
    assert got["pred"].shape == (6, 2, 4)

    monkeypatch.setattr(xpred, "XPRED_ALONE_S", 0.2)
    lone = xpred.XPredEncoder(_OneLayerPredictors(), np.arange(6), shapes, decoder=None)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="layer 0 was not coded first"), lone.coding():
        lone.prediction(1, "k", (0, 6), "layers.1.k")
    assert time.monotonic() - t0 < 5
