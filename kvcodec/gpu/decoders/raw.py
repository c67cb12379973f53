"""GPU decoders of ``raw`` and ``fp16``: the planes are the values, so the decode is the upload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..batch import DecodePlan
from ..device import to_device
from ..registry import register_gpu_decoder

if TYPE_CHECKING:
    from ...codec import Codec, EncodedTensor, TensorContext


@register_gpu_decoder("raw")
def _gpu_raw(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    # bits only: the CPU decode is already a copy, so the GPU path is the upload itself
    t = codec.decode_tensor(enc, ctx).to(dev)
    return DecodePlan(t.clone)


@register_gpu_decoder("fp16")
def _gpu_fp16(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    a = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation
    h = to_device(a, dev).view(torch.float16).reshape(ctx.shape)
    # the cast fp16 -> source dtype is exact (fp32) or RNE (bf16) on both devices
    return DecodePlan(lambda: h.to(ctx.dtype, copy=True))
