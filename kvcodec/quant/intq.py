"""Integer asymmetric (min-max) quantization, 1 to 8 bits, KIVI-style: the reference quantizer.

A ``[T, H, D]`` tensor is cut into groups; each group gets a ``scale`` and a ``zero`` (its
minimum), both stored as **float16**:

=============  ============================================  ==============================
axis           group = ``group`` consecutive ...             scale / zero shape
=============  ============================================  ==============================
``"channel"``  tokens of one (head, channel) (KIVI's K)      ``[ceil(T/group), H, D]``
``"token"``    channels of one (token, head) (KIVI's V)      ``[T, H, ceil(D/group)]``
=============  ============================================  ==============================

The last group along the grouped axis may be shorter than ``group`` (no padding is stored).

Encode, per group, in float32: ``mn, mx`` = group min and max;
``scale16 = fp16((mx - mn) / (2**bits - 1))``, ``zero16 = fp16(mn)`` (a ``-0.0`` min or max is
taken as ``+0.0``); then with
``s = float32(scale16)``, ``z = float32(zero16)``:
``code = clamp(round_half_even((x - z) / s), 0, 2**bits - 1)`` (``code = 0`` where ``s == 0``).
Quantizing against the *rounded* fp16 scale and zero keeps encode and decode consistent.

Decode: ``x = float32(code) * s + z`` in float32 — one product, then one sum, each rounded
separately (no fused multiply-add) — then clamped to the source dtype's finite range
(``+-65504`` for float16, ``+-finfo(bfloat16).max`` for bfloat16, no clamp for float32) and cast
to the source dtype (RNE). The clamp matters only next to the source's max: an fp16 scale rounded
up can place the top level just past 65504, which would otherwise become inf.

Error bound (tested): ``|x - decode| <= s/2 + s * 2**bits * 2**-10 + |z| * 2**-10`` (+ float32
rounding): half a step, plus the fp16 rounding of scale and zero.

Example:
    >>> import torch
    >>> x = torch.tensor([[[0.0, 1.0, 2.0, 3.0]]])
    >>> q = intq_quantize_reference(x, bits=2, axis="token", group=4)
    >>> q.codes.flatten().tolist(), q.scale.item(), q.zero.item()
    ([0, 1, 2, 3], 1.0, 0.0)
    >>> intq_dequantize_reference(q).flatten().tolist()
    [0.0, 1.0, 2.0, 3.0]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import ConfigError, InputError
from .fp8 import check_finite

AXES = ("channel", "token")


class IntQTensor(NamedTuple):
    """An integer-quantized tensor (codes unpacked, one per element).

    Attributes:
        codes: ``uint8 [T, H, D]``, each in ``[0, 2**bits)``.
        scale: float16 per group (shape in the module table).
        zero: float16 per group, the group minimum.
        bits: code width, 1..8.
        axis: ``"channel"`` or ``"token"``.
        group: group length along the grouped axis.
    """

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    axis: str
    group: int


def check_intq_params(bits: int, axis: str, group: int) -> None:
    """Raise :class:`ConfigError` for an unusable bit width, axis or group size."""
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 8:
        raise ConfigError(f"integer quantization needs bits in 1..8, got {bits!r}")
    if axis not in AXES:
        raise ConfigError(f"unknown quantization axis {axis!r}; expected one of {AXES}")
    if not isinstance(group, int) or isinstance(group, bool) or group < 1:
        raise ConfigError(f"group size must be a positive integer, got {group!r}")


def intq_param_shape(shape: tuple[int, int, int], axis: str, group: int) -> tuple[int, int, int]:
    """Shape of the scale and zero planes for a ``[T, H, D]`` tensor."""
    t, h, d = shape
    if axis == "channel":
        return (-(-t // group), h, d)
    return (t, h, -(-d // group))


def _grouped(x: torch.Tensor, axis: str, group: int) -> torch.Tensor:
    """View ``[T, H, D]`` as groups on the last axis; the last group is padded by repeating its
    final element, which changes neither its min nor its max."""
    if axis == "channel":
        x = x.permute(1, 2, 0)  # [H, D, T]
    n = x.shape[-1]
    ng = -(-n // group)
    pad = ng * group - n
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    return x.reshape(*x.shape[:-1], ng, group)


def _ungroup(g: torch.Tensor, axis: str) -> torch.Tensor:
    """``[A, B, ng]`` per-group values back to the plane layout of the module table."""
    return g.permute(2, 0, 1) if axis == "channel" else g


def expand_params(p: torch.Tensor, shape: tuple[int, int, int], axis: str, group: int) -> torch.Tensor:
    """Broadcast a per-group plane to the full ``[T, H, D]`` shape."""
    t, h, d = shape
    # A group at least as long as the axis is one group: capping the repeat keeps the result and
    # bounds memory by the output size, whatever ``group`` a (hostile) file declares.
    if axis == "channel":
        return p.repeat_interleave(min(group, max(t, 1)), dim=0)[:t]
    return p.repeat_interleave(min(group, max(d, 1)), dim=2)[:, :, :d]


def intq_quantize_reference(
    x: torch.Tensor, bits: int, axis: str = "token", group: int = 32
) -> IntQTensor:
    """Asymmetric min-max quantization of a ``[T, H, D]`` tensor.

    Args:
        x: finite fp16/bf16/fp32 values.
        bits: code width, 1..8.
        axis: ``"channel"`` (groups of tokens per channel, KIVI's K) or ``"token"`` (groups of
            channels per token, KIVI's V).
        group: group length along the grouped axis.

    Returns:
        An :class:`IntQTensor`.

    Raises:
        InputError: NaN/Inf input, a non 3-D shape, or a scale or zero beyond fp16 range.
        ConfigError: bad ``bits``, ``axis`` or ``group``.
    """
    check_intq_params(bits, axis, group)
    if x.dim() != 3:
        raise InputError(f"integer quantizer expects a [T, H, D] tensor, got shape {list(x.shape)}")
    check_finite(x)
    shape = tuple(x.shape)
    pshape = intq_param_shape(shape, axis, group)
    xf = x.float()
    if xf.numel() == 0:
        z = torch.zeros(pshape, dtype=torch.float16)
        return IntQTensor(torch.zeros(shape, dtype=torch.uint8), z, z.clone(), bits, axis, group)
    g = _grouped(xf, axis, group)
    # "+ 0.0" turns -0.0 into +0.0: which signed zero min/max return is not specified
    mn = _ungroup(g.amin(dim=-1), axis) + 0.0
    mx = _ungroup(g.amax(dim=-1), axis) + 0.0
    levels = (1 << bits) - 1
    scale16 = ((mx - mn) / levels).to(torch.float16)
    zero16 = mn.to(torch.float16)
    if not (bool(torch.isfinite(scale16).all()) and bool(torch.isfinite(zero16).all())):
        raise InputError(
            "values too large for float16 scales/zeros (|x| or the group range exceeds 65504)"
        )
    s = expand_params(scale16.float(), shape, axis, group)
    z = expand_params(zero16.float(), shape, axis, group)
    q = (xf - z) / torch.where(s > 0, s, torch.ones_like(s))
    q = torch.where(s > 0, q, torch.zeros_like(q))
    codes = torch.clamp(torch.round(q), 0, levels).to(torch.uint8)
    return IntQTensor(codes, scale16, zero16, bits, axis, group)


def intq_dequantize_reference(q: IntQTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode: ``float32(code) * scale + zero`` (multiply, then add), clamped to ``dtype``'s
    finite range, cast to ``dtype``.

    Example:
        >>> import torch
        >>> q = intq_quantize_reference(torch.arange(8.0).reshape(8, 1, 1), 3, "channel", 8)
        >>> intq_dequantize_reference(q, torch.float16).flatten().tolist()
        [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    """
    shape = tuple(q.codes.shape)
    s = expand_params(q.scale.float(), shape, q.axis, q.group)
    z = expand_params(q.zero.float(), shape, q.axis, q.group)
    x = q.codes.float() * s + z
    if dtype != torch.float32:
        fmax = torch.finfo(dtype).max
        x = torch.clamp(x, -fmax, fmax)
    return x.to(dtype)


__all__ = [
    "AXES",
    "IntQTensor",
    "check_intq_params",
    "expand_params",
    "intq_dequantize_reference",
    "intq_param_shape",
    "intq_quantize_reference",
]
