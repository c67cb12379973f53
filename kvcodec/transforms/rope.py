"""Rotating channel means for K after RoPE (formats/codecs/kvc.md §3.1 and §10, normative).

A constant component of K before RoPE (Qwen2's K bias, the large fixed channels of many models)
turns with the position once RoPE is applied, so a per-channel mean of the rotated K no longer
removes it: on Qwen2.5-Coder-0.5B centring leaves 4.3 % of K's energy after RoPE and 1.4 %
before (eval/results/kvc_prerope.md). With ``k_rope_mean`` the encoder takes the channel means
before RoPE, ``mu``, and subtracts ``R(p) mu`` from the token at position ``p``; the decoder adds
the same ``R(p) mu`` back. The rotation does not have to equal the model's to the last bit, only
be the same on both sides, so it is defined here with integers and one table:

* each rotation pair ``c`` turns by a *phase step* ``f[c]``, a uint32 in units of ``2**-32``
  turns per position (the encoder rounds the model's ``inv_freq / 2 pi``);
* the phase at position ``p`` is ``(p mod 2**32) * f[c] mod 2**32``, exact in uint64;
* ``sin`` and ``cos`` are looked up in :func:`sin_table` (65536 float32 values, 16 phase bits):
  ``sin = S[phase >> 16]``, ``cos = S[((phase >> 16) + 16384) mod 65536]``;
* ``R(p) mu`` is ``(mu_a cos - mu_b sin, mu_b cos + mu_a sin)`` on each pair ``(a, b)``, every
  product and sum a separately rounded float32 operation in that order; channels outside the
  pairs keep ``mu``.

The phase is exact; the table's angle is within ``2 pi / 2**17`` of it (5e-5 rad).

Example:
    >>> import numpy as np
    >>> f = phase_steps(np.array([1.0, 0.01], np.float32))
    >>> m = rotated_means(np.ones((1, 4), np.float32), np.arange(3), f, 0, "half")
    >>> m.shape, bool(np.allclose(m[0], 1.0))
    ((3, 1, 4), True)
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

#: phase bits the table resolves
SIN_BITS = 16
#: ``style`` numbers as tensor params write them
STYLES = ("half", "interleaved")


@functools.lru_cache(maxsize=1)
def sin_table() -> np.ndarray:
    """``S[i]``: the float32 nearest to ``sin(2 pi i / 65536)``, ``i < 65536`` (read-only).

    Computed in float64 and rounded once: a float64 ``sin`` within a few units in the last place
    rounds to the same float32 (tests pin the table's SHA-256)."""
    n = 1 << SIN_BITS
    t = np.sin(np.arange(n, dtype=np.float64) * (2.0 * math.pi / n)).astype(np.float32)
    # exact zeros and ones where the real sine has them
    t[0] = t[n // 2] = 0.0
    t[n // 4], t[3 * n // 4] = 1.0, -1.0
    t.setflags(write=False)
    return t


def phase_steps(inv_freq: np.ndarray) -> np.ndarray:
    """The uint32 phase step of each pair from RoPE's angular frequencies (radians per position),
    rounded to the nearest ``2**-32`` turn (encoder side: any steps decode; these are the model's)."""
    turns = np.asarray(inv_freq, dtype=np.float64) / (2.0 * math.pi)
    return (np.round(turns * 2.0**32).astype(np.int64) % (1 << 32)).astype(np.uint32)


def _slices(r2: int, offset: int, style: str) -> tuple[slice, slice]:
    """:func:`pairs` as slices of the channel axis (both layouts are strided runs)."""
    if style == "half":
        return slice(offset, offset + r2), slice(offset + r2, offset + 2 * r2)
    return slice(offset, offset + 2 * r2, 2), slice(offset + 1, offset + 2 * r2, 2)


def pairs(r2: int, offset: int, style: str) -> tuple[np.ndarray, np.ndarray]:
    """Channel indices ``(a, b)`` of the ``r2`` rotation pairs: ``"half"`` pairs ``(offset + c,
    offset + r2 + c)``, ``"interleaved"`` pairs ``(offset + 2c, offset + 2c + 1)``."""
    c = np.arange(r2, dtype=np.int64)
    if style == "half":
        return offset + c, offset + r2 + c
    return offset + 2 * c, offset + 2 * c + 1


def cos_sin(positions: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``(cos, sin)`` ``[n, r2]`` at ``positions`` (int64 ``[n]``, >= 0) for phase
    ``steps`` (uint32 ``[r2]``), from :func:`sin_table`. Read-only arrays, kept for the next
    calls at the same positions and steps (every layer of a cache turns alike)."""
    return _cos_sin_kept(np.ascontiguousarray(positions, dtype=np.int64).tobytes(),
                         np.ascontiguousarray(steps, dtype=np.uint32).tobytes())


@functools.lru_cache(maxsize=8)
def _cos_sin_kept(positions: bytes, steps: bytes) -> tuple[np.ndarray, np.ndarray]:
    c, s = _cos_sin(np.frombuffer(positions, dtype=np.int64), np.frombuffer(steps, dtype=np.uint32))
    c.setflags(write=False)
    s.setflags(write=False)
    return c, s


def _cos_sin(positions: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    p = (np.asarray(positions, dtype=np.int64) & 0xFFFFFFFF).astype(np.uint64)
    ph = (p[:, None] * np.asarray(steps, dtype=np.uint64)[None]) & np.uint64(0xFFFFFFFF)
    i = (ph >> np.uint64(32 - SIN_BITS)).astype(np.int64)
    s = sin_table()
    return s[(i + (1 << (SIN_BITS - 2))) & ((1 << SIN_BITS) - 1)], s[i]


def rotated_means(mu: np.ndarray, positions: np.ndarray, steps: np.ndarray, offset: int,
                  style: str) -> np.ndarray:
    """``R(p) mu`` for every position: float32 ``[n, H, D]`` from ``mu`` float32 ``[H, D]``:
    :func:`rotated_means_reference`, in C where the native library is built (the same bits)."""
    if len(steps) and len(positions) and np.ndim(mu) == 2:
        return _native_else("rotated_means", rotated_means_reference, mu, positions, steps, offset, style)
    return rotated_means_reference(mu, positions, steps, offset, style)


def rope_centred(y: np.ndarray, mu: np.ndarray, positions: np.ndarray, steps: np.ndarray, offset: int,
                 style: str, keep_rot: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """``(y - R(p) mu, R(p) mu)`` for float32 ``y`` ``[n, H, D]``: the encoder's centring with
    rotating means (the second None without ``keep_rot``): :func:`rope_centred_reference`, in one
    C pass where the native library is built (the same bits)."""
    if len(steps) and len(positions) and np.ndim(mu) == 2 and np.asarray(y).dtype == np.float32:
        return _native_else("rope_centre", rope_centred_reference, y, mu, positions, steps, offset, style, keep_rot)
    return rope_centred_reference(y, mu, positions, steps, offset, style, keep_rot)


def rope_centred_reference(y: np.ndarray, mu: np.ndarray, positions: np.ndarray, steps: np.ndarray, offset: int,
                           style: str, keep_rot: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """:func:`rope_centred` as two steps: :func:`rotated_means`, then one float32 subtraction."""
    rot = rotated_means(mu, positions, steps, offset, style)
    return np.subtract(np.asarray(y, dtype=np.float32), rot), (rot if keep_rot else None)


def _native_else(name: str, reference: Any, *args: Any) -> np.ndarray:
    """:mod:`kvcodec.native.rope`'s ``name`` of ``args`` and the sine table, or ``reference``
    of ``args`` where the native library is not built."""
    from .. import native

    try:
        from ..native import rope as fast

        return getattr(fast, name)(*args, sin_table())
    except native.Unsupported:
        return reference(*args)


def rotated_means_reference(mu: np.ndarray, positions: np.ndarray, steps: np.ndarray, offset: int,
                            style: str) -> np.ndarray:
    """``R(p) mu`` for every position: float32 ``[n, H, D]`` from ``mu`` float32 ``[H, D]``
    (the normative arithmetic of the module docstring)."""
    mu = np.asarray(mu, dtype=np.float32)
    n = len(positions)
    out = np.empty((n,) + mu.shape, dtype=np.float32)
    out[:] = mu[None]
    if not len(steps) or not n:
        return out
    a, b = _slices(len(steps), offset, style)
    c, s = cos_sin(positions, steps)
    c, s = c[:, None, :], s[:, None, :]
    ma, mb = mu[None, :, a], mu[None, :, b]
    np.subtract(ma * c, mb * s, out=out[:, :, a])
    np.add(mb * c, ma * s, out=out[:, :, b])
    return out


def layer_rotates(la: Any, width: int) -> bool:
    """Whether rotating means apply to a layer whose calibration facts are ``la`` (a
    :class:`~kvcodec.codecs.kvc.calibration.LayerAttention`): rotary RoPE with known frequencies,
    a style of :data:`STYLES`, and its pairs inside a head of ``width`` channels."""
    f = la.inv_freq
    return (la.rope == "rotary" and f is not None and f.size > 0 and la.style in STYLES
            and la.offset + 2 * f.shape[0] <= width)


def unrotated_mean(k: np.ndarray, positions: np.ndarray, steps: np.ndarray, offset: int,
                   style: str) -> np.ndarray:
    """The mean over tokens of ``R(p)^-1 k`` (float64 ``[H, D]``; encoder side) for ``k``
    ``[n, H, D]``: :func:`unrotated_mean_reference`, in C for float32 and float16 ``k`` where
    the native library is built (the same bits)."""
    if len(steps) and len(k) and isinstance(k, np.ndarray) and k.dtype in (np.float32, np.float16) and k.ndim == 3:
        return _native_else("unrotated_mean", unrotated_mean_reference, k, positions, steps, offset, style)
    return unrotated_mean_reference(k, positions, steps, offset, style)


def unrotated_mean_reference(k: np.ndarray, positions: np.ndarray, steps: np.ndarray, offset: int,
                             style: str) -> np.ndarray:
    """The mean over tokens of ``R(p)^-1 k`` (float64 ``[H, D]``; encoder side) for ``k``
    ``[n, H, D]``: the channel means before RoPE, with the table's rotation."""
    x = np.asarray(k, dtype=np.float64)
    out = x.mean(axis=0)
    if not len(steps) or not len(x):
        return out
    a, b = _slices(len(steps), offset, style)
    c, s = (t.astype(np.float64)[:, None, :] for t in cos_sin(positions, steps))
    xa, xb = x[:, :, a], x[:, :, b]
    out[:, a] = (xa * c + xb * s).mean(axis=0)
    out[:, b] = (xb * c - xa * s).mean(axis=0)
    return out


__all__ = ["SIN_BITS", "STYLES", "cos_sin", "layer_rotates", "pairs", "phase_steps", "rope_centred",
           "rope_centred_reference", "rotated_means", "rotated_means_reference", "sin_table", "unrotated_mean", "unrotated_mean_reference"]
