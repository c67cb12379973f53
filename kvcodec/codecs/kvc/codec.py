"""The ``kvc`` codec: config, validation, the encode pipeline and the decoder.

Contract: :meth:`KVCCodec.encode_tensor` writes exactly the planes and params of
formats/codecs/kvc.md; :meth:`KVCCodec.parse_tensor` accepts exactly what that document allows
(and every file this encoder writes); :meth:`KVCCodec.decode_tensor` follows its normative
arithmetic, on the native path or the reference, bit for bit.

The bitstream is specified in formats/codecs/kvc.md; the design and its measurements are in
docs/kvc-design.md.
"""

from __future__ import annotations

import dataclasses
import functools
from contextvars import ContextVar
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from ... import native
from ...cache import KVCache
from ...codec import Codec, EncodedTensor, Prepared, TensorContext, register_codec
from ...entropy import EntropyStage
from ...errors import ConfigError, FormatError
from ...format.pack import pack_planes, unpack_planes
from ...native.kvc import defer_or_run, kvc_decode_job
from ...quant.deadzone import (
    STEP_CODE_MAX,
    STEP_CODE_MIN,
    STEP_MANTISSA,
    RECON_MAX_LEVELS,
    recon_values,
    step_code,
    step_from_code,
)
from ...transforms.allocation import weighted_steps
from .calibration import Calibration, QueryStats, attention_estimate
from .profile import parse_profile, steps_for_target
from .plan import _layer_calib
from ...transforms.rope import (STYLES, layer_rotates, phase_steps, rope_centred, rotated_means, sin_table,
                                unrotated_mean)
from .sinks import detect_sinks
from .steps import _attn_factor, _checked_codes, _checked_recon, _quantize_tokens, _sens_multipliers, recency_factor, token_steps
from .symbols import _narrowest, _stage, delta_rows, escape_join, pred_mask, running_sums, split_tokens
from ...transforms.centering import channel_means, head_rms, token_rms
from ...transforms.hadamard import fwht, is_power_of_two


_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_NP_INT = {torch.float32: np.int32, torch.float16: np.int16, torch.bfloat16: np.int16}
_STAGE_PREFIX = "ans_"
_STAGE_PLANES = ("meta", "words", "offsets", "tables", "row_table")
#: With ``pack: 2`` these pieces are stored as zstd frames where that is smaller (not the ANS
#: words and the exact tokens: they do not compress), at this level (higher levels cost encode
#: time for almost no bytes: eval/results/kvc_encode_cost.md).
PACK_ZSTD_PIECES = ("side", "esc", "pred", "ans_meta", "ans_offsets", "ans_tables", "ans_row_table")
PACK_ZSTD_LEVEL = 9
#: The pieces of a packed tensor (the ``pk`` directory's piece numbers index this; normative).
PACK_PIECES = ("protect", "side", "esc", "pred", "ans_meta", "ans_words", "ans_offsets", "ans_tables",
               "ans_row_table")


#: tensors coded at once (at most the CPUs) in an encode call with prediction across layers
XPRED_ENCODE_THREADS = 2


@register_codec
class KVCCodec(Codec):
    """Transform codec: protected tokens, centring, weighted dead-zone steps, clustered-table ANS.

    Parameters (all recorded in the file):
        k_step: K (and MLA latent) step as a fraction of the head's RMS after centring.
        v_step: V step as a fraction of each token's RMS (``v_scale="token"``) or the head's.
        k_gamma: channel weighting exponent for K (0 = plain MSE; see the module docstring).
        v_scale: ``"token"`` or ``"head"``.
        v_center: centre V per channel too.
        sinks, recent: tokens at the start / end stored exactly.
        recent_ramp, recent_fine: finer steps for the latest tokens, ``min(1, sqrt((d + 1) /
            recent_ramp))`` times the step at distance ``d`` from the last token, at most
            ``recent_fine`` times finer (``recent_ramp`` 0 = off; see :func:`recency_factor`).
        sink_v_ratio: also store exactly the tokens whose V RMS is below this fraction of the
            median (0 = off).
        delta: code the rows whose token deltas are cheaper as deltas: 1 (the default) when the
            estimated saving pays for the ``pred`` plane, 2 whatever the saving (tests, golden
            vectors), 0 never. Lossless (see :func:`delta_rows`).
        rho: dead-zone rounding offset in (0, 0.5].
        transform: ``"none"`` or ``"hadamard"``.
        max_level: escape threshold ``L`` cap (alphabet ``2L``).
        precision, n_tables, rows_per_stream, chunk: entropy stage settings.
        ctx: magnitude-context thresholds of the entropy stage (``[]`` = off; formats/ANS.md
            §3.1): each code's table is chosen by its row and by the mean magnitude of the codes
            above it in its stream at the same token, which tracks the per-token step (attention,
            recency) a row's single table would otherwise average over. Lossless; the
            ``n_tables`` tables are shared by all (row, class) pairs.
        k_recon: reconstruction offsets for K's codes ``±1 .. ±k_recon`` (0 = off; at most 16):
            the encoder measures, per tensor, how far inside each level the values it codes lie
            and writes that as the tensor's ``rc`` (2 bytes per level), the decoder reconstructs
            there. K values crowd the inner edge of their bins (peaked distributions), so this
            lowers K's error at no rate (eval/results/kvc_recon.md). Not for V: shrinking V's
            values toward zero shrinks every attention output coherently (described there).
        pack: 2 (default) to store the tensor's planes as one packed plane (see the planes below)
            with its small pieces (tables, escapes, means...) as zstd frames where that is smaller,
            1 to pack them without compression, 0 for one container plane each.
        calibration: path of a query-statistics file for the encoder ("" = none; see 8. above).
        calibration_sha256: SHA-256 (hex) of that file. The encoder fills it in, so every file
            coded with a calibration names the exact statistics behind its steps (the path alone
            does not identify them); given explicitly, a file with another hash is refused.
        k_qgamma, v_attn, k_attn, attn_clip, attn_coarse: how the calibrated encoder uses it
            (inert without).
        query_pos: where the next queries will stand, as an absolute token position (0, the
            default: right after the cache's last token). The calibrated encoder turns its
            calibration queries there to estimate the attention each token will get; a chunk cut
            from the middle of a sequence (its keys rotated at their own positions) needs the
            sequence's end here, or its estimates point at the wrong tokens
            (:meth:`part_config`). Encoder-only: not recorded in the file.
        target_kl: the mean next-token KL to meet (0 = off). With a calibration file that holds a
            profile (``kvcodec calibrate``), the steps and every other quality parameter come from
            the profile's measured curve for this target on the profile's model
            (:mod:`kvcodec.codecs.kvc.profile`) and are recorded in the file's config. The level
            presets set it; without a profile they code with their own fixed steps (and the
            file records no target).
        fallback: what ``target_kl`` does without a profile: ``"refuse"`` (the default:
            ConfigError, as the target cannot be kept) or ``"steps"`` (code with ``k_step`` and
            ``v_step`` as given; the level presets, whose steps were measured on SmolLM2 and
            Qwen2.5-Coder-0.5B).
        k_rope_mean: 1 to centre K by rotating means (:mod:`kvcodec.transforms.rope`): the channel
            means taken before RoPE and turned to each token's position, where the calibration
            file knows the layer's rotation (its ``LayerAttention``; other layers, and encodes
            without a calibration, centre as with 0). A constant part of K before RoPE (Qwen2's K
            bias) turns with the position, which a plain channel mean cannot remove. The file
            records the rotation (the global plane ``kvc_rope`` and the tensors' ``rope``), so
            the decoder needs nothing else.
        sens, sens_clip, sens_coarse: per-(layer, head) steps from the file's sensitivities, when
            it has them: multiplier ``(s / geometric mean) ** (-sens / 2)`` clipped to
            ``[1/sens_clip, sens_coarse]`` (see :func:`_sens_multipliers`; 0 = off).
        xpred: 1 to code each layer that the calibration file's profile has a predictor for as
            its residual after a prediction from the layer before as decoded (closed loop;
            :mod:`kvcodec.codecs.kvc.xpred`, formats/codecs/kvc.md §13). Profiles that
            ``kvcodec calibrate`` writes set it for every level (``--no-xpred``: not). **Such a
            file decodes only where that profile is** (found by its SHA-256: the path the
            encoder read, ``profiles=`` / ``kvcodec decode --profile``, ``$KVCODEC_PROFILES``,
            ``~/.cache/kvcodec/profiles``); every other setting leaves files self-contained.

    Example:
        >>> import kvcodec
        >>> kvcodec.get_codec("kvc-aggressive").params["k_step"] > kvcodec.get_codec("kvc-transparent").params["k_step"]
        True
    """

    codec_id = "kvc"
    #: Tensors code side by side (the native passes release the GIL); a calibrated encode, whose
    #: per-call state holds the attention estimates' futures, says 1 for its call (:meth:`prepare`).
    encode_threads = 4
    #: Tensors decode side by side (one native call each, which releases the GIL)
    decode_threads = 2
    defaults = {
        "k_step": 0.45, "v_step": 1.35, "k_gamma": 1.0, "v_scale": "token", "v_center": False,
        "sinks": 1, "recent": 0, "sink_v_ratio": 0.3, "rho": 0.5, "transform": "none", "max_level": 32,
        "precision": 12, "n_tables": 8, "rows_per_stream": 16, "chunk": 4096,
        "calibration": "", "k_qgamma": 1.5, "v_attn": 0.5, "k_attn": 1.0, "attn_clip": 2.0, "attn_coarse": 1.5,
        "sens": 1.0, "sens_clip": 2.0, "sens_coarse": 1.5, "recent_ramp": 0, "recent_fine": 1.0,
        "delta": 1, "calibration_sha256": "", "ctx": [], "k_recon": 0, "pack": 2, "target_kl": 0.0,
        "fallback": "refuse", "query_pos": 0, "k_rope_mean": 0, "xpred": 0,
    }

    def check_params(self) -> None:
        p = self.params
        for k in ("k_step", "v_step"):
            if not 1e-6 <= p[k] <= 1e6:
                raise ConfigError(f"kvc {k} must be in [1e-6, 1e6], got {p[k]}")
        for k in ("k_gamma", "k_qgamma"):
            if not 0.0 <= p[k] <= 4.0:
                raise ConfigError(f"kvc {k} must be in [0, 4], got {p[k]}")
        if p["v_scale"] not in ("token", "head"):
            raise ConfigError(f"kvc v_scale must be 'token' or 'head', got {p['v_scale']!r}")
        if p["transform"] not in ("none", "hadamard"):
            raise ConfigError(f"kvc transform must be 'none' or 'hadamard', got {p['transform']!r}")
        if not 0.0 < p["rho"] <= 0.5:
            raise ConfigError(f"kvc rho must be in (0, 0.5], got {p['rho']}")
        if p["sinks"] < 0 or p["recent"] < 0:
            raise ConfigError("kvc sinks and recent must be >= 0")
        if not 0.0 <= p["sink_v_ratio"] < 1.0:
            raise ConfigError(f"kvc sink_v_ratio must be in [0, 1), got {p['sink_v_ratio']}")
        if not 1 <= p["max_level"] <= 1024:
            raise ConfigError(f"kvc max_level must be in [1, 1024], got {p['max_level']}")
        if not 8 <= p["precision"] <= 16 or 2 * p["max_level"] > (1 << p["precision"]):
            raise ConfigError("kvc precision must be in [8, 16] and 2**precision >= 2 * max_level")
        if not 1 <= p["n_tables"] <= 256 or p["rows_per_stream"] < 1 or p["chunk"] < 0:
            raise ConfigError("kvc n_tables must be in [1, 256], rows_per_stream >= 1, chunk >= 0")
        if (not 0.0 <= p["v_attn"] <= 4.0 or not 0.0 <= p["k_attn"] <= 4.0
                or not 1.0 <= p["attn_clip"] <= 256.0 or not 1.0 <= p["attn_coarse"] <= 256.0):
            raise ConfigError("kvc v_attn and k_attn must be in [0, 4], attn_clip and attn_coarse in [1, 256]")
        if p["recent_ramp"] < 0 or not 1.0 <= p["recent_fine"] <= 256.0:
            raise ConfigError("kvc recent_ramp must be >= 0 and recent_fine in [1, 256]")
        h = p["calibration_sha256"]
        if not isinstance(h, str) or (h and (len(h) != 64 or any(ch not in "0123456789abcdef" for ch in h))):
            raise ConfigError(f"kvc calibration_sha256 must be '' or 64 lowercase hex digits, got {h!r}")
        if not isinstance(p["k_recon"], int) or isinstance(p["k_recon"], bool) or not 0 <= p["k_recon"] <= RECON_MAX_LEVELS:
            raise ConfigError(f"kvc k_recon must be an integer in [0, {RECON_MAX_LEVELS}], got {p['k_recon']!r}")
        if not isinstance(p["pack"], int) or isinstance(p["pack"], bool) or p["pack"] not in (0, 1, 2):
            raise ConfigError(f"kvc pack must be 0, 1 or 2, got {p['pack']!r}")
        if not isinstance(p["delta"], int) or p["delta"] not in (0, 1, 2):
            raise ConfigError(f"kvc delta must be 0, 1 or 2, got {p['delta']!r}")
        if not 0.0 <= p["target_kl"] <= 10.0:
            raise ConfigError(f"kvc target_kl must be in [0, 10] (0 = off), got {p['target_kl']}")
        if p["fallback"] not in ("refuse", "steps"):
            raise ConfigError(f"kvc fallback must be 'refuse' or 'steps', got {p['fallback']!r}")
        if not isinstance(p["k_rope_mean"], int) or isinstance(p["k_rope_mean"], bool) or p["k_rope_mean"] not in (0, 1):
            raise ConfigError(f"kvc k_rope_mean must be 0 or 1, got {p['k_rope_mean']!r}")
        if not isinstance(p["xpred"], int) or isinstance(p["xpred"], bool) or p["xpred"] not in (0, 1):
            raise ConfigError(f"kvc xpred must be 0 or 1, got {p['xpred']!r}")
        q = p["query_pos"]
        if not isinstance(q, int) or isinstance(q, bool) or not 0 <= q <= 1 << 40:
            raise ConfigError(f"kvc query_pos must be an integer in [0, 2**40] (0 = after the cache), got {q!r}")
        if not 0.0 <= p["sens"] <= 4.0 or not 1.0 <= p["sens_clip"] <= 256.0 or not 1.0 <= p["sens_coarse"] <= 256.0:
            raise ConfigError("kvc sens must be in [0, 4], sens_clip and sens_coarse in [1, 256]")
        try:
            _stage(p)
        except ConfigError as e:
            raise ConfigError(f"kvc ctx / entropy settings: {e}") from None

    # ------------------------------------------------------------------ calibration (encoder only)
    def prepare(self, cache: KVCache) -> Prepared:
        """Per-call state: with a ``calibration`` file, read it once (its SHA-256 goes into the
        file's codec config) and estimate, per layer, the query energy per K channel and the
        attention each token will receive (:mod:`kvcodec.codecs.kvc.calibration`). Only the steps
        change, and they are stored as always, so the decoder needs nothing else, except with
        ``xpred`` (the profile's cross-layer predictors: the decoder needs the profile).

        Raises:
            InputError: the calibration file cannot be read.
            FormatError: it is not a calibration file.
            ConfigError: it is for another model, or its hash differs from ``calibration_sha256``.
        """
        config = self.get_config()
        del config["query_pos"]  # encoder-only: where the attention estimates put the queries
        if not self.params["k_rope_mean"]:
            del config["k_rope_mean"]  # files without rotating means keep the config they always had
        if not self.params["xpred"]:
            del config["xpred"]  # files without prediction across layers keep the config they always had
        target = self.params["target_kl"]
        refuse = self.params["fallback"] == "refuse"
        if not target or not self.params["calibration"]:
            # files without a measured target keep the config they always had
            del config["target_kl"], config["fallback"]
        if not self.params["calibration"]:
            if target and refuse:
                raise ConfigError(f"kvc target_kl {target} needs a profile of your model: run `kvcodec calibrate "
                                  f"--model M --out F` and give 'calibration': F (or fallback 'steps')")
            if self.params["xpred"]:
                raise ConfigError("kvc xpred needs a profile that holds cross-layer predictors ('calibration': a "
                                  "file from `kvcodec calibrate`)")
            return Prepared(config, {})
        cal = Calibration.load_kept(self.params["calibration"])
        given = self.params["calibration_sha256"]
        if given and given != cal.sha256:
            raise ConfigError(f"kvc calibration {self.params['calibration']!r} has SHA-256 {cal.sha256}, "
                              f"the config names {given}")
        config["calibration_sha256"] = cal.sha256  # recorded in the file's codec config
        params = dict(self.params)
        if target:
            if cal.stats.profile is None:
                if refuse:
                    raise ConfigError(f"kvc target_kl: {self.params['calibration']!r} holds query statistics but no "
                                      f"profile; run `kvcodec calibrate` again (this version writes one)")
                del config["target_kl"], config["fallback"]  # statistics only: fixed steps as before
            else:
                over = steps_for_target(parse_profile(cal.stats.profile, self.params["calibration"]), target)
                try:
                    type(self)(**{**{k: v for k, v in config.items() if k != "id"}, **over})
                except ConfigError as e:
                    raise FormatError(f"{self.params['calibration']}: profile settings: {e}") from None
                config.update(over)
                params.update(over)
        # the attention estimates (the calibrated encoder's costliest part) run on a second
        # thread, a layer ahead of the coding, which mostly waits in C and releases the GIL
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvc-attn")
        try:
            state: dict[Any, Any] = self._calibration_plan(cache, cal.stats, pool, params)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        if params != dict(self.params):
            state["params"] = params  # the profile's settings, read by encode_planes
        if params["k_rope_mean"]:
            rope = _rope_plan(cache, cal.stats)
            if rope is not None:
                state["rope"] = rope
        elif "k_rope_mean" in config:
            del config["k_rope_mean"]  # files without rotating means keep the config they always had
        if params["xpred"]:
            from .xpred import Predictors, XPredEncoder, absolute_positions

            config["xpred"] = 1
            # the closed loop decodes each tensor as the file's decoder will: with the file's config
            # (the profile's settings over the caller's), not this codec's own
            state["xpred"] = XPredEncoder(Predictors.from_calibration(cal),
                                          absolute_positions(cache.positions, cache.num_tokens),
                                          [{r: tuple(t.shape[1:]) for r, t in layer.items()} for layer in cache.layers],
                                          type(self).from_config(config))
        elif "xpred" in config:
            del config["xpred"]
        # a calibrated encode without prediction across layers gained nothing on threads
        # (Qwen3-0.6B-shaped window on 2 cores, scratch: 1.99 s on two against 1.78 on one;
        # uncalibrated 0.70 against 1.17); with it, one tensor's entropy coding overlaps the next
        # layer's quantization (XPredEncoder orders them)
        return Prepared(config, state, lambda: pool.shutdown(wait=True, cancel_futures=True),
                        encode_threads=XPRED_ENCODE_THREADS if "xpred" in state else 1)

    def part_config(self, first: bool = False, last: bool = False, query_pos: int = 0) -> dict[str, Any]:
        """This codec's config for a *part* of a longer sequence (an independent chunk): no
        leading sink tokens stored exactly unless the part is the sequence's ``first``, and no
        finer steps for its latest tokens unless it is the ``last`` (they are no sequence's
        start or end otherwise). A target met with a profile is resolved to the profile's steps
        and settings first (they are what changes; the attention estimates still apply).

        The recency ramp carries much of a level's KL (eval/results/lmcache_chunks.md: without
        it on every chunk KL rises 2.5-3x): use ``last`` on the chunk that ends the sequence.
        ``query_pos``: where the sequence ends (its token count), when known: the calibrated
        encoder estimates the attention a part's tokens will get from queries there rather than
        just after the part (``query_pos`` of the codec).

        Example:
            >>> import kvcodec
            >>> near = kvcodec.get_codec("kvc-near")
            >>> c = kvcodec.get_codec(near.part_config())
            >>> c.params["sinks"], c.params["recent_ramp"], c.params["k_step"] == near.params["k_step"]
            (0, 0, True)
        """
        config = self.get_config()
        target = config.get("target_kl", 0.0)
        if target and config.get("calibration"):
            cal = Calibration.load(config["calibration"])
            if cal.stats.profile is not None:
                config.update(steps_for_target(parse_profile(cal.stats.profile, config["calibration"]), target))
                config["target_kl"] = 0.0
        if not first:
            config["sinks"] = 0
        if not last:
            config["recent_ramp"] = 0
        if query_pos:
            config["query_pos"] = int(query_pos)
        return config

    def encode_parts(self, cache: KVCache, chunk_tokens: int, last: bool = True,
                     only: Any = None) -> list[bytes | None]:
        """``cache`` as independent files of ``chunk_tokens`` tokens (the last may be shorter),
        each a part of one sequence (:meth:`part_config`): the first keeps the sink tokens, the
        last (when ``last``: it ends the sequence) the recency ramp. With a calibration, every
        part's attention estimates are the whole cache's (the queries at its end, normalised over
        all its tokens), so each token gets the step it would get in the whole file; a part that
        estimated its own (``query_pos``) normalised within itself, which left the chunk with the
        most attention coarser and the others finer than the whole file
        (eval/results/lmcache_chunks_256.md). One part is :meth:`encode`, byte for byte.
        ``only``: the indices of the parts wanted (the others come back as None, uncoded).

        Example:
            >>> import kvcodec, torch
            >>> layer = (torch.randn(40, 2, 8, dtype=torch.float16),) * 2
            >>> cache = kvcodec.KVCache.from_tensors([layer])
            >>> [len(kvcodec.decode(b).layers[0]["k"]) for b in kvcodec.get_codec("kvc-near").encode_parts(cache, 16)]
            [16, 16, 8]

        Raises:
            ConfigError: ``chunk_tokens`` < 1, or what :meth:`encode` raises.
        """
        if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ConfigError(f"encode_parts: chunk_tokens must be a positive int, got {chunk_tokens!r}")
        t = cache.num_tokens
        bounds = [(a, min(a + chunk_tokens, t)) for a in range(0, t, chunk_tokens)] or [(0, 0)]
        places = [(i == 0, last and i == len(bounds) - 1) for i in range(len(bounds))]
        made = {pl: type(self)(**{k: v for k, v in self.part_config(*pl).items() if k != "id"}) for pl in set(places)}
        for c in made.values():  # each part's file names the preset that made it (producer.preset)
            object.__setattr__(c, "preset", self.preset)
        codecs = [made[pl] for pl in places]
        whole = self._sequence_attention(cache, codecs[0].params) if self.params["calibration"] else None
        out: list[bytes | None] = []
        for n, ((a, b), codec) in enumerate(zip(bounds, codecs)):
            if only is not None and n not in only:
                out.append(None)
                continue
            token = _PART_ATTENTION.set(None if whole is None else
                                        {i: (att[a:b], norm) for i, (att, norm) in whole.items()})
            try:
                out.append(codec.encode(cache.tokens(a, b)))
            finally:
                _PART_ATTENTION.reset(token)
        return out

    def _sequence_attention(self, cache: KVCache, p: dict[str, Any]) -> dict[int, tuple[np.ndarray, dict[str, np.ndarray]]]:
        """Per layer, the whole cache's attention estimates and, per role, the mean of their
        weights over the tokens the whole file would code (all but its first ``sinks`` and last
        ``recent`` tokens; sinks that ``sink_v_ratio > 0`` detects are not left out, so with it the
        parts' steps only approximate the whole file's): what :func:`_attn_factor` normalises by
        (``p``: the parts' settings)."""
        if p["k_attn"] <= 0 and p["v_attn"] <= 0:
            return {}
        stats = Calibration.load(self.params["calibration"]).stats
        t = cache.num_tokens
        s = min(p["sinks"], t)
        r = min(p["recent"], t - s)
        keep = np.ones(t, dtype=bool)
        keep[:s] = False
        if r:
            keep[t - r:] = False
        out = {}
        for i, layer in enumerate(cache.layers):
            if "k" not in layer or i >= stats.num_layers:
                continue
            att = attention_estimate(stats, i, layer["k"].float().numpy())
            if att is None:
                continue
            a = np.maximum(np.asarray(att[keep], dtype=np.float64), 1e-12)
            norm = {role: np.array([(a[:, j] ** e).mean() if a.shape[0] else 1.0 for j in range(a.shape[1])])
                    for role, e in (("k", p["k_attn"]), ("v", p["v_attn"]))}
            out[i] = (att, norm)
        return out

    def _calibration_plan(self, cache: KVCache, stats: QueryStats, pool: Any = None,
                          params: Any = None) -> dict[Any, dict[str, Any]]:
        """Per layer: ``q_energy``, ``attn`` (with ``pool``, an executor, a future of it, resolved
        by :func:`_layer_calib`), ``k_mult`` / ``v_mult``; ``params`` (default: the codec's) are
        the settings they follow."""
        p = self.params if params is None else params
        if stats.num_layers != cache.num_layers:
            raise ConfigError(f"kvc calibration {self.params['calibration']!r} has {stats.num_layers} "
                              f"layers, the cache {cache.num_layers}: it is for another model")
        plan: dict[int, dict[str, Any]] = {}
        seq = _PART_ATTENTION.get()  # a part of a longer sequence (encode_parts): its attention is given
        for i, layer in enumerate(cache.layers):
            if "k" not in layer:
                continue
            k = layer["k"]
            e = stats.q_energy[i]
            entry: dict[str, Any] = {}
            if e is not None:
                if e.shape != tuple(k.shape[1:]):
                    raise ConfigError(f"kvc calibration: layer {i} query energy is {list(e.shape)}, "
                                      f"K heads x channels {list(k.shape[1:])}")
                entry["q_energy"] = e.astype(np.float64)
            if seq is not None:
                if i in seq:
                    entry["attn"], entry["attn_norm"] = seq[i]
            elif p["v_attn"] > 0 or p["k_attn"] > 0:
                if pool is not None:
                    entry["attn"] = pool.submit(lambda i=i, k=k: attention_estimate(stats, i, k.float().numpy(),
                                                                                     query_pos=p["query_pos"]))
                else:
                    a = attention_estimate(stats, i, k.float().numpy(), query_pos=p["query_pos"])
                    if a is not None:
                        entry["attn"] = a
            plan[i] = entry
        if p["sens"] > 0:
            for role in ("k", "v"):
                for i, m in enumerate(_sens_multipliers(stats.sensitivity(role), cache, role, p["sens"],
                                                         p["sens_clip"], p["sens_coarse"])):
                    if m is not None and i in plan:
                        plan[i][role + "_mult"] = m
        return plan

    @property
    def nominal_bits(self) -> float:
        # entropy of a Gaussian quantized with step a*sigma: log2(sqrt(2 pi e) / a)
        a = 0.5 * (self.params["k_step"] + self.params["v_step"])
        return float(max(0.05, np.log2(4.1327 / a)))

    # ------------------------------------------------------------------ encode
    def _per_channel(self, ctx: TensorContext, p: Any = None) -> bool:
        return ctx.role in ("k", "kv") or (self.params if p is None else p)["v_scale"] == "head"

    def encode_globals(self, cache: KVCache, state: Any = None) -> dict[str, np.ndarray]:
        """With ``sink_v_ratio > 0`` (a profile's, else the codec's): the detected sink tokens of
        every layer, ``int32 [N, 2]`` rows ``(layer, position)`` (see :func:`detect_sinks`). With
        rotating K means (``k_rope_mean``): ``kvc_rope``, the phase steps of the rotations used."""
        p = (state or {}).get("params", self.params)
        out = {}
        if (state or {}).get("rope") is not None:
            out["kvc_rope"] = state["rope"]["table"]
        thr = p["sink_v_ratio"]
        if thr <= 0:
            return out
        rows = [(i, int(pos)) for i, layer in enumerate(cache.layers) if "v" in layer
                for pos in detect_sinks(layer["v"], thr, p["sinks"])]
        out["kvc_sinks"] = np.array(rows, dtype=np.int32).reshape(-1, 2)
        return out

    def _mask(self, ctx: TensorContext, s: int, r: int, where: str) -> np.ndarray:
        t = ctx.shape[0]
        mask = np.zeros(t, dtype=bool)
        mask[:s] = True
        if r:
            mask[t - r:] = True
        g = ctx.globals.get("kvc_sinks")
        if g is not None and ctx.role in ("k", "v"):
            g = np.asarray(g)
            if g.dtype != np.int32 or g.ndim != 2 or g.shape[1] != 2:
                raise FormatError(f"{where}: global kvc_sinks must be int32 [N, 2]")
            pos = g[g[:, 0] == ctx.layer, 1].astype(np.int64)
            if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= t):
                raise FormatError(f"{where}: a sink position lies outside [0, {t})")
            mask[pos] = True
        return mask

    def encode_tensor(self, x: torch.Tensor, ctx: TensorContext) -> EncodedTensor:
        """:meth:`encode_planes`, its planes packed into one (``pack``, the default) or not; with
        prediction across layers (``xpred``), of the residual after the prediction (param ``xp``)."""
        xp = ctx.state.get("xpred") if isinstance(ctx.state, dict) else None
        if xp is None:
            return self._encode_tensor(x, ctx)
        from .xpred import as_float32, residual

        where = f"layers.{ctx.layer}.{ctx.role}"
        with xp.coding():
            rows = (ctx.start, ctx.start + x.shape[0])
            pred = xp.prediction(ctx.layer, ctx.role, rows, where)  # float32, this call's own
            if pred is not None:  # protected tokens are stored as they are: no prediction there
                p = ctx.state.get("params", self.params)
                t = x.shape[0]
                s = min(p["sinks"], t)
                pred[self._mask(ctx, s, min(p["recent"], t - s), where)] = 0.0
            if pred is None:
                planes, codes, stage, means, steps = self._symbols(x, ctx, split=False)
            else:  # the residual, at the steps the tensor itself would get (its RMS, not the residual's)
                x32 = np.empty(tuple(x.shape), dtype=np.float32)  # x widened, from the residual's pass
                r = residual(x, pred, where, x32)
                planes, codes, stage, means, steps = self._symbols(
                    r, dataclasses.replace(ctx, state={**ctx.state, "scale_of": x32}), split=False)
            # the values the decoder will have, from the codes (what decoding the planes gives)
            dec = xp.decoder.reconstruct(planes, codes, TensorContext(ctx.layer, ctx.role, ctx.shape, ctx.dtype,
                                                                      ctx.layer_kind, ctx.globals), means, steps)
            if pred is None:
                xp.store(ctx.layer, ctx.role, rows, as_float32(dec))  # the next layer may start
            else:  # dtype(residual + prediction), as the decoder rounds it
                xp.store_sum(ctx.layer, ctx.role, rows, dec, pred)
            # the symbols and their coding after the store: the next layer's tensors wait for the
            # store, not for these
            enc = self._packed(self._staged(planes, self._split(planes, stage)))
            if pred is not None:
                enc.params["xp"] = 1
        return enc

    def _encode_tensor(self, x: torch.Tensor, ctx: TensorContext) -> EncodedTensor:
        return self._packed(self.encode_planes(x, ctx))

    def _packed(self, enc: EncodedTensor) -> EncodedTensor:
        """``enc``'s planes packed into one (``pack``), or ``enc`` itself (``pack`` 0)."""
        if not self.params["pack"]:
            return enc
        blob, directory = pack_planes(enc.planes, PACK_PIECES, *((PACK_ZSTD_LEVEL, PACK_ZSTD_PIECES)
                                                                  if self.params["pack"] == 2 else ()))
        return EncodedTensor({"pack": blob}, {**enc.params, "pk": directory})

    def encode_planes(self, x: torch.Tensor, ctx: TensorContext) -> EncodedTensor:
        """One tensor's planes and params, each plane on its own (see the module docstring)."""
        enc, _, stage, _, _ = self._symbols(x, ctx)
        return self._staged(enc, stage)

    def _staged(self, enc: EncodedTensor, stage: Any) -> EncodedTensor:
        """``enc`` with its entropy stage's planes (``stage`` from :meth:`_symbols`)."""
        if stage is not None:
            p, sym, lv, stats, ctx_thr = stage
            if sym.ndim == 2 and sym.strides[0] == sym.itemsize and not sym.flags.c_contiguous:
                # token-major views of row-major symbols (and classes): the stage reads those rows
                # as they lie (the same planes either way)
                sym, layout = sym.T, "rows"
                if stats is not None:
                    stats = (stats[0], stats[1].T)
            else:
                layout = "tokens"
            for k, v in _stage({**p, "ctx": ctx_thr}).encode(sym, alphabet=2 * lv, layout=layout,
                                                             ctx_stats=stats).items():
                enc.planes[_STAGE_PREFIX + k] = v
        return enc

    def _symbols(self, x: torch.Tensor, ctx: TensorContext, split: bool = True
                 ) -> tuple[EncodedTensor, np.ndarray | None, Any, np.ndarray | None, np.ndarray]:
        """:meth:`encode_planes` up to the entropy stage: the tensor's planes and params but the
        stage's, the integer codes the stage will code (token-major ``[n, R]``, what the
        decoder's escape join gives back; None without coded tokens), what :meth:`_staged`
        needs to code them, the rotating means subtracted (float32 ``[n, H, D]``, or None) and
        the steps of the codes (broadcasting to ``[n, H, D]``: the values the decoder derives
        from the planes and codes, which :meth:`reconstruct` then need not derive again). With
        ``split`` False the symbols wait: the third value is then what :meth:`_split` takes, and
        the params hold a provisional ``L`` (the encoder's closed loop reconstructs first and
        splits off the layers' critical path)."""
        p = (ctx.state or {}).get("params", self.params)  # a profile's settings, else the codec's
        t, h, d = x.shape
        where = f"layers.{ctx.layer}.{ctx.role}"
        s = min(p["sinks"], t)
        r = min(p["recent"], t - s)
        try:
            mask = self._mask(ctx, s, r, where)
        except FormatError:
            # the file-level sink positions are read as positions inside every chunk (the
            # format as written so far), so a sink past the first chunk's length cannot be coded
            raise ConfigError(
                f"{where}: kvc with sink detection (sink_v_ratio > 0) cannot code this cache in chunks of "
                f"{t} tokens: a detected sink lies beyond the chunk; encode it unchunked, or with "
                f"sink_v_ratio 0 (the -cal presets), or with longer chunks") from None
        n = t - int(np.count_nonzero(mask))
        keep = torch.from_numpy(mask)
        # float16 and float32 on the CPU go through numpy: torch ops called from the writer's
        # threads (encode_threads) at once each start their own OpenMP team, whose spinning
        # threads slowed a 2-core encode down
        xn = x.numpy() if x.dtype in (torch.float16, torch.float32) and x.device.type == "cpu" \
            and not x.requires_grad else None
        if xn is not None:
            planes: dict[str, np.ndarray] = {"protect": np.ascontiguousarray(xn[mask]).view(_NP_INT[x.dtype])}
        else:
            planes = {"protect": x[keep].contiguous().view(_INT_VIEW[x.dtype]).numpy()}
        is_k = ctx.role in ("k", "kv")
        use_h = p["transform"] == "hadamard" and is_power_of_two(d)
        params: dict[str, Any] = {"n": n, "sinks": s, "recent": r,
                                  "transform": "hadamard" if use_h else "none"}
        from_f16 = xn is not None and xn.dtype == np.float16
        run = _one_run(np.flatnonzero(~mask))
        coded = ~mask if run is None else run  # a slice copies nothing
        if from_f16:
            # float16 values, widened exactly to float32 (in C with F16C where built: numpy's
            # cast runs a scalar loop, 2-3 % of an encode)
            y = _widen(xn[coded])
        elif xn is not None:  # float32
            y = xn[~mask]
        else:
            y = x[~keep].double().numpy()
        rope = _tensor_rope(ctx, n, use_h) if ctx.role == "k" else None
        centre = is_k or p["v_center"]
        mean, z, rot = _centre(y, mask, rope, centre, from_f16)
        if rope is not None:
            params["rope"] = list(rope[0])
        # the signal whose RMS sets the steps: the coded one, or with prediction across layers the
        # tensor before the prediction (its RMS, centred alike; an orthonormal transform keeps it),
        # so the prediction saves bits and leaves the error where the level's steps put it
        orig = ctx.state.get("scale_of") if isinstance(ctx.state, dict) else None  # float32 numpy or torch
        if orig is not None and not isinstance(orig, np.ndarray):
            orig = orig.detach().cpu().to(torch.float32).numpy()
        zs = z if orig is None else _centre(orig[coded], mask, rope, centre, True, keep_rot=False)[1]
        if use_h:
            z = fwht(z)
        # squares of float16-range values summed in float32 cannot overflow (65504^2 * 2^31 <
        # 3.4e38); from other sources float64
        acc = np.float32 if from_f16 and not use_h else np.float64
        side = np.zeros((2, h, d), dtype=np.float16)
        side[0] = mean.astype(np.float16)
        rec = recency_factor(t, ~mask, p["recent_ramp"], p["recent_fine"]) if n else None
        if self._per_channel(ctx, p):
            lv = p["k_recon"] if (is_k and n) else 0  # levels with reconstruction offsets
            step_rel = p["k_step"] if is_k else p["v_step"]
            base = head_rms(zs, acc)  # [H]
            calib = _layer_calib(ctx.state, ctx.layer) if ctx.role == "k" else {}
            if "k_mult" in calib:  # per-head sensitivity from the calibration (Fisher) statistics
                base = base * calib["k_mult"]
            if is_k and p["k_qgamma"] > 0 and not use_h and n and "q_energy" in calib:
                # calibrated: the logit error is sum_c q_c dk_c, so weight channel c by E[q_c^2]
                # (exponent k_qgamma: 1.5 measured better than the MSE-exact 1)
                steps = _query_steps(calib["q_energy"], p["k_qgamma"])
            elif is_k and p["k_gamma"] > 0 and not use_h and n:
                y64 = y.astype(np.float64)
                energy = (y64 * y64).mean(axis=0)  # second moment per (head, channel), incl. mean
                steps = np.stack([weighted_steps(1.0, energy[i] ** p["k_gamma"]) for i in range(h)])
            else:
                steps = np.ones((h, d))
            sc = step_code(step_rel * base[:, None] * steps)
            side[1] = sc.astype(np.float16)
            attn = calib.get("attn")
            use_attn = is_k and p["k_attn"] > 0 and n and attn is not None and attn.shape == (t, h)
            if use_attn or (n and rec is not None):
                # a token's K error moves its logit, which matters in proportion to the attention
                # the token gets: per-token log-step offsets (integers added to the channel codes,
                # kept so every sum stays a valid code), coded as H extra rows
                m = np.ones((n, h))
                if use_attn:
                    m = _attn_factor(attn[~mask], p["k_attn"], p["attn_clip"], p["attn_coarse"],
                                     calib.get("attn_norm", {}).get("k"))
                if rec is not None:
                    m = m * rec[:, None]
                lo = STEP_CODE_MIN - sc.min(axis=1)
                hi = STEP_CODE_MAX - sc.max(axis=1)
                toff = np.clip(step_code(m), lo[None], hi[None]).astype(np.int64)  # [n, H]
                params["k_tok"] = 1
                step = token_steps(sc, toff, where)  # [n, H, D], = step_from_code(sc[None] + toff[:, :, None])
                tok, rc = _quantize_tokens(z, step, p["rho"], lv, h)  # the codes, then the offset rows
                tok[:, h * d:] = toff
            else:
                step = step_from_code(sc)[None]  # [1, H, D]
                tok, rc = _quantize_tokens(z, step, p["rho"], lv, 0)
            if lv:
                # reconstruction offsets of K's first levels (K and MLA latents only): the mean
                # inward distance of the values coded +-k, measured in the quantizer's pass (see
                # kvcodec.quant.deadzone)
                params["rc"] = rc
        else:
            rel = p["v_step"] * token_rms(zs, acc)  # [n, H]
            vcal = _layer_calib(ctx.state, ctx.layer) if ctx.role == "v" else {}
            if "v_mult" in vcal:  # per-head sensitivity from the calibration (Fisher) statistics
                rel = rel * vcal["v_mult"][None, :]
            attn = vcal.get("attn")
            if attn is not None and n and attn.shape == (t, h) and p["v_attn"] > 0:
                # the output error of a token's V scales with the attention it receives
                rel = rel * _attn_factor(attn[~mask], p["v_attn"], p["attn_clip"], p["attn_coarse"],
                                         vcal.get("attn_norm", {}).get("v"))
            if rec is not None:
                rel = rel * rec[:, None]
            sc = step_code(rel)
            step = step_from_code(sc)[:, :, None]
            tok, _ = _quantize_tokens(z, step, p["rho"], 0, h)  # the codes, then the step-code rows
            base = np.median(sc, axis=0).astype(np.int64) if n else np.zeros(h, np.int64)
            params["step_base"] = [int(b) for b in base]
            tok[:, h * d:] = sc - base[None]
        if self._per_channel(ctx, p) or p["v_center"]:
            planes["side"] = side  # token-mode V without centring has no side data: no plane
        # magnitude contexts only where the recency ramp makes the steps vary along the tokens:
        # without it (a part of a sequence that does not end it) they cost up to 2.5 % of the file
        # at 256-1024 tokens, with it they save 1.9-5.2 %, on SmolLM2 and Qwen2.5-Coder alike
        # (eval/results/kvc_ctx_parts.md)
        ctx_thr = list(p["ctx"]) if n and rec is not None else []
        enc = EncodedTensor(planes, params)
        if not split:  # the symbols later (:meth:`_split`); reconstruct reads none of them
            params["L"] = max(1, min(int(p["max_level"]), 1024))  # a valid L until then
            return enc, (tok if n else None), _Deferred(p, tok, n, ctx_thr), rot, step
        return enc, (tok if n else None), self._split(enc, _Deferred(p, tok, n, ctx_thr)), rot, step

    def _split(self, enc: EncodedTensor, d: "_Deferred") -> Any:
        """The symbols of the codes ``d.tok``: the token-delta rows and the escape split, their
        planes (``pred``, ``esc``) and params (``pred``, ``L``) put into ``enc``; returns what
        :meth:`_staged` codes (None without coded tokens)."""
        p, tok, n, ctx_thr = d.p, d.tok, d.n, d.ctx_thr
        planes, params = enc.planes, enc.params
        params.pop("L", None)  # (set last, as it always was)
        use = delta_rows(tok, min_gain_bits=1024.0 if p["delta"] == 1 else 0.0) if p["delta"] and n > 1 else None
        if use is not None and use.any():  # rows coded as token deltas (lossless, see delta_rows)
            params["pred"] = 1
            planes["pred"] = np.packbits(use)
        else:
            use = None
        # the stage's rows are the H*D channels (then the step rows) over the tokens
        sym, esc, lv, stats = split_tokens(tok, p["max_level"], use, p["rows_per_stream"], ctx_thr)
        params["L"] = lv
        if esc.size:  # no escapes: no plane (each plane costs its header entry)
            planes["esc"] = _narrowest(esc)
        return (p, sym, lv, stats, ctx_thr) if n else None

    # ------------------------------------------------------------------ decode
    def parse_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> SimpleNamespace:
        """Validate one coded tensor (everything but the entropy stage's streams, which the
        decoders check as they decode them) — shared by :meth:`decode_tensor` and the GPU decoder
        (:mod:`kvcodec.gpu`), so both accept and reject the same files.

        Returns a namespace: ``where``, ``n`` (coded tokens), ``mask`` (bool ``[T]``, protected
        tokens), ``prot`` (their source-dtype bits); when ``n > 0`` also ``lv`` (``L``), ``tr``
        (transform), ``per_channel``, ``k_tok``, ``rows`` (``R`` of the symbol matrix),
        ``stage_planes``, ``esc`` (int8/16/32), ``use`` (bool ``[R]`` token-delta rows, or
        None), ``sc_ch`` (int64 ``[H, D]`` channel step codes, per-channel tensors), ``base``
        (``H`` step-code bases, token-mode tensors), ``mean`` (float32 ``[H, D]``) and ``rc``.

        Raises:
            FormatError: planes or params that do not describe a valid tensor of ``ctx.shape``.
        """
        p = self.params
        where = f"layers.{ctx.layer}.{ctx.role}"
        t, h, d = ctx.shape
        pr = enc.params
        if "pack" in enc.planes or "pk" in pr:  # one packed plane: unpack it, then as always
            if set(enc.planes) != {"pack"} or "pk" not in pr:
                raise FormatError(f"{where}: a kvc packed tensor has exactly one plane 'pack' and the param 'pk', "
                                  f"got planes {sorted(enc.planes)}")
            enc = EncodedTensor(unpack_planes(enc.planes["pack"], pr["pk"], PACK_PIECES, f"{where}.pack"),
                                {k: v for k, v in pr.items() if k != "pk"})
            pr = enc.params
        try:  # JSON integers only: "32", 32.9 and true are not counts (formats/SPEC.md §11)
            n, s, r, lv = (pr[k] for k in ("n", "sinks", "recent", "L"))
            tr = pr["transform"]
        except (KeyError, TypeError):
            raise FormatError(f"{where}: kvc params incomplete: {pr!r}") from None
        if not all(type(x) is int for x in (n, s, r, lv)) or type(tr) is not str:
            raise FormatError(f"{where}: kvc params n, sinks, recent, L must be integers and transform a string, "
                              f"got {pr!r}")
        extra = sorted(set(enc.planes) - set(PACK_PIECES))
        if extra:
            raise FormatError(f"{where}: unknown kvc plane(s) {extra}")
        xp = pr.get("xp", 0)
        if type(xp) is not int or xp not in (0, 1) or (xp and ctx.layer == 0) or ("xp" in pr and not xp):
            raise FormatError(f"{where}: kvc xp (predicted from the layer before) must be 1 or absent, and never "
                              f"on layer 0; got {xp!r}")
        if min(n, s, r) < 0 or s + r > t or not 1 <= lv <= 1024 or tr not in ("none", "hadamard"):
            raise FormatError(f"{where}: kvc params {pr!r} disagree with shape {list(ctx.shape)}")
        mask = self._mask(ctx, s, r, where)
        npro = int(mask.sum())
        if n + npro != t:
            raise FormatError(f"{where}: kvc params {pr!r} disagree with shape {list(ctx.shape)}")
        if tr != ("hadamard" if p["transform"] == "hadamard" and is_power_of_two(d) else "none"):
            # encode writes the config's transform where the width allows it, else "none"
            raise FormatError(f"{where}: transform {tr!r} recorded, but the codec config ({p['transform']!r}) "
                              f"and width {d} give {'hadamard' if tr == 'none' else 'none'!r}")
        prot = enc.planes.get("protect")
        nv = _NP_INT[ctx.dtype]
        if prot is None or prot.dtype != nv or prot.shape != (npro, h, d):
            raise FormatError(f"{where}: 'protect' plane missing or not {np.dtype(nv)}[{npro}, {h}, {d}]")
        exp = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80, torch.float32: 0x7F800000}[ctx.dtype]
        if prot.size and bool(((prot & nv(exp)) == nv(exp)).any()):  # encode refuses NaN/Inf input
            raise FormatError(f"{where}: kvc 'protect' plane holds NaN or Inf values")
        side = enc.planes.get("side")
        per_channel = ctx.role in ("k", "kv") or p["v_scale"] == "head"
        if side is None and not per_channel and not p["v_center"]:
            side = np.zeros((2, h, d), dtype=np.float16)  # token-mode V, not centred
        if side is None or side.dtype != np.float16 or side.shape != (2, h, d):
            raise FormatError(f"{where}: 'side' plane missing or not float16[2, {h}, {d}]")
        v = SimpleNamespace(where=where, n=n, mask=mask, prot=prot)
        if n == 0:
            return v
        k_tok = pr.get("k_tok", 0)
        if type(k_tok) is not int or k_tok not in (0, 1) or (k_tok and not per_channel):
            raise FormatError(f"{where}: kvc k_tok must be 0 or 1 (per-channel tensors only), got {k_tok!r}")
        rows = h * d + (0 if per_channel and not k_tok else h)
        stage_planes = {k: enc.planes[_STAGE_PREFIX + k] for k in _STAGE_PLANES if _STAGE_PREFIX + k in enc.planes}
        esc = enc.planes.get("esc", np.zeros(0, np.int32))
        if esc.dtype not in (np.int8, np.int16, np.int32) or esc.ndim != 1:
            raise FormatError(f"{where}: kvc 'esc' plane must be 1-D int8, int16 or int32, got {esc.dtype}{list(esc.shape)}")
        pred = pr.get("pred", 0)
        if not isinstance(pred, int) or isinstance(pred, bool) or pred not in (0, 1):
            raise FormatError(f"{where}: kvc pred must be 0 or 1, got {pred!r}")
        if not pred and "pred" in enc.planes:
            raise FormatError(f"{where}: kvc 'pred' plane present but the params say pred 0")
        use = pred_mask(enc.planes.get("pred"), rows, where) if pred else None
        sc_ch, base = None, None
        if per_channel:
            sc_raw = side[1].astype(np.float64)
            if not np.all(np.isfinite(sc_raw)) or np.any(sc_raw != np.round(sc_raw)):
                raise FormatError(f"{where}: kvc step codes are not integers")
            sc_ch = _checked_codes(sc_raw, where)
        else:
            base = pr.get("step_base")
            if not isinstance(base, list) or len(base) != h or not all(type(b) is int for b in base):
                raise FormatError(f"{where}: kvc step_base must list {h} integers")
        mean = side[0].astype(np.float32)
        if not np.all(np.isfinite(mean)):
            raise FormatError(f"{where}: kvc channel means are not finite")
        rc = _checked_recon(pr.get("rc"), where)
        if rc and not per_channel:
            raise FormatError(f"{where}: kvc rc (reconstruction offsets) is for per-channel tensors only")
        rope = _checked_rope(pr.get("rope"), ctx, tr, where)
        v.__dict__.update(lv=lv, tr=tr, per_channel=per_channel, k_tok=k_tok, rows=rows, stage_planes=stage_planes,
                          esc=esc, use=use, sc_ch=sc_ch, base=base, mean=mean, rc=rc, rope=rope)
        return v

    def predicted_rows(self, enc: EncodedTensor, ctx: TensorContext) -> np.ndarray:
        """bool ``[T]``: the tokens of a decoded tensor (or chunk) that take the prediction from
        the layer before: with param ``xp``, its coded tokens (formats/codecs/kvc.md §13), not
        the protected ones, which are stored as they are. Call after decoding it (the params are
        checked then)."""
        t = ctx.shape[0]
        if not enc.params.get("xp"):
            return np.zeros(t, dtype=bool)
        pr = enc.params
        return ~self._mask(ctx, pr["sinks"], pr["recent"], f"layers.{ctx.layer}.{ctx.role}")

    def add_predictions(self, layer: int, decoded: dict[str, torch.Tensor], previous: dict[str, torch.Tensor],
                        positions: np.ndarray, predicted: dict[str, np.ndarray], profiles: Any = (),
                        where: str = "", threads: int = 2) -> dict[str, torch.Tensor]:
        """Layer ``layer``'s tensors from their decoded residuals (``decoded``; the rows that
        ``predicted`` marks, per role: :meth:`predicted_rows`) and layer ``layer - 1`` as decoded (``previous``), at
        absolute ``positions``: formats/codecs/kvc.md §13 (on two threads for long inputs unless
        ``threads`` is 1). The predictors come from the profile the file names (``calibration_sha256``; :func:`kvcodec.codecs.kvc.xpred.find_profile`).

        Raises:
            FormatError: the profile is not here, has no predictor for the layer, or does not fit.
        """
        from .xpred import find_profile

        sha = self.params["calibration_sha256"]
        if not sha:
            raise FormatError(f"{where}: tensors predicted from the layer before (xp), but the codec config "
                              f"names no profile (calibration_sha256)")
        pred = find_profile(sha, self.params["calibration"], profiles, where)
        if not pred.has(layer):
            raise FormatError(f"{where}: the profile {sha[:12]}... has no predictor for layer {layer}")
        return pred.add(layer, decoded, previous, np.asarray(positions, dtype=np.int64),
                        {r: np.asarray(m, dtype=bool) for r, m in predicted.items()}, where, split=threads > 1)

    def reconstruct(self, enc: EncodedTensor, codes: np.ndarray | None, ctx: TensorContext,
                    means: np.ndarray | None = None, steps: np.ndarray | None = None) -> torch.Tensor:
        """What :meth:`decode_tensor` gives for ``enc`` (planes as :meth:`encode_planes` writes
        them), from the integer ``codes`` its encoder coded instead of from the entropy-coded
        streams: the same arithmetic (:meth:`_values`), bit for bit, without the entropy
        decoding. The closed loop of prediction across layers (xpred) runs on it. ``means``: the
        rotating means the encoder subtracted (the values the decoder computes from the file), or
        None to compute them; ``steps``: likewise the steps of the codes (:meth:`_symbols`)."""
        v, out, keep = self._protected(enc, ctx)
        if v.n == 0:
            return out
        if codes is None or codes.shape != (v.n, v.rows):
            raise ValueError(f"{v.where}: reconstruct needs the {v.n} x {v.rows} codes of the tensor")
        return self._values(v, codes, ctx, out, keep, np.flatnonzero(~v.mask), means, steps)

    def _protected(self, enc: EncodedTensor, ctx: TensorContext) -> tuple[SimpleNamespace, torch.Tensor, torch.Tensor]:
        """``enc`` parsed (:meth:`parse_tensor`), the output tensor with its protected tokens
        written (stored as they are), and the bool mask of those tokens."""
        v = self.parse_tensor(enc, ctx)
        out = torch.empty(ctx.shape, dtype=ctx.dtype)
        keep = torch.from_numpy(v.mask)
        if v.prot.shape[0]:  # (a masked write of nothing still costs a pass over the mask)
            iv = _INT_VIEW.get(ctx.dtype)
            prot = v.prot
            if iv is not None and prot.dtype.itemsize == out.element_size():
                # numpy's masked write of the bits: ~2x faster than torch's for a few tokens
                o = out.view(iv).numpy()
                o[v.mask] = prot.view(o.dtype)
            else:
                out[keep] = torch.from_numpy(prot.copy()).view(ctx.dtype)
        return v, out, keep

    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        v, out, keep = self._protected(enc, ctx)
        if v.n == 0:
            return out
        free = np.flatnonzero(~v.mask)  # the coded tokens' positions
        if v.tr == "none" and self._decode_native(v, ctx, out, keep, free):
            return out
        return self._decode_passes(v, ctx, out, keep, free)

    def _decode_passes(self, v: SimpleNamespace, ctx: TensorContext, out: torch.Tensor, keep: torch.Tensor,
                       free: np.ndarray) -> torch.Tensor:
        """:meth:`decode_tensor`'s coded tokens by separate passes (the entropy stage, the escape
        join and running sums, :meth:`_values`), written into ``out``."""
        where, n, lv = v.where, v.n, v.lv
        try:  # the stage checks its geometry against ours before it allocates, then validates
            sym = _stage(self.params).decode(v.stage_planes, layout="tokens", expected=(v.rows, n, 2 * lv))  # [n, R]
        except FormatError as e:  # the same error class (StreamError, ...), located
            raise type(e)(f"{where}: kvc entropy stage: {e}") from None
        try:
            try:  # escape join and token-delta running sums in one native pass
                codes = native.escape_join_tokens(sym, v.esc, lv, v.use, narrow=True)  # int32 where they fit
            except native.Unsupported:
                codes = escape_join(sym.T, v.esc, lv).T
                if v.use is not None:
                    codes = running_sums(codes, v.use)
        except FormatError as e:
            raise FormatError(f"{where}: {e}") from None
        return self._values(v, codes, ctx, out, keep, free)

    def _values(self, v: SimpleNamespace, codes: np.ndarray, ctx: TensorContext, out: torch.Tensor,
                keep: torch.Tensor, free: np.ndarray, means: np.ndarray | None = None,
                steps: np.ndarray | None = None) -> torch.Tensor:
        """The coded tokens' values from their integer ``codes`` (token-major ``[n, R]``, the
        escape join and running sums done) and the parsed tensor ``v``, written into ``out``
        (where ``keep`` marks the protected tokens, already there): the steps, the means and the
        dequantization. The decoder's arithmetic, and the encoder's closed loop (xpred) from the
        codes it wrote."""
        where, n = v.where, v.n
        _, h, d = ctx.shape
        main = codes[:, : h * d].reshape(n, h, d)
        if steps is not None and steps.ndim == 3 and steps.shape[0] in (1, n) and steps.shape[1] == h:
            step = steps  # the encoder's, computed from the same step codes (reconstruct)
        elif v.per_channel:
            if v.k_tok:  # per-token integer offsets added to the channel log-step codes
                step = token_steps(v.sc_ch, codes[:, h * d:], where)
            else:
                step = step_from_code(v.sc_ch)[None]
        else:
            sc = codes[:, h * d:] + np.array(v.base, dtype=np.int64)[None]
            step = step_from_code(_checked_codes(sc, where))[:, :, None]
        rc = v.rc
        if v.rope is not None and means is not None and means.shape == (n, h, d):
            mean = means  # the encoder's, computed from the same mean, positions and steps
        elif v.rope is not None:  # rotating means: one per coded token (kvcodec.transforms.rope)
            off, style, steps = v.rope
            mean = rotated_means(v.mean, free, steps, off, style)  # [n, H, D]
        else:
            mean = v.mean[None]  # [1, H, D]: one for every token
        if v.tr == "none":  # the same float32 arithmetic, saturation and cast in one native pass
            try:
                run = _one_run(free)
                if run is not None:  # the coded tokens are one run: write them in place
                    native.kvc_dequantize(main, step, mean, ctx.dtype, out=out[run], recon=rc)
                else:
                    out[~keep] = native.kvc_dequantize(main, step, mean, ctx.dtype, recon=rc)
                return out
            except native.Unsupported:
                pass
        # normative: the exact value each code stands for, then one float32 multiply
        z = (recon_values(main, rc) if rc else main.astype(np.float32)) * step
        if v.tr == "hadamard":
            z = fwht(z)
        xh = z + mean
        lim = float(torch.finfo(ctx.dtype).max)  # saturate instead of overflowing to inf
        xh = np.clip(xh, -lim, lim)
        out[~keep] = torch.from_numpy(np.ascontiguousarray(xh)).to(ctx.dtype)
        return out

    def _decode_native(self, v: SimpleNamespace, ctx: TensorContext, out: torch.Tensor, keep: torch.Tensor,
                       free: np.ndarray) -> bool:
        """:meth:`decode_tensor`'s coded tokens in one native call (:func:`kvcodec.native.kvc_decode`:
        the same values as the passes below it, bit for bit), written into ``out``; False when
        that call does not apply (no native library). Inside
        :func:`kvcodec.native.kvc.deferred_decodes` the call is only queued: ``out`` holds the
        values once the block's jobs have run (a code past int32 then takes the passes)."""
        where, n = v.where, v.n
        _, h, d = ctx.shape
        try:  # the stage checks its geometry against ours before it allocates, then validates
            stage = EntropyStage.checked_planes(v.stage_planes, expected=(v.rows, n, 2 * v.lv))
        except FormatError as e:  # the same error class as the passes raise, located
            raise type(e)(f"{where}: kvc entropy stage: {e}") from None
        mode = (1 if v.k_tok else 0) if v.per_channel else 2
        sc = v.sc_ch if v.per_channel else np.asarray(v.base, dtype=np.int64)
        run = _one_run(free)  # the coded tokens are one run: write them in place
        dst = out[run] if run is not None else torch.empty((n, h, d), dtype=ctx.dtype)
        rope = None
        if v.rope is not None:
            off, style, steps = v.rope
            rope = (off, STYLES.index(style), steps, sin_table())
        try:
            job = kvc_decode_job(stage, v.esc, v.lv, v.use, n, h, d, mode, sc,
                                 (STEP_MANTISSA, STEP_CODE_MIN, STEP_CODE_MAX), v.rc, v.mean, rope, free, ctx.dtype,
                                 dst)
        except native.Unsupported:
            return False
        job.where = where
        if run is None:
            job.after = lambda: out.__setitem__(torch.from_numpy(~v.mask), dst)
        # a code past int32: the passes, which handle it
        job.fallback = lambda: self._decode_passes(v, ctx, out, keep, free)
        defer_or_run(job)
        return True


def _query_steps(energy: np.ndarray, gamma: float) -> np.ndarray:
    """Per head, the relative channel steps that the query energy ``energy`` (float64 ``[H, D]``,
    a profile's) asks for with exponent ``gamma`` (:func:`weighted_steps` of ``energy ** gamma``),
    read-only: kept for the next encodes, as a profile's energies and its exponent are the same
    for every cache (a list of small numpy calls per K tensor, each holding the GIL)."""
    e = np.ascontiguousarray(energy, dtype=np.float64)
    return _query_steps_kept(e.tobytes(), e.shape, float(gamma))


@functools.lru_cache(maxsize=256)
def _query_steps_kept(energy: bytes, shape: tuple[int, ...], gamma: float) -> np.ndarray:
    e = np.frombuffer(energy, dtype=np.float64).reshape(shape)
    out = np.stack([weighted_steps(1.0, e[i] ** gamma) for i in range(shape[0])])
    out.setflags(write=False)
    return out


def _widen(a: np.ndarray) -> np.ndarray:
    """float16 values widened exactly to a new float32 array."""
    from ...native import Unsupported
    from ...native.convert import widen

    try:
        return widen(a)
    except Unsupported:
        return a.astype(np.float32)


def _one_run(free: np.ndarray) -> slice | None:
    """The slice of a tensor's first axis that the coded tokens' positions ``free`` (ascending)
    fill when they are one run (the usual sinks-and-recent mask; none is one too), else None."""
    if not free.size:
        return slice(0, 0)
    if int(free[-1]) - int(free[0]) + 1 == free.size:
        return slice(int(free[0]), int(free[-1]) + 1)
    return None


@dataclasses.dataclass
class _Deferred:
    """What :meth:`KVCCodec._split` needs to make a tensor's symbols later: the settings, the
    token-major codes, the coded token count and the magnitude-context thresholds."""

    p: dict
    tok: np.ndarray
    n: int
    ctx_thr: list


def _centre(y: np.ndarray, mask: np.ndarray, rope: Any, centre: bool, float32_diff: bool, keep_rot: bool = True
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The coded tokens ``y`` (those ``mask`` leaves) centred as kvc codes them: ``(mean float64
    [H, D] as side[0] holds it, z float32 [n, H, D], the rotating means float32 [n, H, D] that
    were subtracted, or None)``. With ``rope`` (:func:`_tensor_rope`)
    rotating means: the channel means before RoPE, turned to each coded token's position (the
    decoder's float32 values, kvcodec.transforms.rope), subtracted in float32 (one C pass; the
    rotating means returned only with ``keep_rot``); else the channel means (``centre``) or none,
    subtracted in float32 when ``float32_diff`` (float16 values and float16-rounded means: their
    difference is exact in float64, so one float32 subtraction rounds it exactly as the float64
    route would), else in float64."""
    if rope is not None:
        (_, off, sty, _), steps = rope
        pos = np.flatnonzero(~mask)
        mean = np.clip(unrotated_mean(y, pos, steps, off, STYLES[sty]), -65504.0, 65504.0)
        mean = mean.astype(np.float16).astype(np.float64)  # what side[0] holds
        z, rot = rope_centred(y.astype(np.float32, copy=False), mean.astype(np.float32), pos, steps, off, STYLES[sty],
                              keep_rot)
        return mean, z, rot
    mean = channel_means(y) if centre else np.zeros(y.shape[1:])
    if float32_diff:
        return mean, y - mean.astype(np.float32)[None], None
    return mean, (y.astype(np.float64) - mean[None].astype(np.float32)).astype(np.float32), None


def _rope_plan(cache: KVCache, stats: QueryStats) -> dict[str, Any] | None:
    """The rotations of rotating K means (``k_rope_mean``) for ``cache`` from the calibration's
    per-layer facts: ``{"table": uint32 [U, F] distinct phase-step rows, "layers": {i: (row,
    offset, style number, pairs)}}``, or None when no layer rotates or the cache's positions are
    not consecutive (the rotation counts positions from the tensor's first token: where the
    sequence starts does not matter, as rotations commute and the mean absorbs the rest)."""
    rows: list[bytes] = []
    layers: dict[int, tuple[int, int, int, int]] = {}
    for i, layer in enumerate(cache.layers):
        if "k" not in layer or i >= stats.num_layers:
            continue
        la = stats.layer_attention(i)
        if not layer_rotates(la, layer["k"].shape[-1]):
            continue
        r2 = int(la.inv_freq.shape[0])
        key = phase_steps(la.inv_freq).tobytes()
        if key not in rows:
            rows.append(key)
        layers[i] = (rows.index(key), int(la.offset), STYLES.index(la.style), r2)
    if not layers:
        return None
    t = cache.num_tokens
    if cache.positions is not None and t:
        pos = cache.positions.detach().cpu().to(torch.int64).numpy()
        if not np.array_equal(pos, pos[0] + np.arange(t)):
            return None  # the decoder counts positions from the first token, one by one
    width = max(len(r) for r in rows) // 4
    table = np.zeros((len(rows), width), dtype=np.uint32)
    for j, r in enumerate(rows):
        v = np.frombuffer(r, dtype=np.uint32)
        table[j, : len(v)] = v
    return {"table": table, "layers": layers}


def _checked_rope(raw: Any, ctx: TensorContext, tr: str, where: str) -> tuple[int, str, np.ndarray] | None:
    """A K tensor's ``rope`` param checked against the global ``kvc_rope`` (formats/codecs/kvc.md
    §4): ``(offset, style, phase steps uint32 [pairs])``, or None when absent.

    Raises:
        FormatError: a malformed param, on a tensor that cannot have one, or without its table.
    """
    if raw is None:
        return None
    t, h, d = ctx.shape
    if (not isinstance(raw, list) or len(raw) != 4 or not all(type(x) is int for x in raw)
            or ctx.role != "k" or tr != "none"):
        raise FormatError(f"{where}: kvc rope must be 4 integers [row, offset, style, pairs] "
                          f"on a 'k' tensor without a transform, got {raw!r}")
    u, off, sty, r2 = raw
    table = ctx.globals.get("kvc_rope")
    if table is None:
        raise FormatError(f"{where}: kvc rope given but the file has no global kvc_rope plane")
    table = np.asarray(table)
    if table.dtype != np.uint32 or table.ndim != 2 or table.shape[0] < 1 or table.shape[1] < 1:
        raise FormatError(f"{where}: global kvc_rope must be uint32 [U, F] with U, F >= 1")
    if (not 0 <= u < table.shape[0] or off < 0 or sty not in (0, 1) or not 1 <= r2 <= table.shape[1]
            or off + 2 * r2 > d):
        raise FormatError(f"{where}: kvc rope {raw!r} out of range (kvc_rope is {list(table.shape)}, "
                          f"head width {d})")
    return off, STYLES[sty], table[u, :r2]


def _tensor_rope(ctx: TensorContext, n: int, hadamard: bool) -> tuple[tuple[int, int, int, int], np.ndarray] | None:
    """``((row, offset, style, pairs), phase steps)`` of a K tensor coded with
    rotating means, or None (no plan for its layer, nothing coded, or a Hadamard transform)."""
    rope = (ctx.state or {}).get("rope") if isinstance(ctx.state, dict) else None
    if rope is None or not n or hadamard or ctx.layer not in rope["layers"]:
        return None
    u, off, sty, r2 = rope["layers"][ctx.layer]
    return (u, off, sty, r2), rope["table"][u, :r2]

#: While :meth:`KVCCodec.encode_parts` codes a part: per layer ``(the whole cache's attention
#: estimates on the part's tokens [t, H], {"k": mean weight [H], "v": mean weight [H]})``.
_PART_ATTENTION: ContextVar[dict[int, tuple[np.ndarray, dict[str, np.ndarray]]] | None] = \
    ContextVar("kvc_part_attention", default=None)
