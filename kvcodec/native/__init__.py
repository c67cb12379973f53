"""Native CPU coder: the ANS stage encoder and decoder in C (kvcodec/native/kvc_cpu.c).

The C source ships inside the package. On first use it is compiled with the system C compiler
(``$CC``, else ``cc``/``gcc``/``clang``) into a shared library cached under
``$KVCODEC_CACHE_DIR/native`` (default ``~/.cache/kvcodec/native``), keyed by the source, the
compiler's version and the flags, and loaded with :mod:`ctypes` — no build step at install time,
no Python headers, no extra dependency. Its output is bit-identical to the executable spec
(:mod:`kvcodec.entropy.ans_ref`; tests/test_native.py), so it is purely a speed-up: when no
compiler is available, kvcodec falls back to constriction and numpy with the same results.

``KVCODEC_NATIVE`` controls it: ``auto`` (default: use it when it builds), ``0`` (never),
``1`` (require it: :func:`lib` raises :class:`~kvcodec.errors.DependencyError` if it cannot build).

Example:
    >>> from kvcodec import native
    >>> native.status()["mode"] in ("auto", "0", "1")
    True
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DependencyError, StreamError

SOURCE = Path(__file__).with_name("kvc_cpu.c")
#: Flags: no contraction of multiply-adds (bit-exact float code), position independent.
CFLAGS = ["-O3", "-std=c99", "-fPIC", "-shared", "-ffp-contract=off", "-fno-strict-aliasing"]
ABI_VERSION = 22

# status codes of kvc_cpu.c
_OK, _ZERO_WORD, _NOT_CONSUMED, _NOMEM, _BAD_SYMBOL, _OVERFLOW = range(6)
OUT_I32_RN, OUT_U16_NR, OUT_U8_NR = 0, 1, 2

_lock = threading.Lock()
_state: dict[str, Any] = {"lib": None, "error": None, "tried": False, "path": None}


def _mode() -> str:
    m = os.environ.get("KVCODEC_NATIVE", "auto").strip().lower()
    return m if m in ("0", "1") else "auto"


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    if cc and shutil.which(cc.split()[0]):
        return cc.split()[0]
    for name in ("cc", "gcc", "clang"):
        if shutil.which(name):
            return name
    return None


def _cache_root() -> Path:
    base = os.environ.get("KVCODEC_CACHE_DIR")
    return Path(base) if base else Path.home() / ".cache" / "kvcodec"


def _build() -> ctypes.CDLL:
    cc = _compiler()
    if cc is None:
        raise DependencyError("no C compiler found (cc, gcc or clang; or set $CC)")
    try:
        ver = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise DependencyError(f"C compiler {cc!r} does not run: {e}") from None
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + "\0".join([ver, *CFLAGS, platform.machine(), platform.system()]).encode()).hexdigest()[:20]
    name = f"kvc_cpu-{key}{'.dll' if os.name == 'nt' else '.so'}"
    out_dir = _cache_root() / "native"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / name
        if not os.access(out_dir, os.W_OK) and not probe.exists():
            raise OSError("not writable")
    except OSError:
        out_dir = Path(tempfile.gettempdir()) / f"kvcodec-native-{os.getuid() if hasattr(os, 'getuid') else 0}"
        out_dir.mkdir(parents=True, exist_ok=True)
    so = out_dir / name
    if not so.exists():
        # compile to a private name, then rename: concurrent builders never see a partial file
        fd, tmp = tempfile.mkstemp(prefix=".kvc_cpu-", suffix=".so", dir=out_dir)
        os.close(fd)
        try:
            res = subprocess.run([cc, *CFLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=300)
            if res.returncode != 0:
                raise DependencyError(f"compiling {SOURCE.name} with {cc} failed: {res.stderr.strip()[:500]}")
            os.replace(tmp, so)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(so))
    if lib.kvn_abi_version() != ABI_VERSION:
        raise DependencyError(f"{so} has ABI {lib.kvn_abi_version()}, expected {ABI_VERSION}")
    p = ctypes.c_void_p
    lib.kvn_ans_decode.argtypes = [p, p, p, p, p, p, ctypes.c_int, p]
    lib.kvn_ans_decode.restype = ctypes.c_int
    i64, i32, f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_float
    lib.kvn_ans_encode.argtypes = [p, p, p, p, ctypes.c_int, i64, i64, p, i64, p, p]
    lib.kvn_ans_encode.restype = ctypes.c_int
    lib.kvn_hist.argtypes = [p, ctypes.c_int, i64, i64, i64, i64, i64, i64, p]
    lib.kvn_hist.restype = ctypes.c_int
    lib.kvn_ctx_hist.argtypes = [p, ctypes.c_int, i64, i64, i64, i64, i64, i64, p, i64, i64, p, p]
    lib.kvn_ctx_hist.restype = ctypes.c_int
    lib.kvn_convert.argtypes = [ctypes.c_int, ctypes.c_int, p, p, i64]
    lib.kvn_convert.restype = None
    lib.kvn_intq_dequant.argtypes = [p, i64, i64, i64, ctypes.c_int, i64, p, p, f32, ctypes.c_int, p]
    lib.kvn_intq_dequant.restype = ctypes.c_int
    lib.kvn_intq_quant.argtypes = [p, ctypes.c_int, i64, i64, i64, ctypes.c_int, i64, ctypes.c_int, p, p, p]
    lib.kvn_intq_quant.restype = ctypes.c_int
    lib.kvn_tok_quant.argtypes = [p, ctypes.c_int, i64, i64, p, p, p, i32, p, p]
    lib.kvn_tok_quant.restype = ctypes.c_int
    lib.kvn_deadzone.argtypes = [p, i64, i64, i64, p, ctypes.c_int, i64, i64, i64, ctypes.c_double, p, ctypes.c_int,
                                 i64]
    lib.kvn_deadzone.restype = ctypes.c_int
    lib.kvn_recon_sums.argtypes = [p, i64, i64, i64, p, ctypes.c_int, i64, i64, i64, p, i64, i64, p, p]
    lib.kvn_recon_sums.restype = ctypes.c_int
    lib.kvn_deadzone_recon.argtypes = [p, i64, i64, i64, p, ctypes.c_int, i64, i64, i64, ctypes.c_double, p,
                                       ctypes.c_int, i64, i64, p, p]
    lib.kvn_deadzone_recon.restype = ctypes.c_int
    lib.kvn_escape_split.argtypes = [p, i64, i64, i64, p, p, p, p, p, p]
    lib.kvn_escape_split.restype = ctypes.c_int
    lib.kvn_escape_split1.argtypes = [p, ctypes.c_int, i64, i64, i64, p, p, p, p, p, i64, p, p]
    lib.kvn_escape_split1.restype = ctypes.c_int
    lib.kvn_escape_split_ctx.argtypes = [p, ctypes.c_int, i64, i64, i64, p, p, p, p, p, i64, p, p, i64, i64, p, p, p]
    lib.kvn_escape_split_ctx.restype = ctypes.c_int
    lib.kvn_escape_join.argtypes = [p, i64, i64, i64, p, i64, p, p, ctypes.c_int]
    lib.kvn_escape_join.restype = ctypes.c_int
    lib.kvn_kvc_dequant.argtypes = [p, ctypes.c_int, i64, i64, i64, i64, p, i64, i64, i64, p, f32, ctypes.c_int, p, p,
                                    i64]
    lib.kvn_kvc_dequant.restype = ctypes.c_int
    lib.kvn_member_sums.argtypes = [p, i64, i64, p, i64, p, p]
    lib.kvn_member_sums.restype = None
    lib.kvn_delta_hist.argtypes = [p, ctypes.c_int, i64, i64, i64, p, p]
    lib.kvn_delta_hist.restype = None
    lib.kvn_set_hw_f16.argtypes = [ctypes.c_int]
    lib.kvn_set_hw_f16.restype = ctypes.c_int
    lib.kvn_rows_affine.argtypes = [p, ctypes.c_int, i64, i64, p, p, i32, i32, p, p, ctypes.c_int, p]
    lib.kvn_rows_affine.restype = ctypes.c_int
    _state["path"] = str(so)
    return lib


def lib() -> ctypes.CDLL | None:
    """The loaded native library, or ``None`` when disabled or unavailable (``auto`` mode).

    Raises:
        DependencyError: ``KVCODEC_NATIVE=1`` and the library cannot be built.
    """
    mode = _mode()
    if mode == "0":
        return None
    with _lock:
        if not _state["tried"]:
            _state["tried"] = True
            try:
                _state["lib"] = _build()
            except (DependencyError, OSError) as e:
                _state["error"] = str(e)
    if _state["lib"] is None and mode == "1":
        raise DependencyError(f"KVCODEC_NATIVE=1 but the native CPU coder is unavailable: {_state['error']}")
    return _state["lib"]


def _required() -> ctypes.CDLL:
    """The library, for functions callers use only after :func:`available` said yes."""
    lb = lib()
    if lb is None:
        raise DependencyError(f"native CPU coder unavailable: {_state['error'] or 'KVCODEC_NATIVE=0'}")
    return lb


def available() -> bool:
    """True when the native coder is enabled and builds on this machine."""
    try:
        return lib() is not None
    except DependencyError:
        return False


def status() -> dict[str, Any]:
    """``{"mode", "available", "path", "error"}``: what the native coder is doing and why."""
    ok = available()
    return {"mode": _mode(), "available": ok, "path": _state["path"], "error": None if ok else _state["error"]}


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


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
    _ZERO_WORD: "stream ends in a zero word",
    _NOT_CONSUMED: "not consumed exactly (corrupt or wrong index)",
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
    lb = _required()
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
    rc = lb.kvn_ans_decode(_ptr(geom), _ptr(w), _ptr(off), _ptr(tabs), _ptr(table_of), _ptr(out), kind, _ptr(bad))
    if rc == _NOMEM:
        raise MemoryError("native ANS decoder: out of memory")
    if rc != _OK:
        raise StreamError(f"ANS stream {int(bad[0])} {_STATUS_TEXT.get(rc, f'failed ({rc})')}")
    return out


_SYM_KIND = {np.dtype(np.int32): OUT_I32_RN, np.dtype(np.uint16): OUT_U16_NR, np.dtype(np.uint8): OUT_U8_NR}


def symbol_view(symbols: np.ndarray, layout: str = "rows") -> tuple[np.ndarray, int, int, int]:
    """``(array, kind, row_stride, token_stride)`` of a symbol matrix for the C functions:
    ``layout="rows"`` is ``[R, N]``, ``"tokens"`` is ``[N, R]``; int32, uint16 and uint8 are
    passed as they are, other integer dtypes are converted to int32 first."""
    x = np.asarray(symbols)
    if x.dtype not in _SYM_KIND:
        if x.size and (x.dtype.kind not in "iu" or int(x.min()) < 0 or int(x.max()) >= 2**31):
            raise StreamError("symbols must be non-negative integers below 2**31")
        x = x.astype(np.int32)
    x = np.ascontiguousarray(x)
    n_cols = x.shape[1] if x.ndim == 2 else 0
    return (x, _SYM_KIND[x.dtype], n_cols, 1) if layout == "rows" else (x, _SYM_KIND[x.dtype], 1, n_cols)


def histograms(symbols: np.ndarray, alphabet: int, layout: str = "rows", t0: int = 0, t1: int | None = None) -> np.ndarray:
    """``int64 [R, A]`` symbol counts per row over tokens ``[t0, t1)``.

    Raises:
        StreamError: a symbol outside ``[0, alphabet)``.
    """
    lb = _required()
    x, kind, sr, st = symbol_view(symbols, layout)
    r, n = (x.shape if layout == "rows" else x.shape[::-1])
    t1 = n if t1 is None else t1
    hist = np.zeros((r, alphabet), dtype=np.int64)
    if lb.kvn_hist(_ptr(x), kind, r, sr, st, t0, t1, alphabet, _ptr(hist)) != _OK:
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
    lb = _required()
    x, kind, sr, st = symbol_view(symbols, layout)
    r, n = (x.shape if layout == "rows" else x.shape[::-1])
    q = len(thresholds) + 1
    hist = np.zeros((q * r, alphabet), dtype=np.int64)
    cls = np.empty(x.shape, dtype=np.uint8) if classes else None
    thr = np.ascontiguousarray(np.asarray(list(thresholds) or [0], dtype=np.int64))
    rc = lb.kvn_ctx_hist(_ptr(x), kind, r, sr, st, n, g, q - 1, _ptr(thr), (alphabet - 1) // 2, alphabet, _ptr(hist),
                         None if cls is None else _ptr(cls))
    if rc == _NOMEM:
        raise MemoryError("native context histograms: out of memory")
    if rc != _OK:
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
    lb = _required()
    geom, tabs, table_of = _flat_tables(lay, tsets, rts)
    x, kind, sr, st = symbol_view(symbols, layout)
    cls = None
    if classes is not None and lay.scope == 2:
        cls = np.ascontiguousarray(classes, dtype=np.uint8)
        if cls.shape != x.shape:
            raise ValueError(f"classes must have the symbols' shape {x.shape}, got {cls.shape}")
    cap = lay.R * lay.N + 2 * lay.n_streams + 1
    words = np.empty(cap, dtype=np.uint32)
    offsets = np.zeros(lay.n_streams + 1, dtype=np.int64)
    rc = lb.kvn_ans_encode(_ptr(geom), _ptr(tabs), _ptr(table_of), _ptr(x), kind, sr, st, _ptr(words), cap,
                           _ptr(offsets), None if cls is None else _ptr(cls))
    if rc == _NOMEM:
        raise MemoryError("native ANS encoder: out of memory")
    if rc == _BAD_SYMBOL:
        raise StreamError(f"symbols must lie in [0, {lay.A})" + ("" if cls is None else f" and classes in [0, {lay.Q})"))
    if rc != _OK:  # pragma: no cover - the capacity bound is exact
        raise StreamError(f"native ANS encoder failed ({rc})")
    return words[: int(offsets[-1])].copy(), offsets


# ---------------------------------------------------------------------------- dequantization
F_F32, F_F16, F_BF16 = 0, 1, 2


def float_kind(dtype) -> int:
    """The C element kind of a torch float dtype (float32, float16, bfloat16)."""
    import torch

    return {torch.float32: F_F32, torch.float16: F_F16, torch.bfloat16: F_BF16}[dtype]


def intq_dequantize(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, axis: str, group: int, dtype):
    """KIVI dequantization of ``uint8 codes [T, H, D]`` into a new torch tensor of ``dtype``,
    bit-identical to :func:`kvcodec.quant.fast.intq_dequantize_fast` (float32 ``code * scale +
    zero``, clamped to the finite range of fp16/bf16, cast with round-to-nearest-even)."""
    import torch

    lb = _required()
    c = np.ascontiguousarray(codes, dtype=np.uint8)
    t, h, d = c.shape
    group = min(int(group), max(t, d, 1))  # a group as long as the axis is one group: same result, no overflow
    s = np.ascontiguousarray(scale, dtype=np.float32)
    z = np.ascontiguousarray(zero, dtype=np.float32)
    out = torch.empty((t, h, d), dtype=dtype)
    fmax = 0.0 if dtype == torch.float32 else float(torch.finfo(dtype).max)
    rc = lb.kvn_intq_dequant(_ptr(c), t, h, d, 0 if axis == "channel" else 1, group, _ptr(s), _ptr(z), fmax,
                             float_kind(dtype), out.data_ptr())
    if rc == _NOMEM:
        raise MemoryError("native dequantization: out of memory")
    return out


def intq_quantize(x, bits: int, axis: str, group: int):
    """KIVI quantization of a ``[T, H, D]`` float16/bfloat16/float32 tensor in one native pass;
    returns ``(codes uint8 [T, H, D], scale16, zero16)`` as torch tensors, bit-identical to
    :func:`kvcodec.quant.fast.intq_quantize_fast`.

    Raises:
        InputError: NaN/Inf input, or a scale/zero beyond float16 (same messages as the fast path).
    """
    import torch

    from ..errors import InputError

    lb = _required()
    xc = x.detach().cpu().contiguous()
    t, h, d = xc.shape
    codes = torch.empty((t, h, d), dtype=torch.uint8)
    # the scale/zero shape (kvcodec.quant.intq.intq_param_shape; native does not import quant)
    ps = (-(-t // group), h, d) if axis == "channel" else (t, h, -(-d // group))
    group = min(int(group), max(t, d, 1))  # as in intq_dequantize
    scale = torch.empty(ps, dtype=torch.float16)
    zero = torch.empty(ps, dtype=torch.float16)
    rc = lb.kvn_intq_quant(xc.data_ptr(), float_kind(xc.dtype), t, h, d, 0 if axis == "channel" else 1, group, bits,
                           scale.data_ptr(), zero.data_ptr(), codes.data_ptr())
    if rc == 1:
        raise InputError("input holds NaN or Inf values; refusing to quantize")
    if rc == 2:
        raise InputError("values too large for float16 scales/zeros (|x| or the group range exceeds 65504)")
    if rc == _NOMEM:
        raise MemoryError("native quantization: out of memory")
    return codes, scale, zero


def token_quantize(x, rows: np.ndarray, levels: int, base: np.ndarray | None = None,
                   brow: np.ndarray | None = None):
    """CacheGen's per-token symmetric quantization of rows ``rows`` of ``x`` (a ``[T, C]``
    float16/bfloat16/float32 tensor), optionally minus ``base[brow[j]]`` (float32); returns
    ``(codes uint16 [n, C] in [0, levels), scale16 float16 [n])`` as numpy arrays, bit-identical to
    :func:`kvcodec.codecs.cachegen.symmetric_token_quantize`.

    Raises:
        InputError: a scale beyond float16 (or NaN input), the reference's message.
    """
    from ..errors import InputError

    lb = _required()
    xc = x.detach().cpu().contiguous()
    c = xc.shape[1]
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    n = rows.size
    codes = np.empty((n, c), dtype=np.uint16)
    scale = np.empty(n, dtype=np.float16)
    b = None if base is None else np.ascontiguousarray(base, dtype=np.float32)
    br = None if brow is None else np.ascontiguousarray(brow, dtype=np.int64)
    rc = lb.kvn_tok_quant(xc.data_ptr(), float_kind(xc.dtype), n, c, _ptr(rows), None if b is None else _ptr(b),
                          None if br is None else _ptr(br), (int(levels) - 1) // 2, _ptr(scale), _ptr(codes))
    if rc == 2:
        raise InputError("per-token scale exceeds float16 range (|x| too large)")
    if rc == _NOMEM:
        raise MemoryError("native quantization: out of memory")
    return codes, scale


def deadzone_quantize(x: np.ndarray, step: np.ndarray, rho: float, out: np.ndarray | None = None) -> np.ndarray | None:
    """:func:`kvcodec.quant.deadzone.deadzone_quantize` for a float32 ``x`` of up to 3 dims (the
    same float64 arithmetic, int64 codes), or ``None`` when this path does not apply (other
    dtypes or shapes, a step that does not broadcast, non-finite values or huge codes): the
    caller then runs the numpy code. Float32 steps are read as they are (exactly widened).
    ``out``: an int64 ``[n0, >= n1 * n2]`` matrix with contiguous rows (a view of the first
    columns of a wider one is fine) that receives the codes of ``x [n0, n1, n2]``; returned."""
    res = deadzone_recon(x, step, rho, out, 0)
    return None if res is None else res[0]


def deadzone_recon(x: np.ndarray, step: np.ndarray, rho: float, out: np.ndarray | None,
                   levels: int) -> tuple[np.ndarray, tuple[list[int], list[int]] | None] | None:
    """:func:`deadzone_quantize` and, with ``1 <= levels <= 16``, the reconstruction sums of
    :func:`recon_sums` for those codes, in one pass: ``(codes, (sums, counts))`` (``(codes,
    None)`` with ``levels`` 0), or ``None`` when this path does not apply. ``out`` may be int32
    (half the memory traffic of int64; kvc's encoder asks for it): then ``None`` also when a
    code would not fit (``|c| >= 2**31``)."""
    lb = lib()
    ops = _dz_operands(x, step) if lb is not None else None
    if ops is None or not 0 <= levels <= 16 or (levels and np.ndim(x) != 3):
        return None
    x3, st, strides, kind = ops
    n0, n1, n2 = x3.shape
    if out is None:
        codes, orow = np.empty(x3.shape, dtype=np.int64), n1 * n2
    else:
        codes = out
        if out.dtype not in (np.int64, np.int32) or out.ndim != 2 or out.shape != (n0, n1 * n2):
            raise ValueError(f"deadzone out must be an int64 or int32 [{n0}, {n1 * n2}] matrix")
        if out.size == 0:
            return out, (([0] * levels, [0] * levels) if levels else None)
        es = out.itemsize
        if (n1 * n2 > 1 and out.strides[1] != es) or (n0 > 1 and out.strides[0] % es):
            raise ValueError(f"deadzone out must be an int64 or int32 [{n0}, {n1 * n2}] view with contiguous rows")
        orow = out.strides[0] // es if n0 > 1 else n1 * n2
    args = (_ptr(x3), n0, n1, n2, st.ctypes.data, kind, *strides, float(rho), codes.ctypes.data,
            _ckind(codes), orow)
    if not levels:
        if lb.kvn_deadzone(*args) != 0:
            return None
        return (codes if out is not None else codes.reshape(np.shape(x))), None
    sums = np.zeros(levels, dtype=np.int64)
    counts = np.zeros(levels, dtype=np.int64)
    if lb.kvn_deadzone_recon(*args, int(levels), sums.ctypes.data, counts.ctypes.data) != 0:
        return None
    return codes, ([int(v) for v in sums], [int(v) for v in counts])


def _dz_operands(x: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[int], int] | None:
    """What the dead-zone C loops read: ``x`` as a contiguous float32 ``[n0, n1, n2]`` (fewer
    dims padded in front), ``step`` broadcast to it (float32 kept, anything else float64), its
    element strides and kind (1 float32, 0 float64); None when that path does not apply."""
    xa = np.asarray(x)
    if xa.dtype != np.float32 or xa.ndim > 3:
        return None
    x3 = np.ascontiguousarray(xa.reshape((1,) * (3 - xa.ndim) + xa.shape))
    sa = np.asarray(step)
    if sa.dtype != np.float32:
        sa = sa.astype(np.float64)
    try:
        st = np.broadcast_to(sa, xa.shape).reshape(x3.shape)
    except ValueError:
        return None
    if st.size and any(s % st.itemsize for s in st.strides):
        return None
    strides = [s // st.itemsize for s in st.strides] if st.size else [0, 0, 0]
    return x3, st, strides, 1 if st.dtype == np.float32 else 0


def recon_sums(x: np.ndarray, step: np.ndarray, codes: np.ndarray, levels: int) -> tuple[list[int], list[int]] | None:
    """:func:`kvcodec.quant.deadzone.recon_sums` (the same integers) for a float32 ``x`` of 3 dims
    and the int64 codes :func:`deadzone_quantize` wrote (``[n0, n1, n2]``, or a ``[n0, >= n1 *
    n2]`` matrix with contiguous rows holding them in its first columns); ``None`` when this path
    does not apply (the caller runs the numpy code)."""
    lb = lib()
    ops = _dz_operands(x, step) if lb is not None and np.ndim(x) == 3 and levels >= 1 else None
    if ops is None:
        return None
    x3, st, strides, kind = ops
    n0, n1, n2 = x3.shape
    c = np.asarray(codes)
    if c.dtype != np.int64:
        return None
    if c.ndim == 3 and c.shape == x3.shape:
        c = np.ascontiguousarray(c).reshape(n0, n1 * n2)
    if c.ndim != 2 or c.shape[0] != n0 or c.shape[1] < n1 * n2 or (n1 * n2 > 1 and c.strides[1] != 8) \
            or (n0 > 1 and c.strides[0] % 8):
        return None
    orow = c.strides[0] // 8 if n0 > 1 else n1 * n2
    sums = np.zeros(levels, dtype=np.int64)
    counts = np.zeros(levels, dtype=np.int64)
    if lb.kvn_recon_sums(_ptr(x3), n0, n1, n2, st.ctypes.data, kind, *strides,
                         c.ctypes.data, orow, int(levels), sums.ctypes.data, counts.ctypes.data) != 0:
        return None
    return [int(v) for v in sums], [int(v) for v in counts]


def _ckind(codes: np.ndarray) -> int:
    """The C functions' code element kind of an int32 or int64 array (kvc_cpu.c: C_I64 = 0,
    C_I32 = 1)."""
    return 1 if codes.dtype == np.int32 else 0


def _code_matrix(codes: np.ndarray) -> tuple[np.ndarray, int]:
    """Token-major codes as the C functions read them: int32 kept, anything else int64,
    contiguous; and their element kind (:func:`_ckind`)."""
    c = np.ascontiguousarray(codes, dtype=np.int32 if np.asarray(codes).dtype == np.int32 else np.int64)
    return c, _ckind(c)


def _delta_flags(delta: np.ndarray | None, r: int) -> np.ndarray | None:
    """kvc's token-delta column flags as uint8 ``[r]`` (or None)."""
    if delta is None:
        return None
    dl = np.ascontiguousarray(delta, dtype=np.uint8)
    if dl.shape != (r,):
        raise ValueError(f"delta must be [{r}], got {list(dl.shape)}")
    return dl


def _split_operands(codes: np.ndarray, delta: np.ndarray | None):
    """The codes (:func:`_code_matrix`), their kind and shape and the delta column flags as the
    escape-split C functions read them."""
    c, ck = _code_matrix(codes)
    n, r = c.shape
    return c, ck, n, r, _delta_flags(delta, r)


def escape_split_tokens(codes: np.ndarray, max_level: int,
                        delta: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, int]:
    """kvc's escape split of a token-major ``int64 codes [n, R]`` (or int32): returns ``(symbols uint16
    [n, R], escapes int32, L)``, the symbols being the transpose of what
    :func:`kvcodec.codecs.kvc.escape_split` returns for ``codes.T`` and the escapes identical
    (row-major order of ``[R, n]``). With ``delta`` (bool ``[R]``) those columns are split as
    their token deltas ``c[t] - c[t-1]`` (``t > 0``), without a copy of the matrix."""
    lb = _required()
    c, ck, n, r, dl = _split_operands(codes, delta)
    dp = None if dl is None else _ptr(dl)
    sym = np.empty((n, r), dtype=np.uint16)
    cnt, lv = np.zeros(1, np.int64), np.zeros(1, np.int64)
    # one pass while the escapes fit a scratch of 1/16 of the codes (kvc's presets escape well
    # under 1 %); else the two passes (count, then split)
    cap = (n * r) // 16 + 64
    esc, etok, erow = (np.empty(cap, dtype=np.int32) for _ in range(3))
    rc = lb.kvn_escape_split1(_ptr(c), ck, n, r, int(max_level), dp, _ptr(sym),
                              _ptr(esc), _ptr(etok), _ptr(erow), cap, _ptr(cnt), _ptr(lv))
    del etok, erow
    if rc == _NOMEM:
        raise MemoryError("native escape split: out of memory")
    if rc == _OK:
        return sym, esc[: int(cnt[0])].copy(), int(lv[0])
    c = c.astype(np.int64, copy=False)  # the two passes read int64
    rowcnt = np.zeros(max(r, 1), np.int64)
    lb.kvn_escape_split(_ptr(c), n, r, int(max_level), dp, None, None, _ptr(rowcnt), _ptr(cnt), _ptr(lv))
    esc = np.empty(int(cnt[0]), dtype=np.int32)
    if lb.kvn_escape_split(_ptr(c), n, r, int(max_level), dp, _ptr(sym), _ptr(esc), _ptr(rowcnt), _ptr(cnt),
                           _ptr(lv)) == _NOMEM:
        raise MemoryError("native escape split: out of memory")
    return sym, esc, int(lv[0])


def escape_split_ctx_tokens(codes: np.ndarray, max_level: int, delta: np.ndarray | None, g: int,
                            thresholds: list[int]):
    """:func:`escape_split_tokens` and, in the same pass, the scope-2 statistics of the symbols
    it writes — what :func:`ctx_histograms` (``classes=True``) returns for them with streams of
    ``g`` rows and these thresholds: ``(symbols, escapes, L, counts int64 [Q * R, 2 L], classes
    uint8 [n, R])``; ``None`` when the one pass does not apply (more escapes than its scratch
    holds, 2**31 tokens or more): the caller then takes the two calls."""
    lb = _required()
    c, ck, n, r, dl = _split_operands(codes, delta)
    th = list(thresholds)
    q = len(th) + 1
    if not 0 <= len(th) < 16 or g < 1 or n >= 2**31:
        return None
    ml = max(1, int(max_level))
    sym = np.empty((n, r), dtype=np.uint16)
    cls = np.empty((n, r), dtype=np.uint8)
    cnt, lv = np.zeros(1, np.int64), np.zeros(1, np.int64)
    cap = (n * r) // 16 + 64
    esc, etok, erow = (np.empty(cap, dtype=np.int32) for _ in range(3))
    hist = np.empty(q * r * 2 * ml, dtype=np.int64)  # [Q * R, 2 L] in its first entries
    thr = np.ascontiguousarray(np.asarray(th or [0], dtype=np.int64))
    rc = lb.kvn_escape_split_ctx(_ptr(c), ck, n, r, int(max_level),
                                 None if dl is None else _ptr(dl), _ptr(sym), _ptr(esc), _ptr(etok), _ptr(erow), cap,
                                 _ptr(cnt), _ptr(lv), int(g), q - 1, _ptr(thr), _ptr(hist), _ptr(cls))
    del etok, erow
    if rc == _NOMEM:
        raise MemoryError("native escape split: out of memory")
    if rc != _OK:
        return None
    L = int(lv[0])
    return sym, esc[: int(cnt[0])].copy(), L, hist[: q * r * 2 * L].reshape(q * r, 2 * L).copy(), cls


def escape_join_tokens(sym: np.ndarray, esc: np.ndarray, lv: int, delta: np.ndarray | None = None,
                       narrow: bool = False) -> np.ndarray:
    """Inverse of :func:`escape_split_tokens`: ``int64 [n, R]`` codes; with ``delta`` (bool
    ``[R]``) those columns become their running sums over the tokens (kvc's token-delta rows,
    as :func:`kvcodec.codecs.kvc.undelta_rows`), in the same pass. ``narrow``: int32 codes
    when every one fits (half the memory traffic for the dequantization that follows), else
    int64 as without it — the same integers either way.

    Raises:
        FormatError: the escape count differs from the escape plane's length, or an escaped code
            lies inside the regular range (kvc's own messages).
    """
    from ..errors import FormatError

    lb = _required()
    s = np.ascontiguousarray(sym, dtype=np.uint16)
    n, r = s.shape
    e = np.asarray(esc)
    if e.ndim != 1 or (e.size and e.dtype.kind not in "iu"):
        raise FormatError(f"kvc: the esc plane must be a 1-D integer array, got {e.dtype}{list(e.shape)}")
    e = np.ascontiguousarray(e, dtype=np.int64)
    dl = _delta_flags(delta, r)
    dp = None if dl is None else _ptr(dl)
    rc = 3
    if narrow:
        out = np.empty((n, r), dtype=np.int32)
        rc = lb.kvn_escape_join(_ptr(s), n, r, int(lv), _ptr(e), e.size, dp, _ptr(out), 1)
    if rc == 3:  # wide codes (or not asked to narrow): int64
        out = np.empty((n, r), dtype=np.int64)
        rc = lb.kvn_escape_join(_ptr(s), n, r, int(lv), _ptr(e), e.size, dp, _ptr(out), 0)
    if rc == 1:
        count = int((s == 2 * lv - 1).sum())
        raise FormatError(f"kvc: {count} escape symbols but the esc plane holds {e.size} values")
    if rc == 2:
        raise FormatError("kvc: an escaped code lies inside the regular range")
    if rc == _NOMEM:
        raise MemoryError("native escape join: out of memory")
    return out


def kvc_dequantize(codes: np.ndarray, step: np.ndarray, mean: np.ndarray, dtype, out=None, recon=None):
    """kvc's normative reconstruction without a transform: ``float32(code) * step + mean``
    (separately rounded float32 operations), clamped to the finite range of ``dtype`` (fp16/bf16)
    and cast with round-to-nearest-even. ``codes`` int64 ``[n, H, D]`` (token-major), ``step``
    float32 broadcastable to it, ``mean`` float32 ``[H, D]`` (int32 codes are read as they are).
    ``recon``: reconstruction offsets (:func:`kvcodec.quant.deadzone.recon_values`: codes
    ``1 <= |c| <= len(recon)`` stand for ``sign(c) * (|c| - recon[|c| - 1] / 256)``) or None. Returns a torch tensor: ``out``
    when given (a contiguous ``[n, H, D]`` CPU tensor of ``dtype``, written in place)."""
    import torch

    lb = _required()
    c = np.asarray(codes)
    n, h, d = c.shape
    es = c.itemsize
    if (c.dtype not in (np.int64, np.int32) or (n > 1 and c.strides[0] % es) or (h > 1 and c.strides[1] != es * d)
            or (d > 1 and c.strides[2] != es)):
        c = np.ascontiguousarray(c, dtype=np.int64)  # token rows may be strided (a view of the symbol matrix)
    crow = c.strides[0] // c.itemsize if n > 1 else h * d
    st = np.broadcast_to(np.asarray(step, dtype=np.float32), c.shape)
    mu = np.ascontiguousarray(mean, dtype=np.float32).reshape(h, d)
    if out is None:
        out = torch.empty((n, h, d), dtype=dtype)
    elif (tuple(out.shape) != (n, h, d) or out.dtype != dtype or out.device.type != "cpu"
          or not out.is_contiguous()):
        raise ValueError(f"kvc_dequantize: out must be a contiguous CPU {dtype} tensor of shape {(n, h, d)}")
    fmax = float(torch.finfo(dtype).max)  # saturate (float32 too: an overflow to inf becomes its max)
    strides = [x // 4 for x in st.strides] if st.size else [0, 0, 0]
    rtab, rm = None, 0
    if recon:
        # what each code in [-rm-1, rm+1] loses to its reconstruction value: sign(c) * recon[|c|-1] / 256,
        # zero at 0 and at both ends (exact in float32; kvcodec.quant.deadzone.recon_values is the reference)
        rm = len(recon)
        span = np.arange(-rm - 1, rm + 2)
        lost = np.zeros(rm + 2, dtype=np.float64)
        lost[1:rm + 1] = np.asarray(list(recon), dtype=np.float64) / 256.0
        rtab = np.ascontiguousarray(np.sign(span) * lost[np.abs(span)], dtype=np.float32)
    if lb.kvn_kvc_dequant(c.ctypes.data, _ckind(c), crow, n, h, d, st.ctypes.data, *strides,
                          _ptr(mu), fmax, float_kind(dtype),
                          out.data_ptr(), None if rtab is None else rtab.ctypes.data, rm) == _NOMEM:
        raise MemoryError("native dequantization: out of memory")
    return out


def delta_histograms(codes: np.ndarray, stride: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """kvc's token-delta statistics of token-major ``int64`` (or int32) ``codes [n, R]`` (``|c| < 2**62``): per
    column, ``int32 [R, 128]`` counts of the codes and of their token deltas (first delta = the
    first code) at tokens ``0, stride, 2 stride, ...``, clipped to ``[-64, 63]`` and shifted by
    64 — one pass, the same counts as :func:`kvcodec.codecs.kvc.delta_rows`' numpy path."""
    lb = _required()
    c, ck = _code_matrix(codes)
    n, r = c.shape
    if n >= 2**31:
        raise ValueError("delta_histograms: at most 2**31 - 1 tokens")
    hc = np.empty((r, 128), dtype=np.int32)
    he = np.empty((r, 128), dtype=np.int32)
    lb.kvn_delta_hist(_ptr(c), ck, n, r, max(1, int(stride)), _ptr(hc), _ptr(he))
    return hc, he


def member_sums(h: np.ndarray, assign: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Per-cluster sums of the rows of ``h`` (float64 counts; exact) and which clusters are used,
    or ``None`` without the native coder."""
    lb = lib()
    if lb is None:
        return None
    hh = np.ascontiguousarray(h, dtype=np.float64)
    asg = np.ascontiguousarray(assign, dtype=np.int64)
    r, a = hh.shape
    sums = np.empty((k, a), dtype=np.float64)
    used = np.empty(k, dtype=np.uint8)
    lb.kvn_member_sums(_ptr(hh), r, a, _ptr(asg), k, _ptr(sums), _ptr(used))
    return sums, used.astype(bool)


def rows_affine(codes: np.ndarray, orow: np.ndarray, scale: np.ndarray, mid: int, out, *, max_code: int,
                base: np.ndarray | None = None, brow: np.ndarray | None = None) -> bool:
    """CacheGen-style dequantization into rows of ``out`` (a contiguous torch ``[rows, C]``
    tensor): for code row ``j``, ``out[orow[j]] = f32(codes[j] - mid) * scale[j]`` (plus
    ``base[brow[j]]`` first-operand-added when given), cast to ``out``'s dtype with RNE.
    Returns False if a code exceeds ``max_code`` (the caller raises)."""
    lb = _required()
    x, kind, _, _ = symbol_view(codes, "tokens")
    n, c = x.shape
    orow = np.ascontiguousarray(orow, dtype=np.int64)
    sc = np.ascontiguousarray(scale, dtype=np.float32)
    b = None if base is None else np.ascontiguousarray(base, dtype=np.float32)
    br = None if brow is None else np.ascontiguousarray(brow, dtype=np.int64)
    rc = lb.kvn_rows_affine(_ptr(x), kind, n, c, _ptr(orow), _ptr(sc), mid, max_code,
                            None if b is None else _ptr(b), None if br is None else _ptr(br),
                            float_kind(out.dtype), out.data_ptr())
    if rc == _NOMEM:
        raise MemoryError("native dequantization: out of memory")
    return rc == _OK


__all__ = ["available", "decode_stage", "encode_stage", "histograms", "intq_dequantize", "deadzone_quantize", "deadzone_recon", "escape_join_tokens", "escape_split_ctx_tokens", "escape_split_tokens", "intq_quantize", "kvc_dequantize", "lib", "member_sums", "token_quantize", "rows_affine", "status",
           "symbol_view"]
