"""KIVI (:mod:`kvcodec.quant.intq`) in C: quantization and dequantization in one pass each,
bit-identical to :mod:`kvcodec.quant.fast` (tests/test_native.py). C side: csrc/quant.c.
"""

from __future__ import annotations

import numpy as np

from ..errors import InputError
from .abi import NOMEM, float_kind, ptr
from .build import required


def intq_dequantize(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, axis: str, group: int, dtype):
    """KIVI dequantization of ``uint8 codes [T, H, D]`` into a new torch tensor of ``dtype``,
    bit-identical to :func:`kvcodec.quant.fast.intq_dequantize_fast` (float32 ``code * scale +
    zero``, clamped to the finite range of fp16/bf16, cast with round-to-nearest-even)."""
    import torch

    lb = required()
    c = np.ascontiguousarray(codes, dtype=np.uint8)
    t, h, d = c.shape
    group = min(int(group), max(t, d, 1))  # a group as long as the axis is one group: same result, no overflow
    s = np.ascontiguousarray(scale, dtype=np.float32)
    z = np.ascontiguousarray(zero, dtype=np.float32)
    out = torch.empty((t, h, d), dtype=dtype)
    fmax = 0.0 if dtype == torch.float32 else float(torch.finfo(dtype).max)
    rc = lb.kvn_intq_dequant(ptr(c), t, h, d, 0 if axis == "channel" else 1, group, ptr(s), ptr(z), fmax,
                             float_kind(dtype), out.data_ptr())
    if rc == NOMEM:
        raise MemoryError("native dequantization: out of memory")
    return out


def intq_quantize(x, bits: int, axis: str, group: int):
    """KIVI quantization of a ``[T, H, D]`` float16/bfloat16/float32 tensor in one native pass;
    returns ``(codes uint8 [T, H, D], scale16, zero16)`` as torch tensors, bit-identical to
    :func:`kvcodec.quant.fast.intq_quantize_fast`.

    Raises:
        InputError: NaN/Inf input, or a scale/zero beyond float16 (same messages as the fast path).
    """
    import torch

    lb = required()
    xc = x.detach().cpu().contiguous()
    t, h, d = xc.shape
    codes = torch.empty((t, h, d), dtype=torch.uint8)
    # the scale/zero shape (kvcodec.quant.intq.intq_param_shape; native does not import quant)
    ps = (-(-t // group), h, d) if axis == "channel" else (t, h, -(-d // group))
    group = min(int(group), max(t, d, 1))  # as in intq_dequantize
    scale = torch.empty(ps, dtype=torch.float16)
    zero = torch.empty(ps, dtype=torch.float16)
    rc = lb.kvn_intq_quant(xc.data_ptr(), float_kind(xc.dtype), t, h, d, 0 if axis == "channel" else 1, group, bits,
                           scale.data_ptr(), zero.data_ptr(), codes.data_ptr())
    if rc == 1:
        raise InputError("input holds NaN or Inf values; refusing to quantize")
    if rc == 2:
        raise InputError("values too large for float16 scales/zeros (|x| or the group range exceeds 65504)")
    if rc == NOMEM:
        raise MemoryError("native quantization: out of memory")
    return codes, scale, zero
