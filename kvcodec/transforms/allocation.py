"""Bit allocation across coordinates: reverse water-filling, and the step rule it implies.

For independent Gaussian coordinates with variances ``s_i`` and a total squared-error budget,
the optimal allocation (reverse water-filling) gives every coordinate the same distortion ``D``
(the water level) and ``R_i = max(0, log2(s_i / D) / 2)`` bits; coordinates below the water get
no bits at all. An entropy-coded uniform quantizer realises this by using the *same step* for all
coordinates (distortion ~ step²/12 regardless of variance) — coordinates whose spread is below the
step simply quantize to zero and cost almost nothing. With an importance weight ``w_i`` on
coordinate ``i`` (e.g. query energy for K: the model sees K through ``q · k``) the weighted
optimum is ``step_i ∝ w_i ** -1/2``: :func:`weighted_steps`.

Example:
    >>> import numpy as np
    >>> rates, dist = reverse_waterfill(np.array([4.0, 1.0, 0.01]), 0.25)
    >>> rates.tolist(), dist.tolist()
    ([2.0, 1.0, 0.0], [0.25, 0.25, 0.01])
    >>> round(float(waterlevel_for_rate(np.array([4.0, 1.0, 0.01]), 1.0)), 6)
    0.25
    >>> np.round(weighted_steps(1.0, np.array([0.25, 1.0, 1.75])), 4).tolist()
    [2.0, 1.0, 0.7559]
"""

from __future__ import annotations

import numpy as np

from ..errors import InputError


def reverse_waterfill(variances: np.ndarray, level: float) -> tuple[np.ndarray, np.ndarray]:
    """Rates (bits) and distortions of each coordinate at water level ``level``."""
    s = np.asarray(variances, dtype=np.float64)
    if level <= 0:
        raise InputError(f"water level must be > 0, got {level}")
    with np.errstate(divide="ignore"):
        rates = np.maximum(0.0, 0.5 * np.log2(np.maximum(s, 1e-300) / level))
    return rates, np.minimum(s, level)


def rate_for_distortion(variances: np.ndarray, level: float) -> float:
    """Mean bits per coordinate at water level ``level``."""
    return float(reverse_waterfill(variances, level)[0].mean())


def waterlevel_for_rate(variances: np.ndarray, rate: float, iters: int = 200) -> float:
    """The water level at which the mean rate equals ``rate`` bits per coordinate (bisection on
    ``log D``)."""
    s = np.asarray(variances, dtype=np.float64)
    if rate < 0 or s.size == 0 or not (s > 0).any():
        raise InputError("need rate >= 0 and at least one positive variance")
    lo, hi = np.log(s[s > 0].min()) - 60.0, np.log(s.max())
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if rate_for_distortion(s, float(np.exp(mid))) > rate:
            lo = mid
        else:
            hi = mid
    return float(np.exp(0.5 * (lo + hi)))


def weighted_steps(step: float, weights: np.ndarray, mean: float | None = None) -> np.ndarray:
    """Steps ``step * (w / mean(w)) ** -1/2``: equal *weighted* distortion per coordinate.

    Weights are normalised to mean 1 so ``step`` keeps its meaning; zero weights get the largest
    finite step of the others. ``mean``: normalise by this instead of the weights' own mean
    (the weights are a slice of a longer sequence whose mean it is).
    """
    w = np.asarray(weights, dtype=np.float64)
    m = (w.mean() if w.size else 1.0) if mean is None else float(mean)
    if w.size == 0 or m <= 0:
        return np.full(w.shape, float(step))
    r = w / m
    pos = r > 0
    out = np.empty_like(r)
    out[pos] = step / np.sqrt(r[pos])
    out[~pos] = out[pos].max() if pos.any() else step
    return out


__all__ = ["rate_for_distortion", "reverse_waterfill", "waterlevel_for_rate", "weighted_steps"]
