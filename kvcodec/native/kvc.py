"""kvc's symbol passes in C (:mod:`kvcodec.codecs.kvc.symbols`): the escape split and join of
token-major code matrices (with token-delta columns and the magnitude-context statistics in the
same pass), the normative dequantization, and the token-delta statistics. C side: csrc/kvc.c.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Iterator

import numpy as np

from ..errors import FormatError
from .abi import NOMEM, OK, code_kind, float_kind, kept_ptr, ptr
from .ans import _flat_tables
from .build import Unsupported, required


def _code_matrix(codes: np.ndarray) -> tuple[np.ndarray, int]:
    """Token-major codes as the C functions read them: int32 kept, anything else int64,
    contiguous; and their element kind (:func:`_ckind`)."""
    c = np.ascontiguousarray(codes, dtype=np.int32 if np.asarray(codes).dtype == np.int32 else np.int64)
    return c, code_kind(c)


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
    lb = required()
    c, ck, n, r, dl = _split_operands(codes, delta)
    dp = None if dl is None else ptr(dl)
    sym = np.empty((n, r), dtype=np.uint16)
    cnt, lv = np.zeros(1, np.int64), np.zeros(1, np.int64)
    # one pass while the escapes fit a scratch of 1/16 of the codes (kvc's presets escape well
    # under 1 %); else the two passes (count, then split)
    cap = (n * r) // 16 + 64
    esc, etok, erow = (np.empty(cap, dtype=np.int32) for _ in range(3))
    rc = lb.kvn_escape_split1(ptr(c), ck, n, r, int(max_level), dp, ptr(sym),
                              ptr(esc), ptr(etok), ptr(erow), cap, ptr(cnt), ptr(lv))
    del etok, erow
    if rc == NOMEM:
        raise MemoryError("native escape split: out of memory")
    if rc == OK:
        return sym, esc[: int(cnt[0])].copy(), int(lv[0])
    c = c.astype(np.int64, copy=False)  # the two passes read int64
    rowcnt = np.zeros(max(r, 1), np.int64)
    lb.kvn_escape_split(ptr(c), n, r, int(max_level), dp, None, None, ptr(rowcnt), ptr(cnt), ptr(lv))
    esc = np.empty(int(cnt[0]), dtype=np.int32)
    if lb.kvn_escape_split(ptr(c), n, r, int(max_level), dp, ptr(sym), ptr(esc), ptr(rowcnt), ptr(cnt),
                           ptr(lv)) == NOMEM:
        raise MemoryError("native escape split: out of memory")
    return sym, esc, int(lv[0])


def escape_split_ctx_tokens(codes: np.ndarray, max_level: int, delta: np.ndarray | None, g: int,
                            thresholds: list[int], rows: bool = False):
    """:func:`escape_split_tokens` and, in the same pass, the scope-2 statistics of the symbols
    it writes — what :func:`ctx_histograms` (``classes=True``) returns for them with streams of
    ``g`` rows and these thresholds: ``(symbols, escapes, L, counts int64 [Q * R, 2 L], classes
    uint8 [n, R])``. With ``rows``, the symbols and classes are the transposes (``.T``, still
    ``[n, R]``) of row-major ``[R, n]`` views (rows a padded length apart, unit stride along the
    tokens), which the entropy stage reads fastest (``layout="rows"`` on ``.T``).

    Raises:
        Unsupported: the one pass does not apply (more escapes than its scratch holds, 2**31
            tokens or more, 16 thresholds or more): the caller takes the two calls.
    """
    lb = required()
    c, ck, n, r, dl = _split_operands(codes, delta)
    th = list(thresholds)
    q = len(th) + 1
    if not 0 <= len(th) < 16 or g < 1 or n >= 2**31:
        raise Unsupported(f"escape split with contexts: {len(th)} thresholds, {g} rows per stream, {n} tokens")
    ml = max(1, int(max_level))
    # row-major rows a padded length apart: 32 times an odd number of symbols, so that the rows
    # of one block of tokens do not crowd a few cache sets (1536 apart they did)
    orow = 32 * ((n + 31) // 32 | 1) if rows else 0
    shape = (r, orow) if rows else (n, r)
    sym = np.empty(shape, dtype=np.uint16)
    cls = np.empty(shape, dtype=np.uint8)
    cnt, lv = np.zeros(1, np.int64), np.zeros(1, np.int64)
    cap = (n * r) // 16 + 64
    esc, etok, erow = (np.empty(cap, dtype=np.int32) for _ in range(3))
    hist = np.empty(q * r * 2 * ml, dtype=np.int64)  # [Q * R, 2 L] in its first entries
    thr = np.ascontiguousarray(np.asarray(th or [0], dtype=np.int64))
    rc = lb.kvn_escape_split_ctx(ptr(c), ck, n, r, int(max_level),
                                 None if dl is None else ptr(dl), ptr(sym), ptr(esc), ptr(etok), ptr(erow), cap,
                                 ptr(cnt), ptr(lv), int(g), q - 1, ptr(thr), ptr(hist), ptr(cls), orow)
    del etok, erow
    if rc == NOMEM:
        raise MemoryError("native escape split: out of memory")
    if rc != OK:
        raise Unsupported("escape split with contexts: more escapes than the one pass holds")
    L = int(lv[0])
    if rows:
        sym, cls = sym[:, :n].T, cls[:, :n].T
    return sym, esc[: int(cnt[0])].copy(), L, hist[: q * r * 2 * L].reshape(q * r, 2 * L).copy(), cls


def _esc_operand(esc: np.ndarray) -> np.ndarray:
    """kvc's escape plane as the join reads it: contiguous int64 (FormatError when not 1-D integers)."""
    e = np.asarray(esc)
    if e.ndim != 1 or (e.size and e.dtype.kind not in "iu"):
        raise FormatError(f"kvc: the esc plane must be a 1-D integer array, got {e.dtype}{list(e.shape)}")
    return np.ascontiguousarray(e, dtype=np.int64)


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
    lb = required()
    s = np.ascontiguousarray(sym, dtype=np.uint16)
    n, r = s.shape
    e = _esc_operand(esc)
    dl = _delta_flags(delta, r)
    dp = None if dl is None else ptr(dl)
    rc = 3
    if narrow:
        out = np.empty((n, r), dtype=np.int32)
        rc = lb.kvn_escape_join(ptr(s), n, r, int(lv), ptr(e), e.size, dp, ptr(out), 1)
    if rc == 3:  # wide codes (or not asked to narrow): int64
        out = np.empty((n, r), dtype=np.int64)
        rc = lb.kvn_escape_join(ptr(s), n, r, int(lv), ptr(e), e.size, dp, ptr(out), 0)
    if rc == 1:
        count = int((s == 2 * lv - 1).sum())
        raise FormatError(f"kvc: {count} escape symbols but the esc plane holds {e.size} values")
    if rc == 2:
        raise FormatError("kvc: an escaped code lies inside the regular range")
    if rc == NOMEM:
        raise MemoryError("native escape join: out of memory")
    return out


def _recon_table(recon: list[int] | None) -> tuple[np.ndarray | None, int]:
    """``(table, rm)`` for the C dequantization: what each code in ``[-rm-1, rm+1]`` loses to its
    reconstruction value, ``sign(c) * recon[|c|-1] / 256``, zero at 0 and at both ends (exact in
    float32; :func:`kvcodec.quant.deadzone.recon_values` is the reference); ``(None, 0)`` without
    offsets."""
    if not recon:
        return None, 0
    rm = len(recon)
    span = np.arange(-rm - 1, rm + 2)
    lost = np.zeros(rm + 2, dtype=np.float64)
    lost[1:rm + 1] = np.asarray(list(recon), dtype=np.float64) / 256.0
    return np.ascontiguousarray(np.sign(span) * lost[np.abs(span)], dtype=np.float32), rm


def kvc_dequantize(codes: np.ndarray, step: np.ndarray, mean: np.ndarray, dtype, out=None, recon=None):
    """kvc's normative reconstruction without a transform: ``float32(code) * step + mean``
    (separately rounded float32 operations), clamped to the finite range of ``dtype`` (fp16/bf16)
    and cast with round-to-nearest-even. ``codes`` int64 ``[n, H, D]`` (token-major), ``step``
    float32 broadcastable to it, ``mean`` float32 ``[H, D]`` (or ``[1, H, D]``) for every token, or
    ``[n, H, D]`` for a mean per token (kvc's rotating K means) (int32 codes are read as they are).
    ``recon``: reconstruction offsets (:func:`kvcodec.quant.deadzone.recon_values`: codes
    ``1 <= |c| <= len(recon)`` stand for ``sign(c) * (|c| - recon[|c| - 1] / 256)``) or None. Returns a torch tensor: ``out``
    when given (a contiguous ``[n, H, D]`` CPU tensor of ``dtype``, written in place)."""
    import torch

    lb = required()
    c = np.asarray(codes)
    n, h, d = c.shape
    es = c.itemsize
    if (c.dtype not in (np.int64, np.int32) or (n > 1 and c.strides[0] % es) or (h > 1 and c.strides[1] != es * d)
            or (d > 1 and c.strides[2] != es)):
        c = np.ascontiguousarray(c, dtype=np.int64)  # token rows may be strided (a view of the symbol matrix)
    crow = c.strides[0] // c.itemsize if n > 1 else h * d
    st = np.broadcast_to(np.asarray(step, dtype=np.float32), c.shape)
    mu = np.ascontiguousarray(mean, dtype=np.float32)
    if mu.shape == (n, h, d):
        ms0 = h * d
    elif mu.size == h * d:
        mu, ms0 = mu.reshape(h, d), 0
    else:
        raise ValueError(f"kvc_dequantize: mean of shape {list(mu.shape)} is neither [H, D] nor [n, H, D]")
    if out is None:
        out = torch.empty((n, h, d), dtype=dtype)
    elif (tuple(out.shape) != (n, h, d) or out.dtype != dtype or out.device.type != "cpu"
          or not out.is_contiguous()):
        raise ValueError(f"kvc_dequantize: out must be a contiguous CPU {dtype} tensor of shape {(n, h, d)}")
    fmax = float(torch.finfo(dtype).max)  # saturate (float32 too: an overflow to inf becomes its max)
    strides = [x // 4 for x in st.strides] if st.size else [0, 0, 0]
    rtab, rm = _recon_table(recon)
    if lb.kvn_kvc_dequant(ptr(c), code_kind(c), crow, n, h, d, ptr(st), *strides,
                          ptr(mu), ms0, fmax, float_kind(dtype),
                          out.data_ptr(), None if rtab is None else ptr(rtab), rm) == NOMEM:
        raise MemoryError("native dequantization: out of memory")
    return out


def delta_histograms(codes: np.ndarray, stride: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """kvc's token-delta statistics of token-major ``int64`` (or int32) ``codes [n, R]`` (``|c| < 2**62``): per
    column, ``int32 [R, 128]`` counts of the codes and of their token deltas (first delta = the
    first code) at tokens ``0, stride, 2 stride, ...``, clipped to ``[-64, 63]`` and shifted by
    64 — one pass, the same counts as :func:`kvcodec.codecs.kvc.delta_rows`' numpy path."""
    lb = required()
    c, ck = _code_matrix(codes)
    n, r = c.shape
    if n >= 2**31:
        raise ValueError("delta_histograms: at most 2**31 - 1 tokens")
    hc = np.empty((r, 128), dtype=np.int32)
    he = np.empty((r, 128), dtype=np.int32)
    lb.kvn_delta_hist(ptr(c), ck, n, r, max(1, int(stride)), ptr(hc), ptr(he))
    return hc, he


#: kvn_kvc_decode's own status codes (csrc/kvc_decode.c)
_KVD_ESC_COUNT, _KVD_ESC_INSIDE, _KVD_WIDE, _KVD_STEP = 10, 11, 12, 13


def kvc_decode(stage: tuple, esc: np.ndarray, lv: int, delta: np.ndarray | None, n: int, h: int, d: int,
               mode: int, sc: np.ndarray, step_rule: tuple[np.ndarray, int, int], recon: list[int] | None,
               mean: np.ndarray, rope: tuple[int, int, np.ndarray, np.ndarray] | None, positions: np.ndarray,
               dtype, out) -> None:
    """One kvc tensor's coded tokens in one call (csrc/kvc_decode.c): the entropy stage
    (``stage``: what :func:`kvcodec.entropy.layout.parse_planes` returns for its validated
    planes), the escape join with token-delta sums (``delta`` bool ``[R]`` or None), the steps
    (``mode`` 0: channel step codes ``sc [H, D]``; 1: the same plus the ``k_tok`` offset columns;
    2: ``sc`` = the ``H`` step-code bases of token-mode V; ``step_rule`` = ``(float32 mantissas
    [8], lowest code, highest code)`` of :func:`kvcodec.quant.deadzone.step_from_code`), the
    rotating means (``rope`` = ``(channel offset, style number, uint32 phase steps, float32 sine
    table of a power-of-two length)`` of :mod:`kvcodec.transforms.rope`, at ``positions``; or
    None: ``mean [H, D]`` for every token)
    and the dequantization with reconstruction offsets ``recon``, written into ``out`` (a
    contiguous CPU tensor ``[n, H, D]`` of ``dtype``). The same values as the calls it replaces
    in :meth:`KVCCodec.decode_tensor`, bit for bit.

    Raises:
        StreamError: a corrupt stream. FormatError: escapes or step codes that no encoder
        writes (the messages of the separate passes). Unsupported: a code past int32 (the
        caller takes the separate passes, which handle it).
    """
    run_decodes([kvc_decode_job(stage, esc, lv, delta, n, h, d, mode, sc, step_rule, recon, mean, rope,
                                positions, dtype, out)])


class DecodeJob:
    """One :func:`kvc_decode` call, its arguments checked and laid out for
    ``kvn_kvc_decode_batch``: ``args`` (int64 ``[KVD_ARGS]``), the arrays they point into
    (``keep``), and what the caller adds: ``where`` (prefixed to its errors), ``after`` (run
    once it decoded) and ``fallback`` (run instead when a code does not fit int32; without
    one, :class:`Unsupported` is raised)."""

    __slots__ = ("args", "keep", "esc_size", "cmin", "cmax", "where", "after", "fallback")

    def __init__(self, args: list[int], keep: tuple, esc_size: int, cmin: int, cmax: int) -> None:
        self.args, self.keep, self.esc_size, self.cmin, self.cmax = args, keep, esc_size, cmin, cmax
        self.where: str | None = None
        self.after: Any = None
        self.fallback: Any = None

    def error(self, rc: int, bad: int) -> Exception:
        """The exception of status ``rc`` (``bad``: the failing stream or the escape count)."""
        from ..errors import StreamError
        from .ans import _STATUS_TEXT

        if rc == NOMEM:
            return MemoryError("native kvc decode: out of memory")
        if rc == _KVD_WIDE:
            return Unsupported("kvc decode: a code past int32")
        pre = f"{self.where}: " if self.where else ""
        if rc == _KVD_ESC_COUNT:
            return FormatError(f"{pre}kvc: {bad} escape symbols but the esc plane holds {self.esc_size} values")
        if rc == _KVD_ESC_INSIDE:
            return FormatError(f"{pre}kvc: an escaped code lies inside the regular range")
        if rc == _KVD_STEP:
            return FormatError(f"{pre}kvc step code outside [{self.cmin}, {self.cmax}]")
        stage = f"{self.where}: kvc entropy stage: " if self.where else ""
        return StreamError(f"{stage}ANS stream {bad} {_STATUS_TEXT.get(rc, f'failed ({rc})')}")


#: the jobs of the innermost :func:`deferred_decodes` block of this thread (or task), else None
_DEFERRED: ContextVar[list | None] = ContextVar("kvcodec_deferred_decodes", default=None)


@contextlib.contextmanager
def deferred_decodes() -> Iterator[list]:
    """Inside this block, :func:`defer_or_run` collects jobs instead of running them: the block
    yields their list, for one :func:`run_decodes` after it (the outputs are written only then).
    The same values as running each job at once, bit for bit."""
    jobs: list = []
    token = _DEFERRED.set(jobs)
    try:
        yield jobs
    finally:
        _DEFERRED.reset(token)


def defer_or_run(job: DecodeJob) -> bool:
    """``job`` added to the enclosing :func:`deferred_decodes` block (True), or run now (False)."""
    jobs = _DEFERRED.get()
    if jobs is None:
        run_decodes([job])
        return False
    jobs.append(job)
    return True


def run_decodes(jobs: list[DecodeJob]) -> None:
    """Run ``jobs`` in order in as few native calls as their outcomes allow (one when all
    decode): each writes its output, then its ``after`` runs. A job whose codes do not fit
    int32 runs its ``fallback`` (else raises :class:`Unsupported`); the first job that fails
    otherwise raises its error (the jobs after it are not run).

    Raises:
        StreamError, FormatError: as :func:`kvc_decode`. MemoryError.
    """
    if not jobs:
        return
    lb = required()
    table = np.array([j.args for j in jobs], dtype=np.int64)
    st = np.zeros(2, dtype=np.int64)
    done, n = 0, len(jobs)
    while done < n:
        stop = int(lb.kvn_kvc_decode_batch(done, n, ptr(table), ptr(st)))
        for j in jobs[done:stop]:
            if j.after is not None:
                j.after()
        if stop >= n:
            return
        job = jobs[stop]
        rc, bad = int(st[0]), int(st[1])
        if rc == _KVD_WIDE and job.fallback is not None:
            job.fallback()
        else:
            raise job.error(rc, bad)
        done = stop + 1


def kvc_decode_job(stage: tuple, esc: np.ndarray, lv: int, delta: np.ndarray | None, n: int, h: int, d: int,
                   mode: int, sc: np.ndarray, step_rule: tuple[np.ndarray, int, int], recon: list[int] | None,
                   mean: np.ndarray, rope: tuple[int, int, np.ndarray, np.ndarray] | None, positions: np.ndarray,
                   dtype, out) -> DecodeJob:
    """:func:`kvc_decode`'s arguments checked and laid out as a :class:`DecodeJob` (nothing
    decoded yet: :func:`run_decodes`).

    Raises:
        ValueError: arguments that do not fit. Unsupported: no native library, or an alphabet
        over 65536.
    """
    required()  # Unsupported here, before anything is laid out
    lay, words, offsets, tsets, rts = stage
    if lay.A > 65536:
        raise Unsupported("kvc decode: alphabet over 65536")
    geom, tabs, table_of = _flat_tables(lay, tsets, rts)
    w = np.ascontiguousarray(words, dtype=np.uint32)
    off = np.ascontiguousarray(offsets, dtype=np.uint32)
    e = _esc_operand(esc)
    r = h * d + (h if mode else 0)
    dl = _delta_flags(delta, r)
    scv = np.ascontiguousarray(sc, dtype=np.int64).reshape(-1)
    if scv.size != (h if mode == 2 else h * d):
        raise ValueError(f"kvc_decode: sc must hold {h if mode == 2 else h * d} codes, got {scv.size}")
    mant, p_mant = _pinned(step_rule[0], np.float32)
    cmin, cmax = int(step_rule[1]), int(step_rule[2])
    if mant.shape != (8,):
        raise ValueError("kvc_decode: the step rule needs 8 mantissas")
    rtab, rm, p_rtab = _recon_pinned(recon)
    mu = np.ascontiguousarray(mean, dtype=np.float32).reshape(h, d)
    keep: tuple = (geom, tabs, table_of, w, off, e, dl, scv, mant, rtab, mu, out)
    if rope is not None:
        roff, style, steps, sintab = rope
        rs = np.ascontiguousarray(steps, dtype=np.uint32)
        st, p_st = _pinned(sintab, np.float32)
        bits = st.size.bit_length() - 1
        pos = np.ascontiguousarray(positions, dtype=np.int64)
        if pos.shape != (n,) or st.size != 1 << bits or bits < 2 or style not in (0, 1):
            raise ValueError(f"kvc_decode: {n} positions, a sine table of 2**k >= 4 entries and style 0 or 1 expected")
        rope_args = [ptr(rs), rs.size, int(roff), int(style), ptr(pos), p_st, bits]
        keep += (rs, st, pos)
    else:
        rope_args = [0, 0, 0, 0, 0, 0, 2]
    fbits, fkind = _out_kind(dtype)
    if out.shape != (n, h, d) or out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(f"kvc_decode: out must be a contiguous CPU {dtype} tensor of shape {(n, h, d)}")
    args = [ptr(geom), ptr(w), ptr(off), ptr(tabs), ptr(table_of), ptr(e), e.size, int(lv),
            0 if dl is None else ptr(dl), n, h, d, int(mode), ptr(scv), p_mant, cmin, cmax,
            p_rtab, rm, ptr(mu), *rope_args, fbits, fkind, out.data_ptr()]
    assert len(args) == KVD_ARGS
    return DecodeJob(args, keep, e.size, cmin, cmax)


#: the int64 arguments of one job of kvn_kvc_decode_batch (csrc/kvc_decode.c KVD_ARGS)
KVD_ARGS = 30

# Arrays that every job passes (the step mantissas, the sine table) and reconstruction tables,
# with their addresses: laying out a job's arguments is most of a small tensor's Python time.
_RECON: dict[tuple[int, ...], tuple[np.ndarray | None, int, int]] = {}
_KINDS: dict[Any, tuple[int, int]] = {}


def _pinned(a: np.ndarray, dtype: Any) -> tuple[np.ndarray, int]:
    """``a`` as a contiguous array of ``dtype`` and its address, remembered for an array that
    already is one (the module constants passed on every call; an array's address never
    changes while it lives, and :func:`~kvcodec.native.abi.kept_ptr` keeps it alive)."""
    c = np.ascontiguousarray(a, dtype=dtype)
    return c, (kept_ptr(c) if c is a else ptr(c))


def _recon_pinned(recon: list[int] | None) -> tuple[np.ndarray | None, int, int]:
    """:func:`_recon_table` and the table's address (0 without one), remembered per offsets."""
    key = tuple(recon) if recon else ()
    hit = _RECON.get(key)
    if hit is None:
        tab, rm = _recon_table(recon)
        hit = (tab, rm, 0 if tab is None else ptr(tab))
        if len(_RECON) < 64:
            _RECON[key] = hit
    return hit


def _out_kind(dtype: Any) -> tuple[int, int]:
    """The float32 bits of ``dtype``'s largest finite value (the saturation bound) and its C kind."""
    hit = _KINDS.get(dtype)
    if hit is None:
        import torch

        hit = _KINDS[dtype] = (int(np.array(torch.finfo(dtype).max, dtype=np.float32).view(np.uint32)),
                               float_kind(dtype))
    return hit
