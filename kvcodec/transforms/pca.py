"""Per-head principal axes (the Karhunen–Loève transform) and the coding gain they buy.

KVTC decorrelates each head with a PCA basis calibrated once per model. Measured on SmolLM2
(eval/results/kvc_rd.md, 1536 tokens): fitted on the very cache it codes, the per-head basis buys
only ~0.18 bit per element (high-rate coding gain) over per-channel coding for K (after RoPE) and
for V; a basis calibrated on other text bought ~0.03 bit on post-RoPE K in our scratch runs (RoPE
rotates every channel pair at its own frequency; pre-RoPE K gains ~0.3–0.5 bit but needs the RoPE
parameters to undo). Shipping per-cache float16 bases costs ``16 * D / T`` bits per element
(0.67 at D=64, T=1536). That is why the ``kvc`` presets do not use PCA; these functions stay as
the measuring tool.

Example:
    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> z = rng.normal(size=(500, 1, 2)) @ np.array([[3.0, 2.9], [0.0, 0.3]])   # correlated
    >>> basis, var = head_pca(z)
    >>> basis.shape, bool(var[0, 0] > var[0, 1])
    ((1, 2, 2), True)
    >>> coding_gain_db(z) > 3.0
    True
"""

from __future__ import annotations

import numpy as np


def head_pca(z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Principal axes of each head of centred ``z [T, H, D]``.

    Returns:
        ``(basis [H, D, D], variances [H, D])``: columns of ``basis[h]`` are the axes, sorted by
        decreasing variance; project with ``z[:, h] @ basis[h]``.
    """
    z = np.asarray(z, dtype=np.float64)
    t, h, d = z.shape
    basis = np.zeros((h, d, d))
    var = np.zeros((h, d))
    for i in range(h):
        cov = z[:, i].T @ z[:, i] / max(1, t)
        w, u = np.linalg.eigh(cov)
        order = np.argsort(w)[::-1]
        basis[i], var[i] = u[:, order], np.maximum(w[order], 0.0)
    return basis, var


def coding_gain_db(z: np.ndarray) -> float:
    """High-rate coding gain of per-head PCA over per-channel coding, in dB, averaged over heads:
    ``10 log10(geomean(channel variances) / geomean(PCA variances))``."""
    z = np.asarray(z, dtype=np.float64)
    _, var = head_pca(z)
    ch = (z * z).mean(axis=0)
    eps = 1e-30
    g = np.log(ch + eps).mean(axis=1) - np.log(var + eps).mean(axis=1)
    return float(10.0 / np.log(10.0) * g.mean())


__all__ = ["coding_gain_db", "head_pca"]
