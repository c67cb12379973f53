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

from dataclasses import dataclass

from ..codec import Codec, EncodedTensor, TensorContext, register_codec, register_preset
from ..errors import FormatError
from ..quant.fast import nvfp4_dequantize_fast, nvfp4_quantize_fast
from ..quant.fp8 import F4E2M1, F8E4M3, FP32_MIN_NORMAL
from ..quant.nvfp4 import NVFP4_BLOCK, NVFP4Tensor
from .fp8 import NOMINAL_SHAPE
from .parsing import DTYPE_MAX, check_plane_names, f32_bound, plane, strict_int, where


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

    def parse_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> "Nvfp4Parsed":
        """Validate one coded tensor against formats/SPEC.md §11.3 (shared by every decoder).

        Raises:
            FormatError: a pad that does not match head_dim, planes missing, of the wrong dtype or
                shape, unknown planes, NaN or negative block scales, a tensor scale outside what
                encode writes.
        """
        return parse_nvfp4(enc, ctx)

    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        v = self.parse_tensor(enc, ctx)
        q = NVFP4Tensor(torch.from_numpy(v.codes.copy()), torch.from_numpy(v.block_scale.copy()),
                        torch.from_numpy(v.tensor_scale.copy()), v.pad)
        return nvfp4_dequantize_fast(q, ctx.dtype)


@dataclass(frozen=True)
class Nvfp4Parsed:
    """One nvfp4 tensor, validated (:func:`parse_nvfp4`): ``codes uint8 [T, H, Dp/2]``,
    ``block_scale uint8 [T, H, Dp/16]`` (E4M3 codes, no sign, no NaN), ``tensor_scale float32 [1]``
    in ``[2^-126, max_tensor_scale(dtype)]``."""

    pad: int
    codes: np.ndarray
    block_scale: np.ndarray
    tensor_scale: np.ndarray


def max_tensor_scale(dtype: torch.dtype) -> float:
    """The largest tensor scale encode writes: ``f32(dtype_max / (448 * 6))``; with it every block
    decodes to finite values of the source dtype (formats/SPEC.md §11.1)."""
    return f32_bound(np.float32(DTYPE_MAX[dtype]) / np.float32(F8E4M3.max * F4E2M1.max))


def parse_nvfp4(enc: EncodedTensor, ctx: TensorContext) -> Nvfp4Parsed:
    """:meth:`NVFP4Codec.parse_tensor` (see there)."""
    at = where(ctx)
    t, h, d = ctx.shape
    pad = (-d) % NVFP4_BLOCK
    strict_int(enc.params, "pad", pad, pad, at)
    dp = d + pad
    check_plane_names(enc.planes, ("codes", "block_scale", "tensor_scale"), at, "nvfp4")
    codes = plane(enc.planes, "codes", np.uint8, (t, h, dp // 2), at)
    bs = plane(enc.planes, "block_scale", np.uint8, (t, h, dp // NVFP4_BLOCK), at)
    ts = plane(enc.planes, "tensor_scale", np.float32, (1,), at)
    hi = max_tensor_scale(ctx.dtype)
    if not FP32_MIN_NORMAL <= float(ts[0]) <= hi:
        raise FormatError(f"{at}: nvfp4 tensor_scale {float(ts[0])!r} outside [2^-126, {hi!r}] (encode writes "
                          f"amax / 2688, amax at most the {str(ctx.dtype).removeprefix('torch.')} source's largest value)")
    # E4M3 code 0x7F/0xFF is NaN; encode never writes it (and never a negative scale).
    if bs.size and bool((((bs & 0x7F) == 0x7F) | ((bs & 0x80) != 0)).any()):
        raise FormatError(f"{at}: nvfp4 block scale is NaN or negative")
    return Nvfp4Parsed(pad, codes, bs, ts)

register_preset("nvfp4", {"id": "nvfp4"},
                "NVFP4: E2M1 + E4M3 scale per 16 values + fp32 tensor scale (4.5 bits)")
