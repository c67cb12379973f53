"""FP8 (E4M3FN, E5M2) and other small floating-point formats: the reference quantizer.

Everything here is written in plain integer/float torch arithmetic so that it *is* the
definition; it does not call torch's ``float8`` casts (tests compare against them where they
agree). The formats (see ANCHORS.md and formats/SPEC.md):

========  ====  ====  ==========  ==========================================================
format    bias  max   min normal  special codes
========  ====  ====  ==========  ==========================================================
E4M3FN    7     448   2^-6        no infinities; NaN = 0x7F / 0xFF; max = 0x7E; -0 = 0x80
E5M2      15    57344 2^-14       inf = 0x7C / 0xFC; NaN = 0x7D-0x7F / 0xFD-0xFF; max 0x7B
E2M1      1     6     1           no inf, no NaN (FP4, used by NVFP4); -0 = 0x8
========  ====  ====  ==========  ==========================================================

Encoding an already-scaled float32 value ``y`` (:func:`minifloat_encode`):

1. NaN or +-Inf input raises :class:`~kvcodec.errors.InputError` (library casts disagree on them:
   older torch eager casts and ml_dtypes give NaN on overflow, PTX ``satfinite`` saturates).
2. ``|y|`` is clamped to the format's max (saturation, never NaN or inf).
3. ``|y|`` is rounded to the nearest representable value, ties to the even code
   (round-to-nearest-even), subnormals included.
4. The sign bit is copied from ``y`` (so ``-0.0`` encodes to 0x80, and a tiny negative value that
   rounds to zero encodes to ``-0``).

Scaled FP8 (:func:`fp8_encode_reference`): ``scale = amax / FMAX`` per group, computed in float32
(an all-zero group gets scale 1.0; a group whose scale would be 0 or an fp32 subnormal gets
``2^-126`` so the division stays exact-safe), codes = encode(``x_f32 / scale``). Decode
*multiplies*: ``x = fp8_value(code) * scale`` in float32, then casts to the source dtype
(:func:`fp8_decode_reference`).

Scale granularities for a ``[T, H, D]`` tensor (scale plane is float32, broadcastable):

=========  =====================  ========================================================
name       scale shape            one scale per
=========  =====================  ========================================================
tensor     ``[1, 1, 1]``          whole tensor
head       ``[1, H, 1]``          KV head
channel    ``[1, H, D]``          (head, channel), over all tokens
token      ``[T, H, 1]``          (token, head)
block      ``[T, H, ceil(D/B)]``  ``B`` consecutive channels of one (token, head); the last
                                  block may be shorter than ``B`` (no padding)
=========  =====================  ========================================================

Example:
    >>> import torch
    >>> from kvcodec.quant.fp8 import fp8_encode_reference, fp8_decode_reference
    >>> x = torch.tensor([[[1.0, -0.0, 448.0, 0.001953125]]])
    >>> codes, scale = fp8_encode_reference(x, "e4m3", "tensor")
    >>> [hex(c) for c in codes.flatten().tolist()], scale.item()
    (['0x38', '0x80', '0x7e', '0x1'], 1.0)
    >>> fp8_decode_reference(codes, scale, "e4m3").flatten().tolist()
    [1.0, -0.0, 448.0, 0.001953125]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import ConfigError, InputError

#: Smallest positive normal float32; the floor of every scale we compute.
FP32_MIN_NORMAL = 2.0**-126


@dataclass(frozen=True)
class MinifloatFormat:
    """A small sign/exponent/mantissa float format.

    Attributes:
        name: short name (``"e4m3"``, ``"e5m2"``, ``"e2m1"``).
        ebits: exponent bits.
        mbits: mantissa bits.
        bias: exponent bias.
        max: largest finite magnitude.
        inf_code: magnitude code of infinity, or -1 when the format has none.
        nan_codes: magnitude codes that are NaN.
    """

    name: str
    ebits: int
    mbits: int
    bias: int
    max: float
    inf_code: int = -1
    nan_codes: tuple[int, ...] = ()

    @property
    def sign_bit(self) -> int:
        """The sign bit's value in a code (0x80 for FP8, 0x8 for FP4)."""
        return 1 << (self.ebits + self.mbits)

    @property
    def min_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mbits)

    @property
    def max_code(self) -> int:
        """Magnitude code of the largest finite value."""
        return int(minifloat_encode(torch.tensor([self.max]), self).item())


F8E4M3 = MinifloatFormat("e4m3", 4, 3, 7, 448.0, -1, (0x7F,))
F8E5M2 = MinifloatFormat("e5m2", 5, 2, 15, 57344.0, 0x7C, (0x7D, 0x7E, 0x7F))
F4E2M1 = MinifloatFormat("e2m1", 2, 1, 1, 6.0)

#: Largest finite E4M3FN value.
F8E4M3_MAX = F8E4M3.max
#: Largest finite E5M2 value.
F8E5M2_MAX = F8E5M2.max
#: Largest E2M1 value.
F4E2M1_MAX = F4E2M1.max

FP8_FORMATS: dict[str, MinifloatFormat] = {"e4m3": F8E4M3, "e5m2": F8E5M2}
GRANULARITIES = ("tensor", "head", "channel", "token", "block")


def fp8_format(fmt: str | MinifloatFormat) -> MinifloatFormat:
    """Look up an FP8 format by name (``"e4m3"`` or ``"e5m2"``)."""
    if isinstance(fmt, MinifloatFormat):
        return fmt
    try:
        return FP8_FORMATS[fmt]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown fp8 format {fmt!r}; expected one of {sorted(FP8_FORMATS)}") from None


def check_finite(x: torch.Tensor, what: str = "input") -> None:
    """Raise :class:`InputError` if ``x`` holds NaN or +-Inf."""
    if x.is_floating_point() and x.numel() and not bool(torch.isfinite(x).all()):
        raise InputError(f"{what} holds NaN or Inf values; refusing to quantize")


def minifloat_encode(y: torch.Tensor, fmt: MinifloatFormat) -> torch.Tensor:
    """Round float values onto a minifloat grid (saturating, round-to-nearest-even).

    Args:
        y: finite values (any float dtype; computed in float32, which holds every input of the
            source dtypes exactly).
        fmt: the target format.

    Returns:
        ``uint8`` codes, same shape as ``y``: sign bit ``fmt.sign_bit``, then exponent, mantissa.

    Raises:
        InputError: ``y`` holds NaN or Inf.

    Example:
        >>> import torch
        >>> minifloat_encode(torch.tensor([0.25, 0.75, 5.0, 7.0, -6.0]), F4E2M1).tolist()
        [0, 2, 6, 7, 15]
    """
    check_finite(y)
    y = y.float()
    a = y.abs().clamp(max=fmt.max)
    # frexp: a = m * 2**e with m in [0.5, 1); the unbiased exponent of a is e - 1.
    _, e = torch.frexp(a)
    emin = 1 - fmt.bias
    # Below the normal range the quantum stays that of the smallest binade: subnormals.
    # (frexp(0) gives e = 0, so zero must be sent to the subnormal binade explicitly.)
    e = torch.where(a == 0, torch.full_like(e, emin + 1), e)
    eeff = torch.clamp(e.to(torch.int32) - 1, min=emin)
    # a / quantum is exact (a power-of-two scaling); torch.round rounds half to even.
    n = torch.round(torch.ldexp(a, (fmt.mbits - eeff).float())).to(torch.int32)
    # One formula covers normals and subnormals, and a mantissa that rounds up to 2**(mbits+1)
    # carries into the exponent field exactly as the bit pattern requires.
    mag = (eeff - emin) * (1 << fmt.mbits) + n
    code = torch.where(torch.signbit(y), mag | fmt.sign_bit, mag)
    return code.to(torch.uint8)


def minifloat_decode(codes: torch.Tensor, fmt: MinifloatFormat) -> torch.Tensor:
    """The float32 value of each code (NaN and inf codes decode to NaN and inf).

    Example:
        >>> import torch
        >>> minifloat_decode(torch.tensor([0x38, 0x80, 0x7E, 0x7F], dtype=torch.uint8), F8E4M3).tolist()
        [1.0, -0.0, 448.0, nan]
    """
    c = codes.to(torch.int32)
    sign = (c & fmt.sign_bit) != 0
    mag = c & (fmt.sign_bit - 1)
    e = mag >> fmt.mbits
    m = mag & ((1 << fmt.mbits) - 1)
    # subnormal: m * 2^(1-bias-mbits); normal: (2^mbits + m) * 2^(e-bias-mbits)
    sig = torch.where(e == 0, m, m + (1 << fmt.mbits)).float()
    exp = (torch.clamp(e, min=1) - fmt.bias - fmt.mbits).float()
    v = torch.ldexp(sig, exp)
    if fmt.inf_code >= 0:
        v = torch.where(mag == fmt.inf_code, torch.full_like(v, float("inf")), v)
    for nc in fmt.nan_codes:
        v = torch.where(mag == nc, torch.full_like(v, float("nan")), v)
    return torch.where(sign, -v, v)


def all_codes_values(fmt: MinifloatFormat) -> torch.Tensor:
    """The value of every code of ``fmt`` (index = code)."""
    return minifloat_decode(torch.arange(2 * fmt.sign_bit, dtype=torch.int32), fmt)


# --------------------------------------------------------------------------- scaling
def scale_shape(shape: tuple[int, int, int], granularity: str, block: int = 32) -> tuple[int, int, int]:
    """Shape of the float32 scale plane for a ``[T, H, D]`` tensor."""
    t, h, d = shape
    if granularity == "tensor":
        return (1, 1, 1)
    if granularity == "head":
        return (1, h, 1)
    if granularity == "channel":
        return (1, h, d)
    if granularity == "token":
        return (t, h, 1)
    if granularity == "block":
        if block < 1:
            raise ConfigError(f"fp8 block size must be >= 1, got {block}")
        return (t, h, -(-d // block))
    raise ConfigError(f"unknown scale granularity {granularity!r}; expected one of {GRANULARITIES}")


def _group_amax(x: torch.Tensor, granularity: str, block: int) -> torch.Tensor:
    a = x.abs()
    t, h, d = x.shape
    target = scale_shape((t, h, d), granularity, block)
    if x.numel() == 0:
        return torch.zeros(target, dtype=torch.float32)
    if granularity == "tensor":
        return a.amax().reshape(1, 1, 1)
    if granularity == "head":
        return a.amax(dim=(0, 2), keepdim=True)
    if granularity == "channel":
        return a.amax(dim=0, keepdim=True)
    if granularity == "token":
        return a.amax(dim=2, keepdim=True)
    nb = target[2]
    # pad with zeros to whole blocks: zeros do not change an absolute maximum
    a = torch.nn.functional.pad(a, (0, nb * block - d))
    return a.reshape(t, h, nb, block).amax(dim=3)


def absmax_scale(amax: torch.Tensor, fmax: float) -> torch.Tensor:
    """``amax / fmax`` in float32; all-zero groups get 1.0, tiny ones the fp32 minimum normal."""
    s = amax.float() / fmax
    s = torch.where(amax == 0, torch.ones_like(s), s)
    return torch.clamp(s, min=FP32_MIN_NORMAL)


def expand_scale(scale: torch.Tensor, shape: tuple[int, int, int], block: int) -> torch.Tensor:
    """Broadcast a scale plane to the full ``[T, H, D]`` shape (block scales repeated)."""
    t, h, d = shape
    if scale.shape[2] != d and scale.shape[2] != 1:  # block granularity
        scale = scale.repeat_interleave(block, dim=2)[:, :, :d]
    return scale.expand(t, h, d)


def fp8_encode_reference(
    x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensor", block: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a ``[T, H, D]`` tensor to scaled FP8.

    Args:
        x: finite fp16/bf16/fp32 values, shape ``[T, H, D]``.
        fmt: ``"e4m3"`` (E4M3FN) or ``"e5m2"``.
        granularity: ``"tensor"``, ``"head"``, ``"channel"``, ``"token"`` or ``"block"``.
        block: block length along ``D`` for ``granularity="block"``.

    Returns:
        ``(codes, scale)``: ``uint8 [T, H, D]`` codes and the float32 scale plane (shape from
        :func:`scale_shape`). ``x ~= fp8_value(codes) * scale``.

    Raises:
        InputError: NaN/Inf input or a shape that is not 3-D.
        ConfigError: unknown format or granularity.

    Example:
        >>> import torch
        >>> codes, s = fp8_encode_reference(torch.full((2, 1, 4), 3.0), "e5m2", "head")
        >>> codes[0, 0].tolist(), s.shape
        ([123, 123, 123, 123], torch.Size([1, 1, 1]))
    """
    f = fp8_format(fmt)
    if x.dim() != 3:
        raise InputError(f"fp8 quantizer expects a [T, H, D] tensor, got shape {list(x.shape)}")
    check_finite(x)
    xf = x.float()
    scale = absmax_scale(_group_amax(xf, granularity, block), f.max)
    y = xf / expand_scale(scale, tuple(x.shape), block)
    return minifloat_encode(y, f), scale


def fp8_decode_reference(
    codes: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3", dtype: torch.dtype = torch.float32,
    block: int = 32,
) -> torch.Tensor:
    """Decode scaled FP8: ``(fp8_value(code) * scale)`` in float32, then cast to ``dtype``.

    Args:
        codes: ``uint8 [T, H, D]`` codes.
        scale: float32 scale plane (see :func:`scale_shape`).
        fmt: ``"e4m3"`` or ``"e5m2"``.
        dtype: output dtype (the source dtype).
        block: block length, for block scales.

    Example:
        >>> import torch
        >>> c = torch.tensor([[[0x38, 0xB8]]], dtype=torch.uint8)
        >>> fp8_decode_reference(c, torch.tensor([[[2.0]]]), "e4m3").tolist()
        [[[2.0, -2.0]]]
    """
    f = fp8_format(fmt)
    v = minifloat_decode(codes, f)
    return (v * expand_scale(scale.float(), tuple(codes.shape), block)).to(dtype)


__all__ = [
    "F4E2M1",
    "F4E2M1_MAX",
    "F8E4M3",
    "F8E4M3_MAX",
    "F8E5M2",
    "F8E5M2_MAX",
    "FP8_FORMATS",
    "GRANULARITIES",
    "MinifloatFormat",
    "absmax_scale",
    "all_codes_values",
    "check_finite",
    "expand_scale",
    "fp8_decode_reference",
    "fp8_encode_reference",
    "fp8_format",
    "minifloat_decode",
    "minifloat_encode",
    "scale_shape",
]
