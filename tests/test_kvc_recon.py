"""kvc's reconstruction offsets (``k_recon``, the tensor param ``rc``): measured exactly by the
encoder, applied exactly by the decoder, strictly read."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec import native
from kvcodec.codec import TensorContext
from kvcodec.errors import ConfigError, FormatError, InputError
from kvcodec.quant.deadzone import (deadzone_quantize, deadzone_quantize_recon, recon_offsets, recon_sums,
                                    recon_values)


def _laplace_cache(layers=2, t=300, h=2, d=24, seed=0):
    """K Laplacian around per-channel offsets (peaked like real K), V Gaussian."""
    g = np.random.default_rng(seed)
    out = []
    for _ in range(layers):
        k = g.laplace(size=(t, h, d)) + 3 * g.standard_normal((1, h, d))
        v = g.standard_normal((t, h, d))
        out.append((torch.from_numpy(k).half(), torch.from_numpy(v).half()))
    return kvcodec.KVCache.from_tensors(out)


def _offsets_by_fractions(x, step, codes, levels):
    """The definition, in exact rational arithmetic: per level the mean of ``k - |x| / step``
    (each residual rounded to 2**-24, half to even), times 256, rounded half up, clamped."""
    out = []
    xs, ss, cs = (np.broadcast_to(a, codes.shape).ravel() for a in (x, step, codes))
    for k in range(1, levels + 1):
        sel = np.abs(cs) == k
        if not sel.any():
            out.append(0)
            continue
        res = [Fraction(round((k - abs(float(a)) / float(b)) * 2**24), 2**24) for a, b in zip(xs[sel], ss[sel])]
        mean = sum(res) / len(res)
        v = int((mean * 256 + Fraction(1, 2)) // 1)
        out.append(min(max(v, 0), 128))
    return out


def test_offsets_match_their_definition_and_every_path_agrees():
    rng = np.random.default_rng(1)
    z = rng.laplace(size=(37, 3, 10)).astype(np.float32)
    step = rng.uniform(0.3, 1.2, size=(37, 3, 1)).astype(np.float32)
    codes = deadzone_quantize(z, step, 0.45)
    want = _offsets_by_fractions(z, step, codes, 5)
    assert recon_offsets(z, step, codes, 5) == want
    assert any(0 < v < 128 for v in want)
    # the numpy reference and the native sums are the same integers, also from a wider matrix
    wide = np.zeros((37, 30 + 3), dtype=np.int64)
    wide[:, :30] = codes.reshape(37, 30)
    ref = recon_sums(z, step, wide, 5)
    assert ref == recon_sums(z, step, codes, 5)
    if native.available():
        assert native.recon_sums(z, step, wide, 5) == ref
        assert native.recon_sums(z, np.broadcast_to(step, z.shape), codes, 5) == ref
    # integer sums: the order of the values does not matter
    perm = rng.permutation(37)
    assert recon_offsets(z[perm], step[perm], codes[perm], 5) == want


@pytest.mark.parametrize("seed", range(6))
def test_one_pass_quantizer_equals_the_two_reference_calls(seed):
    """deadzone_quantize_recon (native: codes and sums in one pass) gives the codes and offsets of
    deadzone_quantize then recon_offsets' numpy sums, for float32 / float64 steps, broadcast or
    full, into a wider matrix or not, at any level count."""
    rng = np.random.default_rng(100 + seed)
    n, h, d = int(rng.integers(1, 70)), int(rng.integers(1, 4)), int(rng.integers(1, 40))
    z = (rng.laplace(size=(n, h, d)) * rng.uniform(0.1, 30)).astype(np.float32)
    shape = [(n, h, d), (1, h, d), (n, h, 1), (1, 1, 1)][seed % 4]
    step = rng.uniform(0.05, 2.0, size=shape).astype(np.float32 if seed % 2 else np.float64)
    levels = int(rng.integers(1, 17))
    rho = float(rng.uniform(0.3, 0.5))
    want_codes = deadzone_quantize(z.astype(np.float64), step, rho)  # numpy path (float64 x)
    want = recon_sums(z, step, want_codes, levels)  # (sums, counts), numpy
    codes, rc = deadzone_quantize_recon(z, step, rho, levels)
    assert np.array_equal(np.asarray(codes).reshape(z.shape), want_codes)
    assert rc == recon_offsets(z.astype(np.float64), step, want_codes, levels)  # numpy sums
    wide = np.full((n, h * d + 3), 7, dtype=np.int64)
    codes2, rc2 = deadzone_quantize_recon(z, step, rho, levels, out=wide[:, : h * d])
    assert codes2 is not None and rc2 == rc
    assert np.array_equal(wide[:, : h * d], want_codes.reshape(n, h * d)) and (wide[:, h * d:] == 7).all()
    if native.available():
        fused = native.deadzone_recon(z, step, rho, None, levels)
        assert fused is not None and fused[1] == want
        assert native.recon_sums(z, step, want_codes, levels) == want
    no_levels, empty = deadzone_quantize_recon(z, step, rho, 0)
    assert np.array_equal(np.asarray(no_levels).reshape(z.shape), want_codes) and empty == []


def test_one_pass_quantizer_checks_its_arguments_and_falls_back():
    z = np.array([[[0.7, 1.0, -0.8, 2.1]]], dtype=np.float32)
    with pytest.raises(InputError, match="levels"):
        deadzone_quantize_recon(z, np.ones(4), 0.5, 17)
    with pytest.raises(InputError, match="rho"):
        deadzone_quantize_recon(z, np.ones(4), 0.6, 2)
    # a non-finite value: the numpy path decides (as deadzone_quantize does), the same answer as
    # the two reference calls
    bad = z.copy()
    bad[0, 0, 3] = np.inf
    with np.errstate(invalid="ignore"):
        codes, rc = deadzone_quantize_recon(bad, np.ones(4), 0.5, 2)
        ref = deadzone_quantize(bad, np.ones(4), 0.5)
    assert np.array_equal(codes, ref) and rc == [43, 0]


def test_offsets_edge_cases():
    one = np.ones(4, np.float32)
    x = np.array([0.5, 1.0, 0.0, 2.49], np.float32)
    c = np.array([1, 1, 0, 2])
    # level 1: residuals 0.5 and 0 -> 0.25 step -> 64; level 2: -0.49 -> clamped to 0; level 3 empty
    assert recon_offsets(x, one, c, 3) == [64, 0, 0]
    assert recon_offsets(x, one, c, 0) == []
    assert recon_offsets(np.zeros(0, np.float32), np.ones(0, np.float32), np.zeros(0, np.int64), 2) == [0, 0]
    with pytest.raises(InputError, match="levels"):
        recon_offsets(x, one, c, 17)


def test_recon_values_are_exact():
    offs = [1, 64, 128, 0, 77]
    codes = np.arange(-7, 8)
    got = recon_values(codes, offs)
    assert got.dtype == np.float32
    for c, v in zip(codes.tolist(), got.tolist()):
        m = abs(c)
        want = Fraction(c) if m == 0 or m > len(offs) else (1 if c > 0 else -1) * (m - Fraction(offs[m - 1], 256))
        assert Fraction(v) == want, (c, v)
    assert recon_values(codes, None).tolist() == codes.astype(np.float32).tolist()


def test_k_recon_lowers_k_error_leaves_v_alone_and_decodes_by_the_formula():
    cache = _laplace_cache()
    plain = kvcodec.get_codec({"id": "kvc-near", "k_step": 0.8})
    rc = kvcodec.get_codec({"id": "kvc-near", "k_step": 0.8, "k_recon": 4})
    b0, b1 = plain.encode(cache), rc.encode(cache)
    o0, o1 = kvcodec.decode(b0), kvcodec.decode(b1)
    for i, layer in enumerate(cache.layers):
        assert torch.equal(o0.layers[i]["v"], o1.layers[i]["v"])  # V unchanged
        e0 = (o0.layers[i]["k"].float() - layer["k"].float()).pow(2).mean()
        e1 = (o1.layers[i]["k"].float() - layer["k"].float()).pow(2).mean()
        assert e1 < 0.97 * e0, (i, float(e0), float(e1))
    k = cache.layers[0]["k"]
    ctx = TensorContext(0, "k", tuple(k.shape), k.dtype)
    enc = rc.encode_tensor(k, ctx)
    offs = enc.params["rc"]
    assert len(offs) == 4 and offs[0] > 10  # Laplacian values sit well inside the +-1 bins
    assert "rc" not in rc.encode_tensor(cache.layers[0]["v"], TensorContext(0, "v", tuple(k.shape), k.dtype)).params
    # the offsets are what moves the decoded K (the numpy reference path is checked against the
    # native one in tests/test_native.py, k_recon row)
    enc0 = dict(enc.params)
    enc.params.pop("rc")
    base = rc.decode_tensor(enc, ctx).float()
    enc.params.update(enc0)
    got = rc.decode_tensor(enc, ctx).float()
    assert not torch.equal(base, got)
    assert torch.equal(rc.decode_tensor(enc, ctx), o1.layers[0]["k"])


def test_hostile_rc_params_are_refused():
    cache = _laplace_cache(layers=1)
    codec = kvcodec.get_codec({"id": "kvc-near", "k_recon": 3})
    k = cache.layers[0]["k"]
    ctx = TensorContext(0, "k", tuple(k.shape), k.dtype)
    enc = codec.encode_tensor(k, ctx)
    for bad in ([], [129], [-1], [1.5], [True], "12", [0] * 17, 5, {"a": 1}):
        enc.params["rc"] = bad
        with pytest.raises(FormatError, match="rc"):
            codec.decode_tensor(enc, ctx)
    v = cache.layers[0]["v"]
    vctx = TensorContext(0, "v", tuple(v.shape), v.dtype)
    venc = codec.encode_tensor(v, vctx)
    venc.params["rc"] = [10]  # token-mode V has no reconstruction offsets
    with pytest.raises(FormatError, match="per-channel"):
        codec.decode_tensor(venc, vctx)


def test_k_recon_config_is_checked():
    for bad in (-1, 17, True, 1.0, "4"):
        with pytest.raises(ConfigError, match="k_recon"):
            kvcodec.get_codec({"id": "kvc", "k_recon": bad})
