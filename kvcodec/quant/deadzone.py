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
* with reconstruction offsets ``delta[1..M]`` (integers in ``[0, 128]``, units of 1/256 step): a
  code with ``1 <= |code| <= M`` stands for ``sign(code) * (|code| - delta[|code|] / 256)`` instead
  of ``code`` (exact in float32: at most 13 significant bits), then the same multiply. Codes
  ``0`` and ``|code| > M`` are unchanged.

Why reconstruction offsets: the values in a quantizer bin are not spread evenly over it — KV
values after centring and scaling are peaked at zero, so a bin's values crowd its inner edge and
their mean (the MSE-optimal reconstruction) lies inside the bin's midpoint, toward zero.
:func:`recon_offsets` measures that per tensor and level; kvc writes the result as a tensor's
``rc`` (2 bytes per level; what it does to KL: eval/results/kvc_recon.md).

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

    try:
        return native.deadzone_quantize(x, step, rho, out)  # the same float64 arithmetic in C
    except native.Unsupported:
        pass
    xf = np.asarray(x, dtype=np.float64)
    mag = np.floor(np.abs(xf) / np.asarray(step, dtype=np.float64) + rho)
    codes = (np.sign(xf) * mag).astype(np.int64)
    if out is None:
        return codes
    out[...] = codes.reshape(out.shape)
    return out


#: Fixed-point scale of the residual sums in :func:`recon_offsets` (exact integer sums in any order).
RECON_FIX = 1 << 24
#: Reconstruction offsets are in units of ``1 / RECON_UNIT`` step, each in ``[0, RECON_UNIT // 2]``.
RECON_UNIT = 256
#: At most this many levels carry an offset.
RECON_MAX_LEVELS = 16


def recon_offsets(x: np.ndarray, step: np.ndarray, codes: np.ndarray, levels: int) -> list[int]:
    """Per level ``k = 1..levels``: the mean inward distance ``k - |x| / step`` of the values
    coded ``±k``, in units of 1/256 step, rounded and clamped to ``[0, 128]`` (0 for an empty
    level) — the reconstruction offsets that minimise the squared error of those values.

    Deterministic by construction, so every encoder path writes the same numbers: each
    residual ``k - |x| / step`` (float64, the division the quantizer makes) is rounded to a
    multiple of ``2**-24`` (half to even) and summed as an integer, and the mean is rounded
    half up in exact integer arithmetic.

    Args:
        x: values ``[...]``; step: steps broadcastable to ``x``; codes: their dead-zone codes
            (same shape as ``x``, or for ``x [n0, n1, n2]`` the first ``n1 * n2`` columns of an
            ``[n0, >= n1 * n2]`` matrix); levels: ``M``, at most :data:`RECON_MAX_LEVELS`.

    Example:
        >>> x = np.array([0.7, 1.0, -0.8, 2.1]); q = deadzone_quantize(x, np.ones(4))
        >>> q.tolist(), recon_offsets(x, np.ones(4), q, 2)
        ([1, 1, -1, 2], [43, 0])
    """
    if not 0 <= levels <= RECON_MAX_LEVELS:
        raise InputError(f"reconstruction levels must be in [0, {RECON_MAX_LEVELS}], got {levels}")
    from .. import native

    if levels:
        try:
            return recon_from_sums(*native.recon_sums(x, step, codes, levels))  # the same integers in C
        except native.Unsupported:
            pass
    return recon_from_sums(*recon_sums(x, step, codes, levels))


def deadzone_quantize_recon(x: np.ndarray, step: np.ndarray, rho: float, levels: int,
                            out: np.ndarray | None = None) -> tuple[np.ndarray, list[int]]:
    """:func:`deadzone_quantize` then :func:`recon_offsets` of its codes (``levels`` of them):
    ``(codes, offsets)``, exactly what the two calls return; the native path takes both in one
    pass over ``x`` (each value and its step read once: the calibrated kvc encoder's K tensors).

    Example:
        >>> x = np.array([[[0.7, 1.0, -0.8, 2.1]]], dtype=np.float32)
        >>> codes, rc = deadzone_quantize_recon(x, np.ones(4), 0.5, 2)
        >>> codes.reshape(-1).tolist(), rc
        ([1, 1, -1, 2], [43, 0])
    """
    if not 0.0 < rho <= 0.5:
        raise InputError(f"dead-zone rounding offset rho must be in (0, 0.5], got {rho}")
    if not 0 <= levels <= RECON_MAX_LEVELS:
        raise InputError(f"reconstruction levels must be in [0, {RECON_MAX_LEVELS}], got {levels}")
    from .. import native

    if levels:
        try:
            codes, sc = native.deadzone_recon(x, step, rho, out, levels)
            return codes, recon_from_sums(*sc)
        except native.Unsupported:
            pass
    codes = deadzone_quantize(x, step, rho, out)
    return codes, recon_offsets(x, step, codes, levels)


def recon_sums(x: np.ndarray, step: np.ndarray, codes: np.ndarray, levels: int) -> tuple[list[int], list[int]]:
    """The integer residual sums (units ``2**-24`` step) and counts per level behind
    :func:`recon_offsets` (the reference; :func:`kvcodec.native.recon_sums` computes the same
    integers in C)."""
    c = np.asarray(codes).astype(np.int64, copy=False)
    xs = np.shape(x)
    if c.shape != xs and c.ndim == 2 and len(xs) == 3 and c.shape[0] == xs[0] and c.shape[1] >= xs[1] * xs[2]:
        c = c[:, : xs[1] * xs[2]].reshape(xs)  # the first columns of a wider token-major matrix
    m = np.abs(c)
    sums, counts = [0] * levels, [0] * levels
    if levels == 0 or c.size == 0:
        return sums, counts
    sel = (m >= 1) & (m <= levels)
    xa = np.abs(np.asarray(x, dtype=np.float64)[sel])
    st = np.broadcast_to(np.asarray(step, dtype=np.float64), c.shape)[sel]
    lv = m[sel]
    r = np.rint((lv - xa / st) * RECON_FIX).astype(np.int64)
    for k in range(1, levels + 1):
        on = lv == k
        counts[k - 1] = int(on.sum())
        sums[k - 1] = int(r[on].sum())
    return sums, counts


def recon_from_sums(sums: list[int], counts: list[int]) -> list[int]:
    """Offsets from :func:`recon_sums`' integers: ``clamp(round_half_up(256 * s / (n * 2**24)), 0,
    128)``, 0 where ``n`` is 0 (exact integer arithmetic)."""
    out = []
    for s, n in zip(sums, counts):
        if n <= 0:
            out.append(0)
            continue
        num, den = 2 * RECON_UNIT * int(s) + n * RECON_FIX, 2 * n * RECON_FIX
        out.append(int(min(max(num // den, 0), RECON_UNIT // 2)))
    return out


def recon_values(codes: np.ndarray, offsets: list[int] | None) -> np.ndarray:
    """The float32 values codes stand for: ``sign(c) * (|c| - offsets[|c| - 1] / 256)`` for ``1 <=
    |c| <= len(offsets)``, else ``c`` (see the module docstring; exact in float32).

    Example:
        >>> recon_values(np.array([0, 1, -1, 2, 3]), [64, 32]).tolist()
        [0.0, 0.75, -0.75, 1.875, 3.0]
    """
    c = np.asarray(codes)
    v = c.astype(np.float32)
    if offsets:
        m = len(offsets)
        # a table over [-M, M]: exact float32 values (integers minus multiples of 1/256)
        tab = np.arange(-m, m + 1, dtype=np.float64)
        d = np.array(offsets, dtype=np.float64) / RECON_UNIT
        tab[m + 1:] -= d
        tab[:m] += d[::-1]
        small = np.abs(c) <= m
        v[small] = tab[(c[small] + m).astype(np.int64)].astype(np.float32)
    return v


def deadzone_dequantize(codes: np.ndarray, step: np.ndarray) -> np.ndarray:
    """``float32(code) * float32(step)`` in float32 (the normative reconstruction)."""
    return np.asarray(codes).astype(np.float32) * np.asarray(step, dtype=np.float32)


__all__ = [
    "RECON_MAX_LEVELS",
    "recon_offsets",
    "recon_values",
    "STEP_CODE_MAX",
    "STEP_CODE_MIN",
    "STEP_MANTISSA",
    "deadzone_dequantize",
    "deadzone_quantize",
    "deadzone_quantize_recon",
    "step_code",
    "step_from_code",
]
