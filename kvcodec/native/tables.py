"""The entropy stage's table clustering in C (:mod:`kvcodec.entropy.stage`): per-cluster sums
of row histograms. C side: csrc/tables.c.
"""

from __future__ import annotations

import numpy as np

from .abi import ptr
from .build import required


def member_sums(h: np.ndarray, assign: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster sums of the rows of ``h`` (float64 counts; exact) and which clusters are used.

    Raises:
        Unsupported: without the native coder.
    """
    lb = required()
    hh = np.ascontiguousarray(h, dtype=np.float64)
    asg = np.ascontiguousarray(assign, dtype=np.int64)
    r, a = hh.shape
    sums = np.empty((k, a), dtype=np.float64)
    used = np.empty(k, dtype=np.uint8)
    lb.kvn_member_sums(ptr(hh), r, a, ptr(asg), k, ptr(sums), ptr(used))
    return sums, used.astype(bool)
