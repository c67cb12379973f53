"""kvc's step allocation: dead-zone codes with reconstruction offsets, per-token step codes,
recency ramp and the calibrated multipliers (attention, sensitivities). Normative text:
formats/codecs/kvc.md; how the rules were chosen: docs/kvc-design.md.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ... import native
from ...cache import KVCache
from ...errors import FormatError
from ...quant.deadzone import (
    STEP_CODE_MAX,
    STEP_CODE_MIN,
    RECON_MAX_LEVELS,
    RECON_UNIT,
    deadzone_quantize_recon,
    recon_from_sums,
    step_from_code,
)
from ...transforms.allocation import weighted_steps


def _quantize_tokens(z: np.ndarray, step: np.ndarray, rho: float, levels: int,
                     extra: int) -> tuple[np.ndarray, list[int]]:
    """Dead-zone codes of ``z [n, H, D]`` in the first ``H * D`` columns of a token-major matrix
    with ``extra`` more columns (left for the caller), and with ``levels > 0`` the reconstruction
    offsets of those codes: ``(matrix, offsets)``. The matrix is int32 when the native pass takes
    every code (half the memory traffic of the passes that follow: deltas, escapes), else int64
    from :func:`deadzone_quantize_recon` (the same codes)."""
    n, h, d = z.shape
    tok = np.empty((n, h * d + extra), dtype=np.int32)
    try:
        _, sc = native.deadzone_recon(z, step, rho, tok[:, : h * d], levels)
        return tok, (recon_from_sums(*sc) if levels else [])
    except native.Unsupported:  # no native coder, a code past int32, other operands: the int64 path
        pass
    tok = np.empty((n, h * d + extra), dtype=np.int64)
    _, rc = deadzone_quantize_recon(z, step, rho, levels, out=tok[:, : h * d])
    return tok, rc


def token_steps(sc: np.ndarray, toff: np.ndarray, where: str = "kvc") -> np.ndarray:
    """Steps ``step_from_code(sc[h, c] + toff[t, h])`` as float32 ``[n, H, D]`` (``k_tok`` tensors;
    a view of a head-major array).

    Same values as the direct formula, computed from one small table per head (a token's
    offsets take few distinct values), because an ``ldexp`` per element was the slowest part of
    a calibrated decode.

    Raises:
        FormatError: a sum lies outside the step-code range.

    Example:
        >>> sc = np.array([[0, 8]]); off = np.array([[0], [-8], [0]])
        >>> token_steps(sc, off)[:, 0].tolist()
        [[1.0, 2.0], [0.5, 1.0], [1.0, 2.0]]
    """
    sc = np.asarray(sc, dtype=np.int64)
    off = np.asarray(toff, dtype=np.int64)
    n, h = off.shape
    d = sc.shape[1]
    if n and h and d and (int((sc.min(axis=1) + off.min(axis=0)).min()) < STEP_CODE_MIN
                          or int((sc.max(axis=1) + off.max(axis=0)).max()) > STEP_CODE_MAX):
        raise FormatError(f"{where}: kvc step code outside [{STEP_CODE_MIN}, {STEP_CODE_MAX}]")
    step = np.empty((h, n, d), dtype=np.float32)  # head-major: each head's gather is contiguous
    for j in range(h if n else 0):
        # a row per offset from the head's smallest to its largest (at most 641: the check above
        # bounds sc + off), then one gather -- no sort
        lo, hi = int(off[:, j].min()), int(off[:, j].max())
        tab = step_from_code(sc[j][None, :] + np.arange(lo, hi + 1, dtype=np.int64)[:, None])
        np.take(tab, off[:, j] - lo, axis=0, out=step[j], mode="clip")  # in range by construction; "raise" buffers
    return step.transpose(1, 0, 2)  # [n, H, D] view


def recency_factor(t: int, coded: np.ndarray, ramp: int, fine: float) -> np.ndarray | None:
    """Step multipliers ``[n]`` of the coded tokens (``coded``: bool ``[t]``) by their distance
    ``d`` from the last token: ``clip(sqrt((d + 1) / ramp), 1 / fine, 1)``; None when off.

    The tokens the next queries read most are the latest ones: measured on SmolLM2 (the Fisher
    information of the next 512 tokens' distributions, eval/results/kvc_fisher.md), the latest
    10 % of the tokens hold a median 71 % of each (layer, role, head)'s sensitivity. Steps
    ``∝ sensitivity ** -1/2`` call for a ramp like this one. No calibration needed,
    and the steps are in the file as usual (V: per-token step codes; K: ``k_tok`` offset rows).

    Example:
        >>> recency_factor(6, np.ones(6, bool), 4, 2.0).round(3).tolist()
        [1.0, 1.0, 1.0, 0.866, 0.707, 0.5]
    """
    if ramp <= 0 or fine <= 1.0:
        return None
    # every tensor of a cache asks for the same factors: kept, read-only, for a few masks (a
    # cache asks for one or two; a long one's factors are t floats)
    return _recency(t, ramp, fine, np.asarray(coded, dtype=bool).tobytes())


@functools.lru_cache(maxsize=8)
def _recency(t: int, ramp: int, fine: float, coded: bytes) -> np.ndarray:
    pos = np.flatnonzero(np.frombuffer(coded, dtype=bool))
    d = (t - 1 - pos).astype(np.float64)
    out = np.clip(np.sqrt((d + 1.0) / ramp), 1.0 / fine, 1.0)
    out.setflags(write=False)
    return out


def _attn_factor(a: np.ndarray, exponent: float, clip: float, coarse: float | None = None,
                 norm: np.ndarray | None = None) -> np.ndarray:
    """Step multipliers per (token, head) from estimated attention ``a [n, H]``:
    ``weighted_steps(1, a ** exponent)`` per head, i.e. ``(w / mean w) ** -1/2`` with
    ``w = a ** exponent``, clipped to ``[1/clip, coarse]`` (``coarse`` defaults to ``clip``).
    Coarsening is the risky side — a token the calibration queries ignore may be the one a
    later query looks up — so a smaller ``coarse`` (1.5 against ``clip`` 2) measured better on
    two evaluation windows.

    The error a token's V (or K) adds to the attention output scales with the attention it
    receives, so well-attended tokens get finer steps. The normalisation keeps the weighted
    distortion ``sum w * step**2`` of the unweighted steps, so a preset's step keeps its
    quality meaning and the calibrated encoder spends fewer bits at about the same error. The
    exact optimum for MSE would be ``exponent = 2``; the estimates come from calibration
    queries, not the real future ones, so a smaller exponent and a tight clip measured best
    (eval/results/kvc_presets.md).

    ``norm [H]``: the mean of ``w`` to normalise by, per head, when ``a`` is a part of a longer
    sequence whose estimates are on the same scale (:meth:`KVCCodec.encode_parts`); the part's
    tokens then get the steps they would get in the whole sequence's file.

    Example:
        >>> _attn_factor(np.array([[0.2], [0.05], [0.0]]), 2.0, 2.0).round(3).tolist()
        [[0.595], [2.0], [2.0]]
    """
    a = np.maximum(np.asarray(a, dtype=np.float64), 1e-12)
    w = np.ascontiguousarray((a ** exponent).T)  # [H, n]: each head's weights contiguous
    mean = w.mean(axis=1) if norm is None else np.asarray(norm, dtype=np.float64)  # (pairwise, as per head)
    if w.shape[1] and (mean > 0).all() and (w > 0).all():
        # weighted_steps(1, w_j, mean_j) of every head at once: the same operations, element by element
        m = (1.0 / np.sqrt(w / mean[:, None])).T
    else:  # zero weights (or none): weighted_steps' rules, head by head
        m = np.stack([weighted_steps(1.0, w[j], None if norm is None else norm[j]) for j in range(a.shape[1])],
                     axis=1)
    return np.clip(m, 1.0 / clip, clip if coarse is None else coarse)


def _sens_multipliers(sens: list[np.ndarray | None], cache: KVCache, role: str, exponent: float,
                      clip: float, coarse: float | None = None) -> list[np.ndarray | None]:
    """Per layer ``[H]`` step multipliers for ``role`` from calibration sensitivities
    ``sens[i] [H, D]`` (:func:`kvcodec.harness.calibration.fisher_sensitivity`): with ``s`` the
    mean over channels of each (layer, head), ``(s / g) ** (-exponent / 2)`` where ``g`` is the
    geometric mean over all layers and heads of the role, clipped to ``[1/clip, clip]``.

    At exponent 1 this is the reverse water-filling allocation at high rate: equal weighted
    error per element, so a head whose errors move the next-token distribution 16x more gets a
    4x finer step. The geometric-mean normalisation keeps the role's mean log-step, so the
    preset's ``k_step`` / ``v_step`` keep about their rate. Layers whose shapes differ from the
    cache's (another model) get None.

    Example:
        >>> import torch
        >>> c = KVCache.from_tensors([(torch.zeros(2, 1, 2), torch.zeros(2, 1, 2))] * 2)
        >>> [m.tolist() for m in _sens_multipliers([np.full((1, 2), 4.0), np.ones((1, 2))], c, "k", 1.0, 4.0)]
        [[0.7071067811865476], [1.4142135623730951]]
    """
    heads: dict[int, np.ndarray] = {}
    for i, (a, layer) in enumerate(zip(sens, cache.layers)):
        if a is None or role not in layer or tuple(a.shape) != tuple(layer[role].shape[1:]):
            continue
        heads[i] = np.maximum(np.asarray(a, dtype=np.float64).mean(axis=1), 1e-30)
    out: list[np.ndarray | None] = [None] * cache.num_layers
    if not heads:
        return out
    logs = np.concatenate([np.log(h) for h in heads.values()])
    g = float(np.exp(logs.mean()))
    for i, h in heads.items():
        out[i] = np.clip((h / g) ** (-exponent / 2.0), 1.0 / clip, clip if coarse is None else coarse)
    return out


def _checked_recon(rc: Any, where: str) -> list[int] | None:
    """A tensor's ``rc`` param (reconstruction offsets): None when absent, else a list of 1 to
    16 integers in ``[0, 128]``.

    Raises:
        FormatError: any other value.
    """
    if rc is None:
        return None
    if (not isinstance(rc, list) or not 1 <= len(rc) <= RECON_MAX_LEVELS
            or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= RECON_UNIT // 2 for v in rc)):
        raise FormatError(f"{where}: kvc rc must list 1 to {RECON_MAX_LEVELS} integers in [0, {RECON_UNIT // 2}], "
                          f"got {rc!r}")
    return rc


def _checked_codes(sc: np.ndarray, where: str) -> np.ndarray:
    c = np.asarray(sc, dtype=np.int64)
    if c.size and (int(c.min()) < STEP_CODE_MIN or int(c.max()) > STEP_CODE_MAX):
        raise FormatError(f"{where}: kvc step code outside [{STEP_CODE_MIN}, {STEP_CODE_MAX}]")
    return c
