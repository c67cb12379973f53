"""Vectorised numpy ANS decoder: all streams of a stage in lockstep, one symbol per stream per step.

The same arithmetic as :mod:`kvcodec.entropy.ans_ref` (formats/ANS.md §2), on ``uint64`` arrays:
numpy pays its per-call overhead once per *step* instead of once per symbol, so it is fast when a
stage has many streams (thousands of channels × chunks) — the same shape a GPU kernel uses (one
thread per stream). Tests check it bit-exact against the reference, errors included.

Example:
    >>> import numpy as np
    >>> from kvcodec.entropy import EntropyStage
    >>> x = np.random.default_rng(0).integers(0, 5, size=(40, 70))
    >>> st = EntropyStage(chunk=32)
    >>> bool((st.decode(st.encode(x), method="numpy") == x).all())
    True
"""

from __future__ import annotations

import numpy as np

from ..errors import StreamError
from .tables import CODER_PRECISION

_MASK = np.uint64((1 << CODER_PRECISION) - 1)
_LOW = np.uint64(1 << 32)
_LUT_LIMIT = 1 << 24  # entries; above this, find symbols by binary search instead of a slot table


def decode_stage_fast(lay, words, offsets, tsets, rts) -> np.ndarray:
    """Decode validated stage planes (see :func:`kvcodec.entropy.stage.parse_planes`)."""
    out = np.zeros(lay.R * lay.N, dtype=np.int32)
    if lay.n_streams == 0:
        return out.reshape(lay.R, lay.N)
    a, p = lay.A, lay.P
    shift = CODER_PRECISION - p
    flat = tsets.reshape(-1, a).astype(np.uint64)  # [n_sets * K, A]
    freq = flat << np.uint64(shift)
    cum = np.zeros_like(freq)
    np.cumsum(freq[:, :-1], axis=1, out=cum[:, 1:])
    ntab = flat.shape[0]
    use_lut = ntab << p <= _LUT_LIMIT
    if use_lut:
        lut = np.repeat(np.tile(np.arange(a, dtype=np.int64), ntab), flat.ravel().astype(np.int64))
        luts = lut.astype(np.int16 if a <= 32767 else np.int32)
    else:
        # one monotone key space: table t's cumulative values shifted by t * 2**25
        key_c = (cum + (np.arange(ntab, dtype=np.uint64)[:, None] << np.uint64(25))).ravel()
    freq_f, cum_f = freq.ravel(), cum.ravel()
    w64 = words.astype(np.uint64)
    # streams grouped by shape (rows, tokens): at most 4 classes (ragged last group / chunk)
    geo = np.array([lay.stream(s) for s in range(lay.n_streams)], dtype=np.int64).reshape(-1, 4)
    nr, nt = geo[:, 1] - geo[:, 0], geo[:, 3] - geo[:, 2]
    for shape in sorted(set(zip(nr.tolist(), nt.tolist()))):
        ids = np.nonzero((nr == shape[0]) & (nt == shape[1]))[0]
        _decode_class(lay, ids, geo[ids], shape, words, w64, offsets, rts, out, freq_f, cum_f,
                      luts if use_lut else None, None if use_lut else key_c, shift, a, p)
    return out.reshape(lay.R, lay.N)


def _decode_class(lay, ids, geo, shape, words, w64, offsets, rts, out, freq_f, cum_f, luts, key_c, shift, a, p):
    lut = luts
    nrows, ntok = shape
    start = offsets[ids]
    pos = offsets[ids + 1].copy()
    x = np.zeros(len(ids), dtype=np.uint64)
    has = pos > start
    if has.any():
        h = np.nonzero(has)[0]
        x[h] = w64[pos[h] - 1]
        pos[h] -= 1
        if (x[h] == 0).any():
            bad = int(ids[h[x[h] == 0][0]])
            raise StreamError(f"ANS stream {bad}: stream ends in a zero word")
        m = h[(pos[h] > start[h]) & (x[h] < _LOW)]
        x[m] = (x[m] << np.uint64(32)) | w64[pos[m] - 1]
        pos[m] -= 1
    sets = ids // lay.n_groups if lay.scope == 1 else np.zeros(len(ids), dtype=np.int64)
    row0 = geo[:, 0]
    k = lay.K
    p24 = np.uint64(CODER_PRECISION)
    sh = np.uint64(shift)
    buf = np.empty((nrows, ntok, len(ids)), dtype=np.int32)  # step-major: contiguous writes
    ctx = lay.scope == 2  # magnitude contexts (formats/ANS.md §3.1): the table follows each symbol's class
    if ctx:
        thr = np.asarray(list(lay.thresholds), dtype=np.int64)[:, None]
        acc = np.zeros((ntok, len(ids)), dtype=np.int64)  # per token: sum of |sym - center| of the rows above
    for j in range(nrows):
        tid = sets * k + rts[sets, row0 + j] if not ctx else None
        if ctx:
            lut_base = tab_base = None
            for i in range(ntok):
                cls = (8 * acc[i][None, :] >= thr * j).sum(axis=0) if j else np.zeros(len(ids), dtype=np.int64)
                tid = rts[cls, row0 + j].astype(np.int64)
                q = x & _MASK
                if lut is not None:
                    sym = lut[(tid << p) + (q >> sh).astype(np.int64)]
                else:
                    sym = np.searchsorted(key_c, (tid.astype(np.uint64) << np.uint64(25)) + q,
                                          side="right").astype(np.int64) - 1 - tid * a
                fi = tid * a + sym
                x = (x >> p24) * freq_f[fi] + q - cum_f[fi]
                _refill(x, pos, start, w64)
                buf[j, i] = sym
                acc[i] += np.abs(sym.astype(np.int64) - lay.center)
        elif lut is not None:
            lut_base = tid << p
            tab_base = tid * a
            for i in range(ntok):
                q = x & _MASK
                sym = lut[lut_base + (q >> sh).astype(np.int64)]
                fi = tab_base + sym
                x = (x >> p24) * freq_f[fi] + q - cum_f[fi]
                _refill(x, pos, start, w64)
                buf[j, i] = sym
        else:
            tab_base = tid * a
            key_base = tid.astype(np.uint64) << np.uint64(25)
            for i in range(ntok):
                q = x & _MASK
                sym = np.searchsorted(key_c, key_base + q, side="right").astype(np.int64) - 1 - tab_base
                fi = tab_base + sym
                x = (x >> p24) * freq_f[fi] + q - cum_f[fi]
                _refill(x, pos, start, w64)
                buf[j, i] = sym
    # scatter back: stream s, row j, token i -> out[(row0 + j) * N + t0 + i]
    tgt = (row0[None, None, :] + np.arange(nrows)[:, None, None]) * lay.N + geo[None, None, :, 2] \
        + np.arange(ntok)[None, :, None]
    out[tgt.ravel()] = buf.ravel()
    bad = np.nonzero((pos != start) | (x != 0))[0]
    if bad.size:
        raise StreamError(f"ANS stream {int(ids[bad[0]])} not consumed exactly (corrupt or wrong index)")


def _refill(x: np.ndarray, pos: np.ndarray, start: np.ndarray, w64: np.ndarray) -> None:
    """Renormalise in place: every stream whose state fell below 2**32 and has words left pops one."""
    m = np.flatnonzero(x < _LOW)
    if m.size:
        m = m[pos[m] > start[m]]
        x[m] = (x[m] << np.uint64(32)) | w64[pos[m] - 1]
        pos[m] -= 1


def decode_ctx_fast(lay, words, offsets, tsets, rts) -> np.ndarray:
    """Scope 2 (magnitude contexts) decoder without the native coder: the reference's arithmetic
    (:func:`kvcodec.entropy.stage._decode_ctx_reference`) symbol by symbol in plain Python, with
    the symbol found by bisection and the class by bisection over precomputed thresholds — about
    4x the reference's speed. For stages with few streams, where :func:`decode_stage_fast`'s
    lockstep pays numpy's per-step overhead for only a handful of symbols."""
    from bisect import bisect_right

    from .ans_ref import _cdf, ans_open_stream

    pmask, low, prec = (1 << CODER_PRECISION) - 1, 1 << 32, CODER_PRECISION
    cdfs = [_cdf(t) for t in tsets[0]]
    thr = sorted(int(t) for t in lay.thresholds)
    center = int(lay.center)
    out = np.zeros((lay.R, lay.N), dtype=np.int32)
    rt = [[int(v) for v in row] for row in np.asarray(rts)]  # [Q][R]
    for s in range(lay.n_streams):
        r0, r1, t0, t1 = lay.stream(s)
        w, state, pos = ans_open_stream(words[offsets[s]:offsets[s + 1]], f"ANS stream {s}: ")
        acc = [0] * (t1 - t0)
        for row in range(r0, r1):
            k = row - r0
            tabs = [cdfs[rt[q][row]] for q in range(len(rt))]
            thk = [t * k for t in thr]
            res = [0] * (t1 - t0)
            for j in range(t1 - t0):
                f, c = tabs[bisect_right(thk, 8 * acc[j]) if k else 0]
                v = state & pmask
                sym = bisect_right(c, v) - 1
                state = (state >> prec) * f[sym] + v - c[sym]
                if state < low and pos:
                    pos -= 1
                    state = (state << 32) | w[pos]
                res[j] = sym
                acc[j] += sym - center if sym >= center else center - sym
            out[row, t0:t1] = res
        if pos != 0 or state != 0:
            raise StreamError(f"ANS stream {s} not consumed exactly (corrupt or wrong index)")
    return out
