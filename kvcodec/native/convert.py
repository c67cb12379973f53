"""Float conversions in C: float16 widened exactly to float32. C side: csrc/convert.c."""

from __future__ import annotations

import numpy as np

from .abi import F_F16, ptr
from .build import Unsupported, required


def widen(a: np.ndarray) -> np.ndarray:
    """float16 values (numpy) widened exactly to a new float32 array of their shape (``kvn_convert``,
    with F16C where the CPU has it: numpy's own cast runs a scalar loop here).

    Raises:
        Unsupported: the native library is unavailable (the caller uses ``astype``).
    """
    lb = required()
    if a.dtype != np.float16:
        raise Unsupported("widen takes float16")
    src = np.ascontiguousarray(a)
    out = np.empty(src.shape, dtype=np.float32)
    lb.kvn_convert(F_F16, 1, ptr(src), ptr(out), src.size)
    return out

