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
from kvcodec.quant.deadzone import deadzone_quantize, recon_offsets, recon_sums, recon_values


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
