"""Integer frequency tables: the normative probability model of every ANS stream.

A table is a ``uint32`` array ``f`` over an alphabet ``{0, ..., A-1}`` with ``A >= 2``, every
``f[s] >= 1`` and ``sum(f) == 2**P`` for a table precision ``1 <= P <= 24``. The coder always works
at :data:`CODER_PRECISION` = 24 bits; a table of precision ``P`` is used as ``f << (24 - P)``
(:func:`coder_table`). Tables are *stored*, never re-derived, so how :func:`build_table` rounds is
an encoder choice, not part of the format (formats/ANS.md).

Example:
    >>> import numpy as np
    >>> f = build_table(np.array([90, 9, 1, 0]), precision=8)
    >>> int(f.sum()), int(f.min()) >= 1
    (256, True)
    >>> [int(x) for x in f]
    [228, 24, 3, 1]
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError, FormatError

#: Precision (bits) of the fixed-point probabilities inside the ANS coder (constriction's default).
CODER_PRECISION = 24
#: Largest table precision: tables are scaled up to the coder precision, never down.
MAX_PRECISION = CODER_PRECISION


def build_table(hist: np.ndarray, precision: int) -> np.ndarray:
    """Integer frequencies from a histogram: every symbol >= 1, sum exactly ``2**precision``.

    Each symbol first gets 1; the remaining ``2**P - A`` units are shared in proportion to the
    counts (floor), and the units left over go to the largest remainders (ties: lower symbol).
    An all-zero histogram gives a (near) uniform table. All arithmetic is on Python integers,
    so the result is the same on every platform.

    Args:
        hist: non-negative counts, length ``A`` with ``2 <= A <= 2**precision``.
        precision: table precision ``P`` in bits, ``1 <= P <= 24``.

    Returns:
        ``uint32`` array of length ``A``.

    Raises:
        ConfigError: bad precision, alphabet size or negative counts.

    Example:
        >>> [int(x) for x in build_table(np.array([3, 1]), 2)]
        [3, 1]
    """
    h = np.asarray(hist)
    if h.ndim != 1:
        raise ConfigError(f"histogram must be 1-D, got shape {list(h.shape)}")
    if not isinstance(precision, (int, np.integer)) or not 1 <= int(precision) <= MAX_PRECISION:
        raise ConfigError(f"table precision must be an integer in [1, {MAX_PRECISION}], got {precision!r}")
    a, p = int(h.size), int(precision)
    if a < 2 or a > (1 << p):
        raise ConfigError(f"alphabet size {a} must be in [2, 2**precision = {1 << p}]")
    counts = [int(x) for x in h.tolist()]
    if min(counts) < 0:
        raise ConfigError("histogram has negative counts")
    total = sum(counts)
    free = (1 << p) - a
    if total == 0:
        counts, total = [1] * a, a
    # floor share and remainder, exact in integers
    share = [c * free // total for c in counts]
    rem = [c * free % total for c in counts]
    left = free - sum(share)
    order = sorted(range(a), key=lambda i: (-rem[i], i))
    for i in order[:left]:
        share[i] += 1
    return np.array([s + 1 for s in share], dtype=np.uint32)


def build_tables(hists: np.ndarray, precision: int) -> np.ndarray:
    """:func:`build_table` for every row of a ``[n, A]`` histogram array; returns ``uint32 [n, A]``.

    Vectorised (numpy int64/float64 where exact) but equal to the per-row function.

    Example:
        >>> build_tables(np.array([[3, 1], [0, 0]]), 2).tolist()
        [[3, 1], [2, 2]]
    """
    h = np.asarray(hists, dtype=np.int64)
    if h.ndim != 2:
        raise ConfigError(f"histograms must be 2-D [n, A], got shape {list(h.shape)}")
    n, a = h.shape
    p = int(precision)
    if not 1 <= p <= MAX_PRECISION or a < 2 or a > (1 << p):
        raise ConfigError(f"bad table: precision {precision}, alphabet {a}")
    if (h < 0).any():
        raise ConfigError("histogram has negative counts")
    if n == 0:
        return np.zeros((0, a), dtype=np.uint32)
    h = h.copy()
    h[h.sum(axis=1) == 0] = 1
    total = h.sum(axis=1, keepdims=True)
    free = (1 << p) - a
    if int(total.max()) * free >= (1 << 62):  # products would overflow int64: exact slow path
        return np.stack([build_table(row, p) for row in h])
    prod = h * free
    share = prod // total
    rem = prod % total
    left = free - share.sum(axis=1)
    # rank by (-remainder, index): stable argsort of -rem keeps lower index first on ties
    order = np.argsort(-rem, axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(a)[None, :].repeat(n, 0), axis=1)
    share += rank < left[:, None]
    return (share + 1).astype(np.uint32)


def table_precision(freqs: np.ndarray) -> int:
    """The precision ``P`` of a valid table (``sum == 2**P``); raises :class:`FormatError` otherwise.

    Example:
        >>> table_precision(np.array([3, 1], dtype=np.uint32))
        2
    """
    f = np.asarray(freqs)
    if f.ndim != 1 or f.size < 2:
        raise FormatError(f"a frequency table needs >= 2 symbols, got shape {list(f.shape)}")
    if f.dtype.kind not in "ui" or (f < 1).any():
        raise FormatError("every frequency must be an integer >= 1")
    total = int(f.astype(np.uint64).sum())
    p = total.bit_length() - 1
    if total != 1 << p or not 1 <= p <= MAX_PRECISION:
        raise FormatError(f"frequencies sum to {total}, not a power of two 2**P with 1 <= P <= 24")
    return p


def coder_table(freqs: np.ndarray) -> np.ndarray:
    """The 24-bit table the coder uses: ``f << (24 - P)`` (validated). Returns ``int64``.

    Example:
        >>> [int(x) for x in coder_table(np.array([3, 1], dtype=np.uint32))]
        [12582912, 4194304]
    """
    p = table_precision(freqs)
    return np.asarray(freqs, dtype=np.int64) << (CODER_PRECISION - p)


def cross_entropy_bits(symbols: np.ndarray, freqs: np.ndarray) -> float:
    """Ideal code length in bits of ``symbols`` under the table: ``sum(P - log2 f[s])``.

    Example:
        >>> cross_entropy_bits(np.array([0, 0, 1]), np.array([2, 2], dtype=np.uint32))
        3.0
    """
    p = table_precision(freqs)
    s = np.asarray(symbols).ravel()
    if s.size == 0:
        return 0.0
    counts = np.bincount(s, minlength=len(freqs)).astype(np.float64)
    f = np.asarray(freqs, dtype=np.float64)
    return float((counts * (p - np.log2(f))).sum())


def entropy_bits(hist: np.ndarray) -> float:
    """Empirical entropy (total bits) of a histogram: ``sum(c * log2(N / c))``.

    Example:
        >>> entropy_bits(np.array([2, 2]))
        4.0
    """
    c = np.asarray(hist, dtype=np.float64).ravel()
    n = c.sum()
    c = c[c > 0]
    return float((c * np.log2(n / c)).sum()) if n > 0 else 0.0


def encode_tables(tables: np.ndarray, precision: int) -> np.ndarray:
    """Storage form of tables: ``uint16`` holding ``f - 1`` when ``P <= 16``, else ``uint32`` ``f``.

    Storing ``f - 1`` lets a 16-bit precision table (where one ``f`` may be 65535+1) fit 16 bits.

    Example:
        >>> encode_tables(np.array([[3, 1]], dtype=np.uint32), 2).tolist()
        [[2, 0]]
    """
    t = np.asarray(tables, dtype=np.uint32)
    if precision <= 16:
        return (t - 1).astype(np.uint16)
    return t.copy()


def decode_tables(stored: np.ndarray, precision: int) -> np.ndarray:
    """Inverse of :func:`encode_tables`; validates every table. Returns ``uint32`` ``[..., A]``.

    Example:
        >>> decode_tables(np.array([[2, 0]], dtype=np.uint16), 2).tolist()
        [[3, 1]]
    """
    s = np.asarray(stored)
    if not 1 <= int(precision) <= MAX_PRECISION:
        raise FormatError(f"table precision {precision} out of range [1, 24]")
    want = np.uint16 if precision <= 16 else np.uint32
    if s.dtype != want:
        raise FormatError(f"tables of precision {precision} must be stored as {np.dtype(want).name}, got {s.dtype}")
    t = s.astype(np.uint32) + (1 if precision <= 16 else 0)
    if t.ndim < 1 or t.shape[-1] < 2:
        raise FormatError(f"tables need >= 2 symbols, got shape {list(t.shape)}")
    if (t < 1).any():
        raise FormatError("a stored table has a zero frequency")
    sums = t.reshape(-1, t.shape[-1]).astype(np.uint64).sum(axis=1)
    if sums.size and not (sums == (1 << int(precision))).all():
        bad = int(np.nonzero(sums != (1 << int(precision)))[0][0])
        raise FormatError(f"stored table {bad} sums to {int(sums[bad])}, not 2**{precision}")
    return t
