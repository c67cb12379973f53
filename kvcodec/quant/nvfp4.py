"""NVFP4: the reference quantizer (E2M1 values, E4M3 block scales, one FP32 tensor scale).

Along the last axis (``head_dim``), values are cut into blocks of 16 consecutive elements. When
the axis length ``D`` is not a multiple of 16 it is padded with ``+0.0`` to ``Dp = 16*ceil(D/16)``
and ``pad = Dp - D`` is returned (decode drops the padding).

Encode, in float32, in this order:

1. ``amax = max |x|`` over the whole tensor;
   ``tensor_scale = amax / (448 * 6)`` (1.0 when ``amax == 0``; floored at ``2^-126``).
2. per block: ``s = (block_amax / 6) / tensor_scale``, clamped to ``[2^-6, 448]`` (``2^-6`` is
   the smallest normal E4M3 value, torchao's ``tiny``), then rounded to E4M3 with
   round-to-nearest-even: the *block scale code* (uint8). Its value is ``bs``.
3. ``y = x / (bs * tensor_scale)`` (the product rounded to float32 first), clamped to +-6 and
   rounded to the E2M1 grid ``{0, .5, 1, 1.5, 2, 3, 4, 6}`` (round-to-nearest-even, sign kept:
   ``-0`` has code 0x8).
4. Two 4-bit codes per byte: element ``2i`` in the **low** nibble, element ``2i+1`` in the high
   nibble (PyTorch ``float4_e2m1fn_x2`` / torchao order; not ggml's split halves).

Decode *multiplies*: ``x = (e2m1_value(code) * bs) * tensor_scale`` in float32 (two separately
rounded products, in that order), padding dropped, then cast to the source dtype.

Example (the golden block of ANCHORS.md, with a unit tensor scale):
    >>> import torch
    >>> base = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -.25, -.5, -1, -1.5, -2, -3, -4, -6])
    >>> q = nvfp4_quantize_reference(3 * base, tensor_scale=1.0)
    >>> hex(q.block_scale.item()), q.codes.numpy().tobytes().hex(" ")
    ('0x44', '10 32 54 76 98 ba dc fe')
    >>> nvfp4_dequantize_reference(q).tolist() == (3 * torch.tensor(
    ...     [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])).tolist()
    True
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import InputError
from .fp8 import (
    F4E2M1,
    F8E4M3,
    FP32_MIN_NORMAL,
    check_finite,
    minifloat_decode,
    minifloat_encode,
)

#: Elements per NVFP4 block (along the last axis).
NVFP4_BLOCK = 16
#: Smallest block scale (the smallest normal E4M3 value, as torchao clamps).
NVFP4_BLOCK_SCALE_MIN = 2.0**-6


class NVFP4Tensor(NamedTuple):
    """An NVFP4-coded tensor.

    Attributes:
        codes: ``uint8 [..., Dp/2]``, two E2M1 codes per byte, low nibble = even index.
        block_scale: ``uint8 [..., Dp/16]`` E4M3FN codes of the block scales.
        tensor_scale: float32 ``[1]``.
        pad: number of zero elements appended to the last axis (``Dp - D``).
    """

    codes: torch.Tensor
    block_scale: torch.Tensor
    tensor_scale: torch.Tensor
    pad: int


def pack_nibbles(codes4: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes pairwise along the last axis (even length): low nibble = even index."""
    c = codes4.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``[..., n] -> [..., 2n]`` codes."""
    lo = packed & 0x0F
    hi = packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def nvfp4_quantize_reference(x: torch.Tensor, tensor_scale: float | None = None) -> NVFP4Tensor:
    """Quantize to NVFP4 along the last axis.

    Args:
        x: finite fp16/bf16/fp32 tensor of at least one dimension (``[T, H, D]`` for caches).
        tensor_scale: override the per-tensor scale (for example 1.0 for golden checks); by default
            ``amax / (448 * 6)``.

    Returns:
        An :class:`NVFP4Tensor`.

    Raises:
        InputError: NaN/Inf input, a 0-d tensor, or a non-positive ``tensor_scale``.
    """
    if x.dim() == 0:
        raise InputError("nvfp4 needs at least one dimension")
    check_finite(x)
    xf = x.float()
    d = xf.shape[-1]
    pad = (-d) % NVFP4_BLOCK
    xf = torch.nn.functional.pad(xf, (0, pad))
    if tensor_scale is None:
        amax = xf.abs().amax() if xf.numel() else torch.zeros(())
        ts = torch.where(amax > 0, amax / (F8E4M3.max * F4E2M1.max), torch.ones(()))
        ts = torch.clamp(ts, min=FP32_MIN_NORMAL).reshape(1)
    else:
        if not (float(tensor_scale) > 0 and torch.isfinite(torch.tensor(float(tensor_scale)))):
            raise InputError(f"nvfp4 tensor_scale must be positive and finite, got {tensor_scale}")
        ts = torch.tensor([float(tensor_scale)], dtype=torch.float32)
    blocks = xf.reshape(*xf.shape[:-1], xf.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    bamax = blocks.abs().amax(dim=-1) if blocks.numel() else torch.zeros(blocks.shape[:-1])
    s = torch.clamp((bamax / F4E2M1.max) / ts, NVFP4_BLOCK_SCALE_MIN, F8E4M3.max)
    bs_code = minifloat_encode(s, F8E4M3)
    denom = minifloat_decode(bs_code, F8E4M3) * ts
    y = blocks / denom.unsqueeze(-1)
    codes4 = minifloat_encode(y, F4E2M1).reshape(xf.shape)
    return NVFP4Tensor(pack_nibbles(codes4), bs_code, ts, pad)


def nvfp4_dequantize_reference(
    q: NVFP4Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode NVFP4: ``(e2m1 * block_scale) * tensor_scale`` in float32, padding dropped.

    Example:
        >>> import torch
        >>> q = nvfp4_quantize_reference(torch.tensor([[1.0, -2.0, 3.0]]))
        >>> q.pad, nvfp4_dequantize_reference(q).tolist()  # tensor scale 3/2688 is inexact in fp32
        (13, [[1.0, -2.0, 3.000000238418579]])
        >>> nvfp4_dequantize_reference(q, torch.float16).tolist()
        [[1.0, -2.0, 3.0]]
    """
    codes4 = unpack_nibbles(q.codes)
    v = minifloat_decode(codes4, F4E2M1)
    dp = v.shape[-1]
    v = v.reshape(*v.shape[:-1], dp // NVFP4_BLOCK, NVFP4_BLOCK)
    bs = minifloat_decode(q.block_scale, F8E4M3).unsqueeze(-1)
    out = ((v * bs) * q.tensor_scale.float().reshape(())).reshape(*v.shape[:-2], dp)
    return out[..., : dp - q.pad].to(dtype)


__all__ = [
    "NVFP4Tensor",
    "NVFP4_BLOCK",
    "NVFP4_BLOCK_SCALE_MIN",
    "nvfp4_dequantize_reference",
    "nvfp4_quantize_reference",
    "pack_nibbles",
    "unpack_nibbles",
]
