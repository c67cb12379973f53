"""The dead-zone quantizer of :mod:`kvcodec.quant.deadzone` in C: codes, and the
reconstruction-offset sums of those codes, in one pass (the same float64 arithmetic and the same
integers; tests/test_native.py, tests/test_kvc_recon.py). C side: csrc/deadzone.c.
"""

from __future__ import annotations

import numpy as np

from .abi import code_kind, ptr
from .build import Unsupported, required


def deadzone_quantize(x: np.ndarray, step: np.ndarray, rho: float, out: np.ndarray | None = None) -> np.ndarray:
    """:func:`kvcodec.quant.deadzone.deadzone_quantize` for a float32 ``x`` of up to 3 dims (the
    same float64 arithmetic, int64 codes). Float32 steps are read as they are (exactly widened).
    ``out``: an int64 ``[n0, >= n1 * n2]`` matrix with contiguous rows (a view of the first
    columns of a wider one is fine) that receives the codes of ``x [n0, n1, n2]``; returned.

    Raises:
        Unsupported: this path does not apply (other dtypes or shapes, a step that does not
            broadcast, non-finite values or huge codes): the caller runs the numpy code.
    """
    return deadzone_recon(x, step, rho, out, 0)[0]


def deadzone_recon(x: np.ndarray, step: np.ndarray, rho: float, out: np.ndarray | None,
                   levels: int) -> tuple[np.ndarray, tuple[list[int], list[int]] | None]:
    """:func:`deadzone_quantize` and, with ``1 <= levels <= 16``, the reconstruction sums of
    :func:`recon_sums` for those codes, in one pass: ``(codes, (sums, counts))`` (``(codes,
    None)`` with ``levels`` 0). ``out`` may be int32 (half the memory traffic of int64; kvc's
    encoder asks for it).

    Raises:
        Unsupported: as :func:`deadzone_quantize`, or levels outside ``[0, 16]`` (``[1, 16]`` need
            a 3-dim ``x``), or an int32 ``out`` that a code does not fit (``|c| >= 2**31``).
    """
    lb = required()
    x3, st, strides, kind = _dz_operands(x, step)
    if not 0 <= levels <= 16 or (levels and np.ndim(x) != 3):
        raise Unsupported(f"dead-zone: {levels} reconstruction levels of a {np.ndim(x)}-dim tensor")
    n0, n1, n2 = x3.shape
    if out is None:
        codes, orow = np.empty(x3.shape, dtype=np.int64), n1 * n2
    else:
        codes = out
        if out.dtype not in (np.int64, np.int32) or out.ndim != 2 or out.shape != (n0, n1 * n2):
            raise ValueError(f"deadzone out must be an int64 or int32 [{n0}, {n1 * n2}] matrix")
        if out.size == 0:
            return out, (([0] * levels, [0] * levels) if levels else None)
        es = out.itemsize
        if (n1 * n2 > 1 and out.strides[1] != es) or (n0 > 1 and out.strides[0] % es):
            raise ValueError(f"deadzone out must be an int64 or int32 [{n0}, {n1 * n2}] view with contiguous rows")
        orow = out.strides[0] // es if n0 > 1 else n1 * n2
    args = (ptr(x3), n0, n1, n2, ptr(st), kind, *strides, float(rho), ptr(codes),
            code_kind(codes), orow)
    if not levels:
        if lb.kvn_deadzone(*args) != 0:
            raise Unsupported("dead-zone: non-finite values or codes beyond the output type")
        return (codes if out is not None else codes.reshape(np.shape(x))), None
    sums = np.zeros(levels, dtype=np.int64)
    counts = np.zeros(levels, dtype=np.int64)
    if lb.kvn_deadzone_recon(*args, int(levels), ptr(sums), ptr(counts)) != 0:
        raise Unsupported("dead-zone: non-finite values or codes beyond the output type")
    return codes, ([int(v) for v in sums], [int(v) for v in counts])


def _dz_operands(x: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int], int]:
    """What the dead-zone C loops read: ``x`` as a contiguous float32 ``[n0, n1, n2]`` (fewer
    dims padded in front), ``step`` broadcast to it (float32 kept, anything else float64), its
    element strides and kind (1 float32, 0 float64).

    Raises:
        Unsupported: ``x`` is not float32 of up to 3 dims, or ``step`` does not broadcast to it.
    """
    xa = np.asarray(x)
    if xa.dtype != np.float32 or xa.ndim > 3:
        raise Unsupported(f"dead-zone: {xa.dtype} input of {xa.ndim} dims")
    x3 = np.ascontiguousarray(xa.reshape((1,) * (3 - xa.ndim) + xa.shape))
    sa = np.asarray(step)
    if sa.dtype != np.float32:
        sa = sa.astype(np.float64)
    try:
        st = np.broadcast_to(sa, xa.shape).reshape(x3.shape)
    except ValueError:
        raise Unsupported("dead-zone: the step does not broadcast to x") from None
    if st.size and any(s % st.itemsize for s in st.strides):
        raise Unsupported("dead-zone: step strides not a multiple of its element size")
    strides = [s // st.itemsize for s in st.strides] if st.size else [0, 0, 0]
    return x3, st, strides, 1 if st.dtype == np.float32 else 0


def recon_sums(x: np.ndarray, step: np.ndarray, codes: np.ndarray, levels: int) -> tuple[list[int], list[int]]:
    """:func:`kvcodec.quant.deadzone.recon_sums` (the same integers) for a float32 ``x`` of 3 dims
    and the int64 codes :func:`deadzone_quantize` wrote (``[n0, n1, n2]``, or a ``[n0, >= n1 *
    n2]`` matrix with contiguous rows holding them in its first columns).

    Raises:
        Unsupported: other operands (the caller runs the numpy code).
    """
    lb = required()
    if np.ndim(x) != 3 or levels < 1:
        raise Unsupported(f"recon sums: {levels} levels of a {np.ndim(x)}-dim tensor")
    x3, st, strides, kind = _dz_operands(x, step)
    n0, n1, n2 = x3.shape
    c = np.asarray(codes)
    if c.dtype != np.int64:
        raise Unsupported(f"recon sums: {c.dtype} codes")
    if c.ndim == 3 and c.shape == x3.shape:
        c = np.ascontiguousarray(c).reshape(n0, n1 * n2)
    if c.ndim != 2 or c.shape[0] != n0 or c.shape[1] < n1 * n2 or (n1 * n2 > 1 and c.strides[1] != 8) \
            or (n0 > 1 and c.strides[0] % 8):
        raise Unsupported(f"recon sums: codes {list(c.shape)} do not lay out as [{n0}, >= {n1 * n2}] rows")
    orow = c.strides[0] // 8 if n0 > 1 else n1 * n2
    sums = np.zeros(levels, dtype=np.int64)
    counts = np.zeros(levels, dtype=np.int64)
    if lb.kvn_recon_sums(ptr(x3), n0, n1, n2, ptr(st), kind, *strides,
                         ptr(c), orow, int(levels), ptr(sums), ptr(counts)) != 0:
        raise Unsupported(f"recon sums: {levels} levels")
    return [int(v) for v in sums], [int(v) for v in counts]
