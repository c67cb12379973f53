"""The quantizing codecs fp8 / nvfp4 / kivi: pinned plane layouts, sizes, bounds, bad planes."""

import doctest

import numpy as np
import pytest
import torch

import kvcodec
import kvcodec.codecs.fp8 as fp8codec
import kvcodec.codecs.kivi as kivicodec
import kvcodec.codecs.nvfp4 as nvfp4codec
from kvcodec.codec import EncodedTensor, TensorContext
from kvcodec.errors import ConfigError, FormatError, InputError
from kvcodec.quant import (
    fp8_decode_reference,
    fp8_encode_reference,
    intq_dequantize_reference,
    intq_quantize_reference,
    nvfp4_dequantize_reference,
    nvfp4_quantize_reference,
    pack_bits,
)
from kvcodec.testing import SHAPES, SOURCE_DTYPES, value_cases

PRESETS = ["fp8-e4m3", "fp8-e5m2", "nvfp4", "kivi-4", "kivi-2"]
#: worst-case max |err| / max |x| per tensor on Gaussian data, generous but able to fail
REL_MAX_ERR = {"fp8-e4m3": 2.0**-4, "fp8-e5m2": 2.0**-3, "nvfp4": 0.2, "kivi-4": 0.1, "kivi-2": 0.5}


@pytest.mark.parametrize("mod", [fp8codec, nvfp4codec, kivicodec])
def test_doctests(mod):
    assert doctest.testmod(mod).failed == 0


def ctx_for(x, role="k", layer=0):
    return TensorContext(layer=layer, role=role, shape=tuple(x.shape), dtype=x.dtype)


def test_presets_and_ids():
    for name, cid in zip(PRESETS, ["fp8", "fp8", "nvfp4", "kivi", "kivi"]):
        assert name in kvcodec.list_codecs()
        assert kvcodec.get_codec(name).codec_id == cid
    assert kvcodec.get_codec("fp8-e5m2").params["format"] == "e5m2"
    assert kvcodec.get_codec("kivi-2").params == {"bits": 2, "group": 32, "residual": 0, "latent_axis": "token"}


def test_nominal_bits():
    nb = {n: kvcodec.get_codec(n).nominal_bits for n in PRESETS}
    assert nb["fp8-e4m3"] == pytest.approx(8.0, abs=1e-3) and nb["fp8-e4m3"] > 8.0
    assert nb["nvfp4"] == pytest.approx(4.5, abs=1e-4)
    assert nb["kivi-4"] == 5.0 and nb["kivi-2"] == 3.0
    assert kvcodec.get_codec({"id": "fp8", "v_granularity": "token"}).nominal_bits == pytest.approx(8.125, abs=1e-3)
    # a recent window of 128 fp16 tokens out of 1024 costs its share
    assert kvcodec.get_codec({"id": "kivi", "bits": 2, "residual": 128}).nominal_bits == pytest.approx(
        (896 / 1024) * 3 + (128 / 1024) * 16, abs=0.01)


def test_bad_configs():
    bad = [{"id": "fp8", "format": "e4m3fnuz"}, {"id": "fp8", "k_granularity": "row"},
           {"id": "fp8", "block": 0}, {"id": "kivi", "bits": 0}, {"id": "kivi", "bits": 9},
           {"id": "kivi", "group": 0}, {"id": "kivi", "residual": -1},
           {"id": "kivi", "latent_axis": "head"}, {"id": "nvfp4", "block": 32}]
    for cfg in bad:
        with pytest.raises(ConfigError):
            kvcodec.get_codec(cfg)


# --------------------------------------------------------------------------- plane layouts
@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("gran", ["tensor", "head", "channel", "token", "block"])
def test_fp8_planes_are_the_reference_output(shape_name, gran):
    x = torch.randn(SHAPES[shape_name], generator=torch.Generator().manual_seed(1)).half()
    codec = kvcodec.get_codec({"id": "fp8", "format": "e5m2", "k_granularity": gran, "block": 8})
    enc = codec.encode_tensor(x, ctx_for(x))
    codes, scale = fp8_encode_reference(x, "e5m2", gran, 8)
    assert set(enc.planes) == {"codes", "scale"}
    assert enc.planes["codes"].dtype == np.uint8 and enc.planes["codes"].shape == x.shape
    assert enc.planes["scale"].dtype == np.float32 and enc.planes["scale"].shape == tuple(scale.shape)
    assert np.array_equal(enc.planes["codes"], codes.numpy())
    assert np.array_equal(enc.planes["scale"], scale.numpy())
    assert enc.params == {"format": "e5m2", "granularity": gran, "block": 8}
    out = codec.decode_tensor(enc, ctx_for(x))
    assert torch.equal(out, fp8_decode_reference(codes, scale, "e5m2", torch.float16, 8))
    assert 8 * enc.nbytes == codec.tensor_bits(tuple(x.shape), "k")


def test_fp8_v_granularity_applies_to_v_only():
    codec = kvcodec.get_codec({"id": "fp8", "k_granularity": "channel", "v_granularity": "token"})
    x = torch.randn(5, 2, 8)
    assert codec.encode_tensor(x, ctx_for(x, "k")).planes["scale"].shape == (1, 2, 8)
    assert codec.encode_tensor(x, ctx_for(x, "v")).planes["scale"].shape == (5, 2, 1)
    assert codec.encode_tensor(x, ctx_for(x, "kv")).planes["scale"].shape == (1, 2, 8)


@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_nvfp4_planes(shape_name):
    t, h, d = SHAPES[shape_name]
    x = torch.randn(t, h, d, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    codec = kvcodec.get_codec("nvfp4")
    enc = codec.encode_tensor(x, ctx_for(x))
    q = nvfp4_quantize_reference(x)
    dp = -(-d // 16) * 16
    assert set(enc.planes) == {"codes", "block_scale", "tensor_scale"}
    assert enc.planes["codes"].shape == (t, h, dp // 2) and enc.planes["codes"].dtype == np.uint8
    assert enc.planes["block_scale"].shape == (t, h, dp // 16) and enc.planes["block_scale"].dtype == np.uint8
    assert enc.planes["tensor_scale"].shape == (1,) and enc.planes["tensor_scale"].dtype == np.float32
    assert np.array_equal(enc.planes["codes"], q.codes.numpy())
    assert np.array_equal(enc.planes["block_scale"], q.block_scale.numpy())
    assert enc.params == {"pad": dp - d}
    assert 8 * enc.nbytes == codec.tensor_bits((t, h, d))
    assert np.array_equal(enc.planes["tensor_scale"], q.tensor_scale.numpy())
    out = codec.decode_tensor(enc, ctx_for(x))
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.equal(out.view(torch.int16), nvfp4_dequantize_reference(q, torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("role", ["k", "v", "kv"])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_kivi_planes(shape_name, role, bits):
    shape = SHAPES[shape_name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3))
    codec = kvcodec.get_codec({"id": "kivi", "bits": bits, "group": 4, "residual": 2})
    enc = codec.encode_tensor(x, ctx_for(x, role))
    t, h, d = shape
    tr = min(2, t)
    tq = t - tr
    axis = {"k": "channel", "v": "token", "kv": "token"}[role]
    q = intq_quantize_reference(x[:tq], bits, axis, 4)
    assert enc.params == {"axis": axis, "bits": bits, "group": 4, "recent": tr}
    assert np.array_equal(enc.planes["codes"], pack_bits(q.codes, bits))
    assert enc.planes["codes"].shape == ((tq * h * d * bits + 7) // 8,)
    for p in ("scale", "zero"):
        assert enc.planes[p].dtype == np.float16
    assert np.array_equal(enc.planes["scale"], q.scale.numpy())
    assert np.array_equal(enc.planes["zero"], q.zero.numpy())
    if tr:
        assert enc.planes["recent"].dtype == np.int32 and enc.planes["recent"].shape == (tr, h, d)
    else:
        assert "recent" not in enc.planes
    assert 8 * enc.nbytes == codec.tensor_bits(shape, role, source_bits=32)
    out = codec.decode_tensor(enc, ctx_for(x, role))
    assert out.shape == x.shape
    assert torch.equal(out[tq:], x[tq:])  # the recent window is bit for bit
    assert torch.equal(out[:tq].view(torch.int32), intq_dequantize_reference(q).view(torch.int32))


def test_kivi_residual_covers_everything_is_lossless():
    cache = kvcodec.KVCache.from_tensors([(torch.randn(5, 2, 8).to(torch.bfloat16),
                                           torch.randn(5, 2, 8).to(torch.bfloat16))])
    codec = kvcodec.get_codec({"id": "kivi", "bits": 2, "residual": 64})
    assert kvcodec.decode(codec.encode(cache)).equal(cache)


# --------------------------------------------------------------------------- through the container
@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("dtype", SOURCE_DTYPES)
def test_cache_roundtrip_error_and_size(name, dtype):
    g = torch.Generator().manual_seed(4)
    pairs = []
    for shape in [(37, 3, 40), (37, 3, 7), (37, 1, 64)]:
        k = torch.randn(shape, generator=g) + 4 * torch.randn(1, shape[1], shape[2], generator=g)
        pairs.append((k.to(dtype), torch.randn(shape, generator=g).to(dtype)))
    cache = kvcodec.KVCache.from_tensors(pairs)
    codec = kvcodec.get_codec(name)
    blob = codec.encode(cache)
    out = kvcodec.decode(blob)
    assert out.dtype == dtype
    plane_bits = 0
    for (i, r, a), (_, _, b) in zip(cache.tensors(), out.tensors()):
        err = float((b.float() - a.float()).abs().max()) / float(a.float().abs().max())
        assert err <= REL_MAX_ERR[name], (name, dtype, i, r, err)
        bits_fn = codec.tensor_bits
        plane_bits += (bits_fn(tuple(a.shape)) if name == "nvfp4" else
                       bits_fn(tuple(a.shape), r, 16 if dtype != torch.float32 else 32)
                       if name.startswith("kivi") else bits_fn(tuple(a.shape), r))
    # all-in size = planes + container overhead (headers, manifest, alignment)
    assert 8 * len(blob) > plane_bits


@pytest.mark.parametrize("name", PRESETS)
def test_value_cases_through_codecs(name):
    codec = kvcodec.get_codec(name)
    for dtype in SOURCE_DTYPES:
        for case, x in value_cases(dtype, shape=(4, 2, 24)).items():
            cache = kvcodec.KVCache.from_tensors([(x, x.clone())])
            if name.startswith("kivi") and case == "source_max" and dtype != torch.float16:
                with pytest.raises(InputError, match="float16"):
                    codec.encode(cache)
                continue
            out = kvcodec.decode(codec.encode(cache))
            y = out.layers[0]["k"]
            assert y.dtype == dtype and bool(torch.isfinite(y).all()), (name, case, dtype)
            if case in ("all_zero", "all_neg_zero"):
                assert not bool(y.float().any()), (name, case)


# --------------------------------------------------------------------------- bad planes
def _enc(name, x, role="k"):
    codec = kvcodec.get_codec(name)
    return codec, codec.encode_tensor(x, ctx_for(x, role))


@pytest.mark.parametrize("name", ["fp8-e4m3", "nvfp4", "kivi-4"])
def test_bad_planes_raise_format_error(name):
    x = torch.randn(6, 2, 20)
    ctx = ctx_for(x)
    codec, enc = _enc(name, x)
    # missing plane
    for p in enc.planes:
        planes = {k: v for k, v in enc.planes.items() if k != p}
        with pytest.raises(FormatError, match=p):
            codec.decode_tensor(EncodedTensor(planes, enc.params), ctx)
    # wrong size / dtype of each plane
    for p, a in enc.planes.items():
        for bad in (a.reshape(-1)[:-1], a.astype(np.int64)):
            planes = dict(enc.planes, **{p: bad})
            with pytest.raises(FormatError):
                codec.decode_tensor(EncodedTensor(planes, enc.params), ctx)
    # bad params
    for k in enc.params:
        for v in (None, -1, "x"):
            with pytest.raises(FormatError):
                codec.decode_tensor(EncodedTensor(enc.planes, dict(enc.params, **{k: v})), ctx)


def test_bad_scale_values_raise_format_error():
    x = torch.randn(6, 2, 16)
    codec, enc = _enc("fp8-e4m3", x)
    for v in (0.0, -1.0, np.nan, np.inf):
        s = enc.planes["scale"].copy()
        s.reshape(-1)[0] = v
        with pytest.raises(FormatError, match="scale"):
            codec.decode_tensor(EncodedTensor(dict(enc.planes, scale=s), enc.params), ctx_for(x))
    codec, enc = _enc("nvfp4", x)
    for name, val in (("block_scale", 0x7F), ("block_scale", 0x85), ("tensor_scale", 0.0)):
        a = enc.planes[name].copy()
        a.reshape(-1)[0] = val
        with pytest.raises(FormatError, match="scale"):
            codec.decode_tensor(EncodedTensor(dict(enc.planes, **{name: a}), enc.params), ctx_for(x))
    codec, enc = _enc("kivi-4", x)
    z = enc.planes["zero"].copy()
    z.reshape(-1)[0] = np.inf
    with pytest.raises(FormatError, match="finite"):
        codec.decode_tensor(EncodedTensor(dict(enc.planes, zero=z), enc.params), ctx_for(x))
    # a stray recent plane when params say none
    stray = dict(enc.planes, recent=np.zeros((1, 2, 16), np.int32))
    with pytest.raises(FormatError, match="recent"):
        codec.decode_tensor(EncodedTensor(stray, enc.params), ctx_for(x))
