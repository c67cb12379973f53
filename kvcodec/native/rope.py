"""kvc's rotating means in C (:mod:`kvcodec.transforms.rope`'s :func:`rotated_means_reference`
and :func:`unrotated_mean_reference`, bit for bit). C side: csrc/rope.c.
"""

from __future__ import annotations

import numpy as np

from .abi import ptr
from .build import required

_STYLE = {"half": 0, "interleaved": 1}


def _args(positions: np.ndarray, steps: np.ndarray, offset: int, style: str, width: int, n: int) -> tuple:
    pos = np.ascontiguousarray(positions, dtype=np.int64)
    st = np.ascontiguousarray(steps, dtype=np.uint32)
    if pos.shape != (n,) or st.ndim != 1 or style not in _STYLE or offset < 0 or offset + 2 * st.size > width:
        raise ValueError(f"rope: {n} positions, steps [r2] with offset + 2 r2 <= {width} and a style of {list(_STYLE)}")
    return pos, st


def _table(table: np.ndarray) -> tuple[np.ndarray, int]:
    t = np.ascontiguousarray(table, dtype=np.float32)
    bits = t.size.bit_length() - 1
    if t.ndim != 1 or t.size != 1 << bits or not 2 <= bits <= 24:
        raise ValueError("rope: the sine table must hold 2**k float32 values")
    return t, bits


def rotated_means(mu: np.ndarray, positions: np.ndarray, steps: np.ndarray, offset: int, style: str,
                  table: np.ndarray) -> np.ndarray:
    """``R(p) mu`` for every position: float32 ``[n, H, D]`` from ``mu`` ``[H, D]``, with the
    sine ``table`` (:func:`kvcodec.transforms.rope.sin_table`)."""
    lb = required()
    m = np.ascontiguousarray(mu, dtype=np.float32)
    h, d = m.shape
    n = len(positions)
    pos, st = _args(positions, steps, offset, style, d, n)
    out = np.empty((n, h, d), dtype=np.float32)
    tab, bits = _table(table)
    lb.kvn_rotated_means(ptr(m), n, h, d, ptr(pos), ptr(st), st.size, int(offset), _STYLE[style], ptr(tab), bits,
                         ptr(out))
    return out


def rope_centre(y: np.ndarray, mu: np.ndarray, positions: np.ndarray, steps: np.ndarray, offset: int, style: str,
                keep_rot: bool, table: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """``(y - R(p) mu, R(p) mu or None)`` for float32 ``y`` ``[n, H, D]`` and ``mu`` ``[H, D]``
    (float32 ``[n, H, D]`` each; the rotated means only with ``keep_rot``), in one pass, with the
    sine ``table``."""
    lb = required()
    m = np.ascontiguousarray(mu, dtype=np.float32)
    h, d = m.shape
    x = np.ascontiguousarray(y)
    if x.dtype != np.float32 or x.shape[1:] != (h, d):
        raise ValueError(f"rope_centre: float32 [n, {h}, {d}] values expected")
    n = x.shape[0]
    pos, st = _args(positions, steps, offset, style, d, n)
    z = np.empty((n, h, d), dtype=np.float32)
    rot = np.empty((n, h, d), dtype=np.float32) if keep_rot else None
    tab, bits = _table(table)
    lb.kvn_rope_centre(ptr(x), ptr(m), n, h, d, ptr(pos), ptr(st), st.size, int(offset), _STYLE[style], ptr(tab),
                       bits, ptr(z), None if rot is None else ptr(rot))
    return z, rot


def unrotated_mean(k: np.ndarray, positions: np.ndarray, steps: np.ndarray, offset: int, style: str,
                   table: np.ndarray) -> np.ndarray:
    """The mean over tokens of ``R(p)^-1 k`` (float64 ``[H, D]``) for float32 or float16 ``k``
    ``[n, H, D]`` with ``n >= 1``, with the sine ``table``."""
    from .abi import F_F16, F_F32

    lb = required()
    x = np.ascontiguousarray(k)
    if x.dtype not in (np.float32, np.float16) or x.ndim != 3 or x.shape[0] < 1:
        raise ValueError("unrotated_mean: float32 or float16 [n >= 1, H, D] expected")
    n, h, d = x.shape
    pos, st = _args(positions, steps, offset, style, d, n)
    out = np.empty((h, d), dtype=np.float64)
    tab, bits = _table(table)
    lb.kvn_unrotated_mean(ptr(x), F_F32 if x.dtype == np.float32 else F_F16, n, h, d, ptr(pos), ptr(st), st.size,
                          int(offset), _STYLE[style], ptr(tab), bits, ptr(out))
    return out
