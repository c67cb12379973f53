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


class ClusterUpdate:
    """``kvn_cluster_update`` over one clustering's rows ``h`` (float64 ``[R, A]`` counts), ``k``
    tables and their first centres (float64 ``[k, A]``, copied), with its arrays made and
    addressed once. Each call takes the gains ``[R, k]`` and updates :attr:`assign` (int64
    ``[R]``), :attr:`sums` (``[k, A]``), :attr:`used` (bool ``[k]``), :attr:`centers` and the
    next distributions :attr:`q` (``[k, A]``) as ``argmax``, :func:`member_sums`, ``np.where`` and
    ``centers / centers.sum(1)`` would; it returns whether the assignment changed (always True
    with ``first``). :attr:`q` holds nothing before the first call (the caller makes the first
    distributions, as without the native coder).

    Raises:
        Unsupported: without the native coder.
    """

    def __init__(self, h: np.ndarray, k: int, centers: np.ndarray) -> None:
        self._fn = required().kvn_cluster_update
        self.h = np.ascontiguousarray(h, dtype=np.float64)
        self.r, self.a = self.h.shape
        self.k = int(k)
        self.centers = np.array(centers, dtype=np.float64, order="C")
        if self.centers.shape != (self.k, self.a):
            raise ValueError(f"centers must be [{self.k}, {self.a}], got {list(self.centers.shape)}")
        self.q = np.empty((self.k, self.a), dtype=np.float64)
        self.assign = np.zeros(self.r, dtype=np.int64)
        self.sums = np.zeros((self.k, self.a), dtype=np.float64)
        self._used = np.zeros(self.k, dtype=np.uint8)
        self.used = self._used.view(bool)
        self._ptrs = (ptr(self.h), ptr(self.assign), ptr(self.sums), ptr(self._used), ptr(self.centers), ptr(self.q))

    def __call__(self, gain: np.ndarray, first: bool) -> bool:
        g = gain if gain.dtype == np.float64 and gain.flags.c_contiguous else np.ascontiguousarray(gain, np.float64)
        if g.shape != (self.r, self.k):
            raise ValueError(f"gains must be [{self.r}, {self.k}], got {list(g.shape)}")
        hp, ap, sp, up, cp, qp = self._ptrs
        return bool(self._fn(g.ctypes.data, self.r, self.k, hp, self.a, ap, int(first), sp, up, cp, qp))
