"""Integer asymmetric (KIVI-style) reference quantizer: groups, axes, rounding, bounds, edges."""

import doctest

import pytest
import torch

import kvcodec.quant.intq as intqmod
from kvcodec.errors import ConfigError, InputError
from kvcodec.quant.intq import (
    IntQTensor,
    expand_params,
    intq_dequantize_reference,
    intq_param_shape,
    intq_quantize_reference,
)
from kvcodec.testing import NONFINITE, SHAPES, SOURCE_DTYPES, SPECIAL_VALUES, value_cases


def test_doctests():
    assert doctest.testmod(intqmod).failed == 0


def bound(q: IntQTensor, shape) -> torch.Tensor:
    """Half a step plus the fp16 rounding of scale and zero (module docstring)."""
    s = expand_params(q.scale.float(), shape, q.axis, q.group)
    z = expand_params(q.zero.float(), shape, q.axis, q.group)
    return s / 2 + s * 2.0**q.bits * 2.0**-10 + z.abs() * 2.0**-10 + 2.0**-24


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_error_bound_all_bit_widths(bits, axis):
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(45, 3, 40, generator=g) + 4 * torch.randn(1, 3, 40, generator=g)
    q = intq_quantize_reference(x, bits, axis, group=16)
    assert q.codes.dtype == torch.uint8 and int(q.codes.max()) <= 2**bits - 1
    out = intq_dequantize_reference(q)
    assert bool(((out - x).abs() <= bound(q, x.shape)).all()), (bits, axis)
    # the extreme levels are used: min-max quantization reaches both ends of every group
    assert int(q.codes.min()) == 0 and int(q.codes.max()) == 2**bits - 1


@pytest.mark.parametrize("shape_name", list(SHAPES))
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_param_shapes(shape_name, axis):
    shape = SHAPES[shape_name]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    q = intq_quantize_reference(x, 3, axis, group=4)
    t, h, d = shape
    expect = (-(-t // 4), h, d) if axis == "channel" else (t, h, -(-d // 4))
    assert tuple(q.scale.shape) == expect == intq_param_shape(shape, axis, 4)
    assert q.scale.dtype == q.zero.dtype == torch.float16
    assert intq_dequantize_reference(q).shape == shape


def test_groups_are_independent():
    """K per channel: each group of tokens has its own min/max; V per token likewise per channels."""
    x = torch.zeros(8, 1, 2)
    x[:4, 0, 0] = torch.tensor([0.0, 1.0, 2.0, 3.0])
    x[4:, 0, 0] = torch.tensor([100.0, 110.0, 120.0, 130.0])
    x[:, 0, 1] = -1.0  # constant channel: scale 0, codes 0, exact
    q = intq_quantize_reference(x, 2, "channel", group=4)
    assert q.zero[:, 0, 0].tolist() == [0.0, 100.0]
    assert q.scale[:, 0, 0].tolist() == [1.0, 10.0]
    assert q.scale[:, 0, 1].tolist() == [0.0, 0.0]
    assert torch.equal(intq_dequantize_reference(q), x)


def test_rounding_is_half_to_even():
    # range [0, 3] with 2 bits -> step 1; 0.5 -> 0, 1.5 -> 2, 2.5 -> 2
    x = torch.tensor([0.0, 0.5, 1.5, 2.5, 3.0]).reshape(1, 1, 5)
    q = intq_quantize_reference(x, 2, "token", group=5)
    assert q.codes.flatten().tolist() == [0, 0, 2, 2, 3]


def test_decode_is_multiply_then_add_in_fp32():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(33, 2, 24, generator=g)
    q = intq_quantize_reference(x, 4, "channel", group=8)
    s = expand_params(q.scale.float(), x.shape, "channel", 8)
    z = expand_params(q.zero.float(), x.shape, "channel", 8)
    expect = q.codes.float() * s + z
    assert torch.equal(intq_dequantize_reference(q).view(torch.int32), expect.view(torch.int32))


@pytest.mark.parametrize("dtype", SOURCE_DTYPES)
@pytest.mark.parametrize("axis", ["channel", "token"])
def test_value_cases(dtype, axis):
    for name, x in value_cases(dtype).items():
        if name == "source_max" and dtype != torch.float16:
            with pytest.raises(InputError, match="float16"):
                intq_quantize_reference(x, 4, axis, 4)
            continue
        q = intq_quantize_reference(x, 4, axis, 4)
        out = intq_dequantize_reference(q, dtype)
        assert out.dtype == dtype and bool(torch.isfinite(out).all()), name
        cast = x.float().abs() * torch.finfo(dtype).eps + torch.finfo(dtype).smallest_normal
        err = (out.float() - x.float()).abs()
        assert bool((err <= bound(q, x.shape) + cast).all()), (name, dtype, axis)
        if name in ("all_zero", "all_neg_zero", "constant"):  # constant groups are exact
            assert torch.equal(out.float(), x.float()), name


def test_empty_and_single_token():
    for t in (0, 1):
        x = torch.randn(t, 2, 5)
        for axis in ("channel", "token"):
            q = intq_quantize_reference(x, 2, axis, 32)
            out = intq_dequantize_reference(q)
            assert out.shape == x.shape
            if t == 1 and axis == "channel":  # one token per group: min == max, exact in fp16
                assert torch.equal(out, x.half().float())


@pytest.mark.parametrize("name", NONFINITE)
def test_nonfinite_rejected(name):
    x = torch.zeros(2, 1, 3)
    x[0, 0, 1] = SPECIAL_VALUES[name]
    with pytest.raises(InputError, match="NaN or Inf"):
        intq_quantize_reference(x, 4, "token", 2)


def test_bad_params():
    x = torch.zeros(2, 1, 3)
    for bits in (0, 9, 2.0, True):
        with pytest.raises(ConfigError, match="bits"):
            intq_quantize_reference(x, bits, "token", 2)
    with pytest.raises(ConfigError, match="axis"):
        intq_quantize_reference(x, 4, "head", 2)
    with pytest.raises(ConfigError, match="group"):
        intq_quantize_reference(x, 4, "token", 0)
    with pytest.raises(InputError, match=r"\[T, H, D\]"):
        intq_quantize_reference(torch.zeros(3, 3), 4, "token", 2)


def test_range_overflowing_fp16_scale_rejected():
    x = torch.tensor([-60000.0, 60000.0]).reshape(1, 1, 2)
    with pytest.raises(InputError, match="float16"):
        intq_quantize_reference(x, 1, "token", 2)  # scale 120000 > 65504


def test_fp16_top_level_saturates_instead_of_inf():
    """scale16 = fp16(131008/15) = 8736 rounds up, so 15*8736 - 65504 = 65536 > 65504: the decode
    clamps to the source range instead of returning inf."""
    x = torch.tensor([-65504.0, 65504.0], dtype=torch.float16).reshape(1, 1, 2)
    q = intq_quantize_reference(x, 4, "token", 2)
    assert q.scale.item() == 8736.0
    assert intq_quantize_reference(x, 4, "token", 2).codes.flatten().tolist() == [0, 15]
    assert intq_dequantize_reference(q, torch.float16).flatten().tolist() == [-65504.0, 65504.0]
    assert intq_dequantize_reference(q, torch.float32).flatten().tolist() == [-65504.0, 65536.0]


# --------------------------------------------------------------------------- fast path
from kvcodec.quant import fast  # noqa: E402


from kvcodec.testing import bits_equal as _bits_equal  # noqa: E402


@pytest.mark.parametrize("dtype", SOURCE_DTYPES)
def test_fast_intq_is_bit_exact(dtype):
    g = torch.Generator().manual_seed(11)
    inputs = [(n, x) for s in ("T0", "T1", "odd_head_dim", "D17", "non_pow2")
              for n, x in (value_cases(dtype, SHAPES[s]) if SHAPES[s][0]
                           else {"empty": torch.zeros(SHAPES[s], dtype=dtype)}).items()]
    inputs.append(("random", (torch.randn(70, 3, 64, generator=g) + 5 * torch.randn(1, 3, 64, generator=g)).to(dtype)))
    for name, x in inputs:
        for bits, axis, group in ((1, "channel", 32), (3, "token", 4), (4, "channel", 7), (8, "token", 32)):
            try:
                ref = intq_quantize_reference(x, bits, axis, group)
            except InputError:
                with pytest.raises(InputError):
                    fast.intq_quantize_fast(x, bits, axis, group)
                continue
            got = fast.intq_quantize_fast(x, bits, axis, group)
            assert ref[3:] == got[3:]
            for a, b in zip(ref[:3], got[:3]):
                assert _bits_equal(a, b), (name, bits, axis)
            assert _bits_equal(intq_dequantize_reference(ref, dtype), fast.intq_dequantize_fast(ref, dtype)), name


def test_signed_zero_min_is_normalised():
    x = torch.tensor([-0.0, 0.0, -0.0]).reshape(1, 1, 3)
    for q in (intq_quantize_reference(x, 2, "token", 3), fast.intq_quantize_fast(x, 2, "token", 3)):
        assert not torch.signbit(q.zero).any() and not torch.signbit(q.scale).any()


def test_huge_declared_group_decodes_without_overallocation():
    """A file may declare any group; one at least as long as the axis is a single group, and
    decoding must not allocate group-proportional memory (found by eval/fuzz_format.py)."""
    import tracemalloc

    from kvcodec.quant import intq_dequantize_reference, intq_quantize_reference
    from kvcodec.quant.fast import intq_dequantize_fast

    x = torch.randn(5, 2, 8, generator=torch.Generator().manual_seed(3))
    for axis in ("channel", "token"):
        small = intq_quantize_reference(x, 4, axis, 8)
        huge = small._replace(group=2**40)
        tracemalloc.start()
        a = intq_dequantize_fast(huge)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 1 << 20
        assert torch.equal(a, intq_dequantize_fast(small))
        assert torch.equal(intq_dequantize_reference(huge), intq_dequantize_reference(small))
