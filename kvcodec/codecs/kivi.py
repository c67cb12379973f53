"""KIVI-style integer codecs: ``kivi`` (presets ``kivi-4``, ``kivi-2``).

K is quantized per channel (min-max over groups of ``group`` tokens, because K has large fixed
per-channel offsets), V per token (min-max over groups of ``group`` channels), as in KIVI
(Liu et al., ICML'24). See :mod:`kvcodec.quant.intq` for the arithmetic.

Config (codec id ``"kivi"``):

* ``bits``: code width 1..8 (presets: 4 and 2).
* ``group``: group length (tokens for K, channels for V); default 32 as in KIVI. Scale and zero
  are float16, so the side information is 32/group bits per element (1 bit at 32).
* ``residual``: the ``residual`` most recent tokens are kept in the source dtype, unquantized
  (KIVI's full-precision window). Default 0 in the presets: KIVI keeps that window because new
  tokens are still arriving while decoding; a cache at rest in a file gains nothing from it but
  size (128 fp16 tokens of a 1024-token cache cost 2 extra bits per element).
* ``latent_axis``: axis for an MLA latent ``kv`` tensor: ``"token"`` (default: the latent has no
  per-channel offsets known a priori, and per-token groups need no token grouping) or
  ``"channel"``.

Plane layout of one ``[T, H, D]`` tensor (pinned; the CUDA kernels read exactly this). Let
``Tr = min(residual, T)`` and ``Tq = T - Tr`` (the first ``Tq`` tokens are quantized):

* ``codes``: ``uint8 [ceil(Tq * H * D * bits / 8)]`` (1-D): the ``uint8 [Tq, H, D]`` codes
  flattened in C order, written as one continuous LSB-first bit stream (bit ``j`` of code ``i``
  is stream bit ``i * bits + j``, stream bit ``k`` is bit ``k % 8`` of byte ``k // 8``), the last
  byte zero-padded (:func:`kvcodec.quant.packing.pack_bits`).
* ``scale``, ``zero``: ``float16``; K (axis ``"channel"``): ``[ceil(Tq/group), H, D]``, token ``t``
  uses row ``t // group``; V (axis ``"token"``): ``[Tq, H, ceil(D/group)]``, channel ``d`` uses
  column ``d // group``. ``zero`` is the group minimum.
* ``recent`` (present only when ``Tr > 0``): the last ``Tr`` tokens ``[Tr, H, D]`` bit for bit in
  the source dtype, viewed as integers: ``int16`` for float16/bfloat16, ``int32`` for float32.

Tensor params in the manifest: ``{"axis": "channel"|"token", "bits": b, "group": g, "recent": Tr}``.

Decode: ``x = float32(code) * float32(scale) + float32(zero)`` (product rounded, then sum
rounded; no fused multiply-add), clamped to the source dtype's finite range (``+-65504`` for
float16, ``+-finfo(bfloat16).max`` for bfloat16; none for float32), cast to the source dtype
(RNE); then the ``recent`` tokens appended.

Example:
    >>> import torch, kvcodec
    >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(40, 2, 64), torch.randn(40, 2, 64))])
    >>> codec = kvcodec.get_codec("kivi-4")
    >>> out = codec.decode(codec.encode(cache))
    >>> err = (out.layers[0]["v"] - cache.layers[0]["v"]).abs().max().item()
    >>> err < 0.5, codec.nominal_bits
    (True, 5.0)
"""

from __future__ import annotations

import numpy as np
import torch

from ..codec import Codec, EncodedTensor, TensorContext, register_codec, register_preset
from ..errors import ConfigError, FormatError
from ..quant.fast import intq_dequantize_fast, intq_quantize_fast
from ..quant.intq import AXES, IntQTensor, check_intq_params, intq_param_shape
from ..quant.packing import pack_bits, packed_nbytes, unpack_bits
from .fp8 import NOMINAL_SHAPE, plane_as_tensor

_BITS_VIEW = {torch.float32: (torch.int32, np.int32), torch.float16: (torch.int16, np.int16),
              torch.bfloat16: (torch.int16, np.int16)}


@register_codec
class KIVICodec(Codec):
    """KIVI-style asymmetric integer quantization; see the module docstring.

    Example:
        >>> import kvcodec
        >>> kvcodec.get_codec("kivi-2").get_config()
        {'id': 'kivi', 'bits': 2, 'group': 32, 'residual': 0, 'latent_axis': 'token'}
    """

    codec_id = "kivi"
    defaults = {"bits": 4, "group": 32, "residual": 0, "latent_axis": "token"}

    def check_params(self) -> None:
        p = self.params
        check_intq_params(p["bits"], p["latent_axis"], p["group"])
        if p["residual"] < 0:
            raise ConfigError(f"kivi residual must be >= 0, got {p['residual']}")

    def axis(self, role: str) -> str:
        return {"k": "channel", "v": "token"}.get(role, self.params["latent_axis"])

    def tensor_bits(self, shape: tuple[int, int, int], role: str, source_bits: int = 16) -> int:
        """Exact bits of the planes of one tensor."""
        t, h, d = shape
        tr = min(self.params["residual"], t)
        tq = t - tr
        ps = intq_param_shape((tq, h, d), self.axis(role), self.params["group"])
        return (8 * packed_nbytes(tq * h * d, self.params["bits"]) + 2 * 16 * ps[0] * ps[1] * ps[2]
                + source_bits * tr * h * d)

    @property
    def nominal_bits(self) -> float:
        """Bits per element of all planes at ``NOMINAL_SHAPE`` (1024 tokens, 8 heads, D=128, fp16)."""
        n = NOMINAL_SHAPE[0] * NOMINAL_SHAPE[1] * NOMINAL_SHAPE[2]
        return sum(self.tensor_bits(NOMINAL_SHAPE, r) for r in ("k", "v")) / (2 * n)

    def encode_tensor(self, x: torch.Tensor, ctx: TensorContext) -> EncodedTensor:
        bits, group = self.params["bits"], self.params["group"]
        t = x.shape[0]
        tr = min(self.params["residual"], t)
        axis = self.axis(ctx.role)
        # the numpy fast path: bit-exact with intq_quantize_reference (tested)
        q = intq_quantize_fast(x[: t - tr], bits, axis, group)
        planes = {"codes": pack_bits(q.codes, bits), "scale": q.scale.numpy(), "zero": q.zero.numpy()}
        if tr:
            iv, _ = _BITS_VIEW[x.dtype]
            planes["recent"] = x[t - tr:].contiguous().view(iv).numpy()
        return EncodedTensor(planes, {"axis": axis, "bits": bits, "group": group, "recent": tr})

    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        where = f"layers.{ctx.layer}.{ctx.role}"
        p = enc.params
        t, h, d = ctx.shape
        ok = (p.get("axis") in AXES and all(isinstance(p.get(k), int) and not isinstance(p.get(k), bool)
                                            for k in ("bits", "group", "recent")))
        if not ok or not 1 <= p["bits"] <= 8 or p["group"] < 1 or not 0 <= p["recent"] <= t:
            raise FormatError(f"{where}: bad kivi params {p!r}")
        bits, group, tr, axis = p["bits"], p["group"], p["recent"], p["axis"]
        tq = t - tr
        packed = enc.planes.get("codes")
        if packed is None:
            raise FormatError(f"{where}: plane 'codes' is missing")
        codes = torch.from_numpy(unpack_bits(packed, bits, tq * h * d)).reshape(tq, h, d)
        ps = intq_param_shape((tq, h, d), axis, group)
        scale = plane_as_tensor(enc, ctx, "scale", np.float16, ps)
        zero = plane_as_tensor(enc, ctx, "zero", np.float16, ps)
        if scale.numel() and not bool((torch.isfinite(scale) & torch.isfinite(zero)).all()):
            raise FormatError(f"{where}: kivi scale/zero must be finite")
        out = intq_dequantize_fast(IntQTensor(codes, scale, zero, bits, axis, group), ctx.dtype)
        if tr:
            _, nv = _BITS_VIEW[ctx.dtype]
            recent = plane_as_tensor(enc, ctx, "recent", nv, (tr, h, d)).view(ctx.dtype)
            out = torch.cat([out, recent], dim=0)
        elif "recent" in enc.planes:
            raise FormatError(f"{where}: unexpected plane 'recent' (params say 0 recent tokens)")
        return out


register_preset("kivi-4", {"id": "kivi", "bits": 4},
                "KIVI int4: K per channel, V per token, groups of 32, fp16 scale+zero (5 bits)")
register_preset("kivi-2", {"id": "kivi", "bits": 2},
                "KIVI int2: K per channel, V per token, groups of 32, fp16 scale+zero (3 bits)")
