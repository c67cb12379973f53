"""The executable spec of whole stages: encoders and decoders over every stream of a stage
(formats/ANS.md §3), symbol by symbol on :mod:`.ans_ref`. Every fast path matches these.
"""

from __future__ import annotations


import numpy as np

from ..errors import StreamError

def _encode_ctx_reference(lay, x, tabs, rt, cls) -> tuple[np.ndarray, np.ndarray]:
    """Scope 2 encoder on the executable spec: each stream's rows as runs of equal class."""
    from .ans_ref import ans_encode_segments_reference

    words, offsets = [], np.zeros(lay.n_streams + 1, dtype=np.int64)
    for s in range(lay.n_streams):
        r0, r1, t0, t1 = lay.stream(s)
        segs = []
        for row in range(r0, r1):
            cr, xr = cls[row, t0:t1], x[row, t0:t1]
            cut = np.flatnonzero(np.diff(cr)) + 1
            for a, b in zip([0, *cut.tolist()], [*cut.tolist(), t1 - t0]):
                segs.append((xr[a:b], tabs[rt[int(cr[a]), row]]))
        w = ans_encode_segments_reference(segs)
        words.append(w)
        offsets[s + 1] = offsets[s] + len(w)
    return (np.concatenate(words).astype(np.uint32) if words else np.zeros(0, np.uint32)), offsets


def _decode_ctx_reference(lay, words, offsets, tsets, rts) -> np.ndarray:
    """Scope 2 decoder on the executable spec (pure integers, symbol by symbol)."""
    from .ans_ref import CODER_PRECISION, _cdf, ans_open_stream

    pmask, low = (1 << CODER_PRECISION) - 1, 1 << 32
    cdfs = [_cdf(t) for t in tsets[0]]
    out = np.zeros((lay.R, lay.N), dtype=np.int32)
    for s in range(lay.n_streams):
        r0, r1, t0, t1 = lay.stream(s)
        w, state, pos = ans_open_stream(words[offsets[s]:offsets[s + 1]], f"ANS stream {s}: ")
        acc = [0] * (t1 - t0)
        for row in range(r0, r1):
            k = row - r0
            for j in range(t1 - t0):
                q = 0 if k == 0 else sum(1 for t_i in lay.thresholds if 8 * acc[j] >= t_i * k)
                f, c = cdfs[int(rts[q][row])]
                v = state & pmask
                sym = next(i for i in range(len(f)) if c[i + 1] > v)
                state = (state >> CODER_PRECISION) * f[sym] + v - c[sym]
                if state < low and pos:
                    state, pos = (state << 32) | w[pos - 1], pos - 1
                out[row, t0 + j] = sym
                acc[j] += abs(sym - lay.center)
        if pos != 0 or state != 0:
            raise StreamError(f"ANS stream {s} not consumed exactly (corrupt or wrong index)")
    return out


def _decode_reference(lay, words, offsets, tsets, rts) -> np.ndarray:
    from .ans_ref import ans_decode_segments_reference

    out = np.zeros((lay.R, lay.N), dtype=np.int32)
    for s in range(lay.n_streams):
        r0, r1, t0, t1 = lay.stream(s)
        si = 0 if lay.scope == 0 else s // lay.n_groups
        segs = [(tsets[si][int(rts[si][row])], t1 - t0) for row in range(r0, r1)]
        try:
            dec = ans_decode_segments_reference(words[offsets[s]:offsets[s + 1]], segs)
        except StreamError as e:
            raise StreamError(f"ANS stream {s}: {e}") from None
        out[r0:r1, t0:t1] = dec.reshape(r1 - r0, t1 - t0)
    return out
