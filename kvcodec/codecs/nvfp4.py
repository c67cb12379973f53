"""NVFP4 codec: ``nvfp4`` (preset ``nvfp4``).

No parameters: NVFP4 is fully defined (16-element blocks along ``head_dim``, E4M3FN block
scales, one float32 tensor scale per ``[T, H, D]`` tensor); see :mod:`kvcodec.quant.nvfp4`.

Plane layout of one ``[T, H, D]`` tensor (pinned; the CUDA kernels read exactly this). Let
``Dp = 16 * ceil(D / 16)`` (``D`` padded with +0.0 to whole blocks; ``pad = Dp - D``):

* ``codes``: ``uint8 [T, H, Dp/2]``, C order; byte ``j`` of a row holds element ``2j`` in its
  **low** nibble and element ``2j+1`` in its high nibble. Each nibble is an E2M1 code: bit 3 is
  the sign, codes 0-7 = {0, 0.5, 1, 1.5, 2, 3, 4, 6}, 8-15 their negatives (8 = -0).
* ``block_scale``: ``uint8 [T, H, Dp/16]``, E4M3FN codes; element ``d`` uses block ``d // 16``.
  Linear layout (not a swizzled GEMM layout). Values lie in ``[2^-6, 448]``.
* ``tensor_scale``: ``float32 [1]``, ``amax / (448 * 6)`` (1.0 for an all-zero tensor).

Tensor params in the manifest: ``{"pad": Dp - D}``.

Decode (*multiply*), in float32, in this order:
``x = (e2m1_value(code) * e4m3_value(block_scale)) * tensor_scale``, then drop the ``pad``
trailing elements of each row and cast to the source dtype (RNE).

Size: 4 bits + 8/16 bits per element (+ 32 bits per tensor, + padding when D % 16 != 0).

Example:
    >>> import torch, kvcodec
    >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(8, 2, 40), torch.randn(8, 2, 40))])
    >>> codec = kvcodec.get_codec("nvfp4")
    >>> out = codec.decode(codec.encode(cache))
    >>> out.layers[0]["k"].shape
    torch.Size([8, 2, 40])
"""

from __future__ import annotations

import numpy as np
import torch

from ..codec import Codec, EncodedTensor, TensorContext, register_codec, register_preset
from ..errors import FormatError
from ..quant.fast import nvfp4_dequantize_fast, nvfp4_quantize_fast
from ..quant.nvfp4 import NVFP4_BLOCK, NVFP4Tensor
from .fp8 import NOMINAL_SHAPE, plane_as_tensor


@register_codec
class NVFP4Codec(Codec):
    """NVFP4 (E2M1 codes, E4M3 scales per 16 elements, one fp32 scale per tensor).

    Example:
        >>> import kvcodec
        >>> round(kvcodec.get_codec("nvfp4").nominal_bits, 4)
        4.5
    """

    codec_id = "nvfp4"
    defaults: dict = {}

    def tensor_bits(self, shape: tuple[int, int, int]) -> int:
        """Exact bits of the planes of one tensor."""
        t, h, d = shape
        dp = -(-d // NVFP4_BLOCK) * NVFP4_BLOCK
        return 4 * t * h * dp + 8 * t * h * (dp // NVFP4_BLOCK) + 32

    @property
    def nominal_bits(self) -> float:
        """Bits per element of all planes at ``NOMINAL_SHAPE`` (1024 tokens, 8 heads, D=128)."""
        n = NOMINAL_SHAPE[0] * NOMINAL_SHAPE[1] * NOMINAL_SHAPE[2]
        return self.tensor_bits(NOMINAL_SHAPE) / n

    def encode_tensor(self, x: torch.Tensor, ctx: TensorContext) -> EncodedTensor:
        q = nvfp4_quantize_fast(x)  # bit-exact with nvfp4_quantize_reference (tested)
        return EncodedTensor(
            {"codes": q.codes.numpy(), "block_scale": q.block_scale.numpy(),
             "tensor_scale": q.tensor_scale.numpy()},
            {"pad": q.pad},
        )

    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        t, h, d = ctx.shape
        pad = enc.params.get("pad")
        if not isinstance(pad, int) or isinstance(pad, bool) or pad != (-d) % NVFP4_BLOCK:
            raise FormatError(
                f"layers.{ctx.layer}.{ctx.role}: nvfp4 pad {pad!r} does not match head_dim {d}"
            )
        dp = d + pad
        codes = plane_as_tensor(enc, ctx, "codes", np.uint8, (t, h, dp // 2))
        bs = plane_as_tensor(enc, ctx, "block_scale", np.uint8, (t, h, dp // NVFP4_BLOCK))
        ts = plane_as_tensor(enc, ctx, "tensor_scale", np.float32, (1,))
        if not (bool(torch.isfinite(ts).all()) and float(ts[0]) > 0):
            raise FormatError(f"layers.{ctx.layer}.{ctx.role}: nvfp4 tensor_scale must be positive")
        # E4M3 code 0x7F/0xFF is NaN; encode never writes it (and never a negative scale).
        if bs.numel() and bool(((bs & 0x7F) == 0x7F).any() | ((bs & 0x80) != 0).any()):
            raise FormatError(f"layers.{ctx.layer}.{ctx.role}: nvfp4 block scale is NaN or negative")
        return nvfp4_dequantize_fast(NVFP4Tensor(codes, bs, ts, pad), ctx.dtype)


register_preset("nvfp4", {"id": "nvfp4"},
                "NVFP4: E2M1 + E4M3 scale per 16 values + fp32 tensor scale (4.5 bits)")
