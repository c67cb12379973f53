"""kvc's prediction across layers in C (:func:`kvcodec.codecs.kvc.xpred.affine_reference`, bit for
bit). C side: csrc/xpred.c.
"""

from __future__ import annotations

import numpy as np

from .abi import kept_ptr, ptr
from .build import Unsupported, required

#: the rotation operands of a pass whose parts do not turn (read-only: passed by address)
_NO_TURN_F = np.zeros(1, np.float32)
_NO_TURN_I = np.zeros(1, np.int32)
_NO_TURN_F.setflags(write=False)
_NO_TURN_I.setflags(write=False)


def affine(x: np.ndarray, w: np.ndarray, b: np.ndarray, lanes: int = 0) -> np.ndarray:
    """``b + x @ w`` in float32 with the normative order (x ``[T, I]``, w ``[I, O]``, b ``[O]``),
    with the widest vector kernel the CPU runs (``lanes`` 0), or the one of 4, 8 (AVX2) or 16
    (AVX-512) lanes asked for (tests: every kernel gives the same bits).

    Raises:
        Unsupported: the native library is unavailable (the caller runs the reference), or the
            CPU lacks the kernel asked for.
    """
    lb = required()
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)
    t, n_in = x.shape
    if w.shape[0] != n_in or b.shape != (w.shape[1],):
        raise ValueError(f"affine: x {list(x.shape)}, w {list(w.shape)}, b {list(b.shape)} do not fit")
    out = np.empty((t, w.shape[1]), dtype=np.float32)
    if lanes not in (0, 4, 8, 16):
        raise ValueError(f"lanes must be 0, 4, 8 or 16, got {lanes}")
    if lb.kvn_xpred_affine(ptr(x), t, n_in, ptr(w), ptr(b), w.shape[1], ptr(out), lanes) == 0:
        raise Unsupported(f"this CPU has no {lanes}-lane kernel")
    return out


def xpred_pass(rows: tuple[int, int], inputs: list, rot_in: tuple | None, w: np.ndarray, b: np.ndarray,
               outputs: list, rot_out: tuple | None, masks: list | None, lanes: int = 0) -> int:
    """One layer's prediction pass on token rows ``rows`` (csrc/xpred.c ``kvn_xpred_pass``; the
    arithmetic of :meth:`kvcodec.codecs.kvc.xpred.Predictors.predict` and the add, bit for bit).

    ``inputs``: layer ``l - 1``'s tensors in role order, each ``(contiguous CPU torch tensor [T,
    H, D] of float32 / float16 / bfloat16, turned back: bool)``; ``outputs`` alike for layer
    ``l`` (turned forward). ``rot_in`` / ``rot_out``: ``(cos float32 [T, P], sin float32 [T, P],
    channel a int32 [P], channel b int32 [P])`` of the turned parts, or None. ``masks``: per
    output a uint8 ``[T]`` array: the outputs hold their decoded residuals and the marked rows
    become ``dtype(residual + prediction)`` in place; None: the outputs are float32 and get the
    prediction on every row. Returns the kernel lanes used.

    Raises:
        Unsupported: the native library is unavailable, or the CPU lacks the kernel asked for.
    """
    import torch

    from .abi import float_kind

    lb = required()
    w = np.ascontiguousarray(w, dtype=np.float32)
    b = np.ascontiguousarray(b, dtype=np.float32)

    def side(parts: list, rot: tuple | None) -> tuple:
        ptrs = np.zeros(max(1, len(parts)), dtype=np.int64)
        geo = np.zeros(4 * max(1, len(parts)), dtype=np.int64)
        for k, (t, turned) in enumerate(parts):
            if t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 3:
                raise ValueError("xpred_pass: tensors must be contiguous CPU [T, H, D]")
            if turned and rot is None:
                raise ValueError("xpred_pass: a turned part needs its rotation tables")
            ptrs[k] = t.data_ptr()
            geo[4 * k:4 * k + 4] = (float_kind(t.dtype), t.shape[1], t.shape[2], int(bool(turned)))
        if rot is None:
            rot = (_NO_TURN_F, _NO_TURN_F, _NO_TURN_I, _NO_TURN_I)
        tabs = [np.ascontiguousarray(r, dt) for r, dt in zip(rot, (np.float32, np.float32, np.int32, np.int32))]
        # the caller's own tables (kept per layer by the predictors, passed on every call): their
        # addresses remembered; a converted copy: its own (tabs keeps it alive until the call)
        return ptrs, geo, tabs, [kept_ptr(x) if x is r else ptr(x) for x, r in zip(tabs, rot)]

    t_all = inputs[0][0].shape[0] if inputs else 0
    for t, _ in [*inputs, *outputs]:
        if t.shape[0] != t_all:
            raise ValueError("xpred_pass: every tensor must have the same tokens")
    for rot in (rot_in, rot_out):
        if rot is not None and (rot[0].shape != (t_all, rot[2].size) or rot[1].shape != rot[0].shape
                                or rot[3].shape != rot[2].shape):
            raise ValueError("xpred_pass: rotation tables [T, P] and pairs [P] expected")
    if masks is None:
        if any(t.dtype != torch.float32 for t, _ in outputs):
            raise ValueError("xpred_pass: prediction-only outputs must be float32")
        mptr = np.zeros(max(1, len(outputs)), dtype=np.int64)
    else:
        ms = [np.ascontiguousarray(m, dtype=np.uint8) for m in masks]
        if len(ms) != len(outputs) or any(m.shape != (t_all,) for m in ms):
            raise ValueError("xpred_pass: one uint8 [T] mask per output")
        mptr = np.array([ptr(m) for m in ms] or [0], dtype=np.int64)
    pi, gi, tabs_in, at_in = side(inputs, rot_in)
    po, go, tabs_out, at_out = side(outputs, rot_out)
    r0, r1 = int(rows[0]), int(rows[1])
    if not 0 <= r0 <= r1 <= t_all:
        raise ValueError(f"xpred_pass: rows {rows} outside 0..{t_all}")
    if lanes not in (0, 4, 8, 16):
        raise ValueError(f"lanes must be 0, 4, 8 or 16, got {lanes}")
    rc = lb.kvn_xpred_pass(r0, r1, len(inputs), ptr(pi), ptr(gi), *at_in,
                           0 if rot_in is None else tabs_in[2].size, ptr(w), ptr(b), w.shape[0], w.shape[1],
                           len(outputs), ptr(po), ptr(go), ptr(mptr), *at_out,
                           0 if rot_out is None else tabs_out[2].size, 0 if masks is not None else 1, lanes)
    if rc == -1:
        raise MemoryError("xpred_pass: out of memory")
    if rc == -2:
        raise ValueError(f"xpred_pass: the parts do not add up to the predictor's {w.shape[0]} -> {w.shape[1]}")
    if rc == 0 and r1 > r0:
        raise Unsupported(f"this CPU has no {lanes}-lane kernel")
    return rc


def _cpu_kind(t) -> int:
    """The C element kind of a contiguous CPU torch tensor (Unsupported for anything else)."""
    from .abi import float_kind

    if t.device.type != "cpu" or not t.is_contiguous():
        raise Unsupported("a contiguous CPU tensor is needed")
    try:
        return float_kind(t.dtype)
    except KeyError:
        raise Unsupported(f"no C path for {t.dtype}") from None


def residual(x, pred: np.ndarray, x32: np.ndarray | None = None):
    """``(r, finite)``: ``r = dtype(float32(x) - pred)`` (torch, ``x``'s dtype and shape) and
    whether every ``r`` is finite; with ``x32`` (float32, ``x``'s shape), ``float32(x)`` written
    there too. csrc/xpred.c ``kvn_xpred_residual``; the reference is
    :func:`kvcodec.codecs.kvc.xpred.residual`'s torch lines, bit for bit.

    Raises:
        Unsupported: the native library is unavailable, or ``x`` is not a contiguous CPU tensor
            of float32, float16 or bfloat16.
    """
    import torch

    lb = required()
    kind = _cpu_kind(x)
    p = np.ascontiguousarray(pred, dtype=np.float32)
    if p.size != x.numel() or (x32 is not None and (x32.dtype != np.float32 or x32.size != x.numel()
                                                     or not x32.flags.c_contiguous)):
        raise ValueError("residual: pred (and x32) must have x's elements")
    r = torch.empty_like(x)
    ok = lb.kvn_xpred_residual(x.data_ptr(), kind, ptr(p), x.numel(), r.data_ptr(),
                               None if x32 is None else ptr(x32))
    return r, bool(ok)


def prediction_sum(d, pred: np.ndarray, out: np.ndarray) -> None:
    """``out[:] = float32(dtype(float32(d) + pred))`` (``d`` torch, ``out`` float32 numpy of its
    elements, contiguous): a decoded residual plus its prediction as the decoder rounds it,
    widened. csrc/xpred.c ``kvn_xpred_sum``; the reference is
    :meth:`kvcodec.codecs.kvc.xpred.XPredEncoder.store_sum`'s torch lines, bit for bit.

    Raises:
        Unsupported: as :func:`residual`.
    """
    lb = required()
    kind = _cpu_kind(d)
    p = np.ascontiguousarray(pred, dtype=np.float32)
    if p.size != d.numel() or out.dtype != np.float32 or out.size != d.numel() or not out.flags.c_contiguous:
        raise ValueError("prediction_sum: pred and out must have d's elements (out float32, contiguous)")
    lb.kvn_xpred_sum(d.data_ptr(), kind, ptr(p), d.numel(), ptr(out))
