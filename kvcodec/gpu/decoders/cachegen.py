"""GPU decoders of ``cachegen`` (formats/SPEC.md §11.6) and ``cachegen-lmcache`` (§11.7): anchors and
token deltas decoded by the ANS stage and dequantized through sink ``SINK_TOKSYM``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..batch import DecodePlan
from ..device import _DTYPE_MAX, _check_size, to_device
from ..registry import _where, register_gpu_decoder
from ..stage import SINK_TOKSYM, DeviceStage, _run_stage

if TYPE_CHECKING:
    from ...codec import Codec, EncodedTensor, TensorContext


@register_gpu_decoder("cachegen-lmcache")
def _gpu_cachegen_lmcache(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    v = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation (formats/SPEC.md §11.7)
    where = _where(ctx)
    _check_size(ctx.shape)
    st = DeviceStage(v.ans, dev)
    s_dev = to_device(v.scale.view(np.int16), dev)
    levels = v.bins - 1

    def run() -> torch.Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=dev)
        launch = st.launch(SINK_TOKSYM, out, scale=s_dev, mid=(levels - 1) // 2, max_code=v.bins - 2)
        _run_stage(dev, st, launch)
        return out

    return DecodePlan(run, lambda: st.check(where))


@register_gpu_decoder("cachegen")
def _gpu_cachegen(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    v = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation (formats/SPEC.md §11.6)
    where = _where(ctx)
    rec, g, la = v.levels, v.group, v.anchor_levels
    t, h, d = ctx.shape
    c = h * d
    _check_size(ctx.shape)
    na = v.anc_expected[1]
    anc_st = DeviceStage(v.anc, dev)
    dl_st = DeviceStage(v.ans, dev)
    s_dev = to_device(v.scale.view(np.int16), dev)
    fmax = _DTYPE_MAX[ctx.dtype]

    def run() -> torch.Tensor:
        # anchors: fp32 values (code - Ma) * scale[j * g], kept for the deltas
        anc_hat = torch.empty((na, c), dtype=torch.float32, device=dev)
        _run_stage(dev, anc_st, anc_st.launch(SINK_TOKSYM, anc_hat, scale=s_dev, mid=(la - 1) // 2, tmul=g, out_is_t=0))
        out = torch.empty((t, c), dtype=ctx.dtype, device=dev)
        if na:
            # the same saturating RNE cast as the CPU decoders (formats/SPEC.md §11.1)
            out[0::g] = anc_hat.clamp(-fmax, fmax).to(ctx.dtype)
        if t - na:
            # delta column j is token j + j // (g-1) + 1; value = anchor + (code - M) * scale[t]
            launch = dl_st.launch(SINK_TOKSYM, out, out_dtype=ctx.dtype, scale=s_dev, base=anc_hat,
                                  mid=(rec - 1) // 2, tmul=1, tdiv=g - 1, tadd=1, out_is_t=1, base_group=g)
            _run_stage(dev, dl_st, launch)
        return out.reshape(ctx.shape)

    def verify() -> None:
        anc_st.check(where)
        dl_st.check(where)

    return DecodePlan(run, verify)
