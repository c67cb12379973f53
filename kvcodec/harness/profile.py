"""Closed-loop calibration: a model's kvc profile, measured on that model.

kvc's steps are fractions of an RMS; how much next-token KL a step costs depends on the model
(SmolLM2 and Qwen2.5-Coder differ by 2-5x at the same step). :func:`build_profile` measures it:

1. **Statistics** (:func:`~kvcodec.harness.calibration.query_statistics`) on a search window of
   the calibration text: query energies and samples, and per (layer, head) Fisher sensitivities.
2. **K/V balance** from the sensitivities: with ``g_K``, ``g_V`` the geometric means of the K and
   V sensitivities (in kvc's step units), the steps that minimise the summed weighted error at a
   given rate have ``v_step / k_step = sqrt(g_K / g_V)`` (reverse water-filling at high rate;
   the per-head multipliers inside each role come from the same sensitivities).
3. **Closed loop**: for each target, finest first, encode each search window's fp16 cache (one
   window of each calibration domain by default: prose, code, documentation, dialogue) at an
   overall scale, run the model on the next tokens with the decoded cache, measure the mean
   next-token KL against the fp16 cache, and move the scale until the mean over the windows
   sits just under ``margin * target`` and the worst window under 1.2x the target (what a level
   promises: eval/results/kvc_profile.md holds the profiles to it). The first scale is where
   the first window's Fisher information predicts the finest target (a second-order prediction:
   encodes, no model run); the next come from secant steps on log KL against log step with the
   slope of every point measured. A scale that one window already proves too coarse is not
   scored on the others. Every fully scored encode becomes a point of the profile's curve, so
   any later ``target_kl`` maps to steps by interpolation.
4. **Balance per level** (:func:`balance_level`, coarsest level first): the high-rate K/V ratio of step 2 stops
   holding at coarse steps, where one role's values quantise mostly to zero. For each level
   met, a probe moves ``v_step / k_step`` by 0.75x (then further while probes win, or the
   other way when the first lost), at the ``k_step`` that keeps the level's bits (found by
   encodes alone), and scores it; the best probe spends its lower criterion on a coarser step
   (at most two scores). The level keeps the best met point, so its ``v_step`` may differ
   from ``kv_ratio * k_step``. The probes stop when the whole loop has scored
   :data:`MAX_TOTAL_SCORES` steps' worth of windows (a bound on the time a model whose
   every probe wins can take).
5. **Held-out check**: each level's steps are scored once more on a window the search did not
   use (the second window of the first domain text long enough for two; ``max_held`` for more);
   the profile reports that KL beside the search KL.

The windows follow the levels' definition, 512 scored tokens after the cached ones (the tokens
nearest the cache, which a shorter continuation scores alone, lose most; with 256 the steps
chosen came out 2-2.5x below the targets on the evaluation texts, commit 76e7ad4's
eval/results/kvc_profile.md). Each scored step costs a model run per search window (12 s for a
0.5B model on 2 cores): 1024 cached tokens, one held-out window, the early stops and the
count-bounded refinement keep a 0.5B model's calibration under 10 minutes on 2 cores (the
balance probes, early-stopped too, took Qwen2.5-Coder-0.5B from 226 to 315 s and SmolLM2 from 91
to 251 s on a 2-core Xeon; with bits matched on one window and the coarsest level balanced
first, 255 and 147 s: eval/results/kvc_profile.md). A model with 9x the KV per token (Qwen3-0.6B's shape)
spends ~3 s of each window score encoding and decoding; :data:`MAX_TOTAL_SCORES` bounds how many steps a
model whose every balance probe wins may score (eval/results/kvc_calib_time.md).

The result is the statistics file with a ``profile`` (:mod:`kvcodec.codecs.kvc.profile`); the
encoder reads it when ``target_kl`` is set (the level presets set it).

Example:
    >>> from kvcodec.harness import load_model                               # doctest: +SKIP
    >>> from kvcodec.harness.texts import calibration_text                   # doctest: +SKIP
    >>> model, tok = load_model("qwen2.5-coder-0.5b")                        # doctest: +SKIP
    >>> texts = {d: calibration_text(d) for d in ("prose", "code", "docs", "dialogue")}  # doctest: +SKIP
    >>> stats = build_profile(model, tok, texts)                             # doctest: +SKIP
    >>> save_query_statistics(stats, "qwen.profile.safetensors")            # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

from ..codecs.kvc.calibration import QueryStats, save_query_statistics
from ..codecs.kvc.codec import KVCCodec
from ..codecs.kvc.profile import LEVELS, PROFILE_VERSION, QUALITY_PARAMS, parse_profile
from ..errors import InputError

#: The quality settings the search codes with (besides the steps): the calibrated encoder's
#: (query-weighted K channels, per-head sensitivities, attention-weighted per-token steps that
#: only ever refine, finer steps for the latest tokens, K reconstruction offsets). K channels are
#: weighted by the query energy itself (``k_qgamma`` 1, the logit error's exact weight) and a head
#: the model is sensitive to may get up to 8x finer steps (``sens_clip``), never more than 1.5x
#: coarser: on both models' search windows that took the bits at KL 0.006 from 1.82 to 1.74
#: (SmolLM2) and from 2.58 to about 2.1 (Qwen2.5-Coder) against 1.5 and 2x
#: (eval/results/kvc_alloc*.md).
SEARCH_SETTINGS: dict[str, Any] = {
    "k_qgamma": 1.0, "v_attn": 0.5, "k_attn": 1.0, "attn_clip": 3.0, "attn_coarse": 1.0,
    "sens": 1.0, "sens_clip": 8.0, "sens_coarse": 1.5, "recent_ramp": 128, "recent_fine": 4.0, "k_recon": 4,
    "sink_v_ratio": 0.0, "k_rope_mean": 1, "xpred": 1,
}
#: The cross-layer predictors (``xpred``) are fitted once, closed loop, at the steps the Fisher
#: information predicts for this level coded without them (``DEFAULT_MARGIN`` times it): one set
#: fitted at the near-lossless level served every level on both models
#: (eval/results/kvc_xpred_fit001.md); fitted on uncoded K and V they broke SmolLM2's coarse
#: levels (kvc_xpred_clean.md).
XPRED_FIT_KL = 0.01
#: Cross-layer predictors are full rank (smaller ones explain much less: docs/kvc-design.md §5), so
#: their weights and the decoder's work grow as the square of a layer's K and V values per token:
#: SmolLM2 384 (147,456 weights a layer, 8 ms a 1536-token layer on one core here), Qwen2.5-Coder
#: 256; Qwen3-0.6B's 2,048 would take 4.2 M weights a layer (a 235 MB profile) and ~30x
#: SmolLM2's decode work. Past this bound a profile is made without them (1,024 values: a 1B
#: model with 8 KV heads of 64 channels stays within it).
XPRED_MAX_WEIGHTS = 1 << 20
#: Entropy settings of the search's encodes (lossless: they change the bits it reports, not the KL).
SEARCH_ENTROPY: dict[str, Any] = {"ctx": [3, 8, 20], "rows_per_stream": 64, "chunk": 2048, "max_level": 32}
#: A step meets a target ``t`` when the mean KL over the search windows is at most
#: ``DEFAULT_MARGIN * t`` and the worst window's at most ``WORST_FACTOR * t``: what a level
#: promises (mean KL within the target, no text more than 1.2x it), with a margin on the mean
#: because text the search did not see scatters around the search windows' KL
#: (eval/results/kvc_profile.md measures how much).
DEFAULT_MARGIN = 0.8
WORST_FACTOR = 1.2
#: The search refines a level it met low in its band only while it has made fewer window scores
#: than this many steps' worth (a count, not seconds, so a profile does not depend on the
#: machine's speed; a step stopped early counts the windows it scored; the levels need 6-8
#: steps' worth on both models here, so refinement gets what is left of 8).
MAX_SCORES = 8
#: The whole closed loop (search and balance) scores at most this many steps' worth of windows;
#: the balance probes stop when it is spent (keeping the best point found). A count, like
#: MAX_SCORES, so the profile does not depend on the machine. Both real models here need fewer
#: (SmolLM2 14.25, Qwen2.5-Coder 11.25 steps' worth: the ``window_scores`` their profiles of
#: eval/results/kvc_profile.md's run record), so their profiles do not change; it bounds a model where
#: every balance probe wins and the steps cost more: a random-weight model of Qwen3-0.6B's shape
#: (KV 9x Qwen2.5-Coder's) took 907 s without it (a scratch run of eval/studies/kvc_calib_time.py)
#: and 680 s with it (eval/results/kvc_calib_time.md): still over 10 minutes on 2 cores.
MAX_TOTAL_SCORES = 16
#: Seconds the closed loop may take before it stops probing the K/V balance (``build_profile``'s
#: ``time_budget``; None: no bound). A probe starts only when, at the seconds a window score has
#: taken so far, it and the held-out check would still end within the budget; the search for the
#: levels themselves always runs, so every level is met, and what the budget can cut is bits the
#: balance would have saved. Unlike the counts above it makes a profile depend on the machine's
#: speed, but only for models whose steps cost more than the two real ones here (SmolLM2 and
#: Qwen2.5-Coder-0.5B end in 240-400 s, eval/results/kvc_profile.md): a model of Qwen3-0.6B's
#: shape took 691 s without it (commit 4c8041f's eval/results/kvc_calib_time.md). 540 s leaves
#: a 0.5-0.6B model's load inside 10 minutes on 2 cores.
TIME_BUDGET = 540.0
#: How the search proposes steps (recorded in profiles; studies remake profiles made otherwise):
#: finest level first, from the step the Fisher information predicts for it, then secant steps
#: with the slope of every measured point, a step stopped as soon as one window proves it over
#: the level (:func:`search_levels`, :func:`score_windows_until`).
SEARCH_METHOD = f"fine-first/3+balance/5+total/{MAX_TOTAL_SCORES}+xpred-fit/{XPRED_FIT_KL}/held/tensor-rms"


def search_settings() -> dict[str, Any]:
    """Every quality parameter the search codes with besides the steps (``SEARCH_SETTINGS`` over
    kvc's defaults): what a profile records as its ``settings``."""
    return {k: v for k, v in KVCCodec(**SEARCH_SETTINGS).params.items() if k in QUALITY_PARAMS
            and k not in ("k_step", "v_step")}


def kv_ratio(stats: QueryStats) -> float | None:
    """``v_step / k_step`` from the statistics' sensitivities (``sqrt(g_K / g_V)``, see the module
    docstring), clipped to [0.25, 16]; None without sensitivities."""
    def gmean(arrs: list[np.ndarray | None]) -> float | None:
        logs = [np.log(np.maximum(np.asarray(a, dtype=np.float64).mean(axis=1), 1e-30)) for a in arrs if a is not None]
        return float(np.exp(np.concatenate(logs).mean())) if logs else None

    gk, gv = gmean(stats.sensitivity("k")), gmean(stats.sensitivity("v"))
    if gk is None or gv is None:
        return None
    return float(np.clip(math.sqrt(gk / gv), 0.25, 16.0))


def score_windows(evaluators: list[Any], config: dict[str, Any], margin: float,
                  worst: float = WORST_FACTOR) -> tuple[float, list[float], float]:
    """Encode and score ``config`` on every window: ``(criterion, per-window KL, mean bits)``, the
    criterion ``max(mean KL / margin, worst KL / worst)`` meeting a target ``t`` when it is at
    most ``t``."""
    crit, kls, bits, _ = score_windows_until(evaluators, config, margin, worst, None)
    return crit, kls, bits


def score_windows_until(evaluators: list[Any], config: Any, margin: float, worst: float,
                        stop_above: float | None, order: list[int] | None = None,
                        ) -> tuple[float, list[float | None], float, bool]:
    """:func:`score_windows` that stops as soon as the windows scored so far prove the criterion
    above ``stop_above`` (the level being searched cannot take this step):
    ``(criterion or its lower bound, per-window KL (None where not scored), mean bits of the
    scored windows, whether every window was scored)``. Windows are scored in ``order`` (the
    search puts the one with the highest KL so far first). The lower bound after windows ``S``
    of ``N``: ``max(sum_S KL / (N * margin), max_S KL / worst)`` (the others' KL is >= 0).
    ``config``: one codec config, or a function of the window's index that gives its own."""
    n = len(evaluators)
    kls: list[float | None] = [None] * n
    bits = []
    for i in (order or list(range(n))):
        r = evaluators[i].score_next_token(config(i) if callable(config) else config, kl_only=True)
        kls[i] = float(r["next_token"]["kl_mean"])
        bits.append(r["bits_per_element"])
        got = [k for k in kls if k is not None]
        bound = max(sum(got) / (n * margin), max(got) / worst)
        if stop_above is not None and len(got) < n and bound > stop_above:
            return bound, kls, float(np.mean(bits)), False
    got = [k for k in kls if k is not None]
    return max(float(np.mean(got)) / margin, max(got) / worst), kls, float(np.mean(bits)), True


def _slope(pts: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log criterion on log x over ``pts``, or None with fewer than two
    distinct x (every point measured so far: one close pair alone gives a noisy slope)."""
    xs = np.log([max(p[0], 1e-30) for p in pts])
    ys = np.log([max(p[1], 1e-12) for p in pts])
    if len(pts) < 2 or float(np.ptp(xs)) < 1e-6:
        return None
    xc = xs - xs.mean()
    return float((xc * (ys - ys.mean())).sum() / (xc * xc).sum())


def _secant(pts: list[tuple[float, float]], aim: float, slope: float) -> float:
    """Where the criterion reaches ``aim``, from measured ``(k_step, criterion)`` points:
    log-linear between the nearest points either side of the aim when it is bracketed (with
    ``slope``, the slope of all points, when those two lie within 10 % of each other), else from
    the nearest point with ``slope``; slopes clipped to [1, 4], at most a factor e**1.5 from the
    nearest point."""
    pts = sorted(pts)
    below = [p for p in pts if p[1] <= aim]
    above = [p for p in pts if p[1] > aim]
    if below and above and max(below)[0] < min(above)[0]:
        (x0, k0), (x1, k1) = max(below), min(above)
        if abs(math.log(x1 / x0)) >= 0.1:
            slope = math.log(max(k1, 1e-12) / max(k0, 1e-12)) / math.log(x1 / x0)
    else:
        x0, k0 = min(pts, key=lambda p: abs(math.log(max(p[1], 1e-12) / aim)))
    step = math.log(aim / max(k0, 1e-12)) / float(np.clip(slope, 1.0, 4.0))
    return x0 * math.exp(float(np.clip(step, -1.5, 1.5)))


def _next_step(points: list[tuple[float, float, float]], aim: float,
               bounds: list[tuple[float, float, float]] = ()) -> float:
    """The next scale to try: :func:`_secant` on the exactly scored ``points`` with the slope of
    all of them (one point: slope 2, the high-rate law).

    ``bounds`` are steps stopped early, ``(k_step, lower bound of the criterion, bits)``: their
    criterion is not known, only that it exceeds the bound, so they never enter the slope (lower
    bounds would flatten it). A step at or past one whose bound exceeds the aim is known too
    coarse: the proposal is then taken from that bound with the slope of the points."""
    over = [b for b in bounds if b[1] > aim]
    pts = [(p[0], p[1]) for p in points]
    fit = _slope(pts)
    slope = float(np.clip(2.0 if fit is None else fit, 1.0, 4.0))
    s = _secant(pts, aim, slope) if pts else None
    if over:
        sb, lb = min((b[0], b[1]) for b in over)  # the finest step known to be over the aim
        if s is None or s >= sb:
            below = [p for p in pts if p[1] <= aim and p[0] < sb]
            if below:  # bracketed: the true slope to the bound is at least the one to its bound
                s0, c0 = max(below)
                to_bound = math.log(lb / max(c0, 1e-12)) / math.log(sb / s0)
                s = s0 * math.exp(math.log(aim / max(c0, 1e-12)) / float(np.clip(max(to_bound, slope), 1.0, 8.0)))
            else:
                s = sb * math.exp(float(np.clip(math.log(aim / lb) / slope, -1.5, 0.0)))
    if s is None:  # nothing measured at all (a caller's first step is given)
        raise ValueError("no point to step from")
    return s


def _solve_step(predict: Callable[[float], float], target: float, s: float, tries: int = 8,
                ) -> tuple[float, float]:
    """The step whose predicted KL is nearest ``target``, and that KL (secant steps in log-log
    from ``s``; the prediction grows about as the step squared)."""
    pts: list[tuple[float, float]] = []
    for _ in range(tries):
        p = max(predict(s), 1e-30)
        pts.append((s, p))
        if abs(math.log(p / target)) < 0.02:
            break
        slope = 2.0
        if len(pts) > 1:
            (s0, p0), (s1, p1) = pts[-2], pts[-1]
            if abs(math.log(s1 / s0)) > 1e-6 and p1 != p0:
                slope = float(np.clip(math.log(p1 / p0) / math.log(s1 / s0), 0.5, 6.0))
        s *= math.exp(float(np.clip(math.log(target / p) / slope, -1.5, 1.5)))
    return min(pts, key=lambda q: abs(math.log(q[1] / target)))


def _windows(tokenizer: Any, text: str, context: int, continuation: int, count: int) -> list[torch.Tensor]:
    """Up to ``count`` disjoint, consecutive token windows of ``context + continuation + 1`` ids
    (each starts with the BOS token when the tokenizer has one, as the text's first does)."""
    from .capture import tokenize

    n = context + continuation + 1
    ids = tokenize(tokenizer, text, None)
    if ids.numel() < n:
        raise InputError(f"the text has {ids.numel()} tokens; {n} are needed")
    bos = getattr(tokenizer, "bos_token_id", None)
    out = [ids[:n]]
    for i in range(1, ids.numel() // n):
        w = ids[i * n:(i + 1) * n].clone()
        out.append(torch.cat([torch.tensor([bos]), w[:-1]]) if bos is not None else w)
    return out[:count]


def split_windows(tokenizer: Any, texts: dict[str, str], context: int, continuation: int,
                  max_search: int = 4, max_held: int | None = None,
                  ) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """Search and held-out windows: from several texts, each text's first window searches and its
    second (when the text is long enough) is held out; from one text, its windows alternate.

    Raises:
        InputError: a text is shorter than one window, or no window is left to hold out.
    """
    search: list[tuple[str, torch.Tensor]] = []
    held: list[tuple[str, torch.Tensor]] = []
    for name, text in texts.items():
        try:
            wins = _windows(tokenizer, text, context, continuation, 2 * max_search if len(texts) == 1 else 2)
        except InputError as e:
            raise InputError(f"calibration text {name!r} is shorter than one window of "
                             f"{context + continuation + 1} tokens ({e})") from None
        for i, w in enumerate(wins):
            (search if i % 2 == 0 else held).append((f"{name}[{i}]", w))
    if not held:
        raise InputError(f"the calibration text needs at least two windows of {context + continuation + 1} tokens "
                         "(one searched, one held out)")
    return search[:max_search], held[:max_search if max_held is None else max(1, max_held)]


def search_levels(score: Callable[..., Any], levels: dict[str, float],
                  ratio: float, max_evals: int = 5, say: Callable[[str], None] = lambda m: None,
                  t0: float | None = None, max_scores: int | None = MAX_SCORES, first: float = 0.5,
                  partial: list[tuple[float, float, list[float | None]]] | None = None,
                  ) -> tuple[list[tuple[float, float, float]], dict[float, list[float]], dict[str, dict[str, Any]]]:
    """The closed loop of :func:`build_profile`: ``score(k_step) -> (criterion, per-window KL,
    bits)``; for each level (finest first) secant steps until the criterion sits in [0.8, 1]
    times the target (at most ``max_evals`` scores, then up to 4 halvings if none met it). A
    level met below 0.9 times its target gets one more score, aimed at 0.96 times it from the
    points either side, while fewer than ``max_scores`` steps' worth of windows have been
    scored in all (None: never); every 10 % of KL left unused costs about 0.04 bit per element. The refinement is
    bounded by a count, so the same scores give the same profile on any machine; ``t0`` only
    times the progress messages. The finest level is searched first, from the step ``first``
    (:func:`build_profile` passes the step whose KL the Fisher information predicts to be 0.9
    times that level); every later step comes from the measured points (:func:`_next_step`).
    Returns ``(points, window KLs by step, chosen)``: each level's coarsest measured step that
    meets its target with every finer measured step meeting it too (so a smaller target never
    gets a coarser step).

    With a list ``partial``, ``score(k_step, stop_above)`` may stop early
    (:func:`score_windows_until`: ``(criterion or lower bound, window KLs, bits, complete)``) once
    a step is proven over the level's target: such a step guides the next one by its lower
    bound, is appended to ``partial`` as ``(k_step, bound, window KLs)``, and is never chosen
    nor among the returned points (whose KLs are exact). On Qwen2.5-Coder this saved three of
    eight 4-window scores (the prose window alone showed the step too coarse).
    """
    t0 = time.perf_counter() if t0 is None else t0
    points: list[tuple[float, float, float]] = []
    detail: dict[float, list[float]] = {}
    chosen: dict[str, dict[str, Any]] = {}

    rough: list[tuple[float, float, float]] = []  # steps stopped early: (k_step, lower bound, bits)
    runs = [0, 1]  # window scores so far, windows per step

    def run(s: float, stop: float | None) -> float:
        if partial is None:
            crit, kls, bits = score(s)
            complete = True
        else:
            crit, kls, bits, complete = score(s, stop)
        if complete:
            points.append((s, crit, bits))
            detail[s] = kls
        else:
            rough.append((s, crit, bits))
            partial.append((s, crit, kls))
        shown = [k for k in kls if k is not None]
        runs[0] += len(shown)
        runs[1] = len(kls)
        if complete:
            say(f"{name} (KL <= {target:g}): k_step {s:.4f} -> mean KL {np.mean(shown):.5f}, worst {max(shown):.5f}, "
                f"{bits:.3f} b ({time.perf_counter() - t0:.0f} s)")
        else:
            say(f"{name} (KL <= {target:g}): k_step {s:.4f} -> KL {max(shown):.5f} on {len(shown)} of {len(kls)} "
                f"windows: over the target, not scored further ({time.perf_counter() - t0:.0f} s)")
        return crit

    for name, target in sorted(levels.items(), key=lambda kv: kv[1]):  # fine first: where the prediction holds
        s = _next_step(points, 0.9 * target, rough) if points or rough else first
        refining = False
        for _ in range(max_evals):
            if any(abs(math.log(s / p[0])) < 1e-3 for p in points + rough):
                break  # already scored: the curve cannot tell more here
            crit = run(s, target)
            if refining:
                break
            if 0.8 * target <= crit <= target:
                if crit >= 0.9 * target or max_scores is None or runs[0] >= max_scores * runs[1]:
                    break
                refining = True  # met low in the band: one score closer to the target
                s = _next_step(points, 0.96 * target, rough)
                continue
            s = _next_step(points, 0.9 * target, rough)
        if not [p for p in points if p[1] <= target]:  # none met it: halve from the finest until one does (bounded)
            s = min(points + rough)[0]
            for _ in range(4):
                s *= 0.5
                if run(s, None) <= target:
                    break
    for name, target in levels.items():  # chosen from every point measured, so monotone in the target
        # the coarsest measured step that meets the target with every finer step meeting it too
        best = min(points)
        for p in sorted(points):
            if p[1] > target:
                break
            best = p
        chosen[name] = {"target_kl": target, "k_step": best[0], "v_step": best[0] * ratio,
                        "kl_search": float(np.mean(detail[best[0]])), "kl_search_worst": max(detail[best[0]]),
                        "bits": best[2]}
    return points, detail, chosen


#: How far each balance probe moves ``v_step / k_step`` (a factor; :func:`balance_level`). The
#: search's resolution: on the aggressive level's search windows (eval/results/kvc_balance.md)
#: SmolLM2 needed 2.8 % fewer bits at 0.75x its measured ratio and none at 0.6x, Qwen2.5-Coder
#: 8.5 % fewer at 0.75x and 11 % at 0.6x; steps of 0.75x find both.
BALANCE_FACTOR = 0.75
#: At most this many probes per level (the first direction, then the other when it lost; on
#: while a probe wins).
BALANCE_PROBES = 3
#: At most this many scores spend a better balance's KL on a coarser step (the first aims with
#: the search's slope; Qwen2.5-Coder's aggressive level overshot with it once).
BALANCE_LANDINGS = 2


def _match_bits(bits: Callable[[float, float], float], want: float, k: float, ratio: float,
                tries: int = 4) -> float:
    """The ``k_step`` at which ``bits(k_step, ratio * k_step)`` (an encode, no model run) is
    nearest ``want``: secant steps on log bits against log k_step from ``k`` (bits fall about
    linearly in log step; slope clipped so a flat stretch cannot send the step far)."""
    pts: list[tuple[float, float]] = []
    for _ in range(tries):
        b = bits(k, ratio * k)
        pts.append((k, b))
        if abs(b - want) <= 0.005 * want:
            break
        slope = -1.0  # bits per unit of log2 step, about -1 at high rate
        if len(pts) > 1:
            (k0, b0), (k1, b1) = pts[-2], pts[-1]
            if abs(math.log2(k1 / k0)) > 1e-6 and b1 != b0:
                slope = float(np.clip((b1 - b0) / math.log2(k1 / k0), -4.0, -0.1))
        k *= 2.0 ** float(np.clip((want - b) / slope, -1.5, 1.5))
    return min(pts, key=lambda q: abs(q[1] - want))[0]


def balance_level(score: Callable[..., Any], bits: Callable[[float, float], float], target: float,
                  k0: float, ratio0: float, crit0: float, bits0: float, slope: float,
                  say: Callable[[str], None] = lambda m: None, factor: float = BALANCE_FACTOR,
                  probes: int = BALANCE_PROBES, landings: int = BALANCE_LANDINGS,
                  room: Callable[[], bool] = lambda: True,
                  ) -> tuple[dict[str, float], list[list[Any]]]:
    """The K/V balance of one level, closed loop: ``v_step / k_step`` moved from ``ratio0`` while
    the bits stay those of the level's met point ``(k0, ratio0 * k0)`` (``crit0``, ``bits0``).

    The high-rate balance (:func:`kv_ratio`) holds where both roles keep most of their values;
    at coarse steps one role's values quantise mostly to zero and its error stops growing with
    its step while its bits keep falling, so the best balance moves with the rate (at the
    aggressive level's scale, Qwen2.5-Coder needed 1.14-1.19 b instead of 1.30 with V at
    0.4-0.75x the high-rate ratio, SmolLM2 0.84 b instead of 0.86 at 0.75x and more below:
    eval/results/kvc_balance.md). Each probe takes the ratio times ``factor``, finds the
    ``k_step`` that codes to the level's bits by encodes alone (:func:`_match_bits`: ``bits(k_step,
    v_step)`` may measure one window only, matched to its own bits at the level's point, while
    ``bits0`` and the probes' scores are every window's), and scores it,
    stopping as soon as its windows prove it worse than ``crit0``
    (``score(k_step, v_step, stop_above) -> (criterion, window KLs, bits, complete)``). A better
    probe is kept and the next goes further the same way (``probes`` in all); when the first
    loses, the next tries the other way (``1 / factor``). The best probe then spends its lower
    KL: a score at the step its criterion predicts for ``0.96 * target`` (with ``slope``, log
    criterion per log step), and when that one lands over the target or below 0.9x it, one more
    from the points and bounds this ratio measured (``landings`` in all); the coarsest that
    meets the target is kept.

    ``room()`` is asked before every score: False (the calibration's budget, window scores
    :data:`MAX_TOTAL_SCORES` or seconds :data:`TIME_BUDGET`, is spent) ends the balance with the
    best point scored so far.

    Returns ``(chosen, tried)``: the level's point ``{"k_step", "v_step", "crit", "kls",
    "bits"}`` (the original one when no probe beat it) and every probe scored as ``[k_step,
    v_step, criterion or its lower bound, bits, complete]``.
    """
    best = {"k_step": k0, "v_step": ratio0 * k0, "crit": crit0, "kls": None, "bits": bits0}
    tried: list[list[Any]] = []
    ratio, way = ratio0, factor
    want = None  # the level's bits as ``bits`` measures them (a window may stand for all)
    for i in range(probes):
        if not room():
            say(f"balance (KL <= {target:g}): the calibration's budget is spent; no more probes")
            break
        if want is None:  # an encode: only when a probe runs
            want = bits(k0, ratio0 * k0)
        r = ratio * way
        # first guess: K and V steps moved apart by the same factor, about the same bits
        k = _match_bits(bits, want, best["k_step"] * math.sqrt(ratio / r), r)
        crit, kls, b, complete = score(k, r * k, best["crit"])
        tried.append([float(k), float(r * k), float(crit), float(b), bool(complete)])
        say(f"balance (KL <= {target:g}): v/k {r:.3f}, k_step {k:.4f} at {b:.3f} b -> "
            + (f"criterion {crit:.5f}" if complete else f"over {best['crit']:.5f} after "
               f"{sum(x is not None for x in kls)} windows") + f" (was {best['crit']:.5f} at v/k {ratio:.3f})")
        if complete and crit < best["crit"] and b <= bits0 * 1.01:
            best = {"k_step": k, "v_step": r * k, "crit": crit, "kls": kls, "bits": b}
            ratio = r
        elif i == 0:
            way = 1.0 / factor  # the first way lost: the other way
        else:
            break
    if ratio != ratio0 and best["crit"] < 0.9 * target:
        # spend the KL the better balance saved: the step its criterion predicts for 0.96x the
        # target (first with ``slope``, then from what this ratio measured: a step proven over
        # the target bounds the next, :func:`_next_step`), at most ``landings`` scores
        pts = [(best["k_step"], best["crit"], best["bits"])]
        rough: list[tuple[float, float, float]] = []
        for j in range(landings):
            if not room():
                say(f"balance (KL <= {target:g}): the calibration's budget is spent; no more landings")
                break
            if j == 0:
                k = best["k_step"] * math.exp(math.log(0.96 * target / best["crit"]) / float(np.clip(slope, 1.0, 4.0)))
            else:
                k = _next_step(pts, 0.96 * target, rough)
            if any(abs(math.log(k / p[0])) < 1e-3 for p in pts + rough):
                break
            crit, kls, b, complete = score(k, ratio * k, target)
            tried.append([float(k), float(ratio * k), float(crit), float(b), bool(complete)])
            say(f"balance (KL <= {target:g}): v/k {ratio:.3f}, k_step {k:.4f} -> "
                + (f"criterion {crit:.5f}, {b:.3f} b" if complete else "over the target"))
            if not complete:
                rough.append((k, crit, b))
                continue
            pts.append((k, crit, b))
            if crit <= target and b < best["bits"]:
                best = {"k_step": k, "v_step": ratio * k, "crit": crit, "kls": kls, "bits": b}
                if crit >= 0.9 * target:
                    break
    return best, tried


def balance_levels(score_kv: Callable[..., Any], bits_kv: Callable[[float, float], float],
                   levels: dict[str, float], ratio: float, points: list[tuple[float, float, float]],
                   detail: dict[float, list[float]], chosen: dict[str, dict[str, Any]], tried: list[list[Any]],
                   say: Callable[[str], None] = lambda m: None, probes: int = BALANCE_PROBES,
                   room: Callable[[], bool] = lambda: True) -> None:
    """:func:`balance_level` for every level :func:`search_levels` met, coarsest first (where the
    high-rate balance holds least, so the budget of window scores, ``room``, goes there first:
    eval/results/kvc_balance.md), updating ``chosen`` in place (the ``v_step`` of a level may
    then differ from ``ratio * k_step``) and appending every probe to ``tried``. A finer level
    never keeps fewer bits than a coarser one (it keeps its first point then)."""
    slope = _slope([(p[0], p[1]) for p in points]) or 2.0
    crit_at = {p[0]: p[1] for p in points}
    floor = -math.inf  # the most bits a coarser level keeps
    for name, target in sorted(levels.items(), key=lambda kv: -kv[1]):
        row = chosen[name]
        crit0 = crit_at.get(row["k_step"], math.inf)
        if crit0 <= target:
            best, t = balance_level(score_kv, bits_kv, target, row["k_step"], ratio, crit0, row["bits"], slope,
                                    say, probes=probes, room=room)
            tried.extend(t)
            if best["kls"] is not None and best["bits"] >= floor:
                kls = [float(x) for x in best["kls"]]
                row.update(k_step=best["k_step"], v_step=best["v_step"], kl_search=float(np.mean(kls)),
                           kl_search_worst=max(kls), bits=best["bits"])
                detail[best["k_step"]] = kls
        floor = max(floor, row["bits"])


def build_profile(
    model: Any,
    tokenizer: Any,
    texts: str | dict[str, str],
    *,
    context: int = 1024,
    continuation: int = 512,
    samples: int = 64,
    sensitivity_samples: int = 2,
    margin: float = DEFAULT_MARGIN,
    worst: float = WORST_FACTOR,
    levels: dict[str, float] | None = None,
    max_evals: int = 5,
    max_windows: int = 4,
    max_held: int = 1,
    max_scores: int | None = MAX_SCORES,
    max_total_scores: int | None = MAX_TOTAL_SCORES,
    balance_probes: int = BALANCE_PROBES,
    time_budget: float | None = TIME_BUDGET,
    text_name: str = "custom",
    progress: Callable[[str], None] | None = None,
    xpred: bool = True,
) -> QueryStats:
    """Measure ``model``'s kvc profile (see the module docstring) on ``texts`` (one text, or a
    text per domain: :func:`kvcodec.harness.texts.calibration_texts`): the query statistics of
    the first search window with a ``profile`` for each level of ``levels`` (default
    :data:`~kvcodec.codecs.kvc.profile.LEVELS`).

    A step meets a target when, over the search windows, the mean KL is at most ``margin *
    target`` and the worst window's at most ``worst * target``. ``max_scores``: see
    :func:`search_levels`; ``max_total_scores``: :data:`MAX_TOTAL_SCORES` (None: no bound);
    ``time_budget``: :data:`TIME_BUDGET`, seconds (None: no bound).
    ``xpred``: fit cross-layer predictors first (:mod:`kvcodec.harness.xpred`) and search with
    them on, so every level codes layers as residuals; files coded with such a profile decode
    only where the profile is (formats/codecs/kvc.md §13). False: self-contained files.

    Raises:
        InputError: a text is shorter than a window, or bad arguments.
    """
    from ..codec import get_codec
    from .calibration import fisher_diagonal, fisher_kl, query_statistics, sensitivities
    from .evaluate import Evaluator

    levels = dict(LEVELS if levels is None else levels)
    if (not 0 < margin <= 1 or not margin <= worst <= 4 or max_evals < 1 or max_windows < 1 or not levels
            or min(levels.values()) <= 0 or (time_budget is not None and not time_budget > 0)):
        raise InputError("margin must be in (0, 1], worst in [margin, 4], max_evals and max_windows >= 1, "
                         "every level > 0 and a time budget > 0 (or None)")
    if isinstance(texts, str):
        texts = {text_name: texts}
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    search, held = split_windows(tokenizer, texts, context, continuation, max_windows, max_held)

    def fisher_progress(done: int, total: int) -> None:
        say(f"sensitivity draw {done}/{total} ({time.perf_counter() - t0:.0f} s)")

    evs = []
    for name, w in search:  # the fp16 cache and reference logits of each search window
        evs.append(Evaluator(model, tokenizer, "", context, continuation, attn_queries=1, token_ids=w))
        say(f"search window {len(evs)}/{len(search)} ({name}) ready ({time.perf_counter() - t0:.0f} s)")
    setup_s = (time.perf_counter() - t0) / max(1, len(search))  # seconds to set a window up
    say(f"query statistics and sensitivities on {context} + {continuation} tokens of {search[0][0]}")
    stats = query_statistics(model, tokenizer, "", context=context, samples=samples, token_ids=search[0][1])
    fisher: list[dict[str, torch.Tensor]] | None = None
    ref0 = None
    if sensitivity_samples > 0 and not any("kv" in layer for layer in evs[0].reference.layers):
        ids0 = search[0][1]
        ref0, fisher = fisher_diagonal(model, ids0[:context], ids0[context:context + continuation],
                                       sensitivity_samples, progress=fisher_progress, reference=evs[0].reference,
                                       state=evs[0].state)
        # in the step units of the search's centring (rotating K means where the settings use them)
        rope = stats.attention if SEARCH_SETTINGS.get("k_rope_mean") and stats.attention is not None else None
        stats.k_sens, stats.v_sens = sensitivities(ref0, fisher, rope)
        stats.meta["sensitivity"] = f"fisher, {sensitivity_samples} samples, {continuation} scored tokens"
    ratio_measured = kv_ratio(stats)
    ratio = ratio_measured if ratio_measured is not None else 3.0
    say(f"K/V balance v_step / k_step = {ratio:.3f}" + (" (measured)" if ratio_measured else " (no sensitivities)"))
    tmp = tempfile.NamedTemporaryFile(prefix="kvcodec-profile-", suffix=".safetensors", delete=False)
    tmp.close()
    settings = {**SEARCH_SETTINGS, "xpred": int(bool(xpred))}
    xp_on = [False]  # the predictors are fitted before the search codes with them
    window_files: list[str] = []  # per search window: the statistics with its own predictors (xpred)
    try:
        save_query_statistics(stats, tmp.name)

        def config(k_step: float, v_step: float | None = None) -> dict[str, Any]:
            return {"id": "kvc", **SEARCH_ENTROPY, **settings, "k_step": k_step,
                    "v_step": k_step * ratio if v_step is None else v_step, "calibration": tmp.name,
                    "xpred": int(xp_on[0])}

        def for_window(i: int, cfg: dict[str, Any]) -> dict[str, Any]:
            return {**cfg, "calibration": window_files[i]} if window_files else cfg

        def windows_config(k_step: float, v_step: float | None = None) -> Any:
            cfg = config(k_step, v_step)
            return lambda i: for_window(i, cfg)

        xpred_info: dict[str, Any] | None = None
        width = max(sum(int(t.shape[1] * t.shape[2]) for t in layer.values()) for layer in evs[0].reference.layers)
        off = None  # (why, as said; why, as the profile records it): the levels are searched without them
        if xpred and len(evs[0].reference.layers) < 2:
            # one cache layer (a hybrid whose other layers keep no KV): nothing to predict from
            off = ("the cache has one layer", "one cache layer")
        elif xpred and width * width > XPRED_MAX_WEIGHTS:
            # full-rank predictors grow as the square of the KV width: too slow to decode on a CPU
            # (and too large a profile) past the bound
            off = (f"{width} K and V values a token and layer, {width * width} weights a layer > {XPRED_MAX_WEIGHTS}",
                   f"{width * width} weights a layer > XPRED_MAX_WEIGHTS {XPRED_MAX_WEIGHTS}")
        if off is not None:
            say(f"cross-layer predictors: off ({off[0]})")
            xpred_info = {"off": off[1]}
            xpred = False
            settings["xpred"] = 0
        if xpred:
            from .xpred import fit_predictors

            fit_step, fit_kl = 0.5, None
            if fisher is not None:
                def predict_plain(k_step: float) -> float:
                    codec = get_codec(config(k_step))
                    return fisher_kl(fisher, ref0, codec.decode(codec.encode(evs[0].reference)))

                fit_step, fit_kl = _solve_step(predict_plain, margin * XPRED_FIT_KL, 0.5)
            say(f"cross-layer predictors: fitting at step {fit_step:.4f} on the search windows' reconstructions "
                f"({time.perf_counter() - t0:.0f} s)")
            stats.xpred, held_sets = fit_predictors(config(fit_step), tmp.name, [e.reference for e in evs], stats, say)
            # each search window is scored with predictors fitted on the other windows (what unseen
            # text gets: see fit_predictors); the held-out windows and the profile use all of them
            for w_set in held_sets:
                f = tempfile.NamedTemporaryFile(prefix="kvcodec-profile-", suffix=".safetensors", delete=False)
                f.close()
                window_files.append(f.name)
                save_query_statistics(dataclasses.replace(stats, xpred=w_set), f.name)
            save_query_statistics(stats, tmp.name)
            xp_on[0] = True
            xpred_info = {"fit_k_step": float(fit_step), "fit_kl_predicted": fit_kl, "fit_level": XPRED_FIT_KL,
                          "layers": sum(p is not None for p in stats.xpred),
                          "parameters": int(sum(p[0].size + p[1].size for p in stats.xpred if p is not None)),
                          "search": "each search window scored with predictors fitted on the other windows"}

        first, first_kl = 0.5, None
        if fisher is not None:
            # the first step: where window 0's Fisher information predicts 0.9x the finest
            # level (the second-order prediction holds best at small KL; encodes only, no model run)
            def predict(k_step: float) -> float:
                codec = get_codec(for_window(0, config(k_step)))
                return fisher_kl(fisher, ref0, codec.decode(codec.encode(evs[0].reference)))

            first, first_kl = _solve_step(predict, 0.9 * min(levels.values()), 0.5)
            say(f"first step {first:.4f}: predicted KL {first_kl:.5f} on {search[0][0]}")
        order = list(range(len(evs)))  # windows by their last KL, highest first: the first proves a step over
        spent = [0]  # window scores so far (search and balance)
        score_s = [0.0]  # the seconds they took
        timed_out: list[str] = []  # why the time budget stopped the balance (once)

        def score_kv(k_step: float, v_step: float | None, stop: float | None,
                     ) -> tuple[float, list[float | None], float, bool]:
            t = time.perf_counter()
            res = score_windows_until(evs, windows_config(k_step, v_step), margin, worst, stop, order)
            score_s[0] += time.perf_counter() - t
            spent[0] += sum(x is not None for x in res[1])
            if res[3]:
                order.sort(key=lambda i: -float(res[1][i] or 0.0))
            return res

        def room() -> bool:
            if max_total_scores is not None and spent[0] >= max_total_scores * len(evs):
                return False
            if time_budget is None or timed_out:
                return not timed_out
            # one more step on every window, then the held-out check (set-up and a score a level)
            per = score_s[0] / max(1, spent[0])
            end = time.perf_counter() - t0 + len(evs) * per + len(held) * (setup_s + len(levels) * per)
            if end <= time_budget:
                return True
            timed_out.append(f"a probe and the held-out check would end at ~{end:.0f} s, past the time "
                             f"budget of {time_budget:.0f} s")
            say(f"balance: {timed_out[0]}")
            return False

        def score(k_step: float, stop: float | None) -> tuple[float, list[float | None], float, bool]:
            return score_kv(k_step, None, stop)

        def bits_kv(k_step: float, v_step: float) -> float:
            # encodes only, no model run, of the first window alone: the balance probes match
            # bits on it (each probe's score then measures every window's), so their encodes
            # cost a quarter of matching on all four (on a model with Qwen3-0.6B's KV shape,
            # 9x Qwen2.5-Coder's, one encode of a window takes ~2 s: eval/results/kvc_calib_time.md)
            codec = get_codec(for_window(0, config(k_step, v_step)))
            e = evs[0]
            return 8.0 * len(codec.encode(e.reference)) / e.reference.num_elements

        partial: list[tuple[float, float, list[float | None]]] = []
        points, detail, chosen = search_levels(score, levels, ratio, max_evals, say, t0, max_scores, first, partial)
        balance: list[list[Any]] = []
        if balance_probes:
            balance_levels(score_kv, bits_kv, levels, ratio, points, detail, chosen, balance,
                           lambda m: say(f"{m} ({time.perf_counter() - t0:.0f} s)"), balance_probes, room)
        evs.clear()  # free the search windows before the held-out ones
        say(f"held-out windows ({', '.join(n for n, _ in held)}) ({time.perf_counter() - t0:.0f} s)")
        evs_h = [Evaluator(model, tokenizer, "", context, continuation, attn_queries=1, token_ids=w) for _, w in held]
        for name, row in chosen.items():
            _, kls, bits = score_windows(evs_h, config(row["k_step"], row["v_step"]), margin, worst)
            row["kl_holdout"], row["kl_holdout_worst"], row["bits_holdout"] = float(np.mean(kls)), max(kls), bits
            say(f"{name}: held-out mean KL {np.mean(kls):.5f}, worst {max(kls):.5f} (target {row['target_kl']:g}), "
                f"{bits:.3f} b")
    finally:
        for name in [tmp.name, *window_files]:
            os.unlink(name)
    from .capture import model_identity

    ident = model_identity(model, tokenizer)
    stats.profile = {
        "version": PROFILE_VERSION,
        "settings": {**search_settings(), "xpred": int(bool(xpred))},  # every quality parameter the search coded with
        "xpred": xpred_info,
        "kv_ratio": ratio,
        "kv_ratio_measured": ratio_measured,
        "margin": 1.0,  # the points already hold the criterion below
        "search_margin": margin,
        "search_worst": worst,
        "search_max_scores": max_scores,
        "search_max_total_scores": max_total_scores,
        "time_budget": time_budget,
        "stopped_by_time": timed_out[0] if timed_out else None,
        "window_scores": spent[0],
        "search_method": SEARCH_METHOD,
        "first_step": float(first),
        "stopped_early": [[float(k), float(b), [None if x is None else float(x) for x in kl]] for k, b, kl in partial],
        "first_step_predicted_kl": first_kl,
        "criterion": f"max(mean KL / {margin}, worst window KL / {worst}) over the search windows",
        "points": [[float(s), float(c), float(b)] for s, c, b in sorted(points)],
        "window_kl": [[float(s), [float(x) for x in detail[s]]] for s in sorted(detail)],
        "levels": [{"name": n, **{k: float(v) for k, v in r.items()}} for n, r in chosen.items()],
        "balance": balance,  # every balance probe: [k_step, v_step, criterion or bound, bits, complete]
        "model": ident.to_dict(),
        "text": {"name": text_name, "context": context, "continuation": continuation,
                 "search_windows": [n for n, _ in search], "holdout_windows": [n for n, _ in held]},
        "sensitivity_samples": sensitivity_samples,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    parse_profile(stats.profile, "build_profile")  # what we write, the encoder accepts
    return stats


__all__ = ["DEFAULT_MARGIN", "MAX_SCORES", "MAX_TOTAL_SCORES", "SEARCH_METHOD", "SEARCH_ENTROPY", "SEARCH_SETTINGS", "WORST_FACTOR", "build_profile", "kv_ratio", "score_windows", "score_windows_until",
           "search_levels", "search_settings", "split_windows", "balance_level", "balance_levels",
           "BALANCE_FACTOR", "BALANCE_LANDINGS", "BALANCE_PROBES"]
