"""kvc's symbols: the entropy stage settings, escapes (codes beyond the alphabet), token deltas
(``pred`` rows) and their running sums. Normative text: formats/codecs/kvc.md.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ... import native
from ...errors import FormatError


def _stage(p: dict[str, Any]):
    """The entropy stage of kvc's settings ``p`` (one object per distinct setting: it holds no
    state between tensors, and making one per tensor cost 2 % of a calibrated encode).

    Raises:
        ConfigError: settings the stage refuses."""
    vals = (p["precision"], p["chunk"], p["rows_per_stream"], p["n_tables"], *p["ctx"])
    if all(type(v) is int for v in vals):  # the stage refuses the rest (True is no 1): not kept
        return _stage_of(vals[:4], tuple(p["ctx"]))
    return _make_stage(*vals[:4], list(p["ctx"]))


def _make_stage(precision: Any, chunk: Any, rows_per_stream: Any, n_tables: Any, ctx: Any):
    from ...entropy import EntropyStage

    return EntropyStage(precision=precision, chunk=chunk, rows_per_stream=rows_per_stream, tables="cluster",
                        n_tables=n_tables, scope="ctx" if ctx else "all", thresholds=list(ctx))


@functools.lru_cache(maxsize=64)
def _stage_of(head: tuple, ctx: tuple):
    return _make_stage(*head, ctx)


def escape_split(codes: np.ndarray, max_level: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Map signed codes to symbols ``[0, 2L)``: ``|c| < L`` -> ``c + L - 1``; else the escape
    symbol ``2L - 1`` and ``c`` goes to the escape list (row-major order).

    ``L = clamp(max|c| + 1, 1, max_level)`` is returned; ``A = 2L`` is the alphabet.

    Example:
        >>> s, e, L = escape_split(np.array([[0, -1, 5]]), 3)
        >>> s.tolist(), e.tolist(), L
        ([[2, 1, 5]], [5], 3)
    """
    c = np.asarray(codes, dtype=np.int64)
    top = int(np.abs(c).max()) if c.size else 0
    lv = max(1, min(top + 1, int(max_level)))
    esc = np.abs(c) >= lv
    sym = np.where(esc, 2 * lv - 1, c + lv - 1)
    return sym.astype(np.int32), c[esc].astype(np.int32), lv


def split_tokens(tok: np.ndarray, max_level: int, use: np.ndarray | None, rows_per_stream: int,
                 ctx: list[int]) -> tuple[np.ndarray, np.ndarray, int, tuple[np.ndarray, np.ndarray] | None]:
    """The encoder's symbols of token-major codes ``tok [n, R]``: token deltas on the columns
    ``use`` marks, then :func:`escape_split`. Returns ``(sym [n, R], esc, L, stats)``; ``stats``
    is the magnitude-context stage's ``(counts, classes)`` when the native pass took them with
    the split (``ctx`` thresholds given), else None. The native passes and the numpy reference
    give the same symbols."""
    if ctx:
        try:  # row-major underneath (the symbols are views [n, R]): what the stage reads fastest
            sym, esc, lv, hist, cls = native.escape_split_ctx_tokens(tok, max_level, use, rows_per_stream, ctx,
                                                                     rows=True)
            return sym, esc, lv, (hist, cls)
        except native.Unsupported:  # no native coder, or more escapes than the one pass holds
            pass
    try:
        sym, esc, lv = native.escape_split_tokens(tok, max_level, use)
        return sym, esc, lv, None
    except native.Unsupported:
        pass
    if use is not None:
        dt = tok.copy()
        np.subtract(tok[1:], tok[:-1], out=dt[1:], where=use[None, :])
        tok = dt
    sym_rows, esc, lv = escape_split(tok.T, max_level)
    return sym_rows.T, esc, lv, None


def escape_join(sym: np.ndarray, esc: np.ndarray, lv: int) -> np.ndarray:
    """Inverse of :func:`escape_split`.

    Raises:
        FormatError: the escape count differs from the escape plane's length.
    """
    s = np.asarray(sym, dtype=np.int64)
    mask = s == 2 * lv - 1
    n = int(mask.sum())
    e = np.asarray(esc)
    if e.ndim != 1 or e.size != n or (e.size and e.dtype.kind not in "iu"):
        raise FormatError(f"kvc: {n} escape symbols but the esc plane holds {e.size} values")
    out = s - (lv - 1)
    out[mask] = e.astype(np.int64)
    if n and int(np.abs(out[mask]).min()) < lv:
        raise FormatError("kvc: an escaped code lies inside the regular range")
    return out


def delta_rows(codes: np.ndarray, margin: float = 0.02, method: str = "auto",
               min_gain_bits: float = 1024.0, sample: int = 512) -> np.ndarray:
    """Which columns of token-major ``codes [n, R]`` to code as token deltas: bool ``[R]``.

    A row takes deltas when the empirical entropy of ``e[t] = c[t] - c[t-1]`` (``e[0] = c[0]``)
    is below that of ``c`` by more than ``margin`` bits per symbol (values clipped to
    ``[-64, 63]`` for the estimate, measured at every ``max(1, n // sample)``-th token); no row
    does unless the estimated saving over all rows exceeds ``min_gain_bits`` (the ``pred``
    plane and its header entries cost ~1 kbit). An encoder-only choice: any set of rows
    decodes. ``method``: ``"auto"`` (the native one-pass histograms when they build),
    ``"numpy"`` (the reference; same counts, same answer).

    Example:
        >>> t = np.arange(64)
        >>> c = np.stack([t // 4, (-1) ** t], axis=1)   # a slow ramp and an alternating row
        >>> delta_rows(c, min_gain_bits=0).tolist()
        [True, False]
    """
    c = np.asarray(codes)
    if c.dtype not in (np.int32, np.int64):
        c = c.astype(np.int64)
    n, r = c.shape
    if n < 2 or r == 0:
        return np.zeros(r, dtype=bool)
    ts = max(1, n // max(1, int(sample)))
    try:
        if method != "auto":
            raise native.Unsupported("numpy asked for")
        hc, he = native.delta_histograms(c, ts)
    except native.Unsupported:
        c = c.astype(np.int64, copy=False)
        e = c.copy()
        e[1:] -= c[:-1]
        rows = 128 * np.arange(r, dtype=np.int64)[None, :]
        hc, he = (np.bincount((np.clip(x[::ts], -64, 63) + 64 + rows).ravel(), minlength=128 * r).reshape(r, 128)
                  for x in (c, e))
    m = -(-n // ts)  # tokens counted
    # empirical entropy of a row's m values: log2(m) - sum(h log2 h) / m, so the gain of deltas is
    # (sum f(he) - sum f(hc)) / m with f(c) = c log2 c, looked up per count
    f = np.arange(m + 1, dtype=np.float64)
    f[1:] *= np.log2(f[1:])
    gain = (f[he].sum(axis=1) - f[hc].sum(axis=1)) / m
    use = gain > margin
    if float(gain[use].sum()) * n < min_gain_bits:
        use[:] = False
    return use


def pred_mask(plane: Any, r: int, where: str = "kvc") -> np.ndarray:
    """The rows a ``pred`` plane marks as token deltas: bool ``[r]`` (see the module docstring).

    Raises:
        FormatError: the plane is missing, not ``uint8 [ceil(r / 8)]`` or has padding bits set.

    Example:
        >>> pred_mask(np.packbits([True, False, True]), 3).tolist()
        [True, False, True]
    """
    nb = (r + 7) // 8
    pl = None if plane is None else np.asarray(plane)
    if pl is None or pl.dtype != np.uint8 or pl.shape != (nb,):
        got = "missing" if pl is None else f"{pl.dtype}{list(pl.shape)}"
        raise FormatError(f"{where}: kvc 'pred' plane must be uint8[{nb}], got {got}")
    bits = np.unpackbits(pl)
    if bits[r:].any():
        raise FormatError(f"{where}: kvc 'pred' plane has padding bits set")
    return bits[:r].astype(bool)


def undelta_rows(codes: np.ndarray, plane: Any, where: str = "kvc") -> np.ndarray:
    """Inverse of the encoder's token deltas (the reference; the native escape join does the same
    in its pass): the running sums over tokens of the columns of ``codes [n, R]`` whose bit is
    set in the ``pred`` plane (see :func:`pred_mask`).

    Raises:
        FormatError: the plane is missing, not ``uint8 [ceil(R / 8)]`` or has padding bits set.

    Example:
        >>> undelta_rows(np.array([[1, 1], [1, 1], [2, 1]]), np.packbits([True, False])).tolist()
        [[1, 1], [2, 1], [4, 1]]
    """
    return running_sums(codes, pred_mask(plane, np.shape(codes)[1], where))


def running_sums(codes: np.ndarray, use: np.ndarray) -> np.ndarray:
    """``codes [n, R]`` as int64 with the columns where ``use`` (bool ``[R]``) is set replaced by
    their running sums over tokens (:func:`undelta_rows` with the ``pred`` plane already read).

    Example:
        >>> running_sums(np.array([[1, 1], [1, 1]]), np.array([True, False])).tolist()
        [[1, 1], [2, 1]]
    """
    c = np.asarray(codes, dtype=np.int64)
    if use.any():
        c = c.copy()
        c[:, use] = np.cumsum(c[:, use], axis=0)
    return c


def _narrowest(v: np.ndarray) -> np.ndarray:
    """``v`` as int8, int16 or int32, the narrowest that holds every value."""
    lo, hi = (int(v.min()), int(v.max())) if v.size else (0, 0)
    for dt in (np.int8, np.int16):
        if np.iinfo(dt).min <= lo and hi <= np.iinfo(dt).max:
            return v.astype(dt)
    return v.astype(np.int32)
