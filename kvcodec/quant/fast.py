"""Vectorised numpy fast paths of the reference quantizers, bit-exact with them (tested).

The references (:mod:`~kvcodec.quant.fp8`, :mod:`~kvcodec.quant.nvfp4`, :mod:`~kvcodec.quant.intq`)
are the definitions; the codecs call these functions, which compute the very same float32
operations in the same order, with fewer passes over memory:

* minifloat rounding reads the exponent from the float32 bits and scales by an exact power of
  two built from bits (no ``frexp``/``ldexp``); ``np.rint`` rounds half to even like
  ``torch.round``;
* decoding is a 256-entry lookup table made by the reference decoder itself (a 256x2 table of
  nibble pairs for NVFP4);
* bf16 <-> float32 conversions are done on the bits (widening is exact; narrowing is the
  round-to-nearest-even of torch's own cast), so no torch kernel runs per element.

Every ``*_fast`` function has the signature and results of its reference twin.

Example:
    >>> import torch
    >>> from kvcodec.quant.fast import fp8_encode_fast
    >>> from kvcodec.quant.fp8 import fp8_encode_reference
    >>> x = torch.randn(7, 2, 24).to(torch.bfloat16)
    >>> all(torch.equal(a, b) for a, b in zip(fp8_encode_fast(x, "e4m3", "token"),
    ...                                        fp8_encode_reference(x, "e4m3", "token")))
    True
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ..errors import InputError
from .fp8 import (
    F4E2M1,
    F8E4M3,
    FP32_MIN_NORMAL,
    MinifloatFormat,
    all_codes_values,
    fp8_format,
    scale_shape,
)
from .intq import IntQTensor, check_intq_params, intq_param_shape
from .nvfp4 import NVFP4_BLOCK, NVFP4_BLOCK_SCALE_MIN, NVFP4Tensor

_F32 = np.float32


# --------------------------------------------------------------------------- dtype bridges
def to_f32_numpy(x: torch.Tensor) -> np.ndarray:
    """A float32 numpy copy (or view, for float32 input) of a fp16/bf16/fp32 tensor; exact."""
    x = x.detach().cpu().contiguous()
    if x.dtype == torch.float32:
        return x.numpy()
    if x.dtype == torch.float16:
        return x.numpy().astype(_F32)
    if x.dtype == torch.bfloat16:
        return (x.view(torch.int16).numpy().view(np.uint16).astype(np.uint32) << 16).view(_F32)
    raise InputError(f"expected a float32, float16 or bfloat16 tensor, got {x.dtype}")


def from_f32_numpy(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float32 numpy -> torch ``dtype`` with round-to-nearest-even (as ``Tensor.to``)."""
    a = np.ascontiguousarray(a, dtype=_F32)
    if dtype == torch.float32:
        return torch.from_numpy(a)
    if dtype == torch.float16:
        with np.errstate(over="ignore"):  # beyond 65520 rounds to inf, as torch's cast does
            return torch.from_numpy(a.astype(np.float16))
    if dtype == torch.bfloat16:
        u = a.view(np.uint32)
        # RNE on the 16 dropped bits (inputs are finite; overflow correctly rounds to inf)
        r = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
        return torch.from_numpy(r.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    raise InputError(f"unsupported output dtype {dtype}")


def _check_finite_np(a: np.ndarray, what: str = "input") -> None:
    if a.size and not bool(np.isfinite(a).all()):
        raise InputError(f"{what} holds NaN or Inf values; refusing to quantize")


# --------------------------------------------------------------------------- minifloat
def minifloat_encode_np(y: np.ndarray, fmt: MinifloatFormat) -> np.ndarray:
    """numpy twin of :func:`~kvcodec.quant.fp8.minifloat_encode` for finite float32 ``y``."""
    y = np.asarray(y, dtype=_F32)
    a = np.minimum(np.abs(y), _F32(fmt.max))
    emin = 1 - fmt.bias
    # exponent of max(a, min_normal): below the normal range the quantum is the subnormal one
    u = np.maximum(a, _F32(fmt.min_normal)).view(np.uint32)
    eeff = (u >> np.uint32(23)).astype(np.int32) - 127
    # 2**(mbits - eeff) built from its bits: an exact power-of-two scaling
    p2 = ((127 + fmt.mbits - eeff).astype(np.uint32) << np.uint32(23)).view(_F32)
    n = np.rint(a * p2).astype(np.int32)
    mag = ((eeff - emin) << fmt.mbits) + n
    mag |= np.signbit(y).astype(np.int32) * fmt.sign_bit
    return mag.astype(np.uint8)


@lru_cache(maxsize=None)
def _lut(fmt: MinifloatFormat) -> np.ndarray:
    return all_codes_values(fmt).numpy()


@lru_cache(maxsize=None)
def _e2m1_pair_lut() -> np.ndarray:
    v = _lut(F4E2M1)
    b = np.arange(256)
    return np.stack([v[b & 15], v[b >> 4]], axis=-1).astype(_F32)  # [256, 2]: low, high


# --------------------------------------------------------------------------- fp8
def _expand_last(p: np.ndarray, d: int, block: int) -> np.ndarray:
    if p.shape[-1] not in (1, d):
        p = np.repeat(p, block, axis=-1)[..., :d]
    return p


def _group_amax_np(a: np.ndarray, granularity: str, block: int) -> np.ndarray:
    t, h, d = a.shape
    target = scale_shape((t, h, d), granularity, block)
    if a.size == 0:
        return np.zeros(target, dtype=_F32)
    if granularity == "tensor":
        return a.max().reshape(1, 1, 1)
    if granularity == "head":
        return a.max(axis=(0, 2), keepdims=True)
    if granularity == "channel":
        return a.max(axis=0, keepdims=True)
    if granularity == "token":
        return a.max(axis=2, keepdims=True)
    nb = target[2]
    a = np.pad(a, ((0, 0), (0, 0), (0, nb * block - d)))
    return a.reshape(t, h, nb, block).max(axis=3)


def fp8_encode_fast(
    x: torch.Tensor, fmt: str = "e4m3", granularity: str = "tensor", block: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fast twin of :func:`~kvcodec.quant.fp8.fp8_encode_reference` (same results)."""
    f = fp8_format(fmt)
    if x.dim() != 3:
        raise InputError(f"fp8 quantizer expects a [T, H, D] tensor, got shape {list(x.shape)}")
    scale_shape(tuple(x.shape), granularity, block)  # validates granularity and block
    xf = to_f32_numpy(x)
    _check_finite_np(xf)
    amax = _group_amax_np(np.abs(xf), granularity, block)
    s = amax / _F32(f.max)
    s = np.where(amax == 0, _F32(1.0), s)
    s = np.maximum(s, _F32(FP32_MIN_NORMAL)).astype(_F32)
    y = xf / _expand_last(s, xf.shape[2], block)
    return torch.from_numpy(minifloat_encode_np(y, f)), torch.from_numpy(np.ascontiguousarray(s))


def fp8_decode_fast(
    codes: torch.Tensor, scale: torch.Tensor, fmt: str = "e4m3", dtype: torch.dtype = torch.float32,
    block: int = 32,
) -> torch.Tensor:
    """Fast twin of :func:`~kvcodec.quant.fp8.fp8_decode_reference` (same results)."""
    f = fp8_format(fmt)
    c = codes.detach().cpu().numpy()
    s = scale.detach().cpu().float().numpy()
    v = _lut(f)[c] * _expand_last(s, c.shape[-1], block)
    return from_f32_numpy(v, dtype)


# --------------------------------------------------------------------------- nvfp4
def nvfp4_quantize_fast(x: torch.Tensor, tensor_scale: float | None = None) -> NVFP4Tensor:
    """Fast twin of :func:`~kvcodec.quant.nvfp4.nvfp4_quantize_reference` (same results)."""
    if x.dim() == 0:
        raise InputError("nvfp4 needs at least one dimension")
    xf = to_f32_numpy(x)
    _check_finite_np(xf)
    d = xf.shape[-1]
    pad = (-d) % NVFP4_BLOCK
    if pad:
        xf = np.pad(xf, [(0, 0)] * (xf.ndim - 1) + [(0, pad)])
    if tensor_scale is None:
        amax = np.abs(xf).max() if xf.size else _F32(0)
        ts = _F32(amax) / _F32(F8E4M3.max * F4E2M1.max) if amax > 0 else _F32(1.0)
        ts = max(_F32(ts), _F32(FP32_MIN_NORMAL))
    else:
        if not (float(tensor_scale) > 0 and np.isfinite(float(tensor_scale))):
            raise InputError(f"nvfp4 tensor_scale must be positive and finite, got {tensor_scale}")
        ts = _F32(tensor_scale)
    ts = _F32(ts)
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    bamax = np.abs(blocks).max(axis=-1) if blocks.size else np.zeros(blocks.shape[:-1], _F32)
    s = np.clip((bamax / _F32(F4E2M1.max)) / ts, _F32(NVFP4_BLOCK_SCALE_MIN), _F32(F8E4M3.max))
    bs_code = minifloat_encode_np(s, F8E4M3)
    denom = _lut(F8E4M3)[bs_code] * ts
    codes4 = minifloat_encode_np(blocks / denom[..., None], F4E2M1).reshape(xf.shape)
    packed = codes4[..., 0::2] | (codes4[..., 1::2] << 4)
    return NVFP4Tensor(torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(bs_code),
                       torch.tensor([ts], dtype=torch.float32), pad)


def nvfp4_dequantize_fast(q: NVFP4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Fast twin of :func:`~kvcodec.quant.nvfp4.nvfp4_dequantize_reference` (same results)."""
    c = q.codes.detach().cpu().numpy()
    v = _e2m1_pair_lut()[c]  # [..., Dp/2, 2]
    dp = 2 * c.shape[-1]
    v = v.reshape(*c.shape[:-1], dp // NVFP4_BLOCK, NVFP4_BLOCK)
    bs = _lut(F8E4M3)[q.block_scale.detach().cpu().numpy()][..., None]
    ts = _F32(q.tensor_scale.detach().cpu().float().reshape(-1)[0].item())
    out = ((v * bs) * ts).reshape(*c.shape[:-1], dp)
    return from_f32_numpy(out[..., : dp - q.pad], dtype)


# --------------------------------------------------------------------------- intq
def _grouped_np(x: np.ndarray, axis: str, group: int) -> np.ndarray:
    if axis == "channel":
        x = x.transpose(1, 2, 0)  # [H, D, T]
    n = x.shape[-1]
    ng = -(-n // group)
    pad = ng * group - n
    if pad:
        x = np.concatenate([x, np.repeat(x[..., -1:], pad, axis=-1)], axis=-1)
    return x.reshape(*x.shape[:-1], ng, group)


def _expand_params_np(p: np.ndarray, shape: tuple[int, int, int], axis: str, group: int) -> np.ndarray:
    t, h, d = shape
    # A group at least as long as the axis is a single group: capping the repeat count keeps the
    # result identical and bounds memory by the output size whatever ``group`` a file declares.
    if axis == "channel":
        return np.repeat(p, min(group, max(t, 1)), axis=0)[:t]
    return np.repeat(p, min(group, max(d, 1)), axis=2)[:, :, :d]


def intq_quantize_fast(x: torch.Tensor, bits: int, axis: str = "token", group: int = 32) -> IntQTensor:
    """Fast twin of :func:`~kvcodec.quant.intq.intq_quantize_reference` (same results)."""
    check_intq_params(bits, axis, group)
    if x.dim() != 3:
        raise InputError(f"integer quantizer expects a [T, H, D] tensor, got shape {list(x.shape)}")
    from .. import native

    if x.dtype in (torch.float16, torch.bfloat16, torch.float32) and x.numel():
        try:
            codes, scale16, zero16 = native.intq_quantize(x, bits, axis, group)  # the same arithmetic in C
            return IntQTensor(codes, scale16, zero16, bits, axis, group)
        except native.Unsupported:
            pass
    xf = to_f32_numpy(x)
    _check_finite_np(xf)
    shape = tuple(xf.shape)
    pshape = intq_param_shape(shape, axis, group)
    if xf.size == 0:
        z = torch.zeros(pshape, dtype=torch.float16)
        return IntQTensor(torch.zeros(shape, dtype=torch.uint8), z, z.clone(), bits, axis, group)
    g = _grouped_np(xf, axis, group)
    mn, mx = g.min(axis=-1) + _F32(0), g.max(axis=-1) + _F32(0)  # -0.0 -> +0.0 as the reference
    if axis == "channel":
        mn, mx = mn.transpose(2, 0, 1), mx.transpose(2, 0, 1)
    levels = (1 << bits) - 1
    with np.errstate(over="ignore"):
        scale16 = ((mx - mn) / _F32(levels)).astype(np.float16)
        zero16 = mn.astype(np.float16)
    if not (bool(np.isfinite(scale16).all()) and bool(np.isfinite(zero16).all())):
        raise InputError(
            "values too large for float16 scales/zeros (|x| or the group range exceeds 65504)"
        )
    s = _expand_params_np(scale16.astype(_F32), shape, axis, group)
    z = _expand_params_np(zero16.astype(_F32), shape, axis, group)
    pos = s > 0
    q = np.where(pos, (xf - z) / np.where(pos, s, _F32(1)), _F32(0))
    codes = np.clip(np.rint(q), 0, levels).astype(np.uint8)
    return IntQTensor(torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scale16)),
                      torch.from_numpy(np.ascontiguousarray(zero16)), bits, axis, group)


def intq_dequantize_fast(q: IntQTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Fast twin of :func:`~kvcodec.quant.intq.intq_dequantize_reference` (same results)."""
    from .. import native

    if q.codes.dim() == 3 and dtype in (torch.float16, torch.bfloat16, torch.float32):
        try:
            return native.intq_dequantize(q.codes.detach().cpu().numpy(), q.scale.detach().cpu().numpy().astype(_F32),
                                          q.zero.detach().cpu().numpy().astype(_F32), q.axis, q.group, dtype)
        except native.Unsupported:
            pass
    c = q.codes.detach().cpu().numpy()
    shape = tuple(c.shape)
    s = _expand_params_np(q.scale.detach().cpu().numpy().astype(_F32), shape, q.axis, q.group)
    z = _expand_params_np(q.zero.detach().cpu().numpy().astype(_F32), shape, q.axis, q.group)
    x = c.astype(_F32) * s + z
    if dtype != torch.float32:
        fmax = _F32(torch.finfo(dtype).max)
        x = np.clip(x, -fmax, fmax)
    return from_f32_numpy(x, dtype)


__all__ = [
    "fp8_decode_fast",
    "fp8_encode_fast",
    "from_f32_numpy",
    "intq_dequantize_fast",
    "intq_quantize_fast",
    "minifloat_encode_np",
    "nvfp4_dequantize_fast",
    "nvfp4_quantize_fast",
    "to_f32_numpy",
]
