"""GPU decoder of ``kvc`` (formats/codecs/kvc.md): the entropy stage to token-major symbols, then the
``kvc_codec.cu`` kernels (escape join, token deltas, dequantization), and for Hadamard files the
reference's inverse transform in torch (:func:`fwht_torch`).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import numpy as np
import torch

from ...errors import DeviceError, FormatError
from ..batch import DecodePlan
from ..device import _BITS_VIEW, Launch, _check_size, _decode_launch, _out_name, to_device
from ..registry import register_gpu_decoder
from ..stage import DeviceStage, _run_stage

if TYPE_CHECKING:
    from ...codec import Codec, EncodedTensor, TensorContext


class KvcParams(ctypes.Structure):
    """Mirror of ``kvc::KvcParams`` (cuda/kvc_codec.cuh)."""

    _fields_ = [
        *[(n, ctypes.c_void_p) for n in ("codes", "esc", "esc_count", "esc_base", "pred", "step_ch", "sc", "step_tab",
                                        "mean", "recon", "tok", "out", "status")],
        *[(n, ctypes.c_int32) for n in ("n", "R", "H", "D", "L", "n_esc", "n_recon", "step_mode", "raw", "pad_")],
    ]


KVC_STEP_CHANNEL, KVC_STEP_KTOK, KVC_STEP_TOKEN = 0, 1, 2
_KVC_THREADS = 256


def fwht_torch(x: torch.Tensor) -> torch.Tensor:
    """:func:`kvcodec.transforms.hadamard.fwht` on a float32 tensor of any device: the same
    butterflies and the same final float32 multiply, so the same bits (each add, subtract and
    multiply is one IEEE rounding on either device)."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    y = x.clone()
    h = 1
    while h < d:
        v = y.view(*lead, d // (2 * h), 2, h)
        a = v[..., 0, :].clone()
        b = v[..., 1, :]
        v[..., 0, :] = a + b
        v[..., 1, :] = a - b  # b still holds the odd halves: only the even ones were overwritten
        h *= 2
    return y * torch.tensor(np.float32(1.0 / np.sqrt(d)), device=y.device)


_STEP_TABLES: dict[torch.device, torch.Tensor] = {}


def _step_table(dev: torch.device) -> torch.Tensor:
    """The float32 step of every log-step code (kvcodec.quant.deadzone.step_from_code), on ``dev``."""
    from ...quant.deadzone import STEP_CODE_MAX, STEP_CODE_MIN, step_from_code

    if dev not in _STEP_TABLES:
        tab = to_device(step_from_code(np.arange(STEP_CODE_MIN, STEP_CODE_MAX + 1)), dev)
        if dev.type == "cuda":  # shared by every stream from now on: the upload must be complete
            torch.cuda.synchronize(dev)
        _STEP_TABLES[dev] = tab
    return _STEP_TABLES[dev]


def _kvc_error(code: int, where: str, n_esc: int) -> Exception:
    from ...quant.deadzone import STEP_CODE_MAX, STEP_CODE_MIN

    if code == 1:
        return FormatError(f"{where}: kvc: the escape symbols and the esc plane's {n_esc} values disagree in number")
    if code == 2:
        return FormatError(f"{where}: kvc: an escaped code lies inside the regular range")
    if code == 3:
        return DeviceError(f"{where}: kvc codes beyond 32 bits, which the GPU decoder does not hold; "
                           "decode this file with device='cpu'")
    return FormatError(f"{where}: kvc step code outside [{STEP_CODE_MIN}, {STEP_CODE_MAX}]")


@register_gpu_decoder("kvc")
def _gpu_kvc(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    """kvc on the GPU: the entropy stage (any scope, magnitude contexts included) to token-major
    symbols, escape join and token-delta sums per row, then dequantization straight into the
    ``[T, H, D]`` output (protected tokens copied as they are). Validation is the CPU decoder's
    own (:meth:`~kvcodec.codecs.kvc.KVCCodec.parse_tensor`)."""
    from ...entropy.stage import StageLayout
    from ...transforms.rope import rotated_means
    from ...quant.deadzone import recon_values, step_from_code

    v = codec.parse_tensor(enc, ctx)
    t, h, d = ctx.shape
    _check_size(ctx.shape)
    where, n = v.where, v.n
    bits = _BITS_VIEW[ctx.dtype]
    ibits = {np.int16: torch.int16, np.int32: torch.int32}[bits]
    keep_idx = torch.from_numpy(np.flatnonzero(v.mask)).to(dev)
    prot = to_device(np.ascontiguousarray(v.prot, dtype=bits), dev)

    def protected() -> torch.Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=dev)
        if keep_idx.numel():
            out.view(ibits)[keep_idx] = prot
        return out

    if n == 0:
        return DecodePlan(protected)
    lv, rows = v.lv, v.rows
    try:  # the geometry the CPU decoder checks before it allocates, then the stage's own checks
        if "meta" not in v.stage_planes:
            raise FormatError("ANS stage plane 'meta' is missing")
        lay = StageLayout(v.stage_planes["meta"])
        if (lay.R, lay.N, lay.A) != (rows, n, 2 * lv):
            raise FormatError(f"ANS stage is [{lay.R}, {lay.N}] over {lay.A} symbols, expected "
                              f"[{rows}, {n}] over {2 * lv}")
        stage = DeviceStage(v.stage_planes, dev)
    except FormatError as e:
        raise type(e)(f"{where}: kvc entropy stage: {e}") from None
    hd = h * d
    if v.per_channel and not v.k_tok:
        mode, sc = KVC_STEP_CHANNEL, np.zeros(1, np.int32)
        step_ch = step_from_code(v.sc_ch).reshape(-1)
    else:
        mode = KVC_STEP_KTOK if v.per_channel else KVC_STEP_TOKEN
        if v.per_channel:  # channel codes: already checked to lie in the step-code range
            sc = v.sc_ch.reshape(-1).astype(np.int32)
        else:
            if not all(-2**31 <= b < 2**31 for b in v.base):
                raise DeviceError(f"{where}: kvc step_base beyond 32 bits; decode this file with device='cpu'")
            sc = np.array(v.base, dtype=np.int32)
        step_ch = np.zeros(1, np.float32)
    m = len(v.rc) if v.rc else 0
    recon = recon_values(np.arange(-m, m + 1), v.rc) if m else np.zeros(1, np.float32)
    esc = v.esc.astype(np.int32).reshape(-1)
    n_esc = esc.size
    d_esc = to_device(esc if n_esc else np.zeros(1, np.int32), dev)
    d_pred = to_device(v.use.astype(np.uint8), dev) if v.use is not None else None
    d_step_ch = to_device(np.ascontiguousarray(step_ch, dtype=np.float32), dev)
    d_sc = to_device(sc, dev)
    d_tab = _step_table(dev)
    d_mean = to_device(np.ascontiguousarray(v.mean.reshape(-1), dtype=np.float32), dev)
    d_recon = to_device(np.ascontiguousarray(recon, dtype=np.float32), dev)
    free = np.flatnonzero(~v.mask)
    d_tok = to_device(free.astype(np.int32), dev)
    d_free = torch.from_numpy(free).to(dev)
    status = torch.zeros(1, dtype=torch.int32, device=dev)
    raw = v.tr == "hadamard" or v.rope is not None
    if v.rope is not None:  # rotating means: the reference's float32 values, added on the device
        off, style, steps = v.rope
        d_rot = to_device(rotated_means(v.mean, free, steps, off, style), dev)
    lim = float(torch.finfo(ctx.dtype).max)

    def params(codes, counts, base, out) -> KvcParams:
        ptr = (lambda x: 0 if x is None else x.data_ptr())
        return KvcParams(codes.data_ptr(), d_esc.data_ptr(), ptr(counts), ptr(base), ptr(d_pred), d_step_ch.data_ptr(),
                         d_sc.data_ptr(), d_tab.data_ptr(), d_mean.data_ptr(), d_recon.data_ptr() if m else 0,
                         d_tok.data_ptr(), ptr(out), status.data_ptr(), n, rows, h, d, lv, n_esc, m, mode,
                         1 if raw else 0, 0)

    def run() -> torch.Tensor:
        out = protected()
        codes = torch.empty((n, rows), dtype=torch.int32, device=dev)
        _run_stage(dev, stage, stage.launch_tokens(codes))
        status.zero_()
        counts = torch.empty(rows, dtype=torch.int32, device=dev)
        keep = [codes, counts, d_esc, d_pred, status, d_step_ch, d_sc, d_tab, d_mean, d_recon, d_tok]

        def launch(kernel: str, items: int, p: KvcParams, *more: torch.Tensor) -> None:
            _decode_launch(dev, Launch("kvc_codec.cu", kernel, items, [p, ctypes.c_int64(items)],
                                       keep=keep + list(more), block=_KVC_THREADS))

        launch("kvc_esc_count", rows, params(codes, counts, None, None))
        base = torch.cumsum(counts, 0, dtype=torch.int32) - counts  # row r's first escape
        launch("kvc_join", rows, params(codes, counts, base, None), base)
        dst = torch.empty((n, h, d), dtype=torch.float32, device=dev) if raw else out
        launch("kvc_dequant_" + _out_name(torch.float32 if raw else ctx.dtype), n * hd,
               params(codes, None, None, dst), dst)
        if raw:  # Hadamard files, rotating means: the reference's transform, means, saturation and cast
            xh = torch.clamp((dst + d_rot) if v.rope is not None else (fwht_torch(dst) + d_mean.view(1, h, d)),
                             -lim, lim)
            out[d_free] = xh.to(ctx.dtype)
        return out

    def verify() -> None:
        try:
            stage.check(where)
        except FormatError as e:
            raise type(e)(f"{where}: kvc entropy stage: {str(e).removeprefix(where + ': ')}") from None
        code = int(status[0])
        if code:
            raise _kvc_error(code, where, n_esc)

    return DecodePlan(run, verify)
