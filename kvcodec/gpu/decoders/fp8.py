"""GPU decoder of ``fp8`` (formats/SPEC.md §11.2): the ``dequant.cu`` FP8 kernels, a scale plane
broadcast onto ``[T, H, D]`` (:func:`scale_layout`).
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


class Fp8Params(ctypes.Structure):
    """Mirror of ``kvc::Fp8Params`` (cuda/dequant.cuh)."""

    _fields_ = [
        ("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("rows", ctypes.c_int64), ("s_t", ctypes.c_int64), ("s_h", ctypes.c_int64), ("s_d", ctypes.c_int64),
        ("heads", ctypes.c_int32), ("dim", ctypes.c_int32),
        ("t_blk", ctypes.c_int32), ("h_blk", ctypes.c_int32), ("d_blk", ctypes.c_int32),
        ("scale_const16", ctypes.c_int32),
    ]


def scale_layout(scale_shape: tuple[int, ...], shape: tuple[int, int, int]) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Strides and block sizes that map a ``[T, H, D]`` coordinate onto a scale plane.

    The scale plane is broadcast onto ``shape`` after left-padding its shape with ones; an axis
    of size ``S < N`` (``S > 1``) holds one scale per block of ``ceil(N / S)`` coordinates.
    Returns ``((s_t, s_h, s_d), (t_blk, h_blk, d_blk))`` in elements.

    Raises:
        FormatError: the scale plane does not fit the tensor.
    """
    sshape = (1,) * (3 - len(scale_shape)) + tuple(int(s) for s in scale_shape)
    if len(sshape) != 3:
        raise FormatError(f"scale plane of shape {list(scale_shape)} does not broadcast onto {list(shape)}")
    contiguous = (sshape[1] * sshape[2], sshape[2], 1)
    strides, blks = [], []
    for s, n, c in zip(sshape, shape, contiguous):
        if s == 1:
            strides.append(0)
            blks.append(1)
            continue
        blk = -(-n // s) if n else 1
        if s > n or -(-n // blk) != s:
            raise FormatError(f"scale plane of shape {list(scale_shape)} does not fit a tensor of shape {list(shape)}")
        strides.append(c)
        blks.append(blk)
    return (strides[0], strides[1], strides[2]), (blks[0], blks[1], blks[2])


def fp8_launch(codes: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, fmt: str,
               d_block: int | None = None) -> Launch:
    """FP8 dequantization ``out = (f32(codes) * scale).to(out.dtype)``.

    Args:
        codes: uint8 ``[T, H, D]`` FP8 bit patterns (contiguous).
        scale: float32 plane broadcast onto ``[T, H, D]`` (see :func:`scale_layout`).
        out: ``[T, H, D]`` float32/float16/bfloat16 output (contiguous).
        fmt: ``"e4m3"`` or ``"e5m2"``.
        d_block: block length along D when the scale has one value per block of ``d_block``
            channels (the last block may be shorter); by default ``ceil(D / scale.shape[-1])``.
    """
    t, h, d = out.shape
    _check_size(out.shape)
    (s_t, s_h, s_d), (t_blk, h_blk, d_blk) = scale_layout(tuple(scale.shape), (t, h, d))
    if d_block is not None and s_d:
        if -(-d // d_block) != scale.shape[-1]:
            raise FormatError(f"scale plane {list(scale.shape)} does not hold one value per {d_block} channels of {d}")
        d_blk = d_block
    const16 = int(d % 16 == 0 and (s_d == 0 or d_blk % 16 == 0))
    vec = d % 16 == 0 and codes.data_ptr() % 16 == 0 and out.data_ptr() % 16 == 0
    p = Fp8Params(codes.data_ptr(), scale.data_ptr(), out.data_ptr(), t * h, s_t, s_h, s_d, h, d,
                  t_blk, h_blk, d_blk, const16)
    n = t * h * d // 16 if vec else t * h * d
    name = f"fp8_{fmt}_{_out_name(out.dtype)}" + ("_v16" if vec else "")
    return Launch("dequant.cu", name, n, [p, ctypes.c_int64(n)], keep=[codes, scale, out])


@register_gpu_decoder("fp8")
def _gpu_fp8(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    v = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation (formats/SPEC.md §11.2)
    c = to_device(v.codes, dev)
    s = to_device(v.scale, dev)

    def run() -> torch.Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=dev)
        if out.numel():
            _decode_launch(dev, fp8_launch(c, s, out, v.format, d_block=v.block if v.granularity == "block" else None))
        return out

    return DecodePlan(run)
