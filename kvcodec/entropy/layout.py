"""An ANS stage's geometry and planes: the ``meta`` layout, validation of the stored planes,
magnitude classes (formats/ANS.md §3, §3.1). No coding here: :mod:`.stage` codes, this reads.
"""

from __future__ import annotations


import numpy as np

from ..errors import FormatError
from .tables import MAX_PRECISION, decode_tables, encode_tables
from ..quant.packing import packed_nbytes, unpack_bits

ANS_STAGE_VERSION = 1
_SCOPES = {"all": 0, "chunk": 1, "ctx": 2}
MAX_CLASSES = 16  # scope 2: at most 15 thresholds
MAX_THRESHOLD = 1 << 16
_MODES = ("row", "shared", "cluster")
FLAG_EXTERNAL_TABLES = 1
FLAG_ROW_TABLE = 2


class StageLayout:
    """Geometry of a stage's streams, read from (and validated against) its ``meta`` plane.

    Attributes mirror formats/ANS.md §3: ``R, N, C, G, P, A, K, scope, flags``, plus
    ``n_chunks``, ``n_groups``, ``n_streams`` and ``n_sets``.
    """

    def __init__(self, meta: np.ndarray) -> None:
        m = np.asarray(meta)
        if m.dtype != np.uint32 or m.ndim != 1 or not 10 <= m.shape[0] <= 9 + MAX_CLASSES:
            raise FormatError(f"ANS meta plane must be uint32[10] (or [10 + Q - 1] with scope 2), "
                              f"got {m.dtype}{list(m.shape)}")
        vals = m.tolist()  # Python ints
        v, self.R, self.N, self.C, self.G, self.P, self.A, self.K, self.scope, self.flags = vals[:10]
        #: scope 2 (magnitude contexts): the class thresholds (eighths) and the class count Q
        self.thresholds = tuple(vals[10:])
        self.Q = len(self.thresholds) + 1
        self.center = (self.A - 1) // 2
        if v != ANS_STAGE_VERSION:
            raise FormatError(f"ANS stage version {v} is not supported (this reader knows {ANS_STAGE_VERSION})")
        if not 1 <= self.P <= MAX_PRECISION:
            raise FormatError(f"ANS table precision {self.P} outside [1, 24]")
        if not 2 <= self.A <= (1 << self.P):
            raise FormatError(f"ANS alphabet {self.A} outside [2, 2**P]")
        if self.C < 1 or self.G < 1 or self.K < 1 or self.scope not in (0, 1, 2) or self.flags > 3:
            raise FormatError(f"bad ANS meta {m.tolist()}")
        if (self.scope == 2) != (self.Q > 1):
            raise FormatError(f"ANS meta {m.tolist()}: thresholds go with scope 2 and scope 2 needs them")
        if self.scope == 2:
            th = self.thresholds
            if any(b <= a for a, b in zip(th, th[1:])) or th[-1] > MAX_THRESHOLD:
                raise FormatError(f"ANS context thresholds must increase and be <= {MAX_THRESHOLD}, got {list(th)}")
            if not self.flags & FLAG_ROW_TABLE or self.flags & FLAG_EXTERNAL_TABLES:
                raise FormatError("an ANS stage with magnitude contexts needs its own tables and a row_table")
        self.n_chunks = -(-self.N // self.C)
        self.n_groups = -(-self.R // self.G)
        self.n_streams = self.n_chunks * self.n_groups
        self.n_sets = self.n_chunks if self.scope == 1 else 1
        #: row tables: one per set, or one per class with scope 2
        self.n_row_sets = self.Q if self.scope == 2 else self.n_sets
        if not self.flags & FLAG_ROW_TABLE and self.K not in (1, self.R):
            raise FormatError(f"without row_table the table count K={self.K} must be 1 or R={self.R}")

    def stream(self, s: int) -> tuple[int, int, int, int]:
        """``(row0, row1, t0, t1)`` of stream ``s`` (chunk-major order)."""
        c, g = divmod(s, self.n_groups)
        return g * self.G, min(self.R, (g + 1) * self.G), c * self.C, min(self.N, (c + 1) * self.C)

    def symbol_counts(self) -> np.ndarray:
        """Symbols per stream (implied by the geometry), ``int64 [S]``."""
        out = np.empty(self.n_streams, dtype=np.int64)
        for s in range(self.n_streams):
            r0, r1, t0, t1 = self.stream(s)
            out[s] = (r1 - r0) * (t1 - t0)
        return out


def parse_planes(
    planes: dict[str, np.ndarray], tables: np.ndarray | None = None, row_table: np.ndarray | None = None,
    lay: StageLayout | None = None,
) -> tuple[StageLayout, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validate stage planes; return ``(layout, words, offsets int64, tables uint32 [n_sets, K, A],
    row_table int64 [n_sets, R])`` with the identity / zero rule already applied. ``lay``: the
    layout of ``planes["meta"]`` when the caller already read it."""
    for name in ("meta", "words", "offsets"):
        if name not in planes:
            raise FormatError(f"ANS stage plane {name!r} is missing")
    if lay is None:
        lay = StageLayout(planes["meta"])
    words, offsets = np.asarray(planes["words"]), np.asarray(planes["offsets"])
    if words.dtype != np.uint32 or words.ndim != 1:
        raise FormatError(f"ANS words must be uint32[W], got {words.dtype}{list(words.shape)}")
    if offsets.dtype != np.uint32 or offsets.shape != (lay.n_streams + 1,):
        raise FormatError(f"ANS offsets must be uint32[{lay.n_streams + 1}], got {offsets.dtype}{list(offsets.shape)}")
    off = offsets.astype(np.int64)
    if off.size <= 64:  # (a tensor's few streams: Python ints beat numpy's per-call cost)
        ol = off.tolist()
        bad = ol[0] != 0 or ol[-1] != len(words) or any(b < a for a, b in zip(ol, ol[1:]))
    else:
        bad = off[0] != 0 or off[-1] != len(words) or bool((np.diff(off) < 0).any())
    if bad:
        raise FormatError("ANS offsets must start at 0, never decrease and end at len(words)")
    if lay.flags & FLAG_EXTERNAL_TABLES:
        if tables is None:
            raise FormatError("this ANS stage uses external (file-level) tables, but none were given")
        t = np.asarray(tables, dtype=np.uint32)[None]
        rt_in = row_table
    else:
        if "tables" not in planes:
            raise FormatError("ANS stage plane 'tables' is missing")
        t = decode_tables(planes["tables"], lay.P)
        rt_in = planes.get("row_table")
    if t.shape != (lay.n_sets, lay.K, lay.A):
        raise FormatError(f"ANS tables have shape {list(t.shape)}, expected {[lay.n_sets, lay.K, lay.A]}")
    if lay.flags & FLAG_EXTERNAL_TABLES:
        decode_tables(encode_tables(t, lay.P), lay.P)
    if lay.flags & FLAG_ROW_TABLE:
        if rt_in is None:
            raise FormatError("ANS stage needs a row_table plane")
        rt = np.asarray(rt_in)
        if lay.scope == 2 and not lay.flags & FLAG_EXTERNAL_TABLES:
            # §3.1: the [Q, R] indices bit-packed, ctx_row_table_bits(K) bits each, LSB first
            b = ctx_row_table_bits(lay.K)
            if rt.dtype != np.uint8 or rt.ndim != 1:
                raise FormatError(f"ANS row_table of a scope-2 stage must be uint8[{packed_nbytes(lay.Q * lay.R, b)}] "
                                  f"(bit-packed), got {rt.dtype}{list(rt.shape)}")
            rt = unpack_bits(rt, b, lay.Q * lay.R).reshape(lay.Q, lay.R)
        elif not lay.flags & FLAG_EXTERNAL_TABLES:
            # formats/ANS.md §3: the stored plane is uint8 when K <= 256, else uint16, [n_sets, R]
            want = np.uint8 if lay.K <= 256 else np.uint16
            if rt.dtype != want or rt.shape != (lay.n_sets, lay.R):
                raise FormatError(f"ANS row_table must be {np.dtype(want)}[{lay.n_sets}, {lay.R}] (K = {lay.K}), "
                                  f"got {rt.dtype}{list(rt.shape)}")
        if rt.ndim == 1:
            rt = rt[None]
        if rt.dtype.kind not in "ui" or rt.shape != (lay.n_row_sets, lay.R):
            raise FormatError(f"ANS row_table must be [{lay.n_row_sets}, {lay.R}] integers, "
                              f"got {rt.dtype}{list(rt.shape)}")
        rt = rt.astype(np.int64)
        if rt.size and (int(rt.min()) < 0 or int(rt.max()) >= lay.K):
            raise FormatError(f"ANS row_table has an index outside [0, {lay.K})")
    else:
        rt = np.broadcast_to(np.arange(lay.R) if lay.K == lay.R else np.zeros(lay.R, np.int64), (lay.n_sets, lay.R))
    return lay, words, off, t, rt


def ctx_row_table_bits(k: int) -> int:
    """Bits per entry of a scope-2 stage's bit-packed row table (formats/ANS.md §3.1):
    ``max(1, ceil(log2 K))``.

    Example:
        >>> [ctx_row_table_bits(k) for k in (1, 2, 3, 8, 9, 256, 257)]
        [1, 1, 2, 3, 4, 8, 9]
    """
    return max(1, (int(k) - 1).bit_length())


def magnitude_classes(x: np.ndarray, g: int, thresholds: list[int], center: int) -> np.ndarray:
    """The class of every symbol of ``x[R, N]`` under scope 2 (formats/ANS.md §3.1), ``uint8``.

    Row ``r`` is row ``k = r mod G`` of its stream; its class at token ``t`` is 0 when ``k = 0``,
    else the number of thresholds ``T_i`` with ``8 * a >= T_i * k``, where ``a`` is the sum of
    ``|x - center|`` over the rows above it in its stream at token ``t``.

    Example:
        >>> magnitude_classes(np.array([[3, 0], [2, 2], [2, 2]]), 3, [4, 12], 2).tolist()
        [[0, 0], [1, 2], [1, 1]]
    """
    x = np.asarray(x, dtype=np.int64)
    r, n = x.shape
    mag = np.abs(x - int(center))
    k = np.arange(r, dtype=np.int64) % g
    cum = np.cumsum(mag, axis=0)
    start = np.arange(r) - k  # first row of each row's stream
    above = np.where((start > 0)[:, None], cum[np.maximum(start - 1, 0)], 0)  # sums of earlier streams' rows
    acc = cum - mag - above  # sums over the rows above in the same stream
    a8 = 8 * acc
    cls = np.zeros((r, n), dtype=np.uint8)
    for t_i in thresholds:
        cls += (a8 >= int(t_i) * k[:, None]) & (k[:, None] > 0)
    return cls


def planes_nbits(planes: dict[str, np.ndarray]) -> int:
    """Total bits of a dict of planes."""
    return sum(8 * int(np.asarray(p).nbytes) for p in planes.values())


def add_prefix(planes: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """Rename stage planes for a codec's plane namespace (container plane names allow
    ``[A-Za-z0-9_]``, so prefixes look like ``"ans_"``)."""
    return {prefix + k: v for k, v in planes.items()}


def take_prefix(planes: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The stage planes stored under ``prefix`` (inverse of :func:`add_prefix`)."""
    return {k[len(prefix):]: v for k, v in planes.items() if k.startswith(prefix)}
