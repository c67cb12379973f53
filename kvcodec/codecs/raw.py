"""Uncompressed codecs: ``raw`` (source dtype, always lossless) and ``fp16``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..codec import Codec, EncodedTensor, TensorContext, register_codec, register_preset
from ..errors import FormatError
from .parsing import check_plane_names, plane, where

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

    def parse_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> np.ndarray:
        """The ``bits`` plane (source dtype viewed as integers, ``[T, H, D]``), validated
        (formats/SPEC.md §11): exact dtype and shape, no other plane, no NaN/Inf value."""
        return _parse_bits(enc, ctx, _INT_VIEW[ctx.dtype][1], ctx.dtype, "raw")

    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        return torch.from_numpy(self.parse_tensor(enc, ctx).copy()).view(ctx.dtype)


_EXP_MASK = {torch.float16: np.int16(0x7C00), torch.bfloat16: np.int16(0x7F80), torch.float32: np.int32(0x7F800000)}


def _parse_bits(enc: EncodedTensor, ctx: TensorContext, nv: Any, dtype: torch.dtype, codec: str) -> np.ndarray:
    at = where(ctx)
    check_plane_names(enc.planes, ("bits",), at, codec)
    a = plane(enc.planes, "bits", nv, ctx.shape, at)
    exp = _EXP_MASK[dtype]  # all exponent bits set: Inf or NaN
    flat = a.reshape(-1)
    for i in range(0, flat.size, 1 << 13):  # in blocks: the temporaries stay small beside the tensor
        if bool(((flat[i:i + (1 << 13)] & exp) == exp).any()):
            raise FormatError(f"{at}: {codec} values are NaN or Inf (encode refuses them)")
    return a


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

    def parse_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> np.ndarray:
        """The ``bits`` plane (fp16 viewed as int16, ``[T, H, D]``), validated (formats/SPEC.md
        §11): exact dtype and shape, no other plane, no NaN/Inf value."""
        return _parse_bits(enc, ctx, np.int16, torch.float16, "fp16")

    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        return torch.from_numpy(self.parse_tensor(enc, ctx).copy()).view(torch.float16).to(ctx.dtype)


register_preset("raw", {"id": "raw"}, "source dtype, bit for bit (lossless baseline)")
register_preset("fp16", {"id": "fp16"}, "IEEE fp16 (lossless for fp16 caches)")
