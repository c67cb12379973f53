"""The ANS entropy stage in C: stage encode and decode, symbol histograms (plain and per
magnitude context), and the symbol matrix views they read.

Bit-identical to the executable spec, :mod:`kvcodec.entropy.ans_ref` (tests/test_native.py);
C side: csrc/ans_decode.c, csrc/ans_encode.c.

Example:
    >>> import numpy as np
    >>> from kvcodec.native import ans
    >>> x, kind, row_stride, token_stride = ans.symbol_view(np.zeros((2, 3), np.int64))
    >>> (x.dtype.name, row_stride, token_stride)
    ('int32', 3, 1)
"""

from __future__ import annotations

import numpy as np

from ..errors import StreamError
from .abi import BAD_SYMBOL, NOMEM, NOT_CONSUMED, OK, OUT_I32_RN, OUT_U8_NR, OUT_U16_NR, ZERO_WORD, ptr
from .build import required


def _flat_tables(lay, tsets: np.ndarray, rts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tabs = np.ascontiguousarray(np.asarray(tsets, dtype=np.uint32).reshape(-1, lay.A))
    rts = np.asarray(rts, dtype=np.int64)
    if lay.scope == 1:  # a table set per chunk: row tables index into their own set
        rts = rts + np.arange(lay.n_sets, dtype=np.int64)[:, None] * lay.K
    # scope 2: one set, a row table per magnitude class ([Q, R])
    q = getattr(lay, "Q", 1)
    thr = list(getattr(lay, "thresholds", ()))
    geom = np.array([lay.R, lay.N, lay.C, lay.G, lay.P, lay.A, tabs.shape[0], lay.scope, q,
                     getattr(lay, "center", 0), *thr, *([0] * (15 - len(thr)))], dtype=np.int64)
    return geom, tabs, np.ascontiguousarray(rts, dtype=np.int32)


_STATUS_TEXT = {
    ZERO_WORD: "stream ends in a zero word",
    NOT_CONSUMED: "not consumed exactly (corrupt or wrong index)",
}


def decode_stage(lay, words: np.ndarray, offsets: np.ndarray, tsets: np.ndarray, rts: np.ndarray,
                 layout: str = "rows") -> np.ndarray:
    """Decode validated stage planes (see :func:`kvcodec.entropy.stage.parse_planes`).

    ``layout="rows"`` returns ``int32 [R, N]`` (as every other decoder); ``"tokens"`` returns the
    transpose ``[N, R]`` in the narrowest unsigned dtype holding the alphabet (``uint8`` or
    ``uint16``) — the cache's own token-major order, with no transposing copy afterwards.

    Raises:
        StreamError: a stream is corrupt or not consumed exactly (the first such stream).
    """
    lb = required()
    geom, tabs, table_of = _flat_tables(lay, tsets, rts)
    if layout == "rows":
        out, kind = np.zeros((lay.R, lay.N), dtype=np.int32), OUT_I32_RN
    elif lay.A <= 256:
        out, kind = np.zeros((lay.N, lay.R), dtype=np.uint8), OUT_U8_NR
    elif lay.A <= 65536:
        out, kind = np.zeros((lay.N, lay.R), dtype=np.uint16), OUT_U16_NR
    else:
        return np.ascontiguousarray(decode_stage(lay, words, offsets, tsets, rts, "rows").T)
    w = np.ascontiguousarray(words, dtype=np.uint32)
    off = np.ascontiguousarray(offsets, dtype=np.uint32)
    bad = np.full(1, -1, dtype=np.int64)
    rc = lb.kvn_ans_decode(ptr(geom), ptr(w), ptr(off), ptr(tabs), ptr(table_of), ptr(out), kind, ptr(bad))
    if rc == NOMEM:
        raise MemoryError("native ANS decoder: out of memory")
    if rc != OK:
        raise StreamError(f"ANS stream {int(bad[0])} {_STATUS_TEXT.get(rc, f'failed ({rc})')}")
    return out


_SYM_KIND = {np.dtype(np.int32): OUT_I32_RN, np.dtype(np.uint16): OUT_U16_NR, np.dtype(np.uint8): OUT_U8_NR}


def _padded_rows(x: np.ndarray) -> bool:
    """A 2-D array with unit stride along its rows, rows a whole number of elements apart and at
    least a row's length (and more than one row and column: size-1 axes have arbitrary strides)."""
    if x.ndim != 2 or x.shape[0] < 2 or x.shape[1] < 2 or x.flags.c_contiguous:
        return False
    s0, s1 = x.strides
    return s1 == x.itemsize and s0 > 0 and s0 % x.itemsize == 0 and s0 >= x.shape[1] * x.itemsize


def symbol_view(symbols: np.ndarray, layout: str = "rows") -> tuple[np.ndarray, int, int, int]:
    """``(array, kind, row_stride, token_stride)`` of a symbol matrix for the C functions:
    ``layout="rows"`` is ``[R, N]``, ``"tokens"`` is ``[N, R]``; int32, uint16 and uint8 are
    passed as they are, other integer dtypes are converted to int32 first. A 2-D array whose
    rows lie apart by more than their length (unit stride within a row: a view of the first
    columns of a wider one) is passed as it lies, the row stride its own."""
    x = np.asarray(symbols)
    if x.dtype not in _SYM_KIND:
        if x.size and (x.dtype.kind not in "iu" or int(x.min()) < 0 or int(x.max()) >= 2**31):
            raise StreamError("symbols must be non-negative integers below 2**31")
        x = x.astype(np.int32)
    if _padded_rows(x):
        n_cols = x.strides[0] // x.itemsize
    else:
        x = np.ascontiguousarray(x)
        n_cols = x.shape[1] if x.ndim == 2 else 0
    return (x, _SYM_KIND[x.dtype], n_cols, 1) if layout == "rows" else (x, _SYM_KIND[x.dtype], 1, n_cols)


def histograms(symbols: np.ndarray, alphabet: int, layout: str = "rows", t0: int = 0, t1: int | None = None) -> np.ndarray:
    """``int64 [R, A]`` symbol counts per row over tokens ``[t0, t1)``.

    Raises:
        StreamError: a symbol outside ``[0, alphabet)``.
    """
    lb = required()
    x, kind, sr, st = symbol_view(symbols, layout)
    r, n = (x.shape if layout == "rows" else x.shape[::-1])
    t1 = n if t1 is None else t1
    hist = np.zeros((r, alphabet), dtype=np.int64)
    if lb.kvn_hist(ptr(x), kind, r, sr, st, t0, t1, alphabet, ptr(hist)) != OK:
        raise StreamError(f"symbols must lie in [0, {alphabet})")
    return hist


def ctx_histograms(symbols: np.ndarray, alphabet: int, layout: str, g: int, thresholds: list[int],
                   classes: bool = False):
    """``int64 [Q * R, A]`` symbol counts per (magnitude class, row) of a scope-2 stage
    (row ``q * R + r``; formats/ANS.md §3.1), equal to counting
    :func:`kvcodec.entropy.stage.magnitude_classes` by hand. With ``classes=True``, returns
    ``(counts, cls)``: ``cls`` is every symbol's class, uint8 in the layout of ``symbols``, for
    :func:`encode_stage` (which then does not compute them again).

    Raises:
        StreamError: a symbol outside ``[0, alphabet)``.
    """
    lb = required()
    x, kind, sr, st = symbol_view(symbols, layout)
    if classes and not x.flags.c_contiguous:  # the classes are written with the symbols' strides
        x, kind, sr, st = symbol_view(np.ascontiguousarray(x), layout)
    r, n = (x.shape if layout == "rows" else x.shape[::-1])
    q = len(thresholds) + 1
    hist = np.zeros((q * r, alphabet), dtype=np.int64)
    cls = np.empty(x.shape, dtype=np.uint8) if classes else None
    thr = np.ascontiguousarray(np.asarray(list(thresholds) or [0], dtype=np.int64))
    rc = lb.kvn_ctx_hist(ptr(x), kind, r, sr, st, n, g, q - 1, ptr(thr), (alphabet - 1) // 2, alphabet, ptr(hist),
                         None if cls is None else ptr(cls))
    if rc == NOMEM:
        raise MemoryError("native context histograms: out of memory")
    if rc != OK:
        raise StreamError(f"symbols must lie in [0, {alphabet})")
    return (hist, cls) if classes else hist


def encode_stage(lay, symbols: np.ndarray, tsets: np.ndarray, rts: np.ndarray,
                 layout: str = "rows", classes: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Encode ``symbols`` (``[R, N]``, or ``[N, R]`` with ``layout="tokens"``) with the stage
    geometry ``lay``; return ``(words uint32 [W], offsets int64 [S + 1])``, identical to the
    reference encoder. ``classes`` (scope 2 only): the symbols' magnitude classes as
    :func:`ctx_histograms` returns them, used instead of computing them again (they must be
    the rule's classes for the output to decode; a class ``>= Q`` is refused).

    Raises:
        StreamError: a symbol outside the alphabet (or a class outside ``[0, Q)``).
    """
    lb = required()
    geom, tabs, table_of = _flat_tables(lay, tsets, rts)
    x, kind, sr, st = symbol_view(symbols, layout)
    cls = None
    if classes is not None and lay.scope == 2:
        cls = np.asarray(classes)
        # read with the symbols' element strides: laid out as they are, or a contiguous copy
        if not (cls.dtype == np.uint8 and cls.shape == x.shape
                and tuple(s // cls.itemsize for s in cls.strides) == tuple(s // x.itemsize for s in x.strides)
                and all(s % x.itemsize == 0 for s in x.strides)):
            cls = np.ascontiguousarray(classes, dtype=np.uint8)
            if _padded_rows(x):  # the encoder reads both with the symbols' strides
                x, kind, sr, st = symbol_view(np.ascontiguousarray(x), layout)
        if cls.shape != x.shape:
            raise ValueError(f"classes must have the symbols' shape {x.shape}, got {cls.shape}")
    cap = lay.R * lay.N + 2 * lay.n_streams + 1
    words = np.empty(cap, dtype=np.uint32)
    offsets = np.zeros(lay.n_streams + 1, dtype=np.int64)
    rc = lb.kvn_ans_encode(ptr(geom), ptr(tabs), ptr(table_of), ptr(x), kind, sr, st, ptr(words), cap,
                           ptr(offsets), None if cls is None else ptr(cls))
    if rc == NOMEM:
        raise MemoryError("native ANS encoder: out of memory")
    if rc == BAD_SYMBOL:
        raise StreamError(f"symbols must lie in [0, {lay.A})" + ("" if cls is None else f" and classes in [0, {lay.Q})"))
    if rc != OK:  # pragma: no cover - the capacity bound is exact
        raise StreamError(f"native ANS encoder failed ({rc})")
    return words[: int(offsets[-1])].copy(), offsets
