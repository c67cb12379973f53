"""Table clustering of an ANS stage: per-row histograms and the k-means-like grouping of rows
into shared tables (``tables="cluster"``).
"""

from __future__ import annotations

import math

import numpy as np

from .tables import build_tables

def _histograms(symbols: np.ndarray, a: int, layout: str) -> np.ndarray:
    """``int64 [R, A]`` counts of each row's symbols (native when available, else numpy)."""
    from .. import native

    try:
        return native.histograms(symbols, a, layout)
    except native.Unsupported:
        pass
    x = np.asarray(symbols)
    if layout == "tokens":
        x = x.T
    r = x.shape[0]
    flat = (np.arange(r, dtype=np.int64)[:, None] * a + x).ravel()
    return np.bincount(flat, minlength=r * a).reshape(r, a)


def _member_sums(h: np.ndarray, assign: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster sums of the rows of ``h`` (float64 counts) and which clusters have members.

    One weighted bincount, not a matrix product: the sums of integer counts are exact in any
    order, and a wide product would start BLAS threads that crawl on a busy machine. (The
    native passes, :func:`kvcodec.native.tables.cluster_iterate`, take these sums themselves.)"""
    r, a = h.shape
    idx = (assign.astype(np.int64)[:, None] * a + np.arange(a)).ravel()
    sums = np.bincount(idx, weights=h.ravel(), minlength=k * a).reshape(k, a)
    return sums, np.bincount(assign, minlength=k) > 0


def _native_run(h: np.ndarray, k: int, centers: np.ndarray, iters: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """:func:`kvcodec.native.tables.cluster_iterate`, or None (no native coder: the numpy loop
    of :func:`_cluster_tables`, the same result)."""
    from .. import native
    from ..native.tables import cluster_iterate

    try:
        return cluster_iterate(h, k, centers, iters)
    except native.Unsupported:
        return None


#: passes of the table clustering (each never increases the total code length)
CLUSTER_PASSES = 8


def _gains(h: np.ndarray, q: np.ndarray) -> np.ndarray:
    """``[R, k]``: minus each row's code length with each table (in nats), ``sum_c h[r, c] log
    q[j, c]`` summed in ascending ``c`` with Python's (the C library's) log: one fixed order of
    operations, so the clustering no longer depends on the BLAS build (a product's order does),
    and the native pass matches it bit for bit (a column of zero counts adds nothing)."""
    lq = np.array([[math.log(v) for v in row] for row in q.tolist()], dtype=np.float64).reshape(q.shape)
    gain = np.zeros((h.shape[0], q.shape[0]), dtype=np.float64)
    for c in np.flatnonzero(h.any(axis=0)):
        gain += h[:, c : c + 1] * lq[:, c]
    return gain


def _cluster_tables(hist: np.ndarray, k: int, precision: int) -> tuple[np.ndarray, np.ndarray]:
    """KL k-means of row histograms into ``k`` shared tables (deterministic; the gains in a fixed
    order, :func:`_gains`).

    Cost of coding row ``r`` with distribution ``q`` is ``-Σ h[r,a] log q[a]`` (its code length),
    so assigning each row to the cheapest table and re-estimating tables from member histograms
    never increases the total code length. The whole clustering runs in one C call where built
    (:func:`kvcodec.native.tables.cluster_tables`: each call here held the GIL for ~0.2 ms of
    numpy, 9 % of a calibrated Qwen2.5-Coder-0.5B encode's GIL time), else here, with the same
    bits.
    """
    from .. import native
    from ..native.tables import cluster_tables

    try:
        tables, assign = cluster_tables(hist, k, precision, CLUSTER_PASSES)
        return tables, assign.astype(np.uint8 if k <= 256 else np.uint16)
    except native.Unsupported:
        pass
    h = hist.astype(np.float64)
    r, a = h.shape
    # deterministic init: rows spread evenly over the order of their mean symbol and spread
    # (integer sums: exact in any order)
    mean = (h @ np.arange(a, dtype=np.float64)) / np.maximum(h.sum(1), 1)
    order = np.lexsort((np.arange(r), mean))
    centers = h[order[np.linspace(0, r - 1, k).round().astype(int)]] + 0.5
    got = _native_run(h, k, centers, CLUSTER_PASSES)
    if got is not None:
        assign, sums, used = got
    else:
        assign = np.zeros(r, dtype=np.int64)
        q = centers / centers.sum(1, keepdims=True)
        for _ in range(CLUSTER_PASSES):
            new = _gains(h, q).argmax(1)
            if _ and (new == assign).all():
                break
            assign = new
            sums, used = _member_sums(h, assign, k)  # (the first pass always gets here)
            centers = np.where(used[:, None], sums + 0.5, centers)
            q = centers / centers.sum(1, keepdims=True)
    # sums and used are those of the final assignment; empty clusters keep a table (from all
    # rows) so every chunk's set has exactly k tables
    th = np.where(used[:, None], sums, h.sum(0)[None, :]).astype(np.int64)
    return build_tables(th, precision), assign.astype(np.uint8 if k <= 256 else np.uint16)
