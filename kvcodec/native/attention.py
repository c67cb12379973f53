"""kvc's attention estimate in C: the mean over query rows of each row's softmax
(:func:`kvcodec.codecs.kvc.calibration.softmax_mean`, bit for bit). C side: csrc/attention.c.
"""

from __future__ import annotations

import numpy as np

from .abi import ptr
from .build import Unsupported, required


def softmax_mean(logits: np.ndarray, sinks: np.ndarray | None = None, kernel: int = 0) -> np.ndarray:
    """Per KV head, the mean over its query rows of each row's softmax: ``logits`` float32
    ``[B, R, T]`` (finite or -inf), ``sinks`` float32 ``[B, R]`` (each row's sink logit, whose
    share is dropped) or None; returns float64 ``[T, B]``. ``kernel`` 0: the fastest this CPU
    runs, 1: the plain one, 2: AVX2 (tests: the same bits).

    Raises:
        Unsupported: the native library is unavailable, a logit is NaN or +inf, there are no rows
            or tokens, or the CPU lacks the kernel asked for (the caller runs the reference).
    """
    lb = required()
    x = np.ascontiguousarray(logits, dtype=np.float32)
    if x.ndim != 3:
        raise ValueError(f"softmax_mean: logits [B, R, T] expected, got {list(x.shape)}")
    b, r, t = x.shape
    if x.size == 0:
        raise Unsupported("softmax_mean: no rows or no tokens")
    s = None
    if sinks is not None:
        s = np.ascontiguousarray(sinks, dtype=np.float32)
        if s.shape != (b, r):
            raise ValueError(f"softmax_mean: sinks [{b}, {r}] expected, got {list(s.shape)}")
    if kernel not in (0, 1, 2):
        raise ValueError(f"kernel must be 0, 1 or 2, got {kernel}")
    out = np.empty((t, b), dtype=np.float64)
    rc = lb.kvn_softmax_mean(ptr(x), b, r, t, None if s is None else ptr(s), ptr(out), kernel)
    if rc == -1:
        raise MemoryError("softmax_mean: out of memory")
    if rc == -2:
        raise Unsupported("this CPU has no AVX2 kernel")
    if rc == 1:
        raise Unsupported("softmax_mean: a logit is NaN or +inf")
    return out
