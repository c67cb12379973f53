"""CacheGen's per-token quantization in C (:mod:`kvcodec.codecs.cachegen`): the symmetric
token quantizer and the row-affine dequantization, bit-identical to the reference functions
(tests/test_native.py). C side: csrc/quant.c.
"""

from __future__ import annotations

import numpy as np

from ..errors import FormatError, InputError
from .abi import BAD_SYMBOL, NOMEM, float_kind, ptr
from .ans import symbol_view
from .build import required


def token_quantize(x, rows: np.ndarray, levels: int, base: np.ndarray | None = None,
                   brow: np.ndarray | None = None):
    """CacheGen's per-token symmetric quantization of rows ``rows`` of ``x`` (a ``[T, C]``
    float16/bfloat16/float32 tensor), optionally minus ``base[brow[j]]`` (float32); returns
    ``(codes uint16 [n, C] in [0, levels), scale16 float16 [n])`` as numpy arrays, bit-identical to
    :func:`kvcodec.codecs.cachegen.symmetric_token_quantize`.

    Raises:
        InputError: a scale beyond float16 (or NaN input), the reference's message.
    """
    lb = required()
    xc = x.detach().cpu().contiguous()
    c = xc.shape[1]
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    n = rows.size
    codes = np.empty((n, c), dtype=np.uint16)
    scale = np.empty(n, dtype=np.float16)
    b = None if base is None else np.ascontiguousarray(base, dtype=np.float32)
    br = None if brow is None else np.ascontiguousarray(brow, dtype=np.int64)
    rc = lb.kvn_tok_quant(xc.data_ptr(), float_kind(xc.dtype), n, c, ptr(rows), None if b is None else ptr(b),
                          None if br is None else ptr(br), (int(levels) - 1) // 2, ptr(scale), ptr(codes))
    if rc == 2:
        raise InputError("per-token scale exceeds float16 range (|x| too large)")
    if rc == NOMEM:
        raise MemoryError("native quantization: out of memory")
    return codes, scale


def rows_affine(codes: np.ndarray, orow: np.ndarray, scale: np.ndarray, mid: int, out, *, max_code: int,
                base: np.ndarray | None = None, brow: np.ndarray | None = None):
    """CacheGen-style dequantization into rows of ``out`` (a contiguous torch ``[rows, C]``
    tensor): for code row ``j``, ``out[orow[j]] = f32(codes[j] - mid) * scale[j]`` (plus
    ``base[brow[j]]`` first-operand-added when given), cast to ``out``'s dtype with RNE.
    Returns ``out``.

    Raises:
        FormatError: a code exceeds ``max_code``: ``code <c> outside the <max_code + 1> levels``,
            the reference decoder's message (the caller puts the tensor's name in front).
    """
    lb = required()
    x, kind, _, _ = symbol_view(codes, "tokens")
    x = np.ascontiguousarray(x)  # read as [n, C] rows back to back
    n, c = x.shape
    orow = np.ascontiguousarray(orow, dtype=np.int64)
    sc = np.ascontiguousarray(scale, dtype=np.float32)
    b = None if base is None else np.ascontiguousarray(base, dtype=np.float32)
    br = None if brow is None else np.ascontiguousarray(brow, dtype=np.int64)
    rc = lb.kvn_rows_affine(ptr(x), kind, n, c, ptr(orow), ptr(sc), mid, max_code,
                            None if b is None else ptr(b), None if br is None else ptr(br),
                            float_kind(out.dtype), out.data_ptr())
    if rc == NOMEM:
        raise MemoryError("native dequantization: out of memory")
    if rc == BAD_SYMBOL:
        raise FormatError(f"code {int(x.max())} outside the {max_code + 1} levels")
    return out
