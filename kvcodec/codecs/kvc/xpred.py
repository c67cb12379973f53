"""Prediction across layers (kvc ``xpred``; formats/codecs/kvc.md §13, normative).

Layer ``l``'s K and V are linear maps of a residual stream that changes little from layer
``l - 1``, so an affine map of layer ``l - 1``'s *decoded* K (turned back to before RoPE) and V
predicts much of them (docs/kvc-design.md §8, eval/results/kvc_xpred*.md). With ``xpred`` the
encoder codes each tensor of a layer that has a predictor as its residual after that prediction,
and the decoder adds the prediction back, layer after layer:

1. the inputs: every tensor of layer ``l - 1`` as decoded (the cache dtype widened to float32
   exactly), in role order ``k``, ``v``, ``kv``; K turned back with the table rotation of
   :mod:`kvcodec.transforms.rope` at each token's absolute position where the profile says the
   layer rotates: ``(a cos + b sin, b cos - a sin)`` on each pair ``(a, b)``, every product and
   sum a separately rounded float32 operation in that order; each tensor flattened per token
   (heads, then channels), concatenated: ``x`` float32 ``[T, I]``;
2. ``y = b + x W`` with the layer's predictor (``W`` float16 ``[I, O]`` widened exactly, ``b``
   float32 ``[O]``): per output, ``y = b``, then for ``i = 0 .. I-1`` ascending
   ``y = y + x[i] * W[i]``, each product and sum rounded to float32 (no fused multiply-add:
   :func:`affine_reference`, and csrc/xpred.c built with ``-ffp-contract=off``, which fuses
   only exact products: the same bits);
3. ``y`` split into layer ``l``'s tensors in role order; K turned forward where layer ``l``
   rotates: ``(a cos - b sin, b cos + a sin)``;
4. each tensor is its decoded residual widened to float32, plus its prediction, rounded (to
   nearest, ties to even) to the cache dtype: the values the next layer reads.

The encoder codes the residual at the steps the tensor itself would get (they follow the
tensor's RMS, not the residual's): the prediction then lowers the bits, and the error stays
where the level's steps put it (a little lower: more of a small residual falls in the dead
zone), whether or not the predictor suits the text at hand. With steps that followed the
residual's RMS, text the predictors explained less got coarser steps, and the KL moved with the
text: eval/results/kvc_profile_xpred_insample.md.

The predictors live in the model's profile (``kvcodec calibrate`` fits them, one set per model,
on the calibration windows' own reconstructions: :mod:`kvcodec.harness.xpred`), not in the file,
which names the profile by ``calibration_sha256``: a file coded this way decodes only where that
profile is (:func:`find_profile`).

Example:
    >>> import numpy as np
    >>> x = np.array([[1.0, 2.0]], np.float32); w = np.array([[0.5], [0.25]], np.float32)
    >>> affine_reference(x, w, np.array([1.0], np.float32)).tolist()
    [[2.0]]
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from ...errors import ConfigError, FormatError, InputError
from ...transforms.rope import _slices, cos_sin, layer_rotates, pairs, phase_steps
from .calibration import Calibration, QueryStats

#: the order in which a layer's tensors enter and leave a predictor
ROLE_ORDER = ("k", "v", "kv")
#: environment variable: more places (files or directories, ``os.pathsep``-separated) where
#: :func:`find_profile` looks for a profile by its SHA-256
PROFILES_ENV = "KVCODEC_PROFILES"

#: seconds a tensor waits at most for the layer before it to be coded on another thread
XPRED_WAIT_S = 600.0
#: How long a tensor waits for the layer before while no other tensor is coding before it
#: concludes that the layer before will never be coded (a caller coding layers out of order).
XPRED_ALONE_S = 2.0

#: ``(phase steps uint32 [r2], offset, style)`` of a layer whose K rotates, else None
Rotation = "tuple[np.ndarray, int, str] | None"


def affine_reference(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The normative ``b + x W`` (float32, inputs summed in ascending order, each product and sum
    rounded): ``x`` ``[T, I]``, ``w`` ``[I, O]``, ``b`` ``[O]`` -> float32 ``[T, O]``."""
    x = np.asarray(x, dtype=np.float32)
    w = np.asarray(w, dtype=np.float32)
    out = np.empty((x.shape[0], w.shape[1]), dtype=np.float32)
    out[:] = np.asarray(b, dtype=np.float32)[None]
    tmp = np.empty_like(out)
    xt = np.ascontiguousarray(x.T)
    for i in range(x.shape[1]):
        np.multiply(xt[i][:, None], w[i][None], out=tmp)
        np.add(out, tmp, out=out)
    return out


#: rows from which :func:`affine` splits the work over two threads (the C call releases the GIL;
#: rows are independent, so the bits do not change)
AFFINE_SPLIT_ROWS = 256


def _by_halves(t: int, run: Any, split: bool = True) -> tuple[Any, Any]:
    """``run(0, t)`` on this thread, or, for ``t`` rows past :data:`AFFINE_SPLIT_ROWS` where the
    machine has two CPUs (and ``split``), ``run(0, t // 2)`` here and ``run(t // 2, t)`` on a
    second thread (the C calls release the GIL; rows are independent, so the bits do not
    change): the two results (the second None when not split); the second thread's error is
    raised here."""
    if not split or t < AFFINE_SPLIT_ROWS or (os.cpu_count() or 1) < 2:
        return run(0, t), None
    half = t // 2
    got: list[Any] = [None, None]

    def second() -> None:
        try:
            got[0] = run(half, t)
        except BaseException as e:  # noqa: BLE001 - raised on the calling thread below
            got[1] = e

    th = threading.Thread(target=second, name="kvc-xpred")
    th.start()
    try:
        first = run(0, half)
    finally:
        th.join()
    if got[1] is not None:
        raise got[1]
    return first, got[0]


def affine(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """:func:`affine_reference`, in C where the native library is built (bit for bit the same),
    on two threads for long inputs where the machine has two CPUs."""
    from ... import native
    from ...native.xpred import affine as native_affine

    try:
        first, second = _by_halves(x.shape[0], lambda r0, r1: native_affine(x[r0:r1], w, b))
    except native.Unsupported:
        return affine_reference(x, w, b)
    return first if second is None else np.concatenate([first, second])


def _turn(a: np.ndarray, positions: np.ndarray, rot: Any, sign: int) -> np.ndarray:
    """``a`` float32 ``[T, H, D]`` turned forward (``sign`` 1) or back (-1) by the table
    rotation ``rot`` at ``positions`` (steps 1 and 3 of the module docstring)."""
    if rot is None:
        return a
    steps, offset, style = rot
    out = a.copy()
    if not len(steps) or not a.shape[0]:
        return out
    sa, sb = _slices(len(steps), offset, style)
    c, s = cos_sin(positions, steps)
    c, s = c[:, None, :], s[:, None, :]
    xa, xb = a[:, :, sa], a[:, :, sb]
    if sign > 0:
        np.subtract(xa * c, xb * s, out=out[:, :, sa])
        np.add(xb * c, xa * s, out=out[:, :, sb])
    else:
        np.add(xa * c, xb * s, out=out[:, :, sa])
        np.subtract(xb * c, xa * s, out=out[:, :, sb])
    return out


def layer_rotation(stats: QueryStats, layer: int, width: int) -> Any:
    """The rotation of ``layer``'s K as the profile knows it (None where it does not rotate with
    a known table rotation)."""
    la = stats.layer_attention(layer)
    if not layer_rotates(la, width):
        return None
    return phase_steps(la.inv_freq), int(la.offset), la.style


@dataclass(frozen=True)
class Predictors:
    """A profile's predictors: per layer ``(W float32 [I, O], b float32 [O])`` or None (layer 0
    and layers the profile does not predict), and the statistics they came with."""

    sha256: str
    stats: QueryStats = field(repr=False)
    layers: tuple[Any, ...] = field(repr=False)
    #: per (layer, role, shapes): the columns of the map that give one role (:meth:`_columns`)
    cols: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)
    #: per (layer, width): the layer's K rotation and its pairs as the C pass takes them (:meth:`_tables`)
    turns: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_calibration(cls, cal: Calibration) -> "Predictors":
        """The predictors of profile ``cal`` (kept by its SHA-256 for the next calls: the
        float32 weights of SmolLM2's took 10 ms to make)."""
        with _lock:
            kept = _found.get(cal.sha256)
        if kept is not None:
            return kept
        got = cal.stats.xpred
        if got is None:
            raise ConfigError(f"kvc xpred: {cal.path!r} holds no cross-layer predictors; run `kvcodec calibrate` "
                              f"again (this version fits them) or set xpred 0")
        pred = cls(cal.sha256, cal.stats, tuple(None if p is None else (p[0].astype(np.float32), p[1])
                                                for p in got))
        with _lock:
            _found[cal.sha256] = pred
            while len(_found) > 4:
                _found.pop(next(iter(_found)))
        return pred

    def has(self, layer: int) -> bool:
        return 0 < layer < len(self.layers) and self.layers[layer] is not None

    def predict(self, layer: int, prev: dict[str, np.ndarray], shapes: dict[str, tuple[int, int]],
                positions: np.ndarray, where: str) -> dict[str, np.ndarray]:
        """Layer ``layer``'s predictions (float32 ``[T, H, D]`` per role of ``shapes``) from layer
        ``layer - 1``'s decoded tensors ``prev`` (float32 ``[T, H, D]`` per role) at absolute
        ``positions`` (int64 ``[T]``). Raises FormatError where the shapes do not fit the
        predictor (a profile of another model)."""
        w, b = self.layers[layer]
        parts = []
        for role in ROLE_ORDER:
            if role in prev:
                a = prev[role]
                if role == "k":
                    a = _turn(a, positions, layer_rotation(self.stats, layer - 1, a.shape[2]), -1)
                parts.append(a.reshape(a.shape[0], -1))
        x = np.concatenate(parts, axis=1) if parts else np.zeros((0, 0), np.float32)
        roles = [r for r in ROLE_ORDER if r in shapes]
        n_out = sum(h * d for h, d in (shapes[r] for r in roles))
        if x.shape[1] != w.shape[0] or n_out != w.shape[1]:
            raise FormatError(f"{where}: the profile's predictor maps {w.shape[0]} values to {w.shape[1]}, the file's "
                              f"layers hold {x.shape[1]} and {n_out}: a profile of another model")
        y = affine(x, w, b)
        out, at = {}, 0
        for r in roles:
            h, d = shapes[r]
            part = np.ascontiguousarray(y[:, at:at + h * d]).reshape(-1, h, d)
            at += h * d
            if r == "k":
                part = _turn(part, positions, layer_rotation(self.stats, layer, d), 1)
            out[r] = part
        return out


    def _tables(self, layer: int, d: int, positions: np.ndarray) -> Any:
        """``(cos, sin, channel a, channel b)`` of layer ``layer``'s K rotation at ``positions``
        for :func:`kvcodec.native.xpred.xpred_pass`, or None where K does not turn."""
        got = self.turns.get((layer, d))
        if got is None:  # the same for every call on this layer: kept (a dict write is atomic)
            rot = layer_rotation(self.stats, layer, d)
            if rot is None or not len(rot[0]):
                got = (None,)
            else:
                steps, offset, style = rot
                ia, ib = (a.astype(np.int32) for a in pairs(len(steps), offset, style))
                ia.setflags(write=False)
                ib.setflags(write=False)
                got = (steps, ia, ib)
            self.turns[(layer, d)] = got
        if got[0] is None:
            return None
        steps, ia, ib = got
        c, s = cos_sin(positions, steps)
        return c, s, ia, ib

    def _columns(self, layer: int, shapes: dict[str, tuple[int, int]], role: str) -> tuple[np.ndarray, np.ndarray]:
        """The columns of layer ``layer``'s map that give ``role`` (outputs in role order of
        ``shapes``): ``(W float32 [I, O_role] contiguous, b [O_role])``, kept."""
        key = (layer, role, tuple(sorted(shapes.items())))
        got = self.cols.get(key)
        if got is None:
            w, b = self.layers[layer]
            at = 0
            for r in ROLE_ORDER:
                if r in shapes:
                    h, d = shapes[r]
                    if r == role:
                        got = (np.ascontiguousarray(w[:, at:at + h * d]), np.ascontiguousarray(b[at:at + h * d]))
                    at += h * d
            if got is None or at != w.shape[1]:
                raise FormatError(f"layers.{layer}: the profile's predictor gives {w.shape[1]} values, the file's layer "
                                  f"holds {at}: a profile of another model")
            self.cols[key] = got
        return got

    def _native_pass(self, layer: int, prev: dict[str, torch.Tensor], outs: dict[str, torch.Tensor],
                     positions: np.ndarray, masks: dict[str, np.ndarray] | None, where: str,
                     shapes: dict[str, tuple[int, int]] | None = None, split: bool = True) -> None:
        """The pass of :func:`kvcodec.native.xpred.xpred_pass` over all rows, split over two
        threads for long inputs where the machine has two CPUs (rows are independent: the bits
        do not change). With ``shapes`` (every role of the layer), ``outs`` holds some of them
        and only their columns of the map are computed, on this thread. Raises Unsupported
        where the native library is not built."""
        from ...native.xpred import xpred_pass

        w, b = self.layers[layer]
        ins = [(prev[r].contiguous(), r == "k") for r in ROLE_ORDER if r in prev]
        roles = [r for r in ROLE_ORDER if r in outs]
        n_in = sum(t.shape[1] * t.shape[2] for t, _ in ins)
        n_out = sum(h * d for h, d in shapes.values()) if shapes else sum(outs[r].shape[1] * outs[r].shape[2]
                                                                           for r in roles)
        if n_in != w.shape[0] or n_out != w.shape[1]:
            raise FormatError(f"{where}: the profile's predictor maps {w.shape[0]} values to {w.shape[1]}, the file's "
                              f"layers hold {n_in} and {n_out}: a profile of another model")
        if shapes and len(roles) == 1:
            w, b = self._columns(layer, shapes, roles[0])
        elif shapes and len(roles) != len(shapes):
            raise ValueError("_native_pass: one role or all")
        rot_in = self._tables(layer - 1, prev["k"].shape[2], positions) if "k" in prev else None
        rot_out = self._tables(layer, outs["k"].shape[2], positions) if "k" in outs else None
        ins = [(t, turned and rot_in is not None) for t, turned in ins]
        ous = [(outs[r], r == "k" and rot_out is not None) for r in roles]
        ms = None if masks is None else [masks[r] for r in roles]
        _by_halves(positions.shape[0], lambda r0, r1: xpred_pass((r0, r1), ins, rot_in, w, b, ous, rot_out, ms),
                   split=split and not shapes)

    def add(self, layer: int, residuals: dict[str, torch.Tensor], prev: dict[str, torch.Tensor],
            positions: np.ndarray, masks: dict[str, np.ndarray], where: str, split: bool = True
            ) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s values: its decoded ``residuals`` (CPU, the cache dtype) plus the
        prediction from ``prev`` (layer ``layer - 1`` as decoded) on the rows ``masks`` marks
        (step 4 of the module docstring). In C where built (the residual tensors are
        overwritten; ``split``: long inputs on two threads), else :meth:`predict` and
        :func:`add_reference`."""
        from ... import native

        if all(t.device.type == "cpu" for t in (*residuals.values(), *prev.values())):
            outs = {r: t if t.is_contiguous() else t.contiguous() for r, t in residuals.items()}
            try:
                self._native_pass(layer, prev, outs, positions, masks, where, split=split)
                return outs
            except native.Unsupported:
                pass
        shapes = {r: (int(t.shape[1]), int(t.shape[2])) for r, t in residuals.items()}
        p = self.predict(layer, {r: as_float32(t) for r, t in prev.items()}, shapes, positions, where)
        return add_reference(residuals, p, masks)

    def prediction(self, layer: int, prev: dict[str, np.ndarray], shapes: dict[str, tuple[int, int]],
                   positions: np.ndarray, where: str, role: str | None = None) -> dict[str, np.ndarray]:
        """:meth:`predict`, in C where built (the same bits); with ``role``, only that tensor's
        prediction, computed on this thread (the encoder's threads compute K's and V's at once)."""
        from ... import native

        want = shapes if role is None else {role: shapes[role]}
        outs = {r: torch.empty((positions.shape[0], h, d), dtype=torch.float32) for r, (h, d) in want.items()}
        try:
            self._native_pass(layer, {r: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32))
                                      for r, v in prev.items()}, outs, positions, None, where,
                              None if role is None else shapes)
        except native.Unsupported:
            got = self.predict(layer, prev, shapes, positions, where)
            return got if role is None else {role: got[role]}
        return {r: t.numpy() for r, t in outs.items()}


def add_reference(residuals: dict[str, torch.Tensor], pred: dict[str, np.ndarray],
                  masks: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Each residual widened to float32, plus its prediction on the rows ``masks`` marks,
    rounded to the residual's dtype (step 4 of the module docstring; the reference)."""
    out = {}
    for r, t in residuals.items():
        m = masks[r]
        if not m.any():
            out[r] = t
            continue
        v = as_float32(t)
        v[m] = v[m] + pred[r][m]
        out[r] = to_dtype(v, t.dtype).to(t.device)
    return out


def to_dtype(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """float32 values rounded to ``dtype`` (to nearest, ties to even)."""
    t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))
    return t if dtype == torch.float32 else t.to(dtype)


def as_float32(t: torch.Tensor) -> np.ndarray:
    """A decoded tensor widened exactly to float32 numpy."""
    return t.detach().cpu().to(torch.float32).numpy()


def absolute_positions(positions: Any, t: int) -> np.ndarray:
    """The tokens' absolute positions (int64 ``[t]``): the file's or cache's positions, else ``0 .. t-1``."""
    if positions is None:
        return np.arange(t, dtype=np.int64)
    return np.asarray(positions.detach().cpu().to(torch.int64).numpy() if isinstance(positions, torch.Tensor)
                      else positions, dtype=np.int64)


class XPredEncoder:
    """One encode call's closed loop (the encoder's per-call state): every tensor of a layer
    with a predictor is coded as its residual after the prediction from the layer before *as
    the decoder will have it* (reconstructed from the codes written), which then feeds the next
    layer. Safe on the writer's threads: a tensor waits until the layer before is stored on its
    rows (every role; stored before its entropy coding, so that overlaps the next layer), then
    computes its own role's prediction; the writer hands tensors over in layer order, so the
    tensors waited for have started, and a failure in one wakes the others."""

    def __init__(self, predictors: Predictors, positions: np.ndarray,
                 shapes: list[dict[str, tuple[int, int]]], decoder: Any) -> None:
        self.predictors = predictors
        self.decoder = decoder  # the codec of the file's config, which decodes each tensor coded
        self.positions = positions
        self.shapes = shapes  # per layer: role -> (heads, channels)
        self.decoded: dict[int, dict[str, np.ndarray]] = {}  # per layer: role -> float32 [T, H, D] (filled by rows)
        self.stored: dict[int, dict[str, set[tuple[int, int]]]] = {}  # per layer and role: the row ranges stored
        self.cond = threading.Condition()
        self.failed: BaseException | None = None
        self.active = 0  # tensors being coded now (on the writer's threads)

    @contextlib.contextmanager
    def coding(self) -> Iterator[None]:
        """Around one tensor's coding: counts it as active; a failure wakes the tensors waiting."""
        with self.cond:
            self.active += 1
            self.cond.notify_all()  # a tensor waiting alone for this one sees it has started
        try:
            yield
        except BaseException as e:
            with self.cond:
                self.failed = e
                self.cond.notify_all()
            raise
        finally:
            with self.cond:
                self.active -= 1
                self.cond.notify_all()

    def _stored(self, layer: int, rows: tuple[int, int]) -> bool:
        got = self.stored.get(layer, {})
        return all(rows in got.get(r, ()) for r in self.shapes[layer])

    def prediction(self, layer: int, role: str, rows: tuple[int, int], where: str) -> np.ndarray | None:
        """Layer ``layer``'s prediction of ``role`` on token rows ``rows`` (None: not predicted),
        once layer ``layer - 1`` is stored on those rows; only that role's columns of the map,
        on the calling thread."""
        if not self.predictors.has(layer):
            return None
        with self.cond:
            deadline = time.monotonic() + XPRED_WAIT_S
            alone = None  # since when no other tensor has been coding
            while not self._stored(layer - 1, rows):
                if self.failed is not None:
                    raise ConfigError(f"{where}: kvc xpred: a tensor of the layer before failed to code")
                now = time.monotonic()
                if self.active > 1:
                    alone = None
                elif alone is None:
                    # the tensor waited for may be handed to another thread that has not started
                    # it yet (the writer submits in layer order; a pool thread enters coding()
                    # when it runs): a moment's grace before concluding it will never come
                    alone = now
                if now > deadline or (alone is not None and now - alone > XPRED_ALONE_S):
                    raise ConfigError(f"{where}: kvc xpred codes layers in order; layer {layer - 1} was not coded first")
                self.cond.wait(timeout=0.02 if alone is not None else 1.0)
        a, b = rows
        prev = self.decoded[layer - 1]  # kept until this layer is stored whole
        return self.predictors.prediction(layer, {r: v[a:b] for r, v in prev.items()}, self.shapes[layer],
                                          self.positions[a:b], where, role=role)[role]

    def store(self, layer: int, role: str, rows: tuple[int, int], value: np.ndarray) -> None:
        """Layer ``layer``'s decoded ``role`` (float32) on token rows ``rows``: the next layer may
        predict from them once every role is stored."""
        self._slot(layer, role, value.shape[1:])[rows[0]:rows[1]] = value
        self._mark(layer, role, rows)

    def store_sum(self, layer: int, role: str, rows: tuple[int, int], dec: torch.Tensor, pred: np.ndarray) -> None:
        """:meth:`store` of ``dtype(dec + pred)`` widened to float32 (``dec`` the decoded residual,
        torch, of the cache's dtype; ``pred`` its prediction): what the decoder gets (step 4 of
        the module docstring), written straight into the layer's float32 array in C where built."""
        from ...native import Unsupported
        from ...native.xpred import prediction_sum

        slot = self._slot(layer, role, tuple(dec.shape[1:]))[rows[0]:rows[1]]
        try:
            prediction_sum(dec, pred, slot)
        except Unsupported:
            slot[...] = as_float32(to_dtype(as_float32(dec) + pred, dec.dtype))  # the reference
        self._mark(layer, role, rows)

    def _slot(self, layer: int, role: str, tail: tuple[int, ...]) -> np.ndarray:
        """Layer ``layer``'s float32 ``[T, *tail]`` array of ``role`` (made on first use)."""
        with self.cond:
            d = self.decoded.setdefault(layer, {})
            if role not in d:
                d[role] = np.empty((self.positions.shape[0],) + tuple(tail), dtype=np.float32)
            return d[role]

    def _mark(self, layer: int, role: str, rows: tuple[int, int]) -> None:
        with self.cond:
            st = self.stored.setdefault(layer, {})
            st.setdefault(role, set()).add(rows)
            t = self.positions.shape[0]
            if all(sum(b - a for a, b in st.get(r, ())) >= t for r in self.shapes[layer]):
                # layer complete: every prediction from the layer before it was made
                self.decoded.pop(layer - 1, None)
                self.stored.pop(layer - 1, None)
            self.cond.notify_all()


def residual(x: torch.Tensor, pred: np.ndarray, where: str, x32: np.ndarray | None = None) -> torch.Tensor:
    """The value the encoder codes: ``x - pred`` rounded to ``x``'s dtype (in C where built, the
    same bits); with ``x32`` (float32, ``x``'s shape), ``x`` widened to float32 is written there."""
    from ...native import Unsupported
    from ...native.xpred import residual as native_residual

    try:
        r, finite = native_residual(x, pred, x32)
    except Unsupported:  # the reference
        xf = as_float32(x)
        if x32 is not None:
            x32[...] = xf
        r = to_dtype(xf - pred, x.dtype)
        finite = not r.numel() or bool(torch.isfinite(r.abs().amax()))
    if not finite:
        raise InputError(f"{where}: the residual after the cross-layer prediction overflows {x.dtype}; "
                         f"encode with xpred 0")
    return r


# ---------------------------------------------------------------------- finding a profile by hash
_found: dict[str, Predictors] = {}
_hashes: dict[tuple[str, int, int], str] = {}
_lock = threading.Lock()


def default_profile_dir() -> Path:
    """Where ``kvcodec calibrate`` profiles are looked for by default (``profiles`` under the
    kvcodec cache dir, where the harness keeps each model's profile)."""
    base = os.environ.get("KVCODEC_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "kvcodec") / "profiles"


def _candidates(hint: str, extra: Iterable[str]) -> list[Path]:
    out: list[Path] = []
    places = [*extra, *(p for p in os.environ.get(PROFILES_ENV, "").split(os.pathsep) if p), str(default_profile_dir())]
    if hint:
        out.append(Path(hint))
    for place in places:
        p = Path(place)
        if p.is_dir():
            out.extend(sorted(p.glob("*.safetensors")))
        else:
            out.append(p)
    return out


def _sha256_of(path: Path) -> str | None:
    import hashlib

    try:
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    except OSError:
        return None
    with _lock:
        if key in _hashes:
            return _hashes[key]
    try:
        h = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None
    with _lock:
        _hashes[key] = h
    return h


def find_profile(sha256: str, hint: str = "", extra: Iterable[str] = (), where: str = "") -> Predictors:
    """The predictors of the profile whose file has SHA-256 ``sha256``: looked for at ``hint``
    (the path the encoder recorded), in ``extra`` (files or directories given by the caller), in
    ``$KVCODEC_PROFILES`` and in :func:`default_profile_dir`.

    Raises:
        FormatError: no such profile here (the message names the hash and how to give it).
    """
    with _lock:
        if sha256 in _found:
            return _found[sha256]
    for path in _candidates(hint, extra):
        if _sha256_of(path) == sha256:
            try:
                cal = Calibration.load(path)
            except (InputError, FormatError):
                continue
            if cal.sha256 != sha256:  # changed since it was hashed
                continue
            try:
                return Predictors.from_calibration(cal)
            except ConfigError as e:
                raise FormatError(f"{where}: {e}") from None
    raise FormatError(
        f"{where}: coded with prediction across layers (xpred) from the profile with SHA-256 {sha256}, which "
        f"decoding needs and which is not here: give it (kvcodec decode --profile FILE, kvcodec.decode(..., "
        f"profiles=[FILE])), or put it in {default_profile_dir()} or ${PROFILES_ENV}")


__all__ = ["PROFILES_ENV", "ROLE_ORDER", "Predictors", "XPredEncoder", "absolute_positions", "affine",
           "add_reference", "affine_reference", "as_float32", "default_profile_dir", "find_profile", "layer_rotation", "residual",
           "to_dtype"]
