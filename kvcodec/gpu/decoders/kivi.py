"""GPU decoder of ``kivi`` (formats/SPEC.md §11.4): bit-packed integer codes with a float16 scale and
zero per group, dequantized by the ``intq.cu`` kernels; the recent tokens are copied as they are.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...errors import FormatError
from ..batch import DecodePlan
from ..device import Launch, _check_size, _decode_launch, _out_name, to_device
from ..registry import register_gpu_decoder

if TYPE_CHECKING:
    from ...codec import Codec, EncodedTensor, TensorContext


class IntqParams(ctypes.Structure):
    """Mirror of ``kvc::IntqParams`` (cuda/intq.cuh)."""

    _fields_ = [
        ("packed", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("n", ctypes.c_int64), ("heads", ctypes.c_int32), ("dim", ctypes.c_int32), ("group", ctypes.c_int32),
        ("axis", ctypes.c_int32), ("bits", ctypes.c_int32), ("pad_", ctypes.c_int32),
    ]


def intq_launch(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out: torch.Tensor,
                bits: int, axis: str, group: int) -> Launch:
    """KIVI-style dequantization ``out = (f32(code) * f32(scale) + f32(zero)).to(out.dtype)``.

    Args:
        packed: uint8 LSB-first bit stream of the ``[Tq, H, D]`` codes.
        scale, zero: float16 planes (``[ceil(Tq/g), H, D]`` for axis ``"channel"``,
            ``[Tq, H, ceil(D/g)]`` for ``"token"``).
        out: ``[Tq, H, D]`` output (contiguous; may be the first ``Tq`` tokens of a larger tensor).
        bits, axis, group: the tensor's params.
    """
    tq, h, d = out.shape
    _check_size(out.shape)
    n = tq * h * d
    if packed.numel() != (n * bits + 7) // 8:
        raise FormatError(f"packed codes hold {packed.numel()} bytes; {n} codes of {bits} bits need {(n * bits + 7) // 8}")
    ps = (-(-tq // group), h, d) if axis == "channel" else (tq, h, -(-d // group))
    if scale.numel() != ps[0] * ps[1] * ps[2] or zero.numel() != scale.numel():
        raise FormatError(f"scale/zero planes do not have shape {list(ps)}")
    vec = d % 16 == 0 and packed.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0 and scale.data_ptr() % 16 == 0 \
        and zero.data_ptr() % 16 == 0
    p = IntqParams(packed.data_ptr(), scale.data_ptr(), zero.data_ptr(), out.data_ptr(), n, h, d, group,
                   0 if axis == "channel" else 1, bits, 0)
    items = n // 16 if vec else n
    name = f"intq_b{bits}_{_out_name(out.dtype)}_v16" if vec else f"intq_{_out_name(out.dtype)}"
    return Launch("intq.cu", name, items, [p, ctypes.c_int64(items)], keep=[packed, scale, zero, out])


@register_gpu_decoder("kivi")
def _gpu_kivi(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    v = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation (formats/SPEC.md §11.4)
    t, h, d = ctx.shape
    tq = t - v.recent
    n = tq * h * d
    if v.recent:
        r_dev = to_device(v.recent_bits, dev).view(ctx.dtype)
    pk = to_device(v.codes, dev)
    s_dev = to_device(v.scale.view(np.int16), dev)
    z_dev = to_device(v.zero.view(np.int16), dev)

    def run() -> torch.Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=dev)
        if n:
            _decode_launch(dev, intq_launch(pk, s_dev, z_dev, out[:tq], v.bits, v.axis, v.group))
        if v.recent:
            out[tq:] = r_dev
        return out

    return DecodePlan(run)
