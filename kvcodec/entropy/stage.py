"""The entropy stage: code an integer symbol matrix as many independent ANS streams with an index.

Usable after any integer quantizer (KIVI codes, delta codes, CacheGen bins): give it
``symbols[R, N]`` (row = one distribution unit, usually a channel; column = token) and it returns
named planes (formats/ANS.md §3): ``meta``, ``words``, ``offsets``, ``tables`` and, when tables are
shared, ``row_table``. Streams are cut per token chunk (``chunk``) and per group of
``rows_per_stream`` rows, so many decoders can run in parallel (one GPU thread per stream).

Table modes (``tables``):

- ``"row"``: one table per row (per distribution unit), the CacheGen choice.
- ``"shared"``: one table for all rows.
- ``"cluster"``: ``n_tables`` tables shared by rows with similar distributions (KL k-means on the
  row histograms), plus one byte per row naming its table — small side information.

``scope`` is ``"all"`` (one table set for the whole matrix), ``"chunk"`` (a new set per token
chunk, as LMCache ships a CDF per chunk) or ``"ctx"`` (magnitude contexts, formats/ANS.md §3.1:
one table set, and each symbol's table is chosen by its row and by the *class* of the mean
magnitude of the symbols above it in its stream at the same token — ``thresholds`` in eighths;
encoder and decoder both compute the class from symbols already coded, so it costs nothing but a
``row_table`` per class. Codes whose scale varies across tokens, such as per-token steps set by
attention, then stop paying for a mixture of scales in every row's table). Tables may also be *external*: fitted once per file
(:meth:`EntropyStage.fit_tables`, stored by the codec in ``encode_globals``) and passed to both
:meth:`EntropyStage.encode` and :meth:`EntropyStage.decode`.

Example:
    >>> import numpy as np
    >>> from kvcodec.entropy import EntropyStage
    >>> x = np.random.default_rng(0).integers(0, 4, size=(6, 100))
    >>> st = EntropyStage(precision=10, chunk=64)
    >>> planes = st.encode(x, alphabet=4)
    >>> sorted(planes), planes["offsets"].shape
    (['meta', 'offsets', 'tables', 'words'], (13,))
    >>> bool((st.decode(planes) == x).all())
    True
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import numpy as np

from ..errors import ConfigError, FormatError, InputError, StreamError
from .ans import _AnsCoder, _need, constriction_models
from .tables import MAX_PRECISION, build_tables, decode_tables, encode_tables
from ..quant.packing import pack_bits, packed_nbytes, unpack_bits

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
        v, self.R, self.N, self.C, self.G, self.P, self.A, self.K, self.scope, self.flags = (int(x) for x in m[:10])
        #: scope 2 (magnitude contexts): the class thresholds (eighths) and the class count Q
        self.thresholds = tuple(int(x) for x in m[10:])
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


class EntropyStage:
    """Entropy stage with a JSON config; see the module docstring.

    Args:
        precision: table precision ``P`` (bits, 1..24). 12 costs < 0.1% over exact tables on
            KV codes; 16 mirrors LMCache's 16-bit CDFs.
        chunk: tokens per stream (``0`` = all tokens in one chunk).
        rows_per_stream: rows (channels) per stream.
        tables: ``"row"``, ``"shared"`` or ``"cluster"``.
        n_tables: tables per set in ``"cluster"`` mode.
        scope: ``"all"``, ``"chunk"`` or ``"ctx"``.
        thresholds: with ``scope="ctx"``, 1..15 increasing integers (eighths of a symbol
            magnitude): the class boundaries of formats/ANS.md §3.1.
    """

    defaults: dict[str, Any] = {
        "precision": 12, "chunk": 4096, "rows_per_stream": 1, "tables": "row", "n_tables": 16, "scope": "all",
        "thresholds": [],
    }

    def __init__(self, **config: Any) -> None:
        unknown = set(config) - set(self.defaults)
        if unknown:
            raise ConfigError(f"entropy stage has no parameter(s) {sorted(unknown)}; known: {sorted(self.defaults)}")
        cfg = {**copy.deepcopy(self.defaults), **config}
        for k in ("precision", "chunk", "rows_per_stream", "n_tables"):
            if not isinstance(cfg[k], int) or isinstance(cfg[k], bool):
                raise ConfigError(f"entropy stage: {k} must be an integer, got {cfg[k]!r}")
        if not 1 <= cfg["precision"] <= MAX_PRECISION:
            raise ConfigError(f"entropy stage: precision must be in [1, 24], got {cfg['precision']}")
        if cfg["chunk"] < 0 or cfg["rows_per_stream"] < 1 or not 1 <= cfg["n_tables"] <= 65535:
            raise ConfigError(f"entropy stage: bad chunk / rows_per_stream / n_tables in {cfg}")
        if cfg["tables"] not in _MODES:
            raise ConfigError(f"entropy stage: tables must be one of {_MODES}, got {cfg['tables']!r}")
        if cfg["scope"] not in _SCOPES:
            raise ConfigError(f"entropy stage: scope must be 'all', 'chunk' or 'ctx', got {cfg['scope']!r}")
        th = cfg["thresholds"]
        if not isinstance(th, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in th):
            raise ConfigError(f"entropy stage: thresholds must be a list of integers, got {th!r}")
        if cfg["scope"] == "ctx":
            if not 1 <= len(th) < MAX_CLASSES or th[0] < 0 or th[-1] > MAX_THRESHOLD or any(
                    b <= a for a, b in zip(th, th[1:])):
                raise ConfigError(f"entropy stage: scope 'ctx' needs 1..{MAX_CLASSES - 1} increasing thresholds "
                                  f"in [0, {MAX_THRESHOLD}], got {th}")
            if cfg["tables"] == "row":
                raise ConfigError("entropy stage: scope 'ctx' needs tables 'cluster' or 'shared'")
        elif th:
            raise ConfigError("entropy stage: thresholds are only for scope 'ctx'")
        self.config = cfg

    def get_config(self) -> dict[str, Any]:
        return dict(self.config)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "EntropyStage":
        return cls(**config)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EntropyStage) and other.config == self.config

    def __repr__(self) -> str:
        return f"EntropyStage(**{json.dumps(self.config, sort_keys=True)})"

    # ------------------------------------------------------------------ tables
    def fit_tables(self, symbols: np.ndarray, alphabet: int, layout: str = "rows") -> tuple[np.ndarray, np.ndarray | None]:
        """Fit one table set to ``symbols[R, N]`` (``[N, R]`` with ``layout="tokens"``): returns
        ``(tables uint32 [K, A], row_table)``.

        ``row_table`` is ``None`` for ``"row"``/``"shared"`` modes (identity / all zero), else
        ``uint8``/``uint16 [R]``.
        """
        hist = _histograms(symbols, int(alphabet), layout)
        r = hist.shape[0]
        p = self.config["precision"]
        mode = self.config["tables"]
        if mode == "shared" or (mode == "cluster" and r <= 1):
            return build_tables(hist.sum(axis=0, keepdims=True), p), None
        if mode == "row" or r <= self.config["n_tables"]:  # as many tables as rows: no index needed
            return build_tables(hist, p), None
        return _cluster_tables(hist, self.config["n_tables"], p)

    # ------------------------------------------------------------------ encode
    def encode(
        self,
        symbols: np.ndarray,
        alphabet: int | None = None,
        tables: np.ndarray | None = None,
        row_table: np.ndarray | None = None,
        method: str = "auto",
        layout: str = "rows",
        ctx_stats: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """Code ``symbols[R, N]`` (integers in ``[0, alphabet)``); return the planes.

        Args:
            symbols: 2-D integer array, row = distribution unit, column = token.
            alphabet: alphabet size ``A`` (default ``max(2, max + 1)``).
            tables: external tables ``uint32 [K, A]`` of this stage's precision (stored by the
                caller, e.g. once per file); then ``row_table`` gives each row's table (or the
                identity / all-zero rule of formats/ANS.md applies).
            row_table: with external tables, the table index of each row ``[R]``.
            method: ``"auto"`` (the native C coder when it builds, else constriction),
                ``"native"`` or ``"constriction"``; every method gives identical bytes.
            layout: ``"rows"`` (``symbols`` is ``[R, N]``) or ``"tokens"`` (``[N, R]``, the cache's
                token-major order: no transposing copy on the native path).
            ctx_stats: scope ``"ctx"``, native path only: ``(counts, classes)`` of these symbols
                exactly as :func:`kvcodec.native.ctx_histograms` (``classes=True``) returns them,
                taken by the caller in a pass it makes anyway (kvc's escape split); then they are
                not counted again. Wrong statistics make wrong tables: pass only the real ones.

        Raises:
            InputError: symbols not 2-D integers in range.
        """
        _need()
        if method not in ("auto", "native", "constriction"):
            raise ConfigError(f"unknown encode method {method!r}")
        if layout not in ("rows", "tokens"):
            raise ConfigError(f"unknown layout {layout!r} (rows or tokens)")
        x = np.asarray(symbols)
        if x.ndim != 2 or (x.size and x.dtype.kind not in "iu"):
            raise InputError(f"entropy stage needs a 2-D integer symbol array, got {x.dtype}{list(x.shape)}")
        from .. import native

        use_native = method == "native" or (method == "auto" and native.available())
        if not use_native:
            if layout == "tokens":
                x = x.T
            layout = "rows"
            x = np.ascontiguousarray(x, dtype=np.int32)
        r, n = x.shape if layout == "rows" else x.shape[::-1]
        p = self.config["precision"]
        if alphabet is None or not use_native:
            lo, hi = (int(x.min()), int(x.max())) if x.size else (0, 0)
        else:  # the native histogram / encoder check the range themselves
            lo, hi = 0, 0
        a = max(2, hi + 1) if alphabet is None else int(alphabet)
        if lo < 0 or hi >= a or a < 2 or a > (1 << p):
            raise InputError(f"symbols must lie in [0, {a}) with 2 <= A <= 2**{p}; got range [{lo}, {hi}]")
        try:
            return self._encode(x, r, n, a, tables, row_table, use_native, layout, ctx_stats)
        except StreamError as e:
            raise InputError(f"entropy stage: {e}") from None

    def _encode(self, x, r, n, a, tables, row_table, use_native, layout, ctx_stats=None) -> dict[str, np.ndarray]:
        cfg = self.config
        p = cfg["precision"]
        c = cfg["chunk"] if cfg["chunk"] > 0 else max(1, n)
        g = cfg["rows_per_stream"]
        n_chunks, n_groups = -(-n // c), -(-r // g)
        flags = 0
        if cfg["scope"] == "ctx":
            if tables is not None:
                raise ConfigError("scope 'ctx' fits its own tables (no external tables)")
            return self._encode_ctx(x, r, n, a, c, g, n_chunks, n_groups, use_native, layout, ctx_stats)
        if tables is not None:
            if cfg["scope"] != "all":
                raise ConfigError("external tables need scope 'all'")
            t = np.asarray(tables, dtype=np.uint32)
            if t.ndim != 2 or t.shape[1] != a:
                raise InputError(f"external tables must be [K, {a}], got {list(t.shape)}")
            decode_tables(encode_tables(t, p), p)  # validates precision and sums
            sets = [(t, None if row_table is None else np.asarray(row_table))]
            flags |= FLAG_EXTERNAL_TABLES
        elif cfg["scope"] == "all":
            sets = [self.fit_tables(x, a, layout)]
        elif cfg["tables"] == "row" or (cfg["tables"] == "cluster" and r <= cfg["n_tables"]):
            # a table per row per chunk: every chunk's histograms, then all tables in one call
            hists = [_histograms(x[:, i * c:(i + 1) * c] if layout == "rows" else x[i * c:(i + 1) * c], a, layout)
                     for i in range(n_chunks)]
            tabs = build_tables(np.concatenate(hists), p).reshape(n_chunks, r, a) if hists else []
            sets = [(t, None) for t in tabs]
        else:
            sets = [self.fit_tables(x[:, i * c:(i + 1) * c] if layout == "rows" else x[i * c:(i + 1) * c], a, layout)
                    for i in range(n_chunks)]
        if sets:
            k = int(sets[0][0].shape[0])
        else:  # no chunks (N = 0): the table count the mode would give
            mode = cfg["tables"]
            k = 1 if mode == "shared" or r <= 1 else (min(r, cfg["n_tables"]) if mode == "cluster" else r)
            if mode == "cluster" and r > cfg["n_tables"]:
                flags |= FLAG_ROW_TABLE
        k = max(1, k)
        rts = []
        for tset, rt in sets:
            if rt is not None:
                rt = np.asarray(rt)
                if rt.shape != (r,) or (rt.size and (int(rt.min()) < 0 or int(rt.max()) >= len(tset))):
                    raise InputError(f"row_table must be [{r}] indices into {len(tset)} tables")
                flags |= FLAG_ROW_TABLE
            elif len(tset) not in (1, r):
                raise InputError(f"{len(tset)} tables for {r} rows need a row_table")
            rts.append(rt)
        if flags & FLAG_ROW_TABLE:
            rts = [np.arange(r) if (rt is None and k == r) else (np.zeros(r, np.int64) if rt is None else rt) for rt in rts]
        meta = np.array([ANS_STAGE_VERSION, r, n, c, g, p, a, k, _SCOPES[cfg["scope"]], flags], dtype=np.uint32)
        if sets and use_native:
            from .. import native

            lay = StageLayout(meta)
            tsets = np.stack([np.asarray(t, dtype=np.uint32) for t, _ in sets])
            rows = np.stack([(np.arange(r) if len(t) == r else np.zeros(r, np.int64)) if rt is None else rt
                             for (t, _), rt in zip(sets, rts)])
            w_all, offsets = native.encode_stage(lay, x, tsets, rows, layout=layout)
            return self._planes(meta, w_all, offsets, sets, rts, flags, k, r, a, p)
        # index of each (set, row) into the flat list of models
        models = [constriction_models(tset) for tset, _ in sets]
        words: list[np.ndarray] = []
        offsets = np.zeros(n_chunks * n_groups + 1, dtype=np.int64)
        s = 0
        rtl = [(list(range(r)) if len(models[i]) == r else [0] * r) if rt is None else [int(v) for v in rt]
               for i, rt in enumerate(rts)]
        for ci in range(n_chunks):
            t0, t1 = ci * c, min(n, (ci + 1) * c)
            si = 0 if cfg["scope"] == "all" else ci
            rt = rtl[si]
            ms = models[si]
            for gi in range(n_groups):
                coder = _AnsCoder()
                for row in range(min(r, (gi + 1) * g) - 1, gi * g - 1, -1):
                    coder.encode_reverse(x[row, t0:t1], ms[rt[row]])
                w = coder.get_compressed()
                words.append(w)
                s += 1
                offsets[s] = offsets[s - 1] + len(w)
        w_all = np.concatenate(words).astype(np.uint32) if words else np.zeros(0, np.uint32)
        return self._planes(meta, w_all, offsets, sets, rts, flags, k, r, a, p)

    def _encode_ctx(self, x, r, n, a, c, g, n_chunks, n_groups, use_native, layout,
                    ctx_stats=None) -> dict[str, np.ndarray]:
        """Scope 2: fit one table set to the (row, class) histograms, code each symbol with the
        table of its row and class (formats/ANS.md §3.1)."""
        cfg = self.config
        p, th = cfg["precision"], list(cfg["thresholds"])
        q = len(th) + 1
        xr = x if layout == "rows" else x.T  # a view: [R, N]
        # histograms of the virtual rows (class, row): row q * R + r
        if use_native and ctx_stats is not None:
            hist, cls = ctx_stats
            if hist.shape != (q * r, a) or cls.shape != x.shape or cls.dtype != np.uint8:
                raise InputError(f"ctx_stats must be counts [{q * r}, {a}] and uint8 classes {list(x.shape)}")
        elif use_native:
            from .. import native

            # the classes go to the encoder, which reads them (and token-major symbols) in place
            hist, cls = native.ctx_histograms(x, a, layout, g, th, classes=True)
        else:
            cls = magnitude_classes(xr, g, th, (a - 1) // 2)  # uint8 [R, N]
            vr = (cls.astype(np.int64) * r + np.arange(r, dtype=np.int64)[:, None]) * a + xr
            hist = np.bincount(vr.ravel(), minlength=q * r * a).reshape(q * r, a)
        if cfg["tables"] == "shared" or q * r <= 1:
            tabs, rt = build_tables(hist.sum(axis=0, keepdims=True), p), np.zeros(q * r, np.int64)
        else:
            tabs, rt = _cluster_tables(hist, min(cfg["n_tables"], q * r), p)
        k = int(tabs.shape[0])
        rt = np.asarray(rt, dtype=np.int64).reshape(q, r)
        flags = FLAG_ROW_TABLE
        meta = np.array([ANS_STAGE_VERSION, r, n, c, g, p, a, k, _SCOPES["ctx"], flags, *th], dtype=np.uint32)
        lay = StageLayout(meta)
        if n and use_native:
            from .. import native

            w_all, offsets = native.encode_stage(lay, x, tabs[None], rt, layout=layout, classes=cls)
        else:
            cls = magnitude_classes(xr, g, th, (a - 1) // 2)
            w_all, offsets = _encode_ctx_reference(lay, np.ascontiguousarray(xr), tabs, rt, cls)
        planes = {"meta": meta, "words": w_all, "offsets": offsets.astype(np.uint32),
                  "tables": encode_tables(tabs[None], p),
                  "row_table": pack_bits(rt, ctx_row_table_bits(k))}  # §3.1: bit-packed [Q, R]
        if int(offsets[-1]) >= 1 << 32:
            raise InputError("entropy stage output exceeds 2**32 words; use smaller tensors")
        return planes

    @staticmethod
    def _planes(meta, w_all, offsets, sets, rts, flags, k, r, a, p) -> dict[str, np.ndarray]:
        if int(offsets[-1]) >= 1 << 32:
            raise InputError("entropy stage output exceeds 2**32 words; use smaller tensors")
        planes = {"meta": meta, "words": w_all, "offsets": offsets.astype(np.uint32)}
        if not flags & FLAG_EXTERNAL_TABLES:
            tab = np.stack([t for t, _ in sets]) if sets else np.ones((0, k, a), np.uint32)
            planes["tables"] = encode_tables(tab, p)
        if flags & FLAG_ROW_TABLE and not flags & FLAG_EXTERNAL_TABLES:
            rtab = np.stack(rts) if rts else np.zeros((0, r), np.int64)
            planes["row_table"] = rtab.astype(np.uint8 if k <= 256 else np.uint16)
        return planes

    # ------------------------------------------------------------------ decode
    def decode(
        self,
        planes: dict[str, np.ndarray],
        tables: np.ndarray | None = None,
        row_table: np.ndarray | None = None,
        method: str = "auto",
        expected: tuple[int, int, int] | None = None,
        layout: str = "rows",
    ) -> np.ndarray:
        """Decode the planes back to ``int32 [R, N]``.

        Args:
            planes: the planes from :meth:`encode` (read from a file: validated here).
            tables, row_table: the external tables, if the stage was encoded with them.
            method: ``"auto"`` (the native C decoder when it builds, else constriction),
                ``"native"``, ``"constriction"``, ``"numpy"`` (vectorised across streams) or
                ``"reference"`` (the pure-integer spec; slow). All give identical results.
            expected: ``(R, N, A)`` the caller knows from elsewhere (the manifest's tensor
                shape): checked before anything is allocated, so a forged ``meta`` cannot make
                the decoder allocate ``R * N`` symbols it was never meant to.
            layout: ``"rows"`` returns ``int32 [R, N]``; ``"tokens"`` the transpose ``[N, R]`` as
                ``uint8`` (``A <= 256``), ``uint16`` (``A <= 65536``) or ``int32`` — the codecs'
                token-major order, which the native decoder writes directly.

        Raises:
            FormatError: planes missing or inconsistent. StreamError: a stream is corrupt or not
            consumed exactly.
        """
        if expected is not None:
            if "meta" not in planes:
                raise FormatError("ANS stage plane 'meta' is missing")
            lay = StageLayout(planes["meta"])
            if (lay.R, lay.N, lay.A) != tuple(int(v) for v in expected):
                raise FormatError(f"ANS stage is [{lay.R}, {lay.N}] over {lay.A} symbols, expected "
                                  f"[{expected[0]}, {expected[1]}] over {expected[2]}")
        if layout not in ("rows", "tokens"):
            raise ConfigError(f"unknown layout {layout!r} (rows or tokens)")
        if method not in ("auto", "native", "constriction", "numpy", "reference"):
            raise ConfigError(f"unknown decode method {method!r}")
        lay, words, offsets, tsets, rts = parse_planes(planes, tables, row_table)
        if method in ("auto", "native"):
            from .. import native

            if method == "native" or native.available():
                return native.decode_stage(lay, words, offsets, tsets, rts, layout=layout)
            method = "constriction"
        if lay.scope == 2:  # magnitude contexts: the pure-integer reference, or all streams in lockstep
            if method == "reference":
                out = _decode_ctx_reference(lay, words, offsets, tsets, rts)
            else:  # lockstep over streams pays off from ~80 streams (0.36 vs 0.49 us/symbol at 98)
                from .ans_vec import decode_ctx_fast, decode_stage_fast

                many = lay.n_streams >= 80 or method == "numpy"
                out = (decode_stage_fast if many else decode_ctx_fast)(lay, words, offsets, tsets, rts)
        else:
            out = self._decode_rows(lay, words, offsets, tsets, rts, method)
        if layout == "rows":
            return out
        dt = np.uint8 if lay.A <= 256 else np.uint16 if lay.A <= 65536 else np.int32
        return np.ascontiguousarray(out.astype(dt).T)

    @staticmethod
    def _decode_rows(lay, words, offsets, tsets, rts, method) -> np.ndarray:
        if method == "reference":
            return _decode_reference(lay, words, offsets, tsets, rts)
        if method == "numpy":
            from .ans_vec import decode_stage_fast

            return decode_stage_fast(lay, words, offsets, tsets, rts)
        _need()
        out = np.zeros((lay.R, lay.N), dtype=np.int32)
        models = [constriction_models(tset) for tset in tsets]
        # plain Python ints and lists in the hot loop: numpy scalar indexing costs more than a decode
        off = offsets.tolist()
        rtl = [r.tolist() for r in np.asarray(rts)]
        s = 0
        for ci in range(lay.n_chunks):
            t0, t1 = ci * lay.C, min(lay.N, (ci + 1) * lay.C)
            nt = t1 - t0
            si = 0 if lay.scope == 0 else ci
            rt, ms = rtl[si], models[si]
            for r0 in range(0, lay.R, lay.G):
                try:
                    coder = _AnsCoder(words[off[s]:off[s + 1]])
                except ValueError as e:
                    raise StreamError(f"ANS stream {s}: {e}") from None
                for row in range(r0, min(lay.R, r0 + lay.G)):
                    out[row, t0:t1] = coder.decode(ms[rt[row]], nt)
                if not coder.is_empty():
                    raise StreamError(f"ANS stream {s} not consumed exactly (corrupt or wrong index)")
                s += 1
        return out


def parse_planes(
    planes: dict[str, np.ndarray], tables: np.ndarray | None = None, row_table: np.ndarray | None = None
) -> tuple[StageLayout, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Validate stage planes; return ``(layout, words, offsets int64, tables uint32 [n_sets, K, A],
    row_table int64 [n_sets, R])`` with the identity / zero rule already applied."""
    for name in ("meta", "words", "offsets"):
        if name not in planes:
            raise FormatError(f"ANS stage plane {name!r} is missing")
    lay = StageLayout(planes["meta"])
    words, offsets = np.asarray(planes["words"]), np.asarray(planes["offsets"])
    if words.dtype != np.uint32 or words.ndim != 1:
        raise FormatError(f"ANS words must be uint32[W], got {words.dtype}{list(words.shape)}")
    if offsets.dtype != np.uint32 or offsets.shape != (lay.n_streams + 1,):
        raise FormatError(f"ANS offsets must be uint32[{lay.n_streams + 1}], got {offsets.dtype}{list(offsets.shape)}")
    off = offsets.astype(np.int64)
    if off[0] != 0 or off[-1] != len(words) or (np.diff(off) < 0).any():
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
    from .ans_ref import CODER_PRECISION, _cdf

    pmask, low = (1 << CODER_PRECISION) - 1, 1 << 32
    cdfs = [_cdf(t) for t in tsets[0]]
    out = np.zeros((lay.R, lay.N), dtype=np.int32)
    for s in range(lay.n_streams):
        r0, r1, t0, t1 = lay.stream(s)
        w = [int(v) for v in words[offsets[s]:offsets[s + 1]]]
        pos, state = len(w), 0
        if pos:
            state, pos = w[pos - 1], pos - 1
            if state == 0:
                raise StreamError(f"ANS stream {s}: ANS stream ends in a zero word")
            if pos and state < low:
                state, pos = (state << 32) | w[pos - 1], pos - 1
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


def side_info_bits(planes: dict[str, np.ndarray], external_bits: int = 0) -> dict[str, int]:
    """Bits of each plane of a stage: ``words`` (payload) and the side information
    (``meta``, ``offsets``, ``tables``, ``row_table``); ``external_bits`` adds amortised file-level
    tables. ``side`` sums the side information.

    Example:
        >>> st = EntropyStage(chunk=8)
        >>> b = side_info_bits(st.encode(np.zeros((2, 16), np.int32), alphabet=4))
        >>> b["offsets"], b["tables"], b["side"]
        (160, 128, 608)
    """
    out = {k: 8 * int(np.asarray(planes[k]).nbytes) if k in planes else 0
           for k in ("words", "meta", "offsets", "tables", "row_table")}
    out["external"] = int(external_bits)
    out["side"] = out["meta"] + out["offsets"] + out["tables"] + out["row_table"] + out["external"]
    return out


def ideal_bits(symbols: np.ndarray, planes: dict[str, np.ndarray], tables: np.ndarray | None = None,
               row_table: np.ndarray | None = None) -> float:
    """Empirical code length ``Σ (P − log2 f[s])`` of ``symbols`` under the coded tables: the
    bound the ``words`` plane should be within ~1% of."""
    lay, _, _, tsets, rts = parse_planes(planes, tables, row_table)
    x = np.asarray(symbols, dtype=np.int64)
    total = 0.0
    if lay.scope == 2:  # per symbol: the table of its row and magnitude class
        cls = magnitude_classes(x, lay.G, list(lay.thresholds), lay.center).astype(np.int64)
        logf = np.log2(tsets[0].astype(np.float64))
        tab = np.asarray(rts)[cls, np.arange(lay.R)[:, None]]
        return float((lay.P - logf[tab, x]).sum())
    for si in range(lay.n_sets):
        t0, t1 = (0, lay.N) if lay.scope == 0 else (si * lay.C, min(lay.N, (si + 1) * lay.C))
        logf = np.log2(tsets[si].astype(np.float64))  # [K, A]
        rows = rts[si]
        total += float((lay.P - logf[rows[:, None], x[:, t0:t1]]).sum())
    return total


def _histograms(symbols: np.ndarray, a: int, layout: str) -> np.ndarray:
    """``int64 [R, A]`` counts of each row's symbols (native when available, else numpy)."""
    from .. import native

    try:
        return native.histograms(symbols, a, layout)
    except native.Unsupported:
        pass
    x = np.asarray(symbols)
    if layout == "tokens":
        x = x.T
    r = x.shape[0]
    flat = (np.arange(r, dtype=np.int64)[:, None] * a + x).ravel()
    return np.bincount(flat, minlength=r * a).reshape(r, a)


def _member_sums(h: np.ndarray, assign: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-cluster sums of the rows of ``h`` (float64 counts) and which clusters have members.

    One weighted bincount, not a matrix product: the sums of integer counts are exact in any
    order, and a wide product would start BLAS threads that crawl on a busy machine."""
    from .. import native

    try:
        return native.member_sums(h, assign, k)
    except native.Unsupported:
        pass
    r, a = h.shape
    idx = (assign.astype(np.int64)[:, None] * a + np.arange(a)).ravel()
    sums = np.bincount(idx, weights=h.ravel(), minlength=k * a).reshape(k, a)
    return sums, np.bincount(assign, minlength=k) > 0


def _cluster_tables(hist: np.ndarray, k: int, precision: int) -> tuple[np.ndarray, np.ndarray]:
    """KL k-means of row histograms into ``k`` shared tables (deterministic).

    Cost of coding row ``r`` with distribution ``q`` is ``-Σ h[r,a] log q[a]`` (its code length),
    so assigning each row to the cheapest table and re-estimating tables from member histograms
    never increases the total code length.
    """
    h = hist.astype(np.float64)
    r, a = h.shape
    # deterministic init: rows spread evenly over the order of their mean symbol and spread
    mean = (h @ np.arange(a, dtype=np.float64)) / np.maximum(h.sum(1), 1)
    order = np.lexsort((np.arange(r), mean))
    centers = h[order[np.linspace(0, r - 1, k).round().astype(int)]] + 0.5
    assign = np.zeros(r, dtype=np.int64)
    for _ in range(8):
        q = centers / centers.sum(1, keepdims=True)
        gain = h @ np.log(q).T  # [r, k]: minus each row's code length with each table (in nats)
        new = gain.argmax(1)
        if _ and (new == assign).all():
            break
        assign = new
        sums, used = _member_sums(h, assign, k)  # (the first pass always gets here)
        centers = np.where(used[:, None], sums + 0.5, centers)
    # sums and used are those of the final assignment; empty clusters keep a table (from all
    # rows) so every chunk's set has exactly k tables
    th = np.where(used[:, None], sums, h.sum(0)[None, :]).astype(np.int64)
    return build_tables(th, precision), assign.astype(np.uint8 if k <= 256 else np.uint16)


def planes_nbits(planes: dict[str, np.ndarray]) -> int:
    """Total bits of a dict of planes."""
    return sum(8 * int(np.asarray(p).nbytes) for p in planes.values())


def bits_per_symbol_bound(a: int) -> float:
    """Fixed-width bits per symbol for an alphabet of ``a`` symbols (the packing baseline)."""
    return float(max(1, math.ceil(math.log2(max(2, a)))))


def add_prefix(planes: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """Rename stage planes for a codec's plane namespace (container plane names allow
    ``[A-Za-z0-9_]``, so prefixes look like ``"ans_"``)."""
    return {prefix + k: v for k, v in planes.items()}


def take_prefix(planes: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The stage planes stored under ``prefix`` (inverse of :func:`add_prefix`)."""
    return {k[len(prefix):]: v for k, v in planes.items() if k.startswith(prefix)}
