"""Transforms applied before quantization, each a small reference function measured on its own.

* :mod:`~kvcodec.transforms.centering` — per-channel means (K's large fixed offsets) and RMS
  statistics (per head, per token) that set step sizes.
* :mod:`~kvcodec.transforms.hadamard` — the orthonormal fast Walsh–Hadamard transform along the
  channel axis (fixed, no calibration; power-of-two widths).
* :mod:`~kvcodec.transforms.pca` — per-head principal axes (Karhunen–Loève transform) and the
  coding gain they buy over per-channel coding.
* :mod:`~kvcodec.transforms.rope` — RoPE's rotation as kvc's rotating K means define it (integer
  phases and one sine table: normative, the same on every decode path).
* :mod:`~kvcodec.transforms.allocation` — bit allocation across coordinates by reverse
  water-filling, and the weighted step rule it implies for entropy-coded uniform quantizers.

Example:
    >>> import numpy as np
    >>> from kvcodec.transforms import fwht, reverse_waterfill
    >>> x = np.arange(8, dtype=np.float32)
    >>> bool(np.allclose(fwht(fwht(x)), x, atol=1e-5))
    True
    >>> reverse_waterfill(np.array([4.0, 1.0, 0.01]), 0.25)[0].tolist()
    [2.0, 1.0, 0.0]
"""

from .allocation import rate_for_distortion, reverse_waterfill, waterlevel_for_rate, weighted_steps
from .centering import channel_means, head_rms, token_rms
from .hadamard import fwht, is_power_of_two
from .pca import coding_gain_db, head_pca

__all__ = [
    "channel_means",
    "coding_gain_db",
    "fwht",
    "head_pca",
    "head_rms",
    "is_power_of_two",
    "rate_for_distortion",
    "reverse_waterfill",
    "token_rms",
    "waterlevel_for_rate",
    "weighted_steps",
]
