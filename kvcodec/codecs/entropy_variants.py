"""Entropy-coded KIVI: ``kivi-ans`` (presets ``kivi-4-ans``, ``kivi-2-ans``, ``kivi-4-delta-ans``,
``kivi-2-delta-ans``).

Exactly the quantization of the ``kivi`` codec (:mod:`kvcodec.quant.intq`: K per channel over
groups of ``group`` tokens, V per token over groups of ``group`` channels, float16 scale and zero),
so the decoded values are bit-identical to ``kivi`` with the same ``bits``/``group``; only the code
plane changes: instead of fixed-width packing, the ``uint8`` codes are ANS coded by an
:class:`~kvcodec.entropy.EntropyStage` with rows = the ``H * D`` channels over the tokens, cut into
``chunk``-token streams (formats/ANS.md §3). Tables: by default ``n_tables`` = 16 shared 12-bit
tables per tensor, rows assigned by KL k-means (one byte per channel names its table): on a real
SmolLM2 cache this is smaller all-in than one table per channel (``tables="row"``), see
eval/results/entropy_bench.md.

``delta > 0`` (the ``*-delta-ans`` presets) codes, per channel, every token as its code difference
from its group's anchor (the first of each ``delta`` tokens, :mod:`kvcodec.quant.delta`): anchors
go to the ``anc_*`` stage (alphabet ``2**bits``), differences shifted by ``2**bits - 1`` to the
``ans_*`` stage (alphabet ``2**(bits+1) - 1``). It is lossless on the codes, so it only changes the
size: it helps when neighbouring tokens' codes agree (K within a quantization group).

Planes: ``scale``, ``zero`` exactly as ``kivi``; ``ans_*`` (and ``anc_*`` with delta) the stage
planes. Tensor params: ``{"axis", "bits", "group", "delta"}``.

Example:
    >>> import torch, kvcodec
    >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(40, 2, 64), torch.randn(40, 2, 64))])
    >>> a = kvcodec.decode(kvcodec.get_codec("kivi-4-ans").encode(cache))
    >>> b = kvcodec.decode(kvcodec.get_codec("kivi-4").encode(cache))
    >>> a.equal(b)
    True
"""

from __future__ import annotations

import numpy as np
import torch

from dataclasses import dataclass

from ..codec import Codec, EncodedTensor, TensorContext, register_codec, register_preset
from ..entropy.stage import EntropyStage, add_prefix
from ..errors import ConfigError, FormatError
from ..quant.fast import intq_dequantize_fast, intq_quantize_fast
from ..quant.intq import AXES, IntQTensor, check_intq_params, intq_param_shape
from .kivi import check_intq_side
from .parsing import INT32_MAX, check_plane_names, plane, stage, stage_names, strict_choice, strict_int, where


def _stage_params(p):
    return {"precision": p["precision"], "chunk": p["chunk"], "tables": p["tables"], "n_tables": p["n_tables"]}


def _decode_stage(planes: dict[str, np.ndarray], expected: tuple[int, int, int], prefix: str, at: str) -> np.ndarray:
    """The stage's symbols in token-major order ``[n, rows]`` (uint8 / uint16)."""
    try:
        return EntropyStage().decode(planes, expected=expected, layout="tokens")
    except FormatError as e:
        raise type(e)(f"{at}: {prefix}stage: {e}") from None


@dataclass(frozen=True)
class KiviAnsParsed:
    """One kivi-ans tensor, validated (:func:`parse_kivi_ans`): ``scale``/``zero`` float16 of
    :func:`~kvcodec.quant.intq.intq_param_shape`, and the entropy stages' planes with their
    expected geometry ``(R, N, A)``: ``ans`` (all tokens, or the non-anchor differences with
    ``delta``) and ``anc`` (the anchors; None without ``delta``)."""

    axis: str
    bits: int
    group: int
    delta: int
    scale: np.ndarray
    zero: np.ndarray
    ans: dict[str, np.ndarray]
    ans_expected: tuple[int, int, int]
    anc: dict[str, np.ndarray] | None
    anc_expected: tuple[int, int, int] | None


def parse_kivi_ans(enc: EncodedTensor, ctx: TensorContext) -> KiviAnsParsed:
    """:meth:`KIVIANSCodec.parse_tensor` (see there)."""
    at = where(ctx)
    pr = enc.params
    t, h, d = ctx.shape
    c = h * d
    axis = strict_choice(pr, "axis", AXES, at)
    bits = strict_int(pr, "bits", 1, 8, at)
    group = strict_int(pr, "group", 1, INT32_MAX, at)
    dl = strict_int(pr, "delta", 0, INT32_MAX, at)
    check_plane_names(enc.planes, ["scale", "zero", *stage_names("ans_"), *(stage_names("anc_") if dl else [])],
                      at, "kivi-ans")
    ps = intq_param_shape((t, h, d), axis, group)
    scale = plane(enc.planes, "scale", np.float16, ps, at)
    zero = plane(enc.planes, "zero", np.float16, ps, at)
    check_intq_side(scale, zero, at, "kivi-ans")
    if dl:
        na = -(-t // dl)
        anc_x = (c, na, 1 << bits)
        ans_x = (c, t - na, (1 << (bits + 1)) - 1)
        anc = stage(enc.planes, "anc_", anc_x, at)
    else:  # the stage's alphabet is exactly the 2**bits codes
        anc_x, anc = None, None
        ans_x = (c, t, max(2, 1 << bits))
    return KiviAnsParsed(axis, bits, group, dl, scale, zero, stage(enc.planes, "ans_", ans_x, at), ans_x, anc, anc_x)


@register_codec
class KIVIANSCodec(Codec):
    """KIVI quantization with ANS-coded codes (optionally anchor-delta coded); see the module
    docstring.

    Example:
        >>> import kvcodec
        >>> kvcodec.get_codec("kivi-2-ans").get_config()["bits"]
        2
    """

    codec_id = "kivi-ans"
    defaults = {"bits": 4, "group": 32, "latent_axis": "token", "delta": 0,
                "precision": 12, "chunk": 4096, "tables": "cluster", "n_tables": 16}

    def check_params(self) -> None:
        p = self.params
        check_intq_params(p["bits"], p["latent_axis"], p["group"])
        if p["delta"] < 0:
            raise ConfigError(f"kivi-ans delta must be >= 0, got {p['delta']}")
        try:
            EntropyStage(**_stage_params(p))
        except ConfigError as e:
            raise ConfigError(f"codec 'kivi-ans': {e}") from None
        if (1 << (p["bits"] + 1)) > (1 << p["precision"]):
            raise ConfigError("kivi-ans: table precision too small for the code alphabet")

    def axis(self, role: str) -> str:
        return {"k": "channel", "v": "token"}.get(role, self.params["latent_axis"])

    @property
    def nominal_bits(self) -> float:
        # fixed-width kivi size minus a typical entropy-coding gain (measured: eval/results/entropy_*)
        return self.params["bits"] * 0.85 + 1.0

    def encode_tensor(self, x: torch.Tensor, ctx: TensorContext) -> EncodedTensor:
        p = self.params
        bits, group, dl = p["bits"], p["group"], p["delta"]
        t, h, d = x.shape
        axis = self.axis(ctx.role)
        q = intq_quantize_fast(x, bits, axis, group)  # bit-exact with intq_quantize_reference (H1's tests)
        codes = q.codes.numpy().reshape(t, h * d)  # token-major [T, C]: the stage reads it as is
        planes = {"scale": q.scale.numpy(), "zero": q.zero.numpy()}
        st = EntropyStage(**_stage_params(p))
        if dl:
            is_anchor = np.arange(t) % dl == 0
            anc = codes[is_anchor]
            diff = (codes[~is_anchor].astype(np.int16) - codes[(np.arange(t)[~is_anchor] // dl) * dl]
                    + ((1 << bits) - 1)).astype(np.uint16)
            planes.update(add_prefix(st.encode(anc, alphabet=1 << bits, layout="tokens"), "anc_"))
            planes.update(add_prefix(st.encode(diff, alphabet=(1 << (bits + 1)) - 1, layout="tokens"), "ans_"))
        else:
            planes.update(add_prefix(st.encode(codes, alphabet=max(2, 1 << bits), layout="tokens"), "ans_"))
        return EncodedTensor(planes, {"axis": axis, "bits": bits, "group": group, "delta": dl})

    def parse_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> KiviAnsParsed:
        """Validate one coded tensor against formats/SPEC.md §11.5 (shared by every decoder); the
        streams are checked as they are decoded.

        Raises:
            FormatError: params of the wrong type or out of bounds, planes missing, of the wrong
                dtype or shape, unknown planes, non-finite scale/zero, a stage of another geometry.
        """
        v = parse_kivi_ans(enc, ctx)
        p = self.params
        want = (self.axis(ctx.role), p["bits"], p["group"], p["delta"])
        if (v.axis, v.bits, v.group, v.delta) != want:  # encode writes exactly the config's choices
            raise FormatError(f"{where(ctx)}: kivi-ans params {enc.params!r} disagree with the codec config "
                              f"(axis, bits, group, delta) = {want}")
        return v

    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        v = self.parse_tensor(enc, ctx)
        at = where(ctx)
        bits, dl = v.bits, v.delta
        t, h, d = ctx.shape
        c = h * d
        if dl:
            is_anchor = np.arange(t) % dl == 0
            anc = _decode_stage(v.anc, v.anc_expected, "anc_", at)
            diff = _decode_stage(v.ans, v.ans_expected, "ans_", at)
            full = np.zeros((t, c), dtype=np.int16)
            full[is_anchor] = anc
            full[~is_anchor] = diff.astype(np.int16) - ((1 << bits) - 1) + anc[np.arange(t)[~is_anchor] // dl]
            if full.size and (int(full.min()) < 0 or int(full.max()) >= 1 << bits):
                raise FormatError(f"{at}: decoded codes outside [0, 2**{bits})")
        else:
            full = _decode_stage(v.ans, v.ans_expected, "ans_", at)
        codes = full.astype(np.uint8, copy=False).reshape(t, h, d)
        q = IntQTensor(torch.from_numpy(codes), torch.from_numpy(v.scale.copy()), torch.from_numpy(v.zero.copy()),
                       bits, v.axis, v.group)
        return intq_dequantize_fast(q, ctx.dtype)

register_preset("kivi-4-ans", {"id": "kivi-ans", "bits": 4},
                "KIVI int4 (as kivi-4) with ANS-coded codes, 16 clustered 12-bit tables per tensor")
register_preset("kivi-2-ans", {"id": "kivi-ans", "bits": 2},
                "KIVI int2 (as kivi-2) with ANS-coded codes, 16 clustered 12-bit tables per tensor")
register_preset("kivi-4-delta-ans", {"id": "kivi-ans", "bits": 4, "delta": 8},
                "KIVI int4 codes anchor-delta coded per channel (anchor every 8 tokens), then ANS")
register_preset("kivi-2-delta-ans", {"id": "kivi-ans", "bits": 2, "delta": 8},
                "KIVI int2 codes anchor-delta coded per channel (anchor every 8 tokens), then ANS")
