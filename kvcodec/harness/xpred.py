"""Fitting kvc's cross-layer predictors (``xpred``) for a model's profile, closed loop.

kvc with ``xpred`` codes layer ``l`` as its residual after an affine prediction from layer
``l - 1`` *as decoded* (:mod:`kvcodec.codecs.kvc.xpred`, formats/codecs/kvc.md §13). The
predictors are fitted here, on the calibration windows' own reconstructions: layer 0 is coded
and decoded; layer 1's predictor is fitted (ridge least squares) from layer 0's decoded values
to layer 1's true ones; layer 1 is coded as its residual after that prediction and decoded; and
so on up the stack. A predictor fitted on *uncoded* K and V trusts its inputs too much, and the
coding error compounds layer after layer (SmolLM2's aggressive level: KL 0.8-1.3,
eval/results/kvc_xpred_clean.md); one set fitted on reconstructions at the near-lossless level
serves every level (eval/results/kvc_xpred_fit001.md).

Example:
    >>> import numpy as np
    >>> x = np.random.default_rng(0).normal(size=(200, 3)); y = x @ np.array([[1.0], [2.0], [0.0]]) + 5
    >>> w = ridge_fit(x, y)
    >>> np.round(w.ravel(), 2).tolist()
    [1.0, 2.0, 0.0, 5.0]
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from ..cache import KVCache
from ..codecs.kvc.calibration import QueryStats
from ..codecs.kvc.xpred import (ROLE_ORDER, Predictors, _turn, absolute_positions, as_float32, layer_rotation,
                                residual, to_dtype)


def ridge_fit(xs: Any, ys: Any, lam: float = 1e-3) -> Any:
    """Ridge least squares ``ys ~ [xs, 1] @ W`` (lambda ``lam`` times the Gram matrix's mean
    diagonal), in float64: ``W`` with the bias as its last row."""
    x1 = np.hstack([np.asarray(xs, dtype=np.float64), np.ones((len(xs), 1))])
    return ridge_solve(x1.T @ x1, x1.T @ np.asarray(ys, dtype=np.float64), lam)


def ridge_solve(g: np.ndarray, b: np.ndarray, lam: float = 1e-3) -> np.ndarray:
    """:func:`ridge_fit` from the sums ``g = X1^T X1`` and ``b = X1^T Y`` (``X1``: the inputs
    with a column of ones), so fits on subsets of the rows cost no pass over them."""
    reg = lam * np.trace(g) / g.shape[0]
    return np.linalg.solve(g + reg * np.eye(g.shape[0]), b)


def _inputs(stats: QueryStats, layer: int, values: dict[str, np.ndarray], positions: np.ndarray) -> np.ndarray:
    """``[T, n]``: ``values`` (one layer, float32 ``[T, H, D]`` per role) in role order, K turned
    back to before RoPE with that layer's rotation, flattened (step 1 of formats/codecs/kvc.md §13)."""
    parts = []
    for role in ROLE_ORDER:
        if role in values:
            a = values[role]
            if role == "k":
                a = _turn(a, positions, layer_rotation(stats, layer, a.shape[2]), -1)
            parts.append(a.reshape(a.shape[0], -1))
    return np.concatenate(parts, axis=1)


Layers = list  # per layer: None or (W float16 [I, O], b float32 [O]), as QueryStats.xpred holds them


def _as_predictor(w: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    w16 = w[:-1].astype(np.float16)
    if not np.all(np.isfinite(w16)):
        return None  # a weight past float16's range: the layer is coded plain
    return w16, w[-1].astype(np.float32)


def fit_predictors(config: dict[str, Any], calibration: str, caches: list[KVCache], stats: QueryStats,
                   progress: Callable[[str], None] | None = None) -> tuple[Layers, list[Layers]]:
    """Predictors for every layer ``>= 1`` of ``caches``' model, fitted on ``caches`` coded
    closed loop with the kvc ``config`` (its ``xpred`` off; ``calibration``: the statistics file
    it reads, ``stats`` parsed from it): ``(all, held)``, where ``all`` is fitted on every cache
    and ``held[c]`` on every cache but ``c`` (from the same closed-loop pass, whose
    reconstructions follow ``all``).

    A predictor explains much more of the text it was fitted on than of other text (open loop on
    SmolLM2, residual energy 16 % of K and V's on the four search windows it was fitted on, 30 %
    on the evaluation texts: a scratch run of the commit that added this). When kvc's steps
    followed the residual's RMS, a window coded with predictors fitted on it read about half the
    KL that unseen text got (eval/results/kvc_profile_xpred_insample.md); they follow the
    tensor's own RMS now, so it reads fewer bits and a little less error than unseen text gets.
    The search therefore scores window ``c`` with ``held[c]``, and the profile keeps ``all``."""
    from ..codec import get_codec
    from ..planes import TensorContext

    codec = get_codec({**config, "calibration": calibration, "xpred": 0})
    n_layers = caches[0].num_layers
    positions = [absolute_positions(c.positions, c.num_tokens) for c in caches]
    plans = [codec.plan(c) for c in caches]
    full: Layers = [None]
    held: list[Layers] = [[None] for _ in caches]
    try:
        prev: list[dict[str, np.ndarray]] = []
        for layer in range(n_layers):
            current = None
            if layer:
                sums = []
                for before, c, pos in zip(prev, caches, positions):
                    x1 = np.hstack([_inputs(stats, layer - 1, before, pos).astype(np.float64),
                                    np.ones((c.num_tokens, 1))])
                    y = _inputs(stats, layer, {r: as_float32(t) for r, t in c.layers[layer].items()}, pos)
                    sums.append((x1.T @ x1, x1.T @ y.astype(np.float64)))
                g_all, b_all = sum(g for g, _ in sums), sum(b for _, b in sums)
                full.append(_as_predictor(ridge_solve(g_all, b_all)))
                for h, (g, b) in zip(held, sums):
                    h.append(_as_predictor(ridge_solve(g_all - g, b_all - b)) if len(caches) > 1 else full[-1])
                if full[-1] is not None:
                    current = Predictors("", stats, tuple(full + [None] * (n_layers - len(full))))
            now = []
            for c, plan, pos, before in zip(caches, plans, positions, prev or [None] * len(caches)):
                shapes = {r: (int(t.shape[1]), int(t.shape[2])) for r, t in c.layers[layer].items()}
                p = current.predict(layer, before, shapes, pos, f"layers.{layer}") if current is not None else None
                out = {}
                for role, x in c.layers[layer].items():
                    ctx = TensorContext(layer=layer, role=role, shape=tuple(x.shape), dtype=x.dtype,
                                        layer_kind=c.layer_info[layer].kind, globals=plan.globals, state=plan.state)
                    src = x if p is None else residual(x, p[role], f"layers.{layer}.{role}")
                    planes = codec.encode_planes(src, ctx)
                    dec = as_float32(codec.decode_tensor(planes, dataclasses.replace(ctx, state=None)))
                    out[role] = dec if p is None else as_float32(to_dtype(dec + p[role], x.dtype))
                now.append(out)
            prev = now
            if progress is not None and layer and layer % 8 == 0:
                progress(f"cross-layer predictors: layer {layer}/{n_layers - 1}")
    finally:
        for plan in plans:
            plan.__exit__(None, None, None)
    return full, held


__all__ = ["fit_predictors", "ridge_fit", "ridge_solve"]
