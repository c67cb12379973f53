"""kvc's named presets. Their steps were chosen on measured windows (docs/kvc-design.md,
eval/results/kvc_presets*.md); the -cal presets require a calibration file.
"""

from __future__ import annotations


from ...codec import register_preset


register_preset("kvc", {"id": "kvc"}, "kvc transform codec, default settings")
# The steps are the largest that kept every tuning window of SmolLM2 within 90 % of each bar; the
# entropy settings are lossless and only trade file size. How each was chosen, with the numbers:
# docs/kvc-design.md (measurements in eval/results/kvc_presets*.md). These bars were tuned on one
# model: issue 20 moves them to measurement on the user's model.
# The quality each level promises (kvcodec codecs --json shows it). Met on SmolLM2 today; issue 20
# makes them targets met by measurement on the user's model.
_TRANSPARENT = {"kl_mean": 0.002}
_NEAR = {"kl_mean": 0.01, "dppl": 0.01}
_AGGRESSIVE = {"kl_mean": 0.05}
_RAMP = {"recent_ramp": 128, "recent_fine": 4.0, "precision": 14}  # finer steps for the latest tokens
_WIDE = {"max_level": 48}  # escape threshold: table size against escapes
_NARROW = {"max_level": 16}
register_preset("kvc-transparent", {"id": "kvc", "target_kl": 0.002, "fallback": "steps", "k_step": 0.224, "v_step": 0.672, **_RAMP, **_WIDE},
                "kvc at about FP8 quality (target mean KL <= 0.002)", target=_TRANSPARENT)
register_preset("kvc-near", {"id": "kvc", "target_kl": 0.01, "fallback": "steps", "k_step": 0.418, "v_step": 0.99, **_RAMP},
                "kvc near-lossless (target mean KL <= 0.01, dPPL <= 1%)", target=_NEAR)
register_preset("kvc-aggressive", {"id": "kvc", "target_kl": 0.05, "fallback": "steps", "k_step": 0.897, "v_step": 2.691, **_RAMP, **_NARROW},
                "kvc aggressive (target mean KL <= 0.05)", target=_AGGRESSIVE)
# The -cal presets are tuned for the calibrated encoder (a file from ``kvcodec calibrate``) and
# refuse to encode without one (requires=). Sink detection off (attention estimates already give
# sinks fine steps), magnitude contexts on (formats/ANS.md §3.1; eval/results/kvc_ctx*.md),
# reconstruction offsets on K where they helped (eval/results/kvc_recon.md), ANS streams of at
# most 2048 tokens (eval/results/kvc_chunk.md).
_KREC = {"k_recon": 4}
_CTX = {"ctx": [3, 8, 20], "rows_per_stream": 64, "chunk": 2048}
_CTX_LOW = {"ctx": [2, 5, 12], "rows_per_stream": 64, "chunk": 2048}
register_preset("kvc-transparent-cal", {"id": "kvc", "target_kl": 0.002, "fallback": "steps", "k_step": 0.2912, "v_step": 0.9984, "k_qgamma": 1.0,
                                        "sink_v_ratio": 0.0, "attn_clip": 3.0, "attn_coarse": 2.0, **_RAMP, **_CTX,
                                        **_KREC},
                "kvc-transparent's bar (mean KL <= 0.002) with a calibration file", requires=("calibration",),
                target=_TRANSPARENT)
register_preset("kvc-near-cal", {"id": "kvc", "target_kl": 0.01, "fallback": "steps", "k_step": 0.6007, "v_step": 2.1589, "sink_v_ratio": 0.0, "attn_clip": 3.0,
                                 "attn_coarse": 1.0, **_RAMP, **_CTX, **_KREC},
                "kvc-near's bar (mean KL <= 0.01, dPPL <= 1%) with a calibration file", requires=("calibration",),
                target=_NEAR)
register_preset("kvc-aggressive-cal", {"id": "kvc", "target_kl": 0.05, "fallback": "steps", "k_step": 1.0759, "v_step": 3.5931, "sink_v_ratio": 0.0,
                                       "attn_clip": 3.0, "attn_coarse": 2.0, **_RAMP, **_NARROW, **_CTX_LOW},
                "kvc-aggressive's bar (mean KL <= 0.05) with a calibration file", requires=("calibration",),
                target=_AGGRESSIVE)
