"""Scaled FP8 codecs: ``fp8`` (presets ``fp8-e4m3``, ``fp8-e5m2``).

Config (codec id ``"fp8"``):

* ``format``: ``"e4m3"`` (E4M3FN, default) or ``"e5m2"``.
* ``k_granularity`` / ``v_granularity``: scale granularity for K (also used for an MLA latent
  ``kv``) and for V: ``"tensor"``, ``"head"`` (default), ``"channel"``, ``"token"``, ``"block"``.
  Why per head: in the normal range FP8's relative error does not depend on the scale (2^-4 for
  E4M3, 2^-3 for E5M2), and one amax per head keeps realistic K and V (channel offsets of
  10-50x included) far above the subnormal range (E4M3 spans 2^-6..448, 16 binades), so finer
  scales mostly add side information; per head rather than per tensor guards against heads of
  very different magnitude. ``"token"`` costs 32/D extra bits per element, ``"block"`` 32/B.
  Measured on a SmolLM2-135M cache (1536 tokens, fp16; relative RMS error of K / V, E4M3):
  tensor 0.0270 / 0.0265, head 0.0269 / 0.0265, channel 0.0271 / 0.0264 (all ~8.03 bits
  all-in), token 0.0212 / 0.0246 at 8.53 bits.
* ``block``: block length along ``head_dim`` for ``"block"`` granularity (default 32).

Plane layout of one ``[T, H, D]`` tensor (pinned; the CUDA kernels read exactly this):

* ``codes``: ``uint8 [T, H, D]``, C order, one FP8 code per element (sign bit 0x80, then
  exponent and mantissa as in :mod:`kvcodec.quant.fp8`; -0 = 0x80; E4M3FN has no inf, E5M2's
  inf/NaN codes never occur because encode saturates and rejects non-finite input).
* ``scale``: ``float32``, broadcastable against ``codes``: ``[1, 1, 1]`` (tensor), ``[1, H, 1]``
  (head), ``[1, H, D]`` (channel), ``[T, H, 1]`` (token), ``[T, H, ceil(D/B)]`` (block; element
  ``d`` uses scale ``d // B``). ``scale = amax / FMAX`` per group (1.0 for an all-zero group,
  at least ``2^-126``).

Tensor params in the manifest: ``{"format": "e4m3"|"e5m2", "granularity": ..., "block": B}``.

Decode (*multiply*): ``x = fp8_value(code) * scale`` in float32 (one rounded product), then cast
to the source dtype (RNE). Encode: ``code = RNE(clamp(x_f32 / scale, +-FMAX))``.

Example:
    >>> import torch, kvcodec
    >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(8, 2, 64), torch.randn(8, 2, 64))])
    >>> codec = kvcodec.get_codec("fp8-e4m3")
    >>> out = codec.decode(codec.encode(cache))
    >>> bool(((out.layers[0]["k"] - cache.layers[0]["k"]).abs() <= cache.layers[0]["k"].abs() / 16 + 1e-3).all())
    True
"""

from __future__ import annotations

import numpy as np
import torch

from dataclasses import dataclass

from ..codec import Codec, EncodedTensor, TensorContext, register_codec, register_preset
from ..errors import ConfigError, FormatError
from ..quant.fast import fp8_decode_fast, fp8_encode_fast
from ..quant.fp8 import FP32_MIN_NORMAL, FP8_FORMATS, GRANULARITIES, scale_shape
from .parsing import DTYPE_MAX, INT32_MAX, check_plane_names, f32_bound, plane, strict_choice, strict_int, where

#: Geometry behind ``nominal_bits``: 1024 tokens, 8 KV heads, head_dim 128 (K and V averaged).
NOMINAL_SHAPE = (1024, 8, 128)


@register_codec
class FP8Codec(Codec):
    """Scaled FP8 (E4M3FN or E5M2), see the module docstring for config and plane layout.

    Example:
        >>> import kvcodec
        >>> c = kvcodec.get_codec({"id": "fp8", "format": "e5m2", "v_granularity": "token"})
        >>> c.get_config()["format"], round(c.nominal_bits, 3)
        ('e5m2', 8.125)
    """

    codec_id = "fp8"
    defaults = {"format": "e4m3", "k_granularity": "head", "v_granularity": "head", "block": 32}

    def check_params(self) -> None:
        if self.params["format"] not in FP8_FORMATS:
            raise ConfigError(f"fp8 format must be one of {sorted(FP8_FORMATS)}, got {self.params['format']!r}")
        for k in ("k_granularity", "v_granularity"):
            if self.params[k] not in GRANULARITIES:
                raise ConfigError(f"fp8 {k} must be one of {GRANULARITIES}, got {self.params[k]!r}")
        if self.params["block"] < 1:
            raise ConfigError(f"fp8 block must be >= 1, got {self.params['block']}")

    def granularity(self, role: str) -> str:
        return self.params["v_granularity" if role == "v" else "k_granularity"]

    def tensor_bits(self, shape: tuple[int, int, int], role: str) -> int:
        """Exact bits of the planes of one tensor (codes plus float32 scales)."""
        n = shape[0] * shape[1] * shape[2]
        s = scale_shape(shape, self.granularity(role), self.params["block"])
        return 8 * n + 32 * s[0] * s[1] * s[2]

    @property
    def nominal_bits(self) -> float:
        """Bits per element of codes plus scales at :data:`NOMINAL_SHAPE` (K and V averaged)."""
        n = NOMINAL_SHAPE[0] * NOMINAL_SHAPE[1] * NOMINAL_SHAPE[2]
        return sum(self.tensor_bits(NOMINAL_SHAPE, r) for r in ("k", "v")) / (2 * n)

    def encode_tensor(self, x: torch.Tensor, ctx: TensorContext) -> EncodedTensor:
        g = self.granularity(ctx.role)
        # the numpy fast path: bit-exact with fp8_encode_reference (tests/test_quant_fp8.py)
        codes, scale = fp8_encode_fast(x, self.params["format"], g, self.params["block"])
        return EncodedTensor(
            {"codes": codes.numpy(), "scale": scale.contiguous().numpy()},
            {"format": self.params["format"], "granularity": g, "block": self.params["block"]},
        )

    def parse_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> "Fp8Parsed":
        """Validate one coded tensor against formats/SPEC.md §11.2 (shared by every decoder).

        Raises:
            FormatError: params of the wrong type or out of bounds, planes missing, of the wrong
                dtype or shape, unknown planes, NaN/Inf codes, scales outside what encode writes.
        """
        v = parse_fp8(enc, ctx)
        want = (self.params["format"], self.granularity(ctx.role), self.params["block"])
        if (v.format, v.granularity, v.block) != want:  # encode writes exactly the config's choices
            raise FormatError(f"{where(ctx)}: fp8 params {enc.params!r} disagree with the codec config "
                              f"(format, granularity, block) = {want}")
        return v

    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        v = self.parse_tensor(enc, ctx)
        return fp8_decode_fast(torch.from_numpy(v.codes.copy()), torch.from_numpy(v.scale.copy()), v.format,
                               ctx.dtype, v.block)


@dataclass(frozen=True)
class Fp8Parsed:
    """One fp8 tensor, validated (:func:`parse_fp8`): ``codes uint8 [T, H, D]``, ``scale float32``
    of :func:`~kvcodec.quant.fp8.scale_shape`, every code finite, every scale in
    ``[2^-126, max_scale(format, dtype)]``."""

    format: str
    granularity: str
    block: int
    codes: np.ndarray
    scale: np.ndarray


def max_scale(fmt: str, dtype: torch.dtype) -> float:
    """The largest scale encode writes for a source dtype: ``f32(dtype_max / FMAX)``; with it every
    finite code decodes to a finite value of the source dtype (formats/SPEC.md §11.1)."""
    return f32_bound(np.float32(DTYPE_MAX[dtype]) / np.float32(FP8_FORMATS[fmt].max))


def parse_fp8(enc: EncodedTensor, ctx: TensorContext) -> Fp8Parsed:
    """:meth:`FP8Codec.parse_tensor` (see there)."""
    at = where(ctx)
    pr = enc.params
    fmt = strict_choice(pr, "format", sorted(FP8_FORMATS), at)
    g = strict_choice(pr, "granularity", GRANULARITIES, at)
    block = strict_int(pr, "block", 1, INT32_MAX, at)
    check_plane_names(enc.planes, ("codes", "scale"), at, "fp8")
    codes = plane(enc.planes, "codes", np.uint8, ctx.shape, at)
    scale = plane(enc.planes, "scale", np.float32, scale_shape(ctx.shape, g, block), at)
    f = FP8_FORMATS[fmt]
    # encode saturates to +-FMAX: the inf code (E5M2 0x7C) and the NaN codes never occur
    bad = f.nan_codes + ((f.inf_code,) if f.inf_code >= 0 else ())
    if codes.size and np.isin(codes & 0x7F, np.array(bad, dtype=np.uint8)).any():
        raise FormatError(f"{at}: fp8-{fmt} codes hold NaN or Inf codes {[hex(c) for c in bad]} "
                          "(encode never writes them)")
    hi = max_scale(fmt, ctx.dtype)
    ok = (scale >= np.float32(FP32_MIN_NORMAL)) & (scale <= np.float32(hi))
    if not bool(ok.all()):
        bad_v = float(scale.reshape(-1)[int(np.argmin(ok.reshape(-1)))])
        raise FormatError(f"{at}: fp8 scale {bad_v!r} outside [2^-126, {hi!r}] (encode writes amax / {f.max:g}, "
                          f"amax at most the {str(ctx.dtype).removeprefix('torch.')} source's largest value)")
    return Fp8Parsed(fmt, g, block, codes, scale)

register_preset("fp8-e4m3", {"id": "fp8", "format": "e4m3"},
                "FP8 E4M3FN, one fp32 scale per head (amax/448), RNE")
register_preset("fp8-e5m2", {"id": "fp8", "format": "e5m2"},
                "FP8 E5M2, one fp32 scale per head (amax/57344), RNE")
