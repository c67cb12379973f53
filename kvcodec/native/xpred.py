"""kvc's prediction across layers in C (:func:`kvcodec.codecs.kvc.xpred.affine_reference`, bit for
bit). C side: csrc/xpred.c.
"""

from __future__ import annotations

import numpy as np

from .abi import OK, ptr
from .build import required


def affine(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``b + x @ w`` in float32 with the normative order (x ``[T, I]``, w ``[I, O]``, b ``[O]``).

    Raises:
        Unsupported: the native library is unavailable (the caller runs the reference).
    """
    lb = required()
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    t, n_in = x.shape
    if w.shape[0] != n_in or b.shape != (w.shape[1],):
        raise ValueError(f"affine: x {list(x.shape)}, w {list(w.shape)}, b {list(b.shape)} do not fit")
    out = np.empty((t, w.shape[1]), dtype=np.float32)
    rc = lb.kvn_xpred_affine(ptr(x), t, n_in, ptr(w), ptr(b), w.shape[1], ptr(out))
    if rc != OK:  # pragma: no cover - the function has no failure path
        raise MemoryError(f"native xpred affine failed ({rc})")
    return out
