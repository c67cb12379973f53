"""FP8 E4M3FN / E5M2 (and E2M1 grid) reference quantizer: codes, ties, edges, scales, bounds."""

import doctest

import pytest
import torch

import kvcodec.quant.fp8 as fp8mod
from kvcodec.errors import ConfigError, InputError
from kvcodec.quant.fp8 import (
    F4E2M1,
    F8E4M3,
    F8E5M2,
    all_codes_values,
    fp8_decode_reference,
    fp8_encode_reference,
    minifloat_decode,
    minifloat_encode,
    scale_shape,
)
from kvcodec.testing import (
    FORMAT_EDGES,
    FORMATS,
    NONFINITE,
    SHAPES,
    SOURCE_DTYPES,
    SPECIAL_VALUES,
    rounding_ties,
    value_cases,
)

TORCH_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
REL_BOUND = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}


def test_doctests():
    assert doctest.testmod(fp8mod).failed == 0


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_all_256_codes_decode_like_the_format_definition(fmt):
    f = FORMATS[fmt]
    ours = all_codes_values(f)
    lib = torch.arange(256, dtype=torch.uint8).view(TORCH_FP8[fmt]).float()
    assert torch.equal(ours.isnan(), lib.isnan())
    fin = ~ours.isnan()
    assert torch.equal(ours[fin], lib[fin])
    # and the signs of zeros and infinities bit for bit
    assert torch.equal(ours[fin].view(torch.int32), lib[fin].view(torch.int32))


def test_named_codes_from_anchors():
    e4 = all_codes_values(F8E4M3)
    assert e4[0x7E] == 448 and e4[0x08] == 2.0**-6 and e4[0x01] == 2.0**-9 and e4[0x38] == 1.0
    assert e4[0x7F].isnan() and e4[0xFF].isnan() and torch.isfinite(e4[0x7E])
    assert torch.signbit(e4[0x80]) and e4[0x80] == 0
    e5 = all_codes_values(F8E5M2)
    assert e5[0x7B] == 57344 and e5[0x3C] == 1.0 and e5[0x7C] == float("inf") and e5[0xFC] == float("-inf")
    assert all(bool(e5[c].isnan()) for c in (0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF))
    e2 = all_codes_values(F4E2M1)
    assert e2[:8].tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    assert e2[8:].tolist() == [-0.0, -0.5, -1, -1.5, -2, -3, -4, -6] and torch.signbit(e2[8])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_every_finite_code_encodes_to_itself(fmt):
    f = FORMATS[fmt]
    vals = all_codes_values(f)
    fin = torch.isfinite(vals)
    codes = torch.arange(2 * f.sign_bit, dtype=torch.uint8)[fin]
    assert torch.equal(minifloat_encode(vals[fin], f), codes)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_every_rounding_tie_goes_to_even(fmt):
    ties, codes = rounding_ties(fmt)
    assert torch.equal(minifloat_encode(ties, FORMATS[fmt]), codes)
    # just off the tie, rounding goes to the nearer neighbour
    up = torch.nextafter(ties, ties * 2)
    dn = torch.nextafter(ties, torch.zeros_like(ties))
    f = FORMATS[fmt]
    k = ties.numel() // 2
    lo = torch.arange(k, dtype=torch.int32).repeat(2)  # tie i lies between codes i and i+1
    assert torch.equal(minifloat_encode(up, f).to(torch.int32) & (f.sign_bit - 1), lo + 1)
    assert torch.equal(minifloat_encode(dn, f).to(torch.int32) & (f.sign_bit - 1), lo)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_ties_agree_with_torch_casts(fmt):
    ties, codes = rounding_ties(fmt)
    assert torch.equal(ties.to(TORCH_FP8[fmt]).view(torch.uint8), codes)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_agrees_with_torch_cast_inside_the_range(fmt):
    """Inside +-max (subnormals included) our codes equal torch's RNE cast bit for bit."""
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(1)
    n = 200_000
    y = (torch.rand(n, generator=g) * 2 - 1) * f.max
    y = y * torch.pow(2.0, -torch.randint(0, 28, (n,), generator=g).float())
    assert torch.equal(minifloat_encode(y, f), y.to(TORCH_FP8[fmt]).view(torch.uint8))


def test_where_torch_casts_differ_overflow():
    """Documented difference: beyond max we saturate; torch's E5M2 cast gives inf past the
    overflow midpoint (torch 2.x E4M3FN casts saturate now, older eager casts gave NaN)."""
    big = torch.tensor([61440.0, 1e6])
    assert minifloat_encode(big, F8E5M2).tolist() == [0x7B, 0x7B]
    assert big.to(torch.float8_e5m2).float().isinf().all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_format_edge_table(fmt):
    f = FORMATS[fmt]
    for name, (value, code) in FORMAT_EDGES[fmt].items():
        got = minifloat_encode(torch.tensor([value, -value]), f).tolist()
        assert got == [code, code | f.sign_bit], (fmt, name, value, got)


def test_signed_zero_and_negative_underflow():
    x = torch.tensor([0.0, -0.0, -(2.0**-12)])
    assert minifloat_encode(x, F8E4M3).tolist() == [0x00, 0x80, 0x80]
    assert minifloat_encode(x, F8E5M2).tolist() == [0x00, 0x80, 0x8C]
    codes, scale = fp8_encode_reference(torch.tensor([[[-0.0, 0.0]]]), "e4m3", "tensor")
    assert codes.flatten().tolist() == [0x80, 0x00] and scale.item() == 1.0
    out = fp8_decode_reference(codes, scale, "e4m3")
    assert torch.signbit(out.flatten()).tolist() == [True, False]


@pytest.mark.parametrize("name", NONFINITE)
def test_nonfinite_input_rejected(name):
    x = torch.zeros(2, 1, 4)
    x[1, 0, 2] = SPECIAL_VALUES[name]
    with pytest.raises(InputError, match="NaN or Inf"):
        fp8_encode_reference(x, "e4m3")
    with pytest.raises(InputError, match="NaN or Inf"):
        minifloat_encode(x, F8E5M2)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="unknown fp8 format"):
        fp8_encode_reference(torch.zeros(1, 1, 1), "e4m3fnuz")
    with pytest.raises(ConfigError, match="granularity"):
        fp8_encode_reference(torch.zeros(1, 1, 1), "e4m3", "row")
    with pytest.raises(ConfigError, match="block"):
        fp8_encode_reference(torch.zeros(1, 1, 1), "e4m3", "block", 0)
    with pytest.raises(InputError, match=r"\[T, H, D\]"):
        fp8_encode_reference(torch.zeros(4, 4), "e4m3")


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_relative_error_bound_in_normal_range(fmt):
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(2)
    # one scale (tensor): values spread over the whole normal range of the scaled format
    n = 100_000
    lo, hi = torch.log2(torch.tensor(f.min_normal)), torch.log2(torch.tensor(f.max))
    e = lo + torch.rand(n, generator=g) * (hi - lo)
    x = (torch.pow(2.0, e) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)).reshape(n, 1, 1)
    x[0, 0, 0] = f.max  # scale exactly 1
    codes, scale = fp8_encode_reference(x, fmt, "tensor")
    assert scale.item() == 1.0
    rel = ((fp8_decode_reference(codes, scale, fmt) - x).abs() / x.abs()).max().item()
    assert rel <= REL_BOUND[fmt], (fmt, rel)
    # the worst case u/(1+u) (a tie just above a power of two) is reached: the bound is tight
    u = REL_BOUND[fmt]
    assert rel >= u / (1 + u) * 0.999


@pytest.mark.parametrize("granularity", ["tensor", "head", "channel", "token", "block"])
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_granularity_scale_shapes_and_amax_maps_to_max(granularity, shape_name):
    shape = SHAPES[shape_name]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g) * 5
    codes, scale = fp8_encode_reference(x, "e4m3", granularity, block=8)
    assert tuple(scale.shape) == scale_shape(shape, granularity, 8) and scale.dtype == torch.float32
    assert codes.shape == x.shape and codes.dtype == torch.uint8
    if x.numel():
        # every group's |max| element gets the max code 0x7E (saturation never over-shoots)
        mag = codes & 0x7F
        assert mag.max().item() == 0x7E
        assert not bool((mag == 0x7F).any())
    out = fp8_decode_reference(codes, scale, "e4m3", block=8)
    big = fp8mod.expand_scale(scale, shape, 8) * F8E4M3.min_normal
    err = (out - x).abs()
    assert bool((err <= x.abs() * 2.0**-4 * (1 + 1e-6) + big).all())


def test_block_granularity_partial_last_block():
    x = torch.zeros(1, 1, 10)
    x[0, 0, :8] = 1.0
    x[0, 0, 8:] = 100.0  # the last block (2 elements) has its own scale
    codes, scale = fp8_encode_reference(x, "e4m3", "block", block=8)
    assert scale.shape == (1, 1, 2)
    assert scale[0, 0].tolist() == pytest.approx([1 / 448, 100 / 448])
    assert torch.equal(fp8_decode_reference(codes, scale, "e4m3", block=8), x)


def test_all_zero_group_has_unit_scale_and_zero_codes():
    x = torch.zeros(3, 2, 4)
    x[:, 1] = torch.randn(3, 4)
    codes, scale = fp8_encode_reference(x, "e5m2", "head")
    assert scale[0, 0, 0].item() == 1.0 and not bool(codes[:, 0].any())


@pytest.mark.parametrize("dtype", SOURCE_DTYPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_value_cases_roundtrip_within_bounds(dtype, fmt):
    f = FORMATS[fmt]
    for name, x in value_cases(dtype).items():
        for gran in ("tensor", "channel", "token"):
            codes, scale = fp8_encode_reference(x, fmt, gran)
            out = fp8_decode_reference(codes, scale, fmt, dtype)
            assert out.dtype == dtype and out.shape == x.shape
            assert bool(torch.isfinite(out).all()), (name, gran)
            # signs survive (zero and -0 included, except values that underflow to zero)
            xf, of = x.float(), out.float()
            same_sign = torch.signbit(xf) == torch.signbit(of)
            assert bool(same_sign.all()), (name, gran)
            # bound: FP8 rounding + subnormal floor of the group + the cast back to the source
            floor = fp8mod.expand_scale(scale, tuple(x.shape), 32) * f.min_subnormal / 2
            cast = torch.finfo(dtype).eps
            bound = xf.abs() * (REL_BOUND[fmt] * (1 + cast) + cast) + floor * (1 + cast)
            bound += torch.finfo(dtype).smallest_normal * cast  # subnormal casts of the source
            assert bool(((of - xf).abs() <= bound).all()), (name, gran, dtype)


def test_source_max_does_not_overflow():
    for dtype in SOURCE_DTYPES:
        x = torch.tensor([[[torch.finfo(dtype).max, -torch.finfo(dtype).max, 1.0]]], dtype=dtype)
        codes, scale = fp8_encode_reference(x, "e4m3", "tensor")
        out = fp8_decode_reference(codes, scale, "e4m3", dtype)
        assert bool(torch.isfinite(out).all()) and out[0, 0, 0] == x[0, 0, 0], dtype


def test_minifloat_decode_keeps_shape():
    c = torch.randint(0, 256, (3, 4, 5), dtype=torch.uint8)
    assert minifloat_decode(c, F8E4M3).shape == (3, 4, 5)


# --------------------------------------------------------------------------- fast path
from kvcodec.quant import fast  # noqa: E402


from kvcodec.testing import bits_equal  # noqa: E402


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_fast_minifloat_encode_is_bit_exact(fmt):
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(8)
    vals = all_codes_values(f)
    ties, _ = rounding_ties(fmt)
    y = torch.cat([
        vals[torch.isfinite(vals)], ties, torch.nextafter(ties, ties * 2), torch.nextafter(ties, 0 * ties),
        torch.tensor([0.0, -0.0, 2.0**-149, -(2.0**-149), 2.0**-126, 1e30, -1e30, f.max * 1.01]),
        torch.randn(50_000, generator=g) * torch.pow(2.0, torch.randint(-20, 20, (50_000,), generator=g).float()),
    ])
    assert torch.equal(torch.from_numpy(fast.minifloat_encode_np(y.numpy(), f)), minifloat_encode(y, f))


@pytest.mark.parametrize("dtype", SOURCE_DTYPES)
def test_fast_fp8_is_bit_exact_on_the_edge_table(dtype):
    for shape_name in ("T0", "T1", "odd_head_dim", "D17"):
        shape = SHAPES[shape_name]
        cases = value_cases(dtype, shape) if shape[0] else {"empty": torch.zeros(shape, dtype=dtype)}
        for case, x in cases.items():
            for fmt in ("e4m3", "e5m2"):
                for gran in ("tensor", "head", "channel", "token", "block"):
                    ref = fp8_encode_reference(x, fmt, gran, 8)
                    got = fast.fp8_encode_fast(x, fmt, gran, 8)
                    assert bits_equal(ref[0], got[0]) and bits_equal(ref[1], got[1]), (shape_name, case, fmt, gran)
                    assert bits_equal(fp8_decode_reference(*ref, fmt, dtype, 8),
                                      fast.fp8_decode_fast(*ref, fmt, dtype, 8)), (shape_name, case, fmt, gran)


def test_fast_fp8_rejects_what_the_reference_rejects():
    x = torch.zeros(2, 1, 4)
    x[0, 0, 0] = float("inf")
    with pytest.raises(InputError, match="NaN or Inf"):
        fast.fp8_encode_fast(x)
    with pytest.raises(ConfigError):
        fast.fp8_encode_fast(torch.zeros(1, 1, 1), "e4m3", "row")
    with pytest.raises(InputError):
        fast.fp8_encode_fast(torch.zeros(3, 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dtype_bridges_match_torch_casts(dtype):
    g = torch.Generator().manual_seed(9)
    y = torch.randn(100_000, generator=g) * torch.pow(2.0, torch.randint(-140, 120, (100_000,), generator=g).float())
    y = torch.cat([y, torch.tensor([0.0, -0.0, 65504.0, 65519.0, 65520.0, 3.3895e38, -3.3896e38])])
    y = y[torch.isfinite(y)]
    assert bits_equal(fast.from_f32_numpy(y.numpy(), dtype), y.to(dtype))
    x = y.to(dtype)
    x = x[torch.isfinite(x)]
    assert bits_equal(torch.from_numpy(fast.to_f32_numpy(x).copy()), x.float())


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e2m1"])
def test_encode_matches_a_brute_force_nearest_even_oracle(fmt):
    """Independent oracle: the nearest of all grid values by exhaustive search (float64),
    ties to the even code, after clamping to +-max; the sign copied from the input."""
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(12)
    n = 4000
    y = (torch.rand(n, generator=g) * 2 - 1) * f.max * 1.2
    y = y * torch.pow(2.0, -torch.randint(0, 2 * f.bias + f.mbits + 4, (n,), generator=g).float())
    y = torch.cat([y, rounding_ties(fmt)[0], torch.tensor([0.0, -0.0, f.max * 4, -f.max * 4])])
    grid = all_codes_values(f)[: f.sign_bit].double()  # non-negative codes 0.. (NaN/inf last)
    fin = torch.isfinite(grid)
    a = y.double().abs().clamp(max=f.max)
    dist = (a[:, None] - grid[None, :]).abs()
    dist[:, ~fin] = float("inf")
    best = dist.min(dim=1, keepdim=True).values
    cand = dist == best  # one or two (a tie) nearest codes
    codes = torch.arange(grid.numel())
    even_pref = torch.where(cand & (codes % 2 == 0), 0, torch.where(cand, 1, 2))
    expect = even_pref.argmin(dim=1)  # the even code among the nearest, else the only one
    expect = torch.where(torch.signbit(y), expect | f.sign_bit, expect).to(torch.uint8)
    assert torch.equal(minifloat_encode(y, f), expect)
