"""kvc's per-call calibration state: the plan :meth:`KVCCodec.prepare` builds, read layer by layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _layer_calib(state: dict[int, dict[str, Any]] | None, layer: int) -> dict[str, Any]:
    """The calibration plan of ``layer`` (empty without a file), its attention estimate waited
    for if it is still being computed. ``state`` is the encode call's (:meth:`KVCCodec.prepare`);
    the threads coding that call's tensors may resolve the same estimate at once (each dict
    operation is atomic, and they write the same value)."""
    entry = (state or {}).get(layer, {})
    a = entry.get("attn")
    if a is not None and not isinstance(a, np.ndarray):
        a = a.result()  # a future; re-raises the estimate's own error
        if a is None:
            entry.pop("attn", None)
        else:
            entry["attn"] = a
    return entry
