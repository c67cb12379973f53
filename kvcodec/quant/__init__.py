"""Reference quantizers: plain torch code that *defines* each number format and stage.

Fast paths (CUDA kernels, vectorised variants) are tested bit-exact against these.

* :mod:`~kvcodec.quant.fp8` — FP8 E4M3FN / E5M2 (and the generic minifloat rounding).
* :mod:`~kvcodec.quant.nvfp4` — NVFP4 (E2M1 + E4M3 block scales + FP32 tensor scale).
* :mod:`~kvcodec.quant.intq` — integer asymmetric min-max, 1..8 bits, KIVI-style axes.
* :mod:`~kvcodec.quant.delta` — anchor-based delta coding of integer codes across tokens.
* :mod:`~kvcodec.quant.packing` — fixed-width LSB-first bit packing.
* :mod:`~kvcodec.quant.fast` — numpy fast paths, bit-exact with the references (the codecs use them).

Example:
    >>> import torch
    >>> from kvcodec.quant import pack_bits, unpack_bits, delta_encode, delta_decode
    >>> unpack_bits(pack_bits(torch.tensor([3, 0, 1]), 2), 2, 3).tolist()
    [3, 0, 1]
    >>> delta_decode(delta_encode(torch.tensor([4, 5, 3]), 2), 2).tolist()
    [4, 5, 3]
"""

from .delta import delta_decode, delta_encode
from .fast import (
    fp8_decode_fast,
    fp8_encode_fast,
    intq_dequantize_fast,
    intq_quantize_fast,
    nvfp4_dequantize_fast,
    nvfp4_quantize_fast,
)
from .fp8 import (
    F4E2M1,
    F8E4M3,
    F8E4M3_MAX,
    F8E5M2,
    F8E5M2_MAX,
    MinifloatFormat,
    fp8_decode_reference,
    fp8_encode_reference,
    minifloat_decode,
    minifloat_encode,
)
from .intq import IntQTensor, intq_dequantize_reference, intq_quantize_reference
from .nvfp4 import NVFP4Tensor, nvfp4_dequantize_reference, nvfp4_quantize_reference
from .packing import pack_bits, packed_nbytes, unpack_bits

__all__ = [
    "F4E2M1",
    "F8E4M3",
    "F8E4M3_MAX",
    "F8E5M2",
    "F8E5M2_MAX",
    "IntQTensor",
    "MinifloatFormat",
    "NVFP4Tensor",
    "delta_decode",
    "delta_encode",
    "fp8_decode_fast",
    "fp8_decode_reference",
    "fp8_encode_fast",
    "fp8_encode_reference",
    "intq_dequantize_fast",
    "intq_dequantize_reference",
    "intq_quantize_fast",
    "intq_quantize_reference",
    "minifloat_decode",
    "minifloat_encode",
    "nvfp4_dequantize_fast",
    "nvfp4_dequantize_reference",
    "nvfp4_quantize_fast",
    "nvfp4_quantize_reference",
    "pack_bits",
    "packed_nbytes",
    "unpack_bits",
]
