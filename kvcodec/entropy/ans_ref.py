"""The executable spec of an ANS stream: a pure-integer encoder and decoder (formats/ANS.md).

Plain Python integers, no library: this is what every fast path (constriction, the vectorised
numpy decoder, the CUDA kernel) must match bit for bit. A stream codes a sequence of *segments*;
segment ``j`` holds ``n_j`` symbols coded with table ``f_j`` (precision ``P_j``, used as
``f_j << (24 - P_j)``). State: 64 bits; words: 32 bits; the decoder pops words from the end.

Example:
    >>> import numpy as np
    >>> f = np.array([12, 3, 1], dtype=np.uint32)          # precision 4
    >>> w = ans_encode_reference([0, 1, 0, 2, 0], f)
    >>> ans_decode_reference(w, f, 5).tolist()
    [0, 1, 0, 2, 0]
"""

from __future__ import annotations

import numpy as np

from ..errors import StreamError
from .tables import CODER_PRECISION, coder_table

_PMASK = (1 << CODER_PRECISION) - 1
_LOW = 1 << 32  # state invariant: state >= 2**32 while words remain


def _cdf(freqs) -> tuple[list[int], list[int]]:
    f = [int(x) for x in coder_table(np.asarray(freqs))]  # validates; sum == 2**24
    c = [0]
    for x in f:
        c.append(c[-1] + x)
    return f, c


def ans_open_stream(words, where: str = "") -> tuple[list[int], int, int]:
    """A stream's words as Python ints and its initial ``(state, pos)``: the last word (never 0),
    then one more word while the state is below 2**32; ``pos`` words remain to be read.

    Raises:
        StreamError: the stream ends in a zero word (the message starts with ``where``).
    """
    w = [int(x) for x in np.asarray(words, dtype=np.uint32)]
    pos = len(w)
    state = 0
    if pos:
        state, pos = w[pos - 1], pos - 1
        if state == 0:
            raise StreamError(f"{where}ANS stream ends in a zero word")
        if pos and state < _LOW:
            state, pos = (state << 32) | w[pos - 1], pos - 1
    return w, state, pos


def ans_decode_segments_reference(words, segments) -> np.ndarray:
    """Decode ``segments = [(freqs, n), ...]`` from one stream; raise StreamError unless the
    stream is consumed exactly (every word read and the final state 0)."""
    w, state, pos = ans_open_stream(words)
    out = []
    for freqs, n in segments:
        f, c = _cdf(freqs)
        for _ in range(int(n)):
            q = state & _PMASK
            s = next(i for i in range(len(f)) if c[i + 1] > q)  # c[s] <= q < c[s+1]
            state = (state >> CODER_PRECISION) * f[s] + q - c[s]
            if state < _LOW and pos:
                state, pos = (state << 32) | w[pos - 1], pos - 1
            out.append(s)
    if pos != 0 or state != 0:
        raise StreamError(f"ANS stream not consumed exactly: {pos} words left, final state {state:#x}")
    return np.array(out, dtype=np.int32)


def ans_decode_reference(words, freqs, n: int) -> np.ndarray:
    """Decode ``n`` symbols coded with one table (see :func:`ans_decode_segments_reference`)."""
    return ans_decode_segments_reference(words, [(freqs, n)])


def ans_encode_segments_reference(segments) -> np.ndarray:
    """Encode ``segments = [(symbols, freqs), ...]``; the inverse of the decoder above.

    Symbols are pushed last to first (ANS is a stack); a word (the state's low 32 bits) is
    emitted before coding ``s`` whenever ``state >> 40 >= f[s]``; at the end the state is
    appended as its low word then its high word, dropping high zero words.
    """
    w: list[int] = []
    state = 0
    for symbols, freqs in reversed(list(segments)):
        f, c = _cdf(freqs)
        for s in reversed([int(x) for x in np.asarray(symbols).ravel()]):
            if not 0 <= s < len(f):
                raise StreamError(f"symbol {s} outside the table's alphabet [0, {len(f)})")
            if (state >> (64 - CODER_PRECISION)) >= f[s]:
                w.append(state & 0xFFFFFFFF)
                state >>= 32
            state = ((state // f[s]) << CODER_PRECISION) | (c[s] + state % f[s])
    while state:
        w.append(state & 0xFFFFFFFF)
        state >>= 32
    return np.array(w, dtype=np.uint32)


def ans_encode_reference(symbols, freqs) -> np.ndarray:
    """Encode ``symbols`` with one table (see :func:`ans_encode_segments_reference`)."""
    return ans_encode_segments_reference([(symbols, freqs)])
