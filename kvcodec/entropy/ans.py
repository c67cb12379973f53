"""ANS coding through constriction, made exactly defined by our integer tables.

constriction's ``Categorical(p, perfect=False)`` quantizes float probabilities to 24-bit fixed
point as ``cdf[i] = i + floor(scale * sum(p[:i]))`` with ``scale = (2**24 - A) / sum(p)``. Passing
the integer-valued floats ``g = F - 1`` (``F`` = our table at 24 bits, so ``sum(g) = 2**24 - A``)
makes ``scale`` exactly 1.0 and every partial sum exact in float64, hence constriction codes with
exactly ``F``: the stream is defined by the integer table alone. Tests check this against the
pure-integer reference in :mod:`kvcodec.entropy.ans_ref`, bit for bit.

Example:
    >>> import numpy as np
    >>> f = np.array([12, 3, 1], dtype=np.uint32)
    >>> w = ans_encode(np.array([0, 1, 0, 2, 0]), f)
    >>> ans_decode(w, f, 5).tolist()
    [0, 1, 0, 2, 0]
"""

from __future__ import annotations

import numpy as np

from ..errors import DependencyError, StreamError
from .tables import coder_table

try:
    import constriction as _constriction

    _AnsCoder = _constriction.stream.stack.AnsCoder
    _Categorical = _constriction.stream.model.Categorical
except ImportError:  # pragma: no cover - constriction is a core dependency
    _constriction = None


def _need() -> None:
    if _constriction is None:  # pragma: no cover
        raise DependencyError("constriction is required for ANS coding: pip install 'constriction>=0.4'")


def constriction_model(freqs: np.ndarray):
    """The constriction model that codes with exactly the integer table ``freqs`` (any precision).

    Example:
        >>> m = constriction_model(np.array([3, 1], dtype=np.uint32))
    """
    _need()
    g = (coder_table(freqs) - 1).astype(np.float64)
    return _Categorical(g, perfect=False)


def constriction_models(tables: np.ndarray) -> list:
    """Models for every row of a ``[K, A]`` table array (validated together: one numpy pass)."""
    _need()
    t = np.asarray(tables)
    if t.ndim != 2 or t.shape[0] == 0:
        return [constriction_model(f) for f in t.reshape(-1, t.shape[-1] if t.ndim else 1)] if t.size else []
    coder_table(t[0])  # validates dtype / first table's precision
    sums = t.astype(np.uint64).sum(axis=1)
    p = int(sums[0]).bit_length() - 1
    if (t < 1).any() or not (sums == (1 << p)).all():
        return [constriction_model(f) for f in t]  # raises the precise error
    g = (t.astype(np.int64) << (24 - p)) - 1
    g = g.astype(np.float64)
    return [_Categorical(row, perfect=False) for row in g]


def _check_symbols(s: np.ndarray, a: int) -> np.ndarray:
    s = np.asarray(s)
    if s.size and (s.dtype.kind not in "iu" or int(s.min()) < 0 or int(s.max()) >= a):
        raise StreamError(f"symbols must be integers in [0, {a})")
    return np.ascontiguousarray(s.ravel(), dtype=np.int32)


def ans_encode_segments(segments, models=None) -> np.ndarray:
    """Encode ``[(symbols, freqs), ...]`` as one stream (segments decode in the given order).

    ``models`` optionally gives a prebuilt constriction model per segment (same order).
    """
    _need()
    coder = _AnsCoder()
    segs = list(segments)
    for j in range(len(segs) - 1, -1, -1):
        sym, freqs = segs[j]
        s = _check_symbols(sym, len(freqs))
        if s.size:
            coder.encode_reverse(s, models[j] if models is not None else constriction_model(freqs))
    return np.asarray(coder.get_compressed(), dtype=np.uint32)


def ans_encode(symbols: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """Encode symbols with one integer table; returns the ``uint32`` words (formats/ANS.md).

    Args:
        symbols: integers in ``[0, len(freqs))``.
        freqs: a valid table (every entry >= 1, sum a power of two <= 2**24).

    Raises:
        StreamError: a symbol is outside the alphabet.
        FormatError: the table is invalid.
    """
    return ans_encode_segments([(symbols, freqs)])


def ans_decode_segments(words: np.ndarray, segments, models=None) -> np.ndarray:
    """Decode ``[(freqs, n), ...]`` from one stream; StreamError unless consumed exactly."""
    _need()
    w = np.ascontiguousarray(words, dtype=np.uint32)
    try:
        coder = _AnsCoder(w)
    except ValueError as e:
        raise StreamError(f"corrupt ANS stream: {e}") from None
    out = []
    for j, (freqs, n) in enumerate(segments):
        n = int(n)
        if n:
            m = models[j] if models is not None else constriction_model(freqs)
            out.append(np.asarray(coder.decode(m, n), dtype=np.int32))
    if not coder.is_empty():
        raise StreamError(
            f"ANS stream not consumed exactly ({coder.num_words()} words left or nonzero final state)"
        )
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)


def ans_decode(words: np.ndarray, freqs: np.ndarray, n: int) -> np.ndarray:
    """Decode ``n`` symbols coded with ``freqs`` (constriction fast path); returns ``int32``.

    Raises:
        StreamError: the stream is corrupt or not consumed exactly.
    """
    return ans_decode_segments(words, [(freqs, n)])
