"""NVFP4 reference quantizer: golden block, nibble order, scales, padding, edges, bounds."""

import doctest

import pytest
import torch

import kvcodec.quant.nvfp4 as nvmod
from kvcodec.errors import InputError
from kvcodec.quant.fp8 import F4E2M1, F8E4M3, all_codes_values, minifloat_decode
from kvcodec.quant.nvfp4 import (
    NVFP4Tensor,
    nvfp4_dequantize_reference,
    nvfp4_quantize_reference,
    pack_nibbles,
    unpack_nibbles,
)
from kvcodec.testing import NONFINITE, SHAPES, SOURCE_DTYPES, SPECIAL_VALUES, value_cases

GOLDEN = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -.25, -.5, -1, -1.5, -2, -3, -4, -6])


def test_doctests():
    assert doctest.testmod(nvmod).failed == 0


def test_golden_block_byte_for_byte():
    q = nvfp4_quantize_reference(3 * GOLDEN, tensor_scale=1.0)
    assert q.block_scale.tolist() == [0x44]  # E4M3 3.0
    assert bytes(q.codes.tolist()) == bytes.fromhex("10 32 54 76 98 ba dc fe")
    assert q.pad == 0 and q.tensor_scale.tolist() == [1.0]
    # -0.75 / 3 = -0.25 is a tie between -0 and -0.5: to even, -0 (code 0x8)
    assert unpack_nibbles(q.codes).tolist() == list(range(16))


def test_golden_block_with_default_tensor_scale():
    """With the default tensor scale (18/2688) the codes are the same and the block scale is 448."""
    q = nvfp4_quantize_reference(3 * GOLDEN)
    assert q.tensor_scale.item() == pytest.approx(18 / 2688)
    assert q.block_scale.tolist() == [0x7E]
    assert bytes(q.codes.tolist()) == bytes.fromhex("10 32 54 76 98 ba dc fe")


def test_nibble_order_low_is_even():
    c = torch.tensor([[0x1, 0xF, 0x7, 0x8]], dtype=torch.uint8)
    assert pack_nibbles(c).tolist() == [[0xF1, 0x87]]
    assert torch.equal(unpack_nibbles(pack_nibbles(c)), c)
    allc = torch.arange(256, dtype=torch.int32)
    pairs = torch.stack([allc & 15, allc >> 4], -1).to(torch.uint8)
    assert torch.equal(pack_nibbles(pairs).flatten(), allc.to(torch.uint8))


def test_all_16_e2m1_values_roundtrip_with_unit_scales():
    vals = all_codes_values(F4E2M1)  # index = code
    # block amax 6 -> block scale 1.0 with tensor scale 1.0
    q = nvfp4_quantize_reference(vals, tensor_scale=1.0)
    assert q.block_scale.tolist() == [0x38]
    assert unpack_nibbles(q.codes).tolist() == list(range(16))
    out = nvfp4_dequantize_reference(q)
    assert torch.equal(out.view(torch.int32), vals.view(torch.int32))  # -0 kept


def test_block_scale_formula_and_clamp():
    ts = 1.0
    x = torch.zeros(4, 16)
    x[0, 0] = 6 * 2.5  # block amax/6 = 2.5, exact in E4M3
    x[1, 0] = 6 * 1000  # 1000 > 448: clamped to 448
    x[2, 0] = 6 * 2.0**-9  # below 2^-6: clamped to 2^-6
    # row 3 all zero: scale clamps to 2^-6, codes zero
    q = nvfp4_quantize_reference(x, tensor_scale=ts)
    bs = minifloat_decode(q.block_scale, F8E4M3).flatten().tolist()
    assert bs == [2.5, 448.0, 2.0**-6, 2.0**-6]
    assert not bool(unpack_nibbles(q.codes)[3].any())


def test_block_scale_rounds_to_nearest_even_e4m3():
    # block amax / 6 = 1.0625: tie between 1.0 (0x38) and 1.125 (0x39) -> 0x38
    # block amax / 6 = 1.1875: tie between 1.125 (0x39) and 1.25 (0x3A) -> 0x3A
    x = torch.zeros(2, 16)
    x[0, 0] = 6 * 1.0625
    x[1, 0] = 6 * 1.1875
    q = nvfp4_quantize_reference(x, tensor_scale=1.0)
    assert q.block_scale.flatten().tolist() == [0x38, 0x3A]


def test_e2m1_ties_to_even_inside_a_block():
    x = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25, 0, 0, 0, 0, 0, 0])
    q = nvfp4_quantize_reference(x, tensor_scale=1.0)  # block scale 1.0
    assert q.block_scale.tolist() == [0x38]
    assert unpack_nibbles(q.codes).tolist()[:10] == [7, 0, 2, 2, 4, 4, 6, 6, 14, 8]


@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_shapes_padding_and_layout(shape_name):
    t, h, d = SHAPES[shape_name]
    x = torch.randn(t, h, d, generator=torch.Generator().manual_seed(4))
    q = nvfp4_quantize_reference(x)
    dp = -(-d // 16) * 16
    assert q.pad == dp - d
    assert q.codes.shape == (t, h, dp // 2) and q.codes.dtype == torch.uint8
    assert q.block_scale.shape == (t, h, dp // 16) and q.block_scale.dtype == torch.uint8
    assert q.tensor_scale.shape == (1,) and q.tensor_scale.dtype == torch.float32
    if q.pad:  # padding is +0 (code 0) in every row
        assert not bool(unpack_nibbles(q.codes)[..., d:].any())
    out = nvfp4_dequantize_reference(q)
    assert out.shape == x.shape


def test_error_bound_per_block():
    """|err| <= half an E2M1 step at the block's scale: 0.25*s below 2, 0.5*s below 4, s above."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 4, 64, generator=g) * torch.pow(10.0, torch.randn(64, 4, 1, generator=g))
    q = nvfp4_quantize_reference(x)
    out = nvfp4_dequantize_reference(q)
    s = (minifloat_decode(q.block_scale, F8E4M3) * q.tensor_scale).repeat_interleave(16, dim=-1)
    y = (x / s).abs()
    half_step = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0)) * s
    assert bool(((out - x).abs() <= half_step * (1 + 1e-5)).all())
    # scaled values never exceed the grid (block scale rounding can only push them to <= 6 * (1+2^-4))
    assert float(y.max()) <= 6 * (1 + 2.0**-4)


@pytest.mark.parametrize("dtype", SOURCE_DTYPES)
def test_value_cases(dtype):
    for name, x in value_cases(dtype).items():
        q = nvfp4_quantize_reference(x)
        out = nvfp4_dequantize_reference(q, dtype)
        assert out.dtype == dtype and out.shape == x.shape
        assert bool(torch.isfinite(out).all()), name
        xf, of = x.float(), out.float()
        if name in ("all_zero", "all_neg_zero"):
            assert torch.equal(torch.signbit(of), torch.signbit(xf)) and not bool(of.any()), name
            assert q.tensor_scale.item() == 1.0
        if name in ("constant", "one_nonzero"):  # amax maps exactly onto 6 * 448 * ts
            assert torch.allclose(of, xf, rtol=2**-7, atol=0), name
        # relative error of the tensor's max element is small (block scale fits it)
        if float(xf.abs().max()) < 2.0**-126 * 2688:
            # the tensor scale is floored at 2^-126 (fp32 subnormal sources): the error stays
            # below the signal itself
            assert float((of - xf).abs().max()) <= float(xf.abs().max()), name
        elif bool(xf.any()):
            i = xf.abs().argmax()
            rel = (of.flatten()[i] - xf.flatten()[i]).abs() / xf.flatten()[i].abs()
            assert rel <= 2.0**-3 + 2.0**-7, (name, rel.item())


@pytest.mark.parametrize("name", NONFINITE)
def test_nonfinite_rejected(name):
    x = torch.zeros(1, 1, 16)
    x[0, 0, 5] = SPECIAL_VALUES[name]
    with pytest.raises(InputError, match="NaN or Inf"):
        nvfp4_quantize_reference(x)


def test_bad_arguments():
    with pytest.raises(InputError, match="tensor_scale"):
        nvfp4_quantize_reference(torch.ones(16), tensor_scale=0.0)
    with pytest.raises(InputError, match="dimension"):
        nvfp4_quantize_reference(torch.tensor(1.0))


def test_decode_multiplies_in_the_documented_order():
    """Decode = (e2m1 * block_scale) * tensor_scale in fp32: checked against explicit arithmetic."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 2, 32, generator=g)
    q = nvfp4_quantize_reference(x)
    e2 = minifloat_decode(unpack_nibbles(q.codes), F4E2M1)
    bs = minifloat_decode(q.block_scale, F8E4M3).repeat_interleave(16, dim=-1)
    expect = (e2 * bs) * q.tensor_scale[0]
    assert torch.equal(nvfp4_dequantize_reference(q).view(torch.int32), expect.view(torch.int32))
    assert isinstance(q, NVFP4Tensor)


# --------------------------------------------------------------------------- fast path
from kvcodec.quant import fast  # noqa: E402


from kvcodec.testing import bits_equal as _bits_equal  # noqa: E402


@pytest.mark.parametrize("dtype", SOURCE_DTYPES)
def test_fast_nvfp4_is_bit_exact(dtype):
    g = torch.Generator().manual_seed(10)
    inputs = [(n, x) for s in ("T0", "T1", "odd_head_dim", "D17", "non_pow2")
              for n, x in (value_cases(dtype, SHAPES[s]) if SHAPES[s][0]
                           else {"empty": torch.zeros(SHAPES[s], dtype=dtype)}).items()]
    inputs.append(("random", (torch.randn(40, 3, 64, generator=g)
                              * torch.pow(10.0, torch.randn(40, 3, 1, generator=g))).to(dtype)))
    inputs.append(("golden", (3 * GOLDEN).to(dtype)))
    for name, x in inputs:
        for ts in (None, 1.0):
            ref = nvfp4_quantize_reference(x, ts)
            got = fast.nvfp4_quantize_fast(x, ts)
            assert ref.pad == got.pad, name
            for a, b in zip(ref[:3], got[:3]):
                assert _bits_equal(a, b), (name, ts)
            assert _bits_equal(nvfp4_dequantize_reference(ref, dtype), fast.nvfp4_dequantize_fast(ref, dtype)), name


def test_fast_nvfp4_rejects_what_the_reference_rejects():
    with pytest.raises(InputError, match="NaN or Inf"):
        fast.nvfp4_quantize_fast(torch.tensor([1.0, float("nan")]))
    with pytest.raises(InputError, match="tensor_scale"):
        fast.nvfp4_quantize_fast(torch.ones(16), tensor_scale=-1.0)
    with pytest.raises(InputError, match="dimension"):
        fast.nvfp4_quantize_fast(torch.tensor(1.0))
