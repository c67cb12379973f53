"""Uncompressed codecs: ``raw`` (source dtype, always lossless) and ``fp16``."""

from __future__ import annotations

import numpy as np
import torch

from ..codec import Codec, EncodedTensor, TensorContext, register_codec, register_preset
from ..errors import FormatError

_INT_VIEW = {torch.float32: (torch.int32, np.int32), torch.float16: (torch.int16, np.int16),
             torch.bfloat16: (torch.int16, np.int16)}


@register_codec
class RawCodec(Codec):
    """Stores every value in the source dtype, bit for bit. The lossless baseline.

    Example:
        >>> import torch, kvcodec
        >>> c = kvcodec.KVCache.from_tensors([(torch.randn(3, 1, 4), torch.randn(3, 1, 4))])
        >>> kvcodec.get_codec("raw").decode(kvcodec.get_codec("raw").encode(c)).equal(c)
        True
    """

    codec_id = "raw"
    lossless = True

    @property
    def nominal_bits(self) -> float:
        return 16.0

    def encode_tensor(self, x: torch.Tensor, ctx: TensorContext) -> EncodedTensor:
        iv, _ = _INT_VIEW[x.dtype]
        return EncodedTensor({"bits": x.contiguous().view(iv).numpy()})

    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        iv, nv = _INT_VIEW[ctx.dtype]
        a = enc.planes.get("bits")
        if a is None or a.dtype != nv or a.size != ctx.numel:
            raise FormatError(f"layers.{ctx.layer}.{ctx.role}: 'bits' plane missing or wrong size")
        return torch.from_numpy(a.copy()).view(ctx.dtype).reshape(ctx.shape)


@register_codec
class FP16Codec(Codec):
    """Stores every value as IEEE fp16 (round to nearest even). Lossless for fp16 sources;
    for bf16 or fp32 sources it rounds (and saturates beyond ±65504 to ±inf, so it refuses those).
    """

    codec_id = "fp16"

    @property
    def nominal_bits(self) -> float:
        return 16.0

    def encode_tensor(self, x: torch.Tensor, ctx: TensorContext) -> EncodedTensor:
        if x.dtype != torch.float16 and bool((x.abs() > 65504).any()):
            from ..errors import InputError

            raise InputError(f"layers.{ctx.layer}.{ctx.role} has values beyond fp16 range ±65504")
        return EncodedTensor({"bits": x.to(torch.float16).contiguous().view(torch.int16).numpy()})

    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        a = enc.planes.get("bits")
        if a is None or a.dtype != np.int16 or a.size != ctx.numel:
            raise FormatError(f"layers.{ctx.layer}.{ctx.role}: 'bits' plane missing or wrong size")
        return torch.from_numpy(a.copy()).view(torch.float16).reshape(ctx.shape).to(ctx.dtype)


register_preset("raw", {"id": "raw"}, "source dtype, bit for bit (lossless baseline)")
register_preset("fp16", {"id": "fp16"}, "IEEE fp16 (lossless for fp16 caches)")
