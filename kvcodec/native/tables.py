"""The entropy stage's table clustering in C (:mod:`kvcodec.entropy.clustering`): its passes,
or the whole clustering with its tables, in one call. C side: csrc/tables.c.
"""

from __future__ import annotations

import numpy as np

from .abi import ptr
from .build import Unsupported, required


def cluster_iterate(h: np.ndarray, k: int, centers: np.ndarray, iters: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The table clustering's passes after its first ``centers`` (float64 ``[k, A]``) over the
    rows ``h`` (float64 ``[R, A]`` counts), at most ``iters``, in one call
    (``kvn_cluster_iterate``): ``(assign int64 [R], sums [k, A], used bool [k])`` of the final
    assignment, bit for bit what the numpy loop of
    :func:`kvcodec.entropy.clustering._cluster_tables` gives.

    Raises:
        Unsupported: without the native coder.
        MemoryError: out of memory.
    """
    lb = required()
    hh = np.ascontiguousarray(h, dtype=np.float64)
    r, a = hh.shape
    c = np.array(centers, dtype=np.float64, order="C")
    if c.shape != (k, a) or k < 1 or iters < 1:
        raise ValueError(f"centers must be [{k}, {a}] with k, iters >= 1, got {list(c.shape)}, {iters}")
    assign = np.zeros(r, dtype=np.int64)
    sums = np.zeros((k, a), dtype=np.float64)
    used = np.zeros(k, dtype=np.uint8)
    q = np.empty((k, a), dtype=np.float64)
    if lb.kvn_cluster_iterate(ptr(hh), r, a, k, int(iters), ptr(c), ptr(assign), ptr(sums), ptr(used), ptr(q)) < 0:
        raise MemoryError("kvn_cluster_iterate: out of memory")
    return assign, sums, used.view(bool)


def cluster_tables(hist: np.ndarray, k: int, precision: int, iters: int) -> tuple[np.ndarray, np.ndarray]:
    """The whole table clustering of :func:`kvcodec.entropy.clustering._cluster_tables` in one
    call (``kvn_cluster_tables``): the first centres, at most ``iters`` passes and each cluster's
    table of ``precision`` bits from the integer counts ``hist [R, A]``: ``(tables uint32 [k, A],
    assign int64 [R])``, bit for bit what the numpy code gives.

    Raises:
        Unsupported: without the native coder, or counts the numpy code takes on its own
            (negative, or so large that a table's products could pass 2**62; bad sizes).
        MemoryError: out of memory.
    """
    lb = required()
    h = np.ascontiguousarray(hist, dtype=np.int64)
    if h.ndim != 2:
        raise Unsupported("cluster_tables: counts must be [R, A]")
    r, a = h.shape
    tables = np.empty((max(k, 0), a), dtype=np.uint32)
    assign = np.zeros(r, dtype=np.int64)
    rc = lb.kvn_cluster_tables(ptr(h), r, a, int(k), int(iters), int(precision), ptr(tables), ptr(assign))
    if rc == -1:
        raise MemoryError("kvn_cluster_tables: out of memory")
    if rc < 0:
        raise Unsupported(f"cluster_tables: {r} x {a} counts into {k} tables of {precision} bits")
    return tables, assign
