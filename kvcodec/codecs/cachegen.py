"""CacheGen codecs: ``cachegen`` (the SIGCOMM'24 paper's design) and ``cachegen-lmcache`` (the
public LMCache implementation's behaviour), both entropy-coded with :class:`~kvcodec.entropy.EntropyStage`.

Symmetric per-token quantization with ``L`` levels (``L`` odd, ``M = (L - 1) / 2``), shared by
both: for one token ``t`` (all heads and channels together),
``scale16 = fp16(absmax_t / M)``, ``s = float32(scale16)``,
``code = clamp(round_half_even(x / s), -M, M) + M`` (``code = M`` where ``s == 0``), decode
``x = float32(code - M) * s``. Codes of a ``[T, H, D]`` tensor are entropy coded as rows = the
``H * D`` channels (one distribution per (layer, channel)) over the tokens.

``cachegen`` (paper, §5): tokens in groups of ``group`` (10); the first token of a group (the
anchor) is quantized alone with ``anchor_levels`` (255, i.e. 8 bits); every other token is coded as
its delta from the *decoded* anchor, quantized per token with the levels of its layer group:
layers are split in thirds (``levels[0]`` for the first third, ...), fewer levels for later layers.
Each (layer, K/V, channel) has its own table for the deltas; anchors use ``anchor_tables`` shared
tables per tensor. The per-layer levels are computed once from the cache's layer count and
**recorded in the file** (global plane ``cachegen_levels``, int32 ``[L, 2]`` = levels of K and V);
the decoder reads them, it never recomputes them.

``cachegen-lmcache`` (what LMCache ships): no anchors/deltas; every token quantized with
absmax over all heads; bins by layer: K layers ``< k_early_layers`` (10) use ``early_bins`` (32),
V layers ``< v_early_layers`` (2) use ``early_bins``, all others ``late_bins`` (16); ``bins`` bins
are ``bins - 1`` levels (``M = bins/2 - 1``) and the alphabet has ``bins`` symbols (LMCache's CDF
covers all bins). A fresh 16-bit table per (layer, channel) is fitted and shipped for every
256-token chunk (``chunk``), and every (layer, channel, chunk) is its own stream. The bins per layer
are recorded in the global plane ``cachegen_bins`` (int32 ``[L, 2]``).

Planes of one tensor (``cachegen``): ``scale`` float16 ``[T]`` (anchor scale for anchor tokens,
delta scale otherwise), ``anc_*`` the anchors' entropy stage (rows = channels, columns = anchor
tokens), ``ans_*`` the deltas' stage (columns = non-anchor tokens in order). ``cachegen-lmcache``:
``scale`` float16 ``[T]`` and ``ans_*`` (formats/ANS.md §3). Tensor params: ``{"levels": L}`` or
``{"bins": b}``, checked against the global plane.

Example:
    >>> import torch, kvcodec
    >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(30, 2, 16), torch.randn(30, 2, 16))] * 3)
    >>> for name in ("cachegen", "cachegen-lmcache"):
    ...     out = kvcodec.decode(kvcodec.get_codec(name).encode(cache))
    ...     print(name, (out.layers[0]["v"] - cache.layers[0]["v"]).abs().max().item() < 0.6)
    cachegen True
    cachegen-lmcache True
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dataclasses import dataclass

from .. import native
from ..cache import KVCache
from ..codec import Codec, EncodedTensor, TensorContext, register_codec, register_preset
from ..entropy.stage import EntropyStage, add_prefix
from ..errors import ConfigError, FormatError, InputError
from .parsing import DTYPE_MAX, INT32_MAX, check_plane_names, plane, stage, stage_names, strict_int, where

#: Largest ``levels`` / ``anchor_levels`` of cachegen (its encoder's bound, formats/SPEC.md §11.6).
MAX_LEVELS = 4095
#: Largest ``bins`` of cachegen-lmcache: codes ``< bins`` are written as uint16 (§11.7).
MAX_BINS = 65536


# ---------------------------------------------------------------------- shared arithmetic
def symmetric_token_quantize(x: torch.Tensor, levels: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token symmetric quantization of ``x[T, C]`` (float32) with ``levels`` (odd; per token
    or one int). Returns ``(codes int32 [T, C] in [0, levels), scale float16 [T])``.

    Example:
        >>> c, s = symmetric_token_quantize(torch.tensor([[1.0, -2.0, 0.5]]), 5)
        >>> c.tolist(), s.tolist()
        ([[3, 0, 2]], [1.0])
    """
    lv = torch.as_tensor(levels, dtype=torch.int64).expand(x.shape[0]) if x.shape[0] else torch.zeros(0, dtype=torch.int64)
    m = ((lv - 1) // 2).to(torch.float32)
    amax = x.abs().amax(dim=1) if x.shape[1] else torch.zeros(x.shape[0])
    scale16 = (amax / m).to(torch.float16)
    if not bool(torch.isfinite(scale16).all()):
        raise InputError("per-token scale exceeds float16 range (|x| too large)")
    s = scale16.float()[:, None]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.where(s > 0, torch.round(x / safe), torch.zeros_like(x))
    q = torch.minimum(torch.maximum(q, -m[:, None]), m[:, None])
    return (q + m[:, None]).to(torch.int32), scale16


def symmetric_token_dequantize(codes: torch.Tensor, scale16: torch.Tensor, levels: torch.Tensor | int) -> torch.Tensor:
    """``float32(code - M) * float32(scale)`` per token; ``codes[T, C]``, ``scale16[T]``."""
    lv = torch.as_tensor(levels, dtype=torch.int64).expand(codes.shape[0]) if codes.shape[0] else torch.zeros(0, dtype=torch.int64)
    m = (lv - 1) // 2
    return (codes.to(torch.int64) - m[:, None]).to(torch.float32) * scale16.float()[:, None]


def _stage_params(p: dict[str, Any]) -> dict[str, Any]:
    return {"precision": p["precision"], "chunk": p["chunk"], "tables": p["tables"], "n_tables": p["n_tables"]}


def _check_stage_params(codec: Codec) -> None:
    try:
        EntropyStage(**_stage_params(codec.params))
    except ConfigError as e:
        raise ConfigError(f"codec {codec.codec_id!r}: {e}") from None


def _tokens(codes: torch.Tensor) -> np.ndarray:
    """``[T, C]`` codes as the stage's token-major symbols (rows = channels: one distribution
    per channel), narrowed to 16 bits (levels are at most 4095)."""
    return codes.numpy().astype(np.uint16)


def _global_plane(ctx: TensorContext, name: str, where: str) -> np.ndarray:
    g = ctx.globals.get(name)
    if g is None:
        raise FormatError(f"{where}: global plane {name!r} (recorded quantization bins) is missing")
    g = np.asarray(g)
    if g.dtype != np.int32 or g.ndim != 2 or g.shape[1] != 2 or ctx.layer >= g.shape[0]:
        raise FormatError(f"{where}: global plane {name!r} must be int32 [layers, 2], got {g.dtype}{list(g.shape)}")
    return g


def recorded_value(ctx: TensorContext, name: str, where: str) -> int:
    """The value a file recorded for this tensor in global plane ``name`` (int32 ``[layers, 2]``:
    column 0 for K, 1 for V; an MLA latent ``kv`` follows the K rule). Shared with the GPU decoder."""
    return int(_global_plane(ctx, name, where)[ctx.layer, 1 if ctx.role == "v" else 0])


def _scale_plane(enc: EncodedTensor, at: str, t: int) -> np.ndarray:
    """The per-token scales as encode writes them: float16 ``[T]``, finite, sign bit clear."""
    s = plane(enc.planes, "scale", np.float16, (t,), at)
    if not bool(np.isfinite(s).all()) or bool((s.view(np.uint16) & 0x8000).any()):
        raise FormatError(f"{at}: 'scale' must be finite and >= 0 (encode writes absmax / M)")
    return s


def _recorded_bounded(ctx: TensorContext, name: str, at: str, lo: int, hi: int, even: bool) -> int:
    """The file's recorded levels (or bins) of this tensor, bounded as its encoder writes them."""
    rec = recorded_value(ctx, name, at)
    if not lo <= rec <= hi or rec % 2 != (0 if even else 1):
        raise FormatError(f"{at}: global plane {name!r} records {rec} for this tensor; "
                          f"expected {'an even' if even else 'an odd'} value in [{lo}, {hi}]")
    return rec


def _decode_tokens(planes: dict[str, np.ndarray], expected: tuple[int, int, int], prefix: str, at: str) -> np.ndarray:
    """A stage's codes as ``[n, rows]`` (token-major, uint8 or uint16)."""
    try:
        return EntropyStage().decode(planes, expected=expected, layout="tokens")
    except FormatError as e:
        raise type(e)(f"{at}: {prefix}stage: {e}") from None


def _to_torch(codes: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(codes.astype(np.int32))  # uint16 codes (alphabets <= 65536) fit


def _saturate(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 values clamped to the source dtype's finite range, then cast (RNE): the rounding of
    the float16 scale can put a coded extreme just past 65504 (formats/SPEC.md §11.1)."""
    m = DTYPE_MAX[dtype]
    return x.clamp(-m, m).to(dtype)


@dataclass(frozen=True)
class CacheGenParsed:
    """One cachegen tensor, validated (:meth:`CacheGenCodec.parse_tensor`): ``levels`` (the
    recorded levels of the deltas), ``group``, ``anchor_levels``, ``scale float16 [T]`` and the two
    entropy stages' planes with their geometry ``(R, N, A)``."""

    levels: int
    group: int
    anchor_levels: int
    scale: np.ndarray
    anc: dict[str, np.ndarray]
    anc_expected: tuple[int, int, int]
    ans: dict[str, np.ndarray]
    ans_expected: tuple[int, int, int]


@dataclass(frozen=True)
class CacheGenLMCacheParsed:
    """One cachegen-lmcache tensor, validated (:meth:`CacheGenLMCacheCodec.parse_tensor`): ``bins``
    (recorded), ``scale float16 [T]`` and the entropy stage's planes with geometry ``(R, N, A)``."""

    bins: int
    scale: np.ndarray
    ans: dict[str, np.ndarray]
    ans_expected: tuple[int, int, int]


# ---------------------------------------------------------------------- cachegen (paper)
@register_codec
class CacheGenCodec(Codec):
    """CacheGen as in the paper: anchors + deltas in token groups, layer-group bins, per
    (layer, channel) tables, ANS. See the module docstring for the exact arithmetic and planes.

    Example:
        >>> import kvcodec
        >>> kvcodec.get_codec("cachegen").get_config()["levels"]
        [31, 15, 15]
    """

    codec_id = "cachegen"
    defaults = {
        "group": 10, "anchor_levels": 255, "levels": [31, 15, 15],
        "precision": 12, "chunk": 4096, "tables": "row", "n_tables": 16, "anchor_tables": 8,
    }

    def check_params(self) -> None:
        p = self.params
        if p["group"] < 1:
            raise ConfigError(f"cachegen group must be >= 1, got {p['group']}")
        lv = p["levels"]
        if not (isinstance(lv, list) and lv and all(isinstance(v, int) and not isinstance(v, bool) for v in lv)):
            raise ConfigError(f"cachegen levels must be a non-empty list of ints, got {lv!r}")
        for v in [*lv, p["anchor_levels"]]:
            if v < 3 or v % 2 == 0 or v > 4095:
                raise ConfigError(f"cachegen levels must be odd in [3, 4095], got {v}")
        if not 1 <= p["anchor_tables"] <= 256:
            raise ConfigError(f"cachegen anchor_tables must be in [1, 256], got {p['anchor_tables']}")
        _check_stage_params(self)
        if max([*lv, p["anchor_levels"]]) > (1 << p["precision"]):
            raise ConfigError("cachegen: table precision too small for the number of levels")

    @property
    def nominal_bits(self) -> float:
        return 2.5

    def layer_levels(self, num_layers: int) -> np.ndarray:
        """Levels of each layer (same for K and V): ``levels[j]`` for the j-th equal layer group."""
        lv = self.params["levels"]
        g = len(lv)
        out = np.array([[lv[min(g - 1, i * g // max(1, num_layers))]] * 2 for i in range(num_layers)], dtype=np.int32)
        return out.reshape(num_layers, 2)

    def encode_globals(self, cache: KVCache, state: Any = None) -> dict[str, np.ndarray]:
        return {"cachegen_levels": self.layer_levels(cache.num_layers)}

    def encode_tensor(self, x: torch.Tensor, ctx: TensorContext) -> EncodedTensor:
        p = self.params
        where = f"layers.{ctx.layer}.{ctx.role}"
        levels = recorded_value(ctx, "cachegen_levels", where)
        t, h, d = x.shape
        g, la = p["group"], p["anchor_levels"]
        is_anchor = torch.arange(t) % g == 0
        scale = torch.zeros(t, dtype=torch.float16)
        try:  # the same arithmetic, one native pass per stage
            xr = x.reshape(t, h * d)
            tok = np.arange(t)
            anc_rows, dl_rows = tok[tok % g == 0], tok[tok % g != 0]
            anc_codes, anc_scale = native.token_quantize(xr, anc_rows, la)
            anc_hat = torch.empty((anc_rows.size, h * d), dtype=torch.float32)
            native.rows_affine(anc_codes, np.arange(anc_rows.size), anc_scale.astype(np.float32), (la - 1) // 2,
                               anc_hat, max_code=la - 1)
            dl_codes, dl_scale = native.token_quantize(xr, dl_rows, levels, base=anc_hat.numpy(), brow=dl_rows // g)
            scale[is_anchor], scale[~is_anchor] = torch.from_numpy(anc_scale), torch.from_numpy(dl_scale)
        except native.Unsupported:
            xf = x.float().reshape(t, h * d)
            anc_c, anc_s = symmetric_token_quantize(xf[is_anchor], la)
            anc_hat = symmetric_token_dequantize(anc_c, anc_s, la)
            ref = anc_hat[torch.arange(t)[~is_anchor] // g]  # each delta token's decoded anchor
            dl_c, dl_s = symmetric_token_quantize(xf[~is_anchor] - ref, levels)
            scale[is_anchor], scale[~is_anchor] = anc_s, dl_s
            anc_codes, dl_codes = _tokens(anc_c), _tokens(dl_c)
        st = EntropyStage(**_stage_params(p))
        sa = EntropyStage(**{**_stage_params(p), "tables": "cluster", "n_tables": p["anchor_tables"]})
        planes = {"scale": scale.numpy()}
        planes.update(add_prefix(sa.encode(anc_codes, alphabet=la, layout="tokens"), "anc_"))
        planes.update(add_prefix(st.encode(dl_codes, alphabet=levels, layout="tokens"), "ans_"))
        return EncodedTensor(planes, {"levels": levels, "group": g, "anchor_levels": la})

    def parse_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> CacheGenParsed:
        """Validate one coded tensor against formats/SPEC.md §11.6 (shared by every decoder); the
        streams are checked as they are decoded.

        Raises:
            FormatError: params that disagree with the recorded levels, of the wrong type or out of
                bounds, planes missing, of the wrong dtype or shape, unknown planes, bad scales, a
                stage of another geometry.
        """
        at = where(ctx)
        rec = _recorded_bounded(ctx, "cachegen_levels", at, 3, MAX_LEVELS, even=False)
        pr = enc.params
        if type(pr.get("levels")) is not int or pr["levels"] != rec:
            raise FormatError(f"{at}: cachegen params {pr!r} disagree with the recorded levels {rec}")
        g = strict_int(pr, "group", 1, INT32_MAX, at)
        la = strict_int(pr, "anchor_levels", 3, MAX_LEVELS, at)
        if la % 2 == 0:
            raise FormatError(f"{at}: cachegen anchor_levels must be odd, got {la}")
        if (g, la) != (self.params["group"], self.params["anchor_levels"]):  # encode writes the config's
            raise FormatError(f"{at}: cachegen params {pr!r} disagree with the codec config (group "
                              f"{self.params['group']}, anchor_levels {self.params['anchor_levels']})")
        t, h, d = ctx.shape
        check_plane_names(enc.planes, ["scale", *stage_names("anc_"), *stage_names("ans_")], at, "cachegen")
        scale = _scale_plane(enc, at, t)
        na = -(-t // g)
        anc_x, ans_x = (h * d, na, la), (h * d, t - na, rec)
        return CacheGenParsed(rec, g, la, scale, stage(enc.planes, "anc_", anc_x, at), anc_x,
                              stage(enc.planes, "ans_", ans_x, at), ans_x)

    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        v = self.parse_tensor(enc, ctx)
        at = where(ctx)
        rec, g, la = v.levels, v.group, v.anchor_levels
        t, h, d = ctx.shape
        scale = torch.from_numpy(v.scale.copy())
        is_anchor = torch.arange(t) % g == 0
        na = v.anc_expected[1]
        anc = _decode_tokens(v.anc, v.anc_expected, "anc_", at)
        dl = _decode_tokens(v.ans, v.ans_expected, "ans_", at)
        try:  # the same float32 arithmetic in one native pass per stage, cast in place
            s32 = v.scale.astype(np.float32)
            tok = np.arange(t)
            anc_hat = torch.empty((na, h * d), dtype=torch.float32)
            out = torch.empty((t, h * d), dtype=ctx.dtype)
            try:  # the stages' alphabets are the levels: a code past them is a forged table
                native.rows_affine(anc, np.arange(na), s32[tok % g == 0], (la - 1) // 2, anc_hat, max_code=la - 1)
                native.rows_affine(anc, tok[tok % g == 0], s32[tok % g == 0], (la - 1) // 2, out, max_code=la - 1)
                native.rows_affine(dl, tok[tok % g != 0], s32[tok % g != 0], (rec - 1) // 2, out, max_code=rec - 1,
                                   base=anc_hat.numpy(), brow=tok[tok % g != 0] // g)
            except FormatError as e:
                raise type(e)(f"{at}: {e}") from None
            return out.reshape(t, h, d)
        except native.Unsupported:
            pass
        anc_hat = symmetric_token_dequantize(_to_torch(anc), scale[is_anchor], la)
        out = torch.empty(t, h * d, dtype=torch.float32)
        out[is_anchor] = anc_hat
        out[~is_anchor] = anc_hat[torch.arange(t)[~is_anchor] // g] + symmetric_token_dequantize(_to_torch(dl), scale[~is_anchor], rec)
        return _saturate(out.reshape(t, h, d), ctx.dtype)


# ---------------------------------------------------------------------- cachegen-lmcache
@register_codec
class CacheGenLMCacheCodec(Codec):
    """CacheGen as the public LMCache implementation behaves (per-token absmax over all heads, no
    delta, a 16-bit table per (layer, channel) shipped in every 256-token chunk).

    Example:
        >>> import kvcodec
        >>> c = kvcodec.get_codec("cachegen-lmcache")
        >>> c.layer_bins(12)[:, 0].tolist()
        [32, 32, 32, 32, 32, 32, 32, 32, 32, 32, 16, 16]
    """

    codec_id = "cachegen-lmcache"
    defaults = {
        "early_bins": 32, "late_bins": 16, "k_early_layers": 10, "v_early_layers": 2,
        "precision": 16, "chunk": 256, "tables": "row", "n_tables": 16,
    }

    def check_params(self) -> None:
        p = self.params
        _check_stage_params(self)  # first: bounds precision before it is used as a shift
        for k in ("early_bins", "late_bins"):
            if p[k] < 4 or p[k] % 2 or p[k] > min(1 << p["precision"], MAX_BINS):
                raise ConfigError(f"cachegen-lmcache {k} must be even, >= 4 and <= min(2**precision, {MAX_BINS}) "
                                  f"(codes are written as uint16), got {p[k]}")
        if p["k_early_layers"] < 0 or p["v_early_layers"] < 0:
            raise ConfigError("cachegen-lmcache early layer counts must be >= 0")

    @property
    def nominal_bits(self) -> float:
        return 5.0

    def layer_bins(self, num_layers: int) -> np.ndarray:
        """Bins of each layer as int32 ``[L, 2]`` (K, V)."""
        p = self.params
        k = [p["early_bins"] if i < p["k_early_layers"] else p["late_bins"] for i in range(num_layers)]
        v = [p["early_bins"] if i < p["v_early_layers"] else p["late_bins"] for i in range(num_layers)]
        return np.array([k, v], dtype=np.int32).T.reshape(num_layers, 2)

    def encode_globals(self, cache: KVCache, state: Any = None) -> dict[str, np.ndarray]:
        return {"cachegen_bins": self.layer_bins(cache.num_layers)}

    def _stage(self) -> EntropyStage:
        return EntropyStage(**_stage_params(self.params), scope="chunk")

    def encode_tensor(self, x: torch.Tensor, ctx: TensorContext) -> EncodedTensor:
        where = f"layers.{ctx.layer}.{ctx.role}"
        bins = recorded_value(ctx, "cachegen_bins", where)
        t, h, d = x.shape
        try:
            codes, scale = native.token_quantize(x.reshape(t, h * d), np.arange(t), bins - 1)
        except native.Unsupported:
            c32, s16 = symmetric_token_quantize(x.float().reshape(t, h * d), bins - 1)
            codes, scale = _tokens(c32), s16.numpy()
        planes = {"scale": scale}
        planes.update(add_prefix(self._stage().encode(codes, alphabet=bins, layout="tokens"), "ans_"))
        return EncodedTensor(planes, {"bins": bins})

    def parse_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> CacheGenLMCacheParsed:
        """Validate one coded tensor against formats/SPEC.md §11.7 (shared by every decoder); the
        streams are checked as they are decoded.

        Raises:
            FormatError: params that disagree with the recorded bins, bins out of bounds, planes
                missing, of the wrong dtype or shape, unknown planes, bad scales, a stage of another
                geometry.
        """
        at = where(ctx)
        rec = _recorded_bounded(ctx, "cachegen_bins", at, 4, MAX_BINS, even=True)
        pr = enc.params
        if type(pr.get("bins")) is not int or pr["bins"] != rec:
            raise FormatError(f"{at}: cachegen-lmcache params {pr!r} disagree with recorded bins {rec}")
        t, h, d = ctx.shape
        check_plane_names(enc.planes, ["scale", *stage_names("ans_")], at, "cachegen-lmcache")
        scale = _scale_plane(enc, at, t)
        ans_x = (h * d, t, rec)
        return CacheGenLMCacheParsed(rec, scale, stage(enc.planes, "ans_", ans_x, at), ans_x)

    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        v = self.parse_tensor(enc, ctx)
        at = where(ctx)
        rec = v.bins
        t, h, d = ctx.shape
        codes = _decode_tokens(v.ans, v.ans_expected, "ans_", at)
        try:
            out = torch.empty((t, h * d), dtype=ctx.dtype)
            try:  # a code past the bins - 1 levels: the reference's error below, word for word
                native.rows_affine(codes, np.arange(t), v.scale.astype(np.float32), (rec - 2) // 2, out,
                                   max_code=rec - 2)
            except FormatError as e:
                raise type(e)(f"{at}: {e}") from None
            return out.reshape(t, h, d)
        except native.Unsupported:
            pass
        if codes.size and int(codes.max()) > rec - 2:
            raise FormatError(f"{at}: code {int(codes.max())} outside the {rec - 1} levels")
        out = symmetric_token_dequantize(_to_torch(codes), torch.from_numpy(v.scale.copy()), rec - 1)
        return _saturate(out.reshape(t, h, d), ctx.dtype)

register_preset("cachegen", {"id": "cachegen"},
                "CacheGen (paper): anchor+delta in groups of 10, layer-group bins 31/15/15, per-channel ANS tables")
register_preset("cachegen-lmcache", {"id": "cachegen-lmcache"},
                "CacheGen as LMCache ships it: per-token absmax, bins 32/16, 16-bit tables per channel per 256-token chunk")
