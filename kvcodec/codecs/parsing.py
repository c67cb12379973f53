"""Shared checks for the codecs' ``parse_tensor``: one validation per codec, used by every decoder.

Each codec's ``parse_tensor(enc, ctx)`` turns a tensor read from a file (planes plus manifest
params) into a frozen dataclass whose fields are checked once: parameters of the exact JSON type
and within what the codec's encoder writes (formats/SPEC.md §11), every plane present with its exact
dtype and shape, no plane the codec does not define. The CPU decoders (native and fallback) and the
GPU decoders (:mod:`kvcodec.gpu`) all decode from that object, so they accept and reject the same
files.

Example:
    >>> strict_int({"bits": 4}, "bits", 1, 8, "layers.0.k")
    4
    >>> strict_int({"bits": True}, "bits", 1, 8, "layers.0.k")
    Traceback (most recent call last):
    ...
    kvcodec.errors.FormatError: layers.0.k: param 'bits' must be an integer in [1, 8], got True
"""

from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from ..entropy.stage import StageLayout, take_prefix
from ..errors import FormatError

#: Largest int32: parameters the GPU decoders pass as int32 are bounded by it.
INT32_MAX = 2**31 - 1
#: Planes of one entropy stage (formats/ANS.md §3), without the codec's prefix.
STAGE_PLANES = ("meta", "words", "offsets", "tables", "row_table")
#: Largest finite value of each source dtype, as float32 (saturation bound, formats/SPEC.md §11).
DTYPE_MAX = {torch.float16: 65504.0, torch.bfloat16: float(torch.finfo(torch.bfloat16).max),
             torch.float32: float(np.finfo(np.float32).max)}


def where(ctx: Any) -> str:
    """``layers.{i}.{role}``: how every error names the tensor."""
    return f"layers.{ctx.layer}.{ctx.role}"


def strict_int(params: dict[str, Any], key: str, lo: int, hi: int, at: str) -> int:
    """``params[key]`` as a JSON integer (not a bool, not a float) in ``[lo, hi]``, else FormatError."""
    v = params.get(key)
    if type(v) is not int or not lo <= v <= hi:
        raise FormatError(f"{at}: param {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def strict_choice(params: dict[str, Any], key: str, choices: Iterable[str], at: str) -> str:
    """``params[key]`` as one of the strings ``choices``, else FormatError."""
    v = params.get(key)
    ch = tuple(choices)
    if type(v) is not str or v not in ch:
        raise FormatError(f"{at}: param {key!r} must be one of {list(ch)}, got {v!r}")
    return v


def check_plane_names(planes: dict[str, np.ndarray], allowed: Iterable[str], at: str, codec: str) -> None:
    """Reject planes the codec does not define (an unknown plane is never silently ignored)."""
    extra = sorted(set(planes) - set(allowed))
    if extra:
        raise FormatError(f"{at}: unknown {codec} plane(s) {extra}; this tensor has {sorted(allowed)}")


def stage_names(prefix: str) -> list[str]:
    """The plane names of an entropy stage stored under ``prefix``."""
    return [prefix + n for n in STAGE_PLANES]


def stage(planes: dict[str, np.ndarray], prefix: str, expected: tuple[int, int, int], at: str) -> dict[str, np.ndarray]:
    """The planes of the entropy stage under ``prefix`` (without it), after checking that its
    ``meta`` declares exactly ``expected = (R, N, A)`` (rows, tokens, alphabet): nothing is
    allocated for a stage whose geometry is not the codec's. The streams are checked by the
    decoders as they decode them (formats/ANS.md §3)."""
    sub = take_prefix(planes, prefix)
    if "meta" not in sub:
        raise FormatError(f"{at}: {prefix}stage: ANS stage plane 'meta' is missing")
    try:
        lay = StageLayout(sub["meta"])
    except FormatError as e:
        raise FormatError(f"{at}: {prefix}stage: {e}") from None
    if (lay.R, lay.N, lay.A) != tuple(expected):
        raise FormatError(f"{at}: {prefix}stage is [{lay.R}, {lay.N}] over {lay.A} symbols, expected "
                          f"[{expected[0]}, {expected[1]}] over {expected[2]}")
    return sub


def plane(planes: dict[str, np.ndarray], name: str, dtype: Any, shape: tuple[int, ...], at: str) -> np.ndarray:
    """Plane ``name`` with exactly ``dtype`` and ``shape`` (same rank: ``[T*H*D]`` is not
    ``[T, H, D]``), as a C-contiguous numpy array; FormatError otherwise."""
    a = planes.get(name)
    if a is None:
        raise FormatError(f"{at}: plane {name!r} is missing")
    a = np.asarray(a)
    if a.dtype != np.dtype(dtype) or tuple(a.shape) != tuple(shape):
        raise FormatError(f"{at}.{name}: {a.dtype}{list(a.shape)}, expected {np.dtype(dtype)}{list(shape)}")
    return np.ascontiguousarray(a)


def f32_bound(x: float) -> float:
    """``x`` rounded to float32 (RNE), as a Python float."""
    return float(np.float32(x))


__all__ = ["DTYPE_MAX", "INT32_MAX", "STAGE_PLANES", "check_plane_names", "f32_bound",
           "plane", "stage", "stage_names", "strict_choice", "strict_int", "where"]
