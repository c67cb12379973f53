"""GPU decoder of ``nvfp4`` (formats/SPEC.md §11.3): E2M1 codes, E4M3 block scales and one tensor
scale, dequantized by the ``dequant.cu`` NVFP4 kernels.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

from ...errors import FormatError
from ..batch import DecodePlan
from ..device import Launch, _check_size, _decode_launch, _out_name, to_device
from ..registry import register_gpu_decoder

if TYPE_CHECKING:
    from ...codec import Codec, EncodedTensor, TensorContext


class Nvfp4Params(ctypes.Structure):
    """Mirror of ``kvc::Nvfp4Params`` (cuda/dequant.cuh)."""

    _fields_ = [
        ("codes", ctypes.c_void_p), ("block_scale", ctypes.c_void_p), ("tensor_scale", ctypes.c_void_p),
        ("out", ctypes.c_void_p), ("rows", ctypes.c_int64), ("dim", ctypes.c_int32), ("dim_padded", ctypes.c_int32),
    ]


def nvfp4_launch(codes: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor, out: torch.Tensor) -> Launch:
    """NVFP4 dequantization ``out = ((e2m1 * block_scale) * tensor_scale).to(out.dtype)``.

    Args:
        codes: uint8 ``[T, H, Dp/2]`` (low nibble = even index).
        block_scale: uint8 E4M3 ``[T, H, Dp/16]``.
        tensor_scale: float32 ``[1]``.
        out: ``[T, H, D]`` output, ``D <= Dp``.
    """
    t, h, d = out.shape
    _check_size(codes.shape)
    dp = codes.shape[-1] * 2
    if dp % 16 or not (d <= dp < d + 16) or block_scale.numel() != t * h * (dp // 16) or codes.numel() != t * h * dp // 2:
        raise FormatError(f"NVFP4 planes ({list(codes.shape)}, {list(block_scale.shape)}) do not fit {list(out.shape)}")
    if tensor_scale.numel() != 1:
        raise FormatError("NVFP4 tensor_scale must hold one value")
    p = Nvfp4Params(codes.data_ptr(), block_scale.data_ptr(), tensor_scale.data_ptr(), out.data_ptr(), t * h, d, dp)
    n = t * h * (dp // 16)
    return Launch("dequant.cu", f"nvfp4_{_out_name(out.dtype)}", n, [p, ctypes.c_int64(n)],
                  keep=[codes, block_scale, tensor_scale, out])


@register_gpu_decoder("nvfp4")
def _gpu_nvfp4(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    v = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation (formats/SPEC.md §11.3)
    c_dev = to_device(v.codes, dev)
    bs_dev = to_device(v.block_scale, dev)
    ts_dev = to_device(v.tensor_scale, dev)

    def run() -> torch.Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=dev)
        if out.numel():
            _decode_launch(dev, nvfp4_launch(c_dev, bs_dev, ts_dev, out))
        return out

    return DecodePlan(run)
