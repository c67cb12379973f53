"""The entropy stage on a device: ANS streams (formats/ANS.md §3) validated on the host, uploaded,
and decoded by the ``ans.cu`` kernels, either fused with a codec's dequantization (the sinks) or
into token-major symbols (:meth:`DeviceStage.launch_tokens`).
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from ..errors import DeviceError, StreamError
from .device import Launch, _decode_launch, _out_name, to_device

ANS_THREADS = 128
#: Bits of the bucket index of the _blk kernels (256 entries per table).
BUCKET_BITS = 8
#: Shared memory a block may use without opting in; the _smem kernels need blockDim*(A+1)*4.
_SMEM_DEFAULT_LIMIT = 48 * 1024
SINK_SYMBOLS, SINK_KIVI, SINK_TOKSYM = 0, 1, 2
_ANS_STATUS = {1: "ends in a zero word", 2: "not consumed exactly (corrupt or wrong index)",
               3: "decodes to a code outside the quantizer's range"}


class AnsParams(ctypes.Structure):
    """Mirror of ``kvc::AnsParams`` (cuda/ans.cuh)."""

    _fields_ = [
        ("words", ctypes.c_void_p), ("offsets", ctypes.c_void_p), ("cdf", ctypes.c_void_p),
        ("table_of", ctypes.c_void_p), ("status", ctypes.c_void_p), ("out", ctypes.c_void_p),
        ("scale", ctypes.c_void_p), ("zero", ctypes.c_void_p), ("base", ctypes.c_void_p),
        *[(n, ctypes.c_int32) for n in ("R", "N", "C", "G", "A", "n_groups", "n_streams", "scope",
                                        "heads", "dim", "group", "axis", "mid", "max_code",
                                        "tmul", "tdiv", "tadd", "out_is_t", "base_group")],
        ("aux", ctypes.c_void_p),
        *[(n, ctypes.c_int32) for n in ("aux_mode", "code_off", "code_max", "blk_words", "cs", "half")],
        ("bucket", ctypes.c_void_p), ("bucket_bits", ctypes.c_int32), ("bucket_words", ctypes.c_int32),
        ("acc", ctypes.c_void_p), ("thr", ctypes.c_void_p), ("n_thr", ctypes.c_int32), ("center", ctypes.c_int32),
    ]


class DeviceStage:
    """An entropy stage (formats/ANS.md §3) validated on the host and uploaded to a device.

    Validation is :func:`kvcodec.entropy.stage.parse_planes`, the CPU decoder's own, so both
    devices accept and reject the same planes. Tables become cumulative frequencies at
    precision 24, each padded with ``2**24`` to ``cs = 2**LOG + 1`` entries (``2**LOG >= A``) for
    the kernels' fixed-step binary search (``cdf [n_sets * K, cs]``), and ``table_of [n_sets, R]``
    indexes them.
    """

    def __init__(self, planes: dict[str, np.ndarray], dev: torch.device, tables: np.ndarray | None = None,
                 row_table: np.ndarray | None = None) -> None:
        from ..entropy.stage import parse_planes

        lay, words, off, tsets, rts = parse_planes(planes, tables, row_table)
        if lay.scope == 2 and min(lay.G, lay.R) * (lay.A // 2 + 1) >= 2**31:
            # the kernels keep §3.1's magnitude sums in int32 (a stream has at most min(G, R) rows)
            raise DeviceError("entropy stage scope 2 with magnitude sums beyond int32 (rows per stream "
                              f"{min(lay.G, lay.R)}, alphabet {lay.A}): decode this file with device='cpu'")
        self.layout = lay
        f = tsets.astype(np.uint64) << np.uint64(24 - lay.P)  # [n_sets, K, A] at precision 24
        log = max(1, (lay.A - 1).bit_length())  # 2**log >= A
        self.cs, self.half = (1 << log) + 1, 1 << (log - 1)
        cdf = np.full((lay.n_sets * lay.K, self.cs), 1 << 24, dtype=np.uint32)
        if cdf.size:
            cdf[:, 0] = 0
            cdf[:, 1:lay.A + 1] = np.cumsum(f.reshape(-1, lay.A), axis=1).astype(np.uint32)
        sets = np.arange(lay.n_sets, dtype=np.int64)[:, None] * lay.K
        # [n_sets, R]; scope 2: [Q, R], the table of each (class, row) in the one set
        table_of = (sets + np.asarray(rts, dtype=np.int64)).astype(np.int32)
        if lay.n_streams >= 2**31 or words.size >= 2**32:
            raise DeviceError("entropy stage too large for the GPU decoder")
        self.words = to_device(np.ascontiguousarray(words, dtype=np.uint32), dev)
        self.offsets = to_device(off.astype(np.uint32), dev)
        self.cdf = to_device(cdf, dev)
        self.table_of = to_device(np.ascontiguousarray(table_of), dev)
        self.status = torch.zeros(max(1, lay.n_streams), dtype=torch.int32, device=dev)
        self._cdf_host = cdf if lay.n_sets == 1 else None
        self.thr = to_device(np.array(lay.thresholds or (0,), dtype=np.int32), dev)
        self._dev = dev
        self._bucket: tuple[torch.Tensor, int] | None = None

    def bucket(self, bits: int) -> torch.Tensor:
        """The bucket index of table set 0: ``uint16 [K, 2**bits]``, entry ``b`` = the symbol whose
        interval holds ``b << (24 - bits)`` (formats/ANS.md allows any exact symbol search)."""
        if self._bucket is None or self._bucket[1] != bits:
            lay = self.layout
            cdf = self._cdf_host[: lay.K, : lay.A + 1].astype(np.int64)
            starts = np.arange(1 << bits, dtype=np.int64) << (24 - bits)
            b = np.stack([np.searchsorted(row, starts, side="right") - 1 for row in cdf]).astype(np.uint16)
            self._bucket = (to_device(np.ascontiguousarray(b), self._dev), bits)
        return self._bucket[0]

    def launch(self, sink: int, out: torch.Tensor, out_dtype: torch.dtype | None = None, *,
               scale: torch.Tensor | None = None, zero: torch.Tensor | None = None, base: torch.Tensor | None = None,
               heads: int = 0, dim: int = 0, group: int = 1, axis: int = 0, mid: int = 0, max_code: int | None = None,
               tmul: int = 1, tdiv: int = 0, tadd: int = 0, out_is_t: int = 1, base_group: int = 1,
               aux: torch.Tensor | None = None, aux_mode: int = 0, code_off: int = 0, code_max: int = 0,
               tables: str | None = None, use_bucket: bool = True) -> Launch:
        """The launch that decodes every stream into ``out`` through ``sink``.

        ``tables`` forces where the kernel reads the tables (``"blk"``, ``"smem"``, ``"global"``);
        by default the block-shared copy when the stage has one table set that fits in 48 KB of
        shared memory, else per-thread copies when they fit, else global memory.
        """
        lay = self.layout
        if lay.scope == 2:
            raise DeviceError("a scope-2 stage (magnitude contexts) decodes through launch_tokens only")
        ptr = (lambda t: t.data_ptr() if t is not None else 0)
        blk_words = lay.K * self.cs
        bits = self._bucket_bits(blk_words)
        if tables is None:
            if lay.scope == 0 and blk_words * 4 <= _SMEM_DEFAULT_LIMIT:
                tables = "blk"
            elif ANS_THREADS * self.cs * 4 <= _SMEM_DEFAULT_LIMIT:
                tables = "smem"
            else:
                tables = "global"
        if tables == "blk" and (lay.scope != 0 or blk_words * 4 > _SMEM_DEFAULT_LIMIT):
            raise DeviceError("block-shared tables need one table set of at most 48 KB")
        if tables == "smem" and ANS_THREADS * self.cs * 4 > _SMEM_DEFAULT_LIMIT:
            raise DeviceError("per-thread tables need at most 48 KB of shared memory per block")
        if tables != "blk" or not use_bucket:
            bits = 0
        bkt = self.bucket(bits) if bits else None
        bucket_words = lay.K * (1 << bits) // 2 if bits else 0
        p = AnsParams(self.words.data_ptr(), self.offsets.data_ptr(), self.cdf.data_ptr(), self.table_of.data_ptr(),
                      self.status.data_ptr(), out.data_ptr(), ptr(scale), ptr(zero), ptr(base),
                      lay.R, lay.N, lay.C, lay.G, lay.A, lay.n_groups, lay.n_streams, lay.scope,
                      heads, dim, group, axis, mid, lay.A - 1 if max_code is None else max_code,
                      tmul, tdiv, tadd, out_is_t, base_group, ptr(aux), aux_mode, code_off, code_max, blk_words,
                      self.cs, self.half, ptr(bkt), bits, bucket_words, 0, self.thr.data_ptr(), 0, 0)
        smem = {"blk": (blk_words + bucket_words) * 4, "smem": ANS_THREADS * self.cs * 4, "global": 0}[tables]
        if sink == SINK_SYMBOLS:
            name = "ans_symbols"
        else:
            # the fast kernels take column j as token j with no anchors; the "x" ones any mapping
            general = (tmul, tdiv, tadd) != (1, 0, 0) or aux_mode != 0 or base is not None or not out_is_t
            kind = ("kivi" if sink == SINK_KIVI else "toksym") + ("x" if general else "")
            name = f"ans_{kind}_{_out_name(out_dtype or out.dtype)}"
        keep = [self.words, self.offsets, self.cdf, self.table_of, self.status, out, scale, zero, base, aux, bkt]
        return Launch("ans.cu", name + ("" if tables == "global" else "_" + tables), lay.n_streams, [p], keep=keep,
                      block=ANS_THREADS, smem=smem)

    def _bucket_bits(self, blk_words: int) -> int:
        """Bits of the _blk kernels' bucket index: ``2**bits`` entries per table (``bits <= P``:
        finer buckets than the table's own quantum would not help), as many as fit next to the
        tables in 48 KB; 0 for none."""
        lay = self.layout
        if lay.n_sets != 1 or lay.A > 65535:
            return 0
        for b in range(min(lay.P, BUCKET_BITS), 3, -1):
            if (blk_words + lay.K * (1 << b) // 2) * 4 <= _SMEM_DEFAULT_LIMIT:
                return b
        return 0

    def launch_tokens(self, out: torch.Tensor, *, tables: str | None = None, use_bucket: bool = True) -> Launch:
        """The launch that decodes every stream into token-major ``int32 out [N, R]`` (any scope,
        magnitude contexts included: the ``ans_tokens`` kernels).

        ``tables``: ``"blk"`` (one table set in shared memory; the default when it fits in
        48 KB) or ``"global"``.
        """
        lay = self.layout
        blk_words = lay.K * self.cs
        fits = lay.n_sets == 1 and blk_words * 4 <= _SMEM_DEFAULT_LIMIT
        if tables is None:
            tables = "blk" if fits else "global"
        if tables not in ("blk", "global") or (tables == "blk" and not fits):
            raise DeviceError("ans_tokens: tables 'blk' need one table set of at most 48 KB, else 'global'")
        if tuple(out.shape) != (lay.N, lay.R) or out.dtype != torch.int32 or not out.is_contiguous():
            raise DeviceError(f"ans_tokens: out must be a contiguous int32 [{lay.N}, {lay.R}] tensor")
        bits = self._bucket_bits(blk_words) if tables == "blk" and use_bucket else 0
        bkt = self.bucket(bits) if bits else None
        bucket_words = lay.K * (1 << bits) // 2 if bits else 0
        acc = None
        if lay.scope == 2:  # per (stream group, token): the magnitude sum of the rows decoded so far
            acc = torch.empty((lay.n_groups, max(1, lay.N)), dtype=torch.int32, device=out.device)
        p = AnsParams(self.words.data_ptr(), self.offsets.data_ptr(), self.cdf.data_ptr(), self.table_of.data_ptr(),
                      self.status.data_ptr(), out.data_ptr(), 0, 0, 0,
                      lay.R, lay.N, lay.C, lay.G, lay.A, lay.n_groups, lay.n_streams, lay.scope,
                      0, 0, 1, 0, 0, lay.A - 1, 1, 0, 0, 1, 1, 0, 0, 0, 0, blk_words,
                      self.cs, self.half, 0 if bkt is None else bkt.data_ptr(), bits, bucket_words,
                      0 if acc is None else acc.data_ptr(), self.thr.data_ptr(), lay.Q - 1, lay.center)
        smem = (blk_words + bucket_words) * 4 if tables == "blk" else 0
        keep = [self.words, self.offsets, self.cdf, self.table_of, self.status, out, bkt, acc, self.thr]
        return Launch("ans.cu", "ans_tokens" + ("_blk" if tables == "blk" else ""), lay.n_streams, [p], keep=keep,
                      block=ANS_THREADS, smem=smem)

    def check(self, where: str) -> None:
        """Raise :class:`~kvcodec.errors.StreamError` if any stream failed (synchronises)."""
        if self.layout.n_streams == 0:
            return
        st = self.status[: self.layout.n_streams]
        bad = torch.nonzero(st).flatten()
        if bad.numel():
            i = int(bad[0])
            code = int(st[i])
            raise StreamError(f"{where}: ANS stream {i} {_ANS_STATUS.get(code, f'failed ({code})')}")


def _run_stage(dev: torch.device, stage: DeviceStage, launch: Launch) -> None:
    """Run a stage's launch unless the stage has no streams (an empty tensor)."""
    if stage.layout.n_streams:
        _decode_launch(dev, launch)
