"""Orthonormal fast Walsh–Hadamard transform along the last axis (power-of-two widths).

A fixed rotation needs no calibration and spreads outlier channels over all coordinates. With an
entropy coder behind the quantizer that is *not* automatically a gain: coding gain comes from
unequal variances, which a rotation evens out. It is here to be measured (eval/studies/kvc_rd.py).

Normative arithmetic (so a GPU kernel can match it bit for bit): float32 throughout; stages
``h = 1, 2, 4, ...``; in each stage, for every pair ``(i, i + h)`` inside blocks of ``2h``:
``a, b = x[i], x[i + h]; x[i], x[i + h] = a + b, a - b``; finally multiply by the float32
constant ``1 / sqrt(D)`` (one multiply per element). The transform is its own inverse up to
rounding.

Example:
    >>> import numpy as np
    >>> fwht(np.array([1.0, 0.0, 0.0, 0.0], dtype=np.float32)).tolist()
    [0.5, 0.5, 0.5, 0.5]
"""

from __future__ import annotations

import numpy as np

from ..errors import InputError


def is_power_of_two(n: int) -> bool:
    """True for 1, 2, 4, 8, ..."""
    return n >= 1 and (n & (n - 1)) == 0


def fwht(x: np.ndarray) -> np.ndarray:
    """Orthonormal Walsh–Hadamard transform of the last axis, float32 (see module docstring).

    Raises:
        InputError: the last axis is not a power of two.
    """
    y = np.array(x, dtype=np.float32, copy=True)
    d = y.shape[-1]
    if not is_power_of_two(d):
        raise InputError(f"Hadamard transform needs a power-of-two width, got {d}")
    lead = y.shape[:-1]
    h = 1
    while h < d:
        v = y.reshape(*lead, d // (2 * h), 2, h)
        a = v[..., 0, :].copy()
        b = v[..., 1, :]
        v[..., 0, :] = a + b
        v[..., 1, :] = a - b
        h *= 2
    return y * np.float32(1.0 / np.sqrt(d))


__all__ = ["fwht", "is_power_of_two"]
