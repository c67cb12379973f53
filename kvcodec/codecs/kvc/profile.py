"""A model's kvc profile: quality targets mapped to that model's steps by measurement.

``kvcodec calibrate`` (:mod:`kvcodec.harness.profile`) runs the model: it encodes a calibration
cache at several overall step scales, scores the real next-token KL against the fp16 cache on
calibration tokens, and keeps the measured curve. This module is the encoder's side: the profile
as a validated value, and the steps it gives for a target KL. It runs no model.

The profile is a JSON object stored in the calibration file's metadata (``profile``):

* ``version``: 1.
* ``settings``: the kvc parameters the search used besides the steps (only those in
  :data:`QUALITY_PARAMS`: they change the decoded values; entropy and packing settings do not,
  so the caller's are kept).
* ``kv_ratio``: ``v_step / k_step`` (the K/V balance, from the model's measured sensitivities).
* ``margin``: a step meets a target ``t`` when its point's KL is at most ``margin * t`` (1.0 in
  the profiles ``kvcodec calibrate`` writes: their points already hold its criterion, ``max(mean
  KL / 0.8, worst window KL / 1.2)`` over the search windows; see ``criterion``).
* ``points``: ``[[k_step, kl, bits_per_element], ...]``, every encode the search scored (``kl``
  as ``criterion`` says; ``window_kl`` has each window's).
* ``levels``: ``[{"target_kl", "k_step", "v_step", "kl_search", "kl_holdout", "bits"}, ...]``:
  the named levels' verified steps and the KL measured on the held-out windows (means). A
  level's ``v_step / k_step`` may differ from ``kv_ratio``: the calibration balances K and V
  per level, closed loop (:func:`kvcodec.harness.profile.balance_level`).
* free-form provenance (``model``, ``text``, ``tokens``, ``seconds``...).

Steps for a target (:func:`steps_for_target`): a level's verified entry when the target is one
of the profile's levels; otherwise the largest ``k_step`` whose KL, interpolated log-linearly
between measured points (KL made non-decreasing in the step first), stays at or below
``margin * target``, kept between the neighbouring levels' steps, with ``v_step / k_step``
from :func:`ratio_for` (between the neighbouring levels' own ratios, never above
``kv_ratio``). Below the finest measured point the curve is extended with ``KL ∝ step**2``
(the high-rate law); it is never extended past the coarsest point.

Example:
    >>> prof = {"version": 1, "settings": {}, "kv_ratio": 2.0, "margin": 0.5,
    ...         "points": [[0.2, 0.001, 3.0], [0.4, 0.004, 2.0], [0.8, 0.02, 1.2]], "levels": []}
    >>> p = parse_profile(prof, "example")
    >>> s = steps_for_target(p, 0.008)   # aim 0.004: the measured point at 0.4
    >>> round(s["k_step"], 3), round(s["v_step"], 3)
    (0.4, 0.8)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ...errors import FormatError

PROFILE_VERSION = 1
#: kvc parameters that change the decoded values (the profile's search fixes them); all others
#: (entropy tables, contexts, packing, chunking) are lossless and stay the caller's.
#: (``sinks``, the leading tokens stored exactly, stays the caller's too. ``sink_v_ratio`` is
#: the profile's: the search measures without sink detection, and a caller's detection, the
#: plain presets' 0.3, cost about 0.06 b for a KL the search never asked for.)
QUALITY_PARAMS = ("k_step", "v_step", "k_gamma", "v_scale", "v_center", "recent", "rho",
                  "transform", "k_qgamma", "v_attn", "k_attn", "attn_clip", "attn_coarse", "sens", "sens_clip",
                  "sens_coarse", "recent_ramp", "recent_fine", "k_recon", "sink_v_ratio", "k_rope_mean", "xpred")
#: the quality levels kvc's presets name (mean next-token KL against the fp16 cache)
LEVELS = {"transparent": 0.002, "near": 0.01, "aggressive": 0.05}
_EPS = 1e-12


@dataclass(frozen=True)
class Profile:
    """A parsed profile (see the module docstring)."""

    settings: dict[str, Any]
    kv_ratio: float
    margin: float
    points: tuple[tuple[float, float, float], ...]
    levels: tuple[dict[str, float], ...]
    raw: dict[str, Any]


def _num(v: Any, what: str, where: str, lo: float = 0.0, hi: float = 1e9, open_lo: bool = True) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise FormatError(f"{where}: profile {what} must be a finite number, got {v!r}")
    if (v <= lo if open_lo else v < lo) or v > hi:
        raise FormatError(f"{where}: profile {what} must be in {'(' if open_lo else '['}{lo}, {hi}], got {v!r}")
    return float(v)


def parse_profile(raw: Any, where: str) -> Profile:
    """Validate a profile object (from a calibration file's metadata).

    Raises:
        FormatError: anything the calibrate command does not write.
    """
    if not isinstance(raw, dict) or type(raw.get("version")) is not int or raw.get("version") != PROFILE_VERSION:
        raise FormatError(f"{where}: not a version {PROFILE_VERSION} kvc profile")
    settings = raw.get("settings")
    if not isinstance(settings, dict) or not set(settings) <= set(QUALITY_PARAMS) or "k_step" in settings \
            or "v_step" in settings:
        raise FormatError(f"{where}: profile settings must be a JSON object of kvc quality parameters "
                          f"other than the steps ({', '.join(QUALITY_PARAMS[2:])})")
    # the values are checked by the codec that applies them (KVCCodec.prepare)
    kv_ratio = _num(raw.get("kv_ratio"), "kv_ratio", where, 0.0, 1000.0)
    margin = _num(raw.get("margin"), "margin", where, 0.0, 1.0)
    pts = raw.get("points")
    if not isinstance(pts, list) or not 1 <= len(pts) <= 1000:
        raise FormatError(f"{where}: profile points must be a list of 1 to 1000 [k_step, kl, bits]")
    points = []
    for p in pts:
        if not isinstance(p, list) or len(p) != 3:
            raise FormatError(f"{where}: profile point {p!r} is not [k_step, kl, bits]")
        points.append((_num(p[0], "k_step", where, 0.0, 1e6), _num(p[1], "kl", where, 0.0, 1e6, open_lo=False),
                       _num(p[2], "bits", where, 0.0, 64.0)))
    points.sort()
    levels = raw.get("levels")
    if not isinstance(levels, list) or len(levels) > 100:
        raise FormatError(f"{where}: profile levels must be a list")
    out_levels = []
    for lv in levels:
        if not isinstance(lv, dict) or not {"target_kl", "k_step", "v_step"} <= set(lv):
            raise FormatError(f"{where}: profile level {lv!r} needs target_kl, k_step and v_step")
        row = {k: _num(v, f"level {k}", where, 0.0, 1e6, open_lo=k not in ("kl_search", "kl_holdout"))
               for k, v in lv.items() if k in ("target_kl", "k_step", "v_step", "kl_search", "kl_holdout", "bits")}
        out_levels.append(row)
    return Profile(dict(settings), kv_ratio, margin, tuple(points), tuple(out_levels), raw)


def _envelope(points: tuple[tuple[float, float, float], ...]) -> list[tuple[float, float]]:
    """``(log k_step, log kl)`` with KL made non-decreasing in the step (a noisy point never
    makes a coarser step look better than a finer one)."""
    out: list[tuple[float, float]] = []
    hi = 0.0
    for s, kl, _ in points:
        hi = max(hi, kl)
        out.append((math.log(s), math.log(max(hi, _EPS))))
    return out


def k_step_for(profile: Profile, aim: float) -> float:
    """The largest ``k_step`` whose interpolated KL is at most ``aim`` (see the module docstring)."""
    env = _envelope(profile.points)
    la = math.log(max(aim, _EPS))
    if la < env[0][1]:  # finer than anything measured: KL ~ step**2
        return math.exp(env[0][0] + 0.5 * (la - env[0][1]))
    best = env[0][0]
    for (x0, y0), (x1, y1) in zip(env, env[1:]):
        if y1 <= la:
            best = x1
        elif y0 <= la < y1:
            best = x0 + (x1 - x0) * (la - y0) / (y1 - y0)
            break
        else:
            break
    return math.exp(best)


def steps_for_target(profile: Profile, target_kl: float) -> dict[str, Any]:
    """The quality parameters (the profile's settings, ``k_step`` and ``v_step``) that meet
    ``target_kl`` on the profile's model (see the module docstring)."""
    for lv in profile.levels:
        if abs(lv["target_kl"] - target_kl) <= 1e-9 * target_kl:
            return {**profile.settings, "k_step": lv["k_step"], "v_step": lv["v_step"]}
    k = k_step_for(profile, profile.margin * target_kl)
    # between two levels, never coarser than the next larger level's or finer than the next
    # smaller's verified step (a smaller target never codes coarser)
    for lv in profile.levels:
        if lv["target_kl"] > target_kl:
            k = min(k, lv["k_step"])
        elif lv["target_kl"] < target_kl:
            k = max(k, lv["k_step"])
    ratio = ratio_for(profile, target_kl)
    k = min(max(k, 1e-6), 1e6 / max(ratio, 1.0))
    return {**profile.settings, "k_step": k, "v_step": min(max(k * ratio, 1e-6), 1e6)}


def ratio_for(profile: Profile, target_kl: float) -> float:
    """``v_step / k_step`` for a target between the profile's levels: log-linear in log target
    between the two nearest levels' own ratios (the nearest level's outside them), never above
    ``kv_ratio``. A level's search may have moved its balance from ``kv_ratio`` (at coarse steps
    the best balance moves with the rate: :func:`kvcodec.harness.profile.balance_level`); the
    curve's points were measured at ``kv_ratio``, so a ratio at most that codes V at most as
    coarsely as the point the step came from: the KL stays on the safe side of the curve's.

    Example:
        >>> prof = parse_profile({"version": 1, "settings": {}, "kv_ratio": 2.0, "margin": 1.0,
        ...     "points": [[0.2, 0.002, 3.0], [1.0, 0.05, 1.0]],
        ...     "levels": [{"target_kl": 0.002, "k_step": 0.2, "v_step": 0.4},
        ...                {"target_kl": 0.05, "k_step": 1.5, "v_step": 0.75}]}, "example")
        >>> round(ratio_for(prof, 0.01), 3)   # halfway in log target: sqrt(2.0 * 0.5)
        1.0
    """
    lv = sorted((x["target_kl"], x["v_step"] / x["k_step"]) for x in profile.levels)
    if not lv:
        return profile.kv_ratio
    if target_kl <= lv[0][0]:
        r = lv[0][1]
    elif target_kl >= lv[-1][0]:
        r = lv[-1][1]
    else:
        (t0, r0), (t1, r1) = next((a, b) for a, b in zip(lv, lv[1:]) if a[0] <= target_kl <= b[0])
        w = math.log(target_kl / t0) / math.log(t1 / t0) if t1 > t0 else 0.0
        r = math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))
    return min(r, profile.kv_ratio)


__all__ = ["LEVELS", "PROFILE_VERSION", "QUALITY_PARAMS", "Profile", "k_step_for", "parse_profile",
           "ratio_for", "steps_for_target"]
