"""Dead-zone uniform scalar quantizer with power-of-two-fraction step sizes (reference code).

Why a dead zone: after a decorrelating or centring transform the coordinates have unequal
variances, and an entropy coder follows. For a Laplacian-like source the rate-distortion-optimal
entropy-coded scalar quantizer is uniform with a slightly *wider zero bin* (rounding offset
``rho < 1/2``): small values cost almost nothing, and the entropy coder turns the many zeros into
a fraction of a bit. With ``rho = 1/2`` it is plain rounding.

Normative arithmetic (what a decoder, on any device, MUST compute):

* step from a log-step code ``s`` (int): ``step = STEP_MANTISSA[s mod 8] * 2**(s div 8)``, in
  float32, where ``STEP_MANTISSA[i]`` is the float32 nearest ``2**(i/8)`` (the table below) and
  ``div``/``mod`` are floor division/modulo. Multiplying by a power of two is exact, so the step
  is bit-identical everywhere (``ldexp``). Steps are thus on a 1/8-octave grid (≈9% apart).
* dequantize: ``x_hat = float32(code) * step`` (one float32 multiply, round to nearest even), then
  any offset is added as a separate float32 add (no fused multiply-add).

Encoding (not normative; any encoder may choose codes): ``code = sign(x) * floor(|x| / step + rho)``
computed in float64.

Example:
    >>> import numpy as np
    >>> from kvcodec.quant.deadzone import deadzone_quantize, deadzone_dequantize, step_from_code
    >>> step = step_from_code(np.array([-8]))          # 2**-1 = 0.5
    >>> float(step[0])
    0.5
    >>> q = deadzone_quantize(np.array([0.2, -0.3, 1.1, 2.0]), step, rho=0.5)
    >>> q.tolist(), deadzone_dequantize(q, step).tolist()
    ([0, -1, 2, 4], [0.0, -0.5, 1.0, 2.0])
    >>> deadzone_quantize(np.array([0.2, -0.3, 1.1, 2.0]), step, rho=0.3).tolist()   # wider zero bin
    [0, 0, 2, 4]
"""

from __future__ import annotations

import numpy as np

from ..errors import InputError

#: float32 nearest to 2**(i/8), i = 0..7: the mantissas of every step (normative constants).
STEP_MANTISSA = np.array([2.0 ** (i / 8.0) for i in range(8)], dtype=np.float32)

#: Log-step codes are clamped to this range (steps 2**-40 .. 2**40, all normal float32).
STEP_CODE_MIN, STEP_CODE_MAX = -320, 320


def step_code(step: np.ndarray) -> np.ndarray:
    """Nearest log-step code ``round(8 * log2(step))`` (int32, clamped); zero/negative -> min.

    Example:
        >>> step_code(np.array([1.0, 0.5, 3.0, 0.0])).tolist()
        [0, -8, 13, -320]
    """
    s = np.asarray(step, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        c = np.where(s > 0, np.round(8.0 * np.log2(np.where(s > 0, s, 1.0))), STEP_CODE_MIN)
    return np.clip(c, STEP_CODE_MIN, STEP_CODE_MAX).astype(np.int32)


def step_from_code(code: np.ndarray) -> np.ndarray:
    """The normative float32 step of each log-step code (see the module docstring).

    Raises:
        InputError: a code outside ``[STEP_CODE_MIN, STEP_CODE_MAX]``.
    """
    c = np.asarray(code).astype(np.int64)
    if c.size and (int(c.min()) < STEP_CODE_MIN or int(c.max()) > STEP_CODE_MAX):
        raise InputError(f"log-step code outside [{STEP_CODE_MIN}, {STEP_CODE_MAX}]")
    return np.ldexp(STEP_MANTISSA[c % 8], (c // 8).astype(np.int32)).astype(np.float32)


def deadzone_quantize(x: np.ndarray, step: np.ndarray, rho: float = 0.5, out: np.ndarray | None = None) -> np.ndarray:
    """Codes ``sign(x) * floor(|x| / step + rho)`` (int64); ``step`` broadcasts against ``x``.

    Args:
        x: values (any float array).
        step: positive step sizes, broadcastable to ``x``.
        rho: rounding offset in ``(0, 1/2]``; ``1/2`` is round-half-up on magnitudes, smaller
            values widen the zero bin (the dead zone is ``|x| < (1 - rho) * step``).
        out: for a 3-D ``x [n0, n1, n2]``, an int64 ``[n0, n1 * n2]`` matrix with contiguous
            rows (e.g. the first columns of a wider one) to write the codes into; returned.
    """
    if not 0.0 < rho <= 0.5:
        raise InputError(f"dead-zone rounding offset rho must be in (0, 0.5], got {rho}")
    from .. import native

    fast = native.deadzone_quantize(x, step, rho, out)  # the same float64 arithmetic in C, when it applies
    if fast is not None:
        return fast
    xf = np.asarray(x, dtype=np.float64)
    mag = np.floor(np.abs(xf) / np.asarray(step, dtype=np.float64) + rho)
    codes = (np.sign(xf) * mag).astype(np.int64)
    if out is None:
        return codes
    out[...] = codes.reshape(out.shape)
    return out


def deadzone_dequantize(codes: np.ndarray, step: np.ndarray) -> np.ndarray:
    """``float32(code) * float32(step)`` in float32 (the normative reconstruction)."""
    return np.asarray(codes).astype(np.float32) * np.asarray(step, dtype=np.float32)


__all__ = [
    "STEP_CODE_MAX",
    "STEP_CODE_MIN",
    "STEP_MANTISSA",
    "deadzone_dequantize",
    "deadzone_quantize",
    "step_code",
    "step_from_code",
]
