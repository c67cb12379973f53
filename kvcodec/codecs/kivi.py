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

from dataclasses import dataclass

from ..codec import Codec, EncodedTensor, TensorContext, register_codec, register_preset
from ..errors import ConfigError, FormatError
from ..quant.fast import intq_dequantize_fast, intq_quantize_fast
from ..quant.intq import AXES, IntQTensor, check_intq_params, intq_param_shape
from ..quant.packing import pack_bits, packed_nbytes, unpack_bits
from .fp8 import NOMINAL_SHAPE
from .parsing import INT32_MAX, check_plane_names, plane, strict_choice, strict_int, where

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

    def parse_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> "KiviParsed":
        """Validate one coded tensor against formats/SPEC.md §11.4 (shared by every decoder).

        Raises:
            FormatError: params of the wrong type or out of bounds, planes missing, of the wrong
                dtype or shape, unknown planes, non-finite or negative scales, non-finite zeros,
                non-zero padding bits after the last code.
        """
        v = parse_kivi(enc, ctx)
        p = self.params
        want = (self.axis(ctx.role), p["bits"], p["group"], min(p["residual"], ctx.shape[0]))
        if (v.axis, v.bits, v.group, v.recent) != want:  # encode writes exactly the config's choices
            raise FormatError(f"{where(ctx)}: kivi params {enc.params!r} disagree with the codec config "
                              f"(axis, bits, group, recent) = {want}")
        return v

    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        v = self.parse_tensor(enc, ctx)
        t, h, d = ctx.shape
        tq = t - v.recent
        codes = torch.from_numpy(unpack_bits(v.codes, v.bits, tq * h * d)).reshape(tq, h, d)
        q = IntQTensor(codes, torch.from_numpy(v.scale.copy()), torch.from_numpy(v.zero.copy()), v.bits, v.axis, v.group)
        out = intq_dequantize_fast(q, ctx.dtype)
        if v.recent:
            out = torch.cat([out, torch.from_numpy(v.recent_bits.copy()).view(ctx.dtype)], dim=0)
        return out


@dataclass(frozen=True)
class KiviParsed:
    """One kivi tensor, validated (:func:`parse_kivi`): the packed ``codes`` (``uint8``, padding bits
    zero), ``scale``/``zero`` float16 of :func:`~kvcodec.quant.intq.intq_param_shape` over the
    ``T - recent`` quantized tokens, and ``recent_bits`` (the last ``recent`` tokens' source-dtype
    bits as int16/int32 ``[recent, H, D]``, or None)."""

    axis: str
    bits: int
    group: int
    recent: int
    codes: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    recent_bits: np.ndarray | None


def check_intq_side(scale: np.ndarray, zero: np.ndarray, at: str, codec: str) -> None:
    """Scale and zero as encode writes them: finite, scale ``>= +0`` (sign bit clear)."""
    if scale.size and not bool((np.isfinite(scale) & np.isfinite(zero)).all()):
        raise FormatError(f"{at}: {codec} scale/zero must be finite")
    if scale.size and bool((scale.view(np.uint16) & 0x8000).any()):
        raise FormatError(f"{at}: {codec} scale must be >= 0 (encode writes (max - min) / levels)")


def parse_kivi(enc: EncodedTensor, ctx: TensorContext) -> KiviParsed:
    """:meth:`KIVICodec.parse_tensor` (see there)."""
    at = where(ctx)
    t, h, d = ctx.shape
    pr = enc.params
    axis = strict_choice(pr, "axis", AXES, at)
    bits = strict_int(pr, "bits", 1, 8, at)
    group = strict_int(pr, "group", 1, INT32_MAX, at)
    tr = strict_int(pr, "recent", 0, t, at)
    tq = t - tr
    names = ("codes", "scale", "zero", "recent") if tr else ("codes", "scale", "zero")
    check_plane_names(enc.planes, names, at, "kivi")
    codes = plane(enc.planes, "codes", np.uint8, (packed_nbytes(tq * h * d, bits),), at)
    used = (tq * h * d * bits) % 8
    if used and int(codes[-1]) >> used:
        raise FormatError(f"{at}: kivi codes have non-zero padding bits after the last packed code")
    ps = intq_param_shape((tq, h, d), axis, group)
    scale = plane(enc.planes, "scale", np.float16, ps, at)
    zero = plane(enc.planes, "zero", np.float16, ps, at)
    check_intq_side(scale, zero, at, "kivi")
    recent = plane(enc.planes, "recent", _BITS_VIEW[ctx.dtype][1], (tr, h, d), at) if tr else None
    return KiviParsed(axis, bits, group, tr, codes, scale, zero, recent)

register_preset("kivi-4", {"id": "kivi", "bits": 4},
                "KIVI int4: K per channel, V per token, groups of 32, fp16 scale+zero (5 bits)")
register_preset("kivi-2", {"id": "kivi", "bits": 2},
                "KIVI int2: K per channel, V per token, groups of 32, fp16 scale+zero (3 bits)")
