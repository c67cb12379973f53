"""kvc's prediction across layers in C (:func:`kvcodec.codecs.kvc.xpred.affine_reference`, bit for
bit). C side: csrc/xpred.c.
"""

from __future__ import annotations

import numpy as np

from .abi import ptr
from .build import Unsupported, required


def affine(x: np.ndarray, w: np.ndarray, b: np.ndarray, lanes: int = 0) -> np.ndarray:
    """``b + x @ w`` in float32 with the normative order (x ``[T, I]``, w ``[I, O]``, b ``[O]``),
    with the widest vector kernel the CPU runs (``lanes`` 0), or the one of 4, 8 (AVX2) or 16
    (AVX-512) lanes asked for (tests: every kernel gives the same bits).

    Raises:
        Unsupported: the native library is unavailable (the caller runs the reference), or the
            CPU lacks the kernel asked for.
    """
    lb = required()
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    t, n_in = x.shape
    if w.shape[0] != n_in or b.shape != (w.shape[1],):
        raise ValueError(f"affine: x {list(x.shape)}, w {list(w.shape)}, b {list(b.shape)} do not fit")
    out = np.empty((t, w.shape[1]), dtype=np.float32)
    if lanes not in (0, 4, 8, 16):
        raise ValueError(f"lanes must be 0, 4, 8 or 16, got {lanes}")
    if lb.kvn_xpred_affine(ptr(x), t, n_in, ptr(w), ptr(b), w.shape[1], ptr(out), lanes) == 0:
        raise Unsupported(f"this CPU has no {lanes}-lane kernel")
    return out
