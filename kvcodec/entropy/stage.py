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
from ..quant.packing import pack_bits
from .clustering import _cluster_tables, _histograms, _member_sums  # noqa: F401  (re-exported)
from .layout import (  # noqa: F401  (re-exported: kvcodec.entropy.stage is where callers look)
    ANS_STAGE_VERSION,
    FLAG_EXTERNAL_TABLES,
    FLAG_ROW_TABLE,
    MAX_CLASSES,
    MAX_THRESHOLD,
    _MODES,
    _SCOPES,
    StageLayout,
    add_prefix,
    ctx_row_table_bits,
    magnitude_classes,
    parse_planes,
    planes_nbits,
    take_prefix,
)
from .stage_reference import _decode_ctx_reference, _decode_reference, _encode_ctx_reference  # noqa: F401

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
    @staticmethod
    def checked_planes(planes: dict[str, np.ndarray], tables: np.ndarray | None = None,
                       row_table: np.ndarray | None = None, expected: tuple[int, int, int] | None = None,
                       ) -> tuple[StageLayout, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The validation :meth:`decode` does before decoding (``expected`` as there, checked
        first): what :func:`~kvcodec.entropy.layout.parse_planes` returns, for a decoder of
        its own (kvc's one-call native decode).

        Raises:
            FormatError: planes missing or inconsistent, or not of the expected geometry.
        """
        lay = None
        if expected is not None:
            if "meta" not in planes:
                raise FormatError("ANS stage plane 'meta' is missing")
            lay = StageLayout(planes["meta"])
            if (lay.R, lay.N, lay.A) != tuple(int(v) for v in expected):
                raise FormatError(f"ANS stage is [{lay.R}, {lay.N}] over {lay.A} symbols, expected "
                                  f"[{expected[0]}, {expected[1]}] over {expected[2]}")
        return parse_planes(planes, tables, row_table, lay)

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
        if layout not in ("rows", "tokens"):
            raise ConfigError(f"unknown layout {layout!r} (rows or tokens)")
        if method not in ("auto", "native", "constriction", "numpy", "reference"):
            raise ConfigError(f"unknown decode method {method!r}")
        lay, words, offsets, tsets, rts = self.checked_planes(planes, tables, row_table, expected)
        if method in ("auto", "native"):
            from .. import native

            if method == "native" or native.available():
                return native.decode_stage(lay, words, offsets, tsets, rts, layout=layout)
            method = "constriction"
        if lay.scope == 2:  # magnitude contexts: the pure-integer reference, or all streams in lockstep
            if method == "reference":
                out = _decode_ctx_reference(lay, words, offsets, tsets, rts)
            else:  # lockstep over streams pays off from ~80 streams (eval/results/ctx_fallback_speed.md)
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


def bits_per_symbol_bound(a: int) -> float:
    """Fixed-width bits per symbol for an alphabet of ``a`` symbols (the packing baseline)."""
    return float(max(1, math.ceil(math.log2(max(2, a)))))
