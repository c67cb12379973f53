"""GPU decoder of ``kivi-ans`` (formats/SPEC.md §11.5): the ANS stage decoded and dequantized in one
fused pass (sink ``SINK_KIVI``), with the token-delta anchors in a second stage.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from ..batch import DecodePlan
from ..device import _check_size, to_device
from ..registry import _where, register_gpu_decoder
from ..stage import SINK_KIVI, DeviceStage, _run_stage

if TYPE_CHECKING:
    from ...codec import Codec, EncodedTensor, TensorContext


@register_gpu_decoder("kivi-ans")
def _gpu_kivi_ans(codec: "Codec", enc: "EncodedTensor", ctx: "TensorContext", dev: torch.device) -> DecodePlan:
    v = codec.parse_tensor(enc, ctx)  # the CPU decoder's own validation (formats/SPEC.md §11.5)
    where = _where(ctx)
    bits, group, axis, dl = v.bits, v.group, v.axis, v.delta
    t, h, d = ctx.shape
    c = h * d
    _check_size(ctx.shape)
    if dl:
        na = v.anc_expected[1]
        anc_st = DeviceStage(v.anc, dev)
        dif_st = DeviceStage(v.ans, dev)
    else:
        st = DeviceStage(v.ans, dev)
    s_dev = to_device(v.scale.view(np.int16).reshape(-1), dev)
    z_dev = to_device(v.zero.view(np.int16).reshape(-1), dev)
    ax = 0 if axis == "channel" else 1

    def run() -> torch.Tensor:
        out = torch.empty(ctx.shape, dtype=ctx.dtype, device=dev)
        kw = dict(scale=s_dev, zero=z_dev, heads=h, dim=d, group=group, axis=ax)
        if not dl:
            # one pass: ANS decode fused with the kivi dequantization, straight into [T, H, D]
            _run_stage(dev, st, st.launch(SINK_KIVI, out, **kw))
            return out
        # delta: the anchors' stage decodes and dequantizes tokens 0, dl, 2*dl, ... and keeps their
        # codes; the differences' stage adds each token's anchor code (range-checked) and
        # dequantizes the rest. Both fused, in stream order on the same CUDA stream.
        anc_codes = torch.empty((na, c), dtype=torch.uint8, device=dev)
        _run_stage(dev, anc_st, anc_st.launch(SINK_KIVI, out, tmul=dl, aux=anc_codes, aux_mode=1, **kw))
        if t - na:
            launch = dif_st.launch(SINK_KIVI, out, tmul=1, tdiv=dl - 1, tadd=1, base_group=dl, aux=anc_codes,
                                   aux_mode=2, code_off=(1 << bits) - 1, code_max=(1 << bits) - 1, **kw)
            _run_stage(dev, dif_st, launch)
        return out

    def verify() -> None:
        for stage in ([anc_st, dif_st] if dl else [st]):
            stage.check(where)

    return DecodePlan(run, verify)
