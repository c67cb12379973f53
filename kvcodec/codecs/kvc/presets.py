"""kvc's named presets: quality levels (met by measurement with a profile of the user's model,
else with fixed steps measured on SmolLM2-135M and Qwen2.5-Coder-0.5B) and the -cal presets,
which require a calibration file (docs/kvc-design.md, eval/results/kvc_fixed_steps.md).
"""

from __future__ import annotations


from ...codec import register_preset


register_preset("kvc", {"id": "kvc"}, "kvc transform codec, default settings")
# The level presets promise a quality (kvcodec codecs --json: "target"). With a profile of the
# user's model (kvcodec calibrate; the file named by "calibration") they meet it by measurement:
# target_kl picks that model's steps (kvcodec/codecs/kvc/profile.py). Without one they code with
# the fixed steps below (fallback "steps"): the finest steps either real model we have needed to
# meet the level on one window of each calibration domain (mean KL <= 0.8x the target, the worst
# window <= the target; 1024 cached tokens, 256 scored; Qwen2.5-Coder-0.5B needed the finer at
# every level): `python eval/studies/kvc_fixed_steps.py`, eval/results/kvc_fixed_steps.md. They
# cost about a bit more per element than a profile's steps and promise nothing for other models:
# calibrate. Until issue 20 the steps were SmolLM2's (0.224 / 0.418 / 0.897), 2-5x too coarse
# for Qwen. The entropy settings are lossless and only trade file size (docs/kvc-design.md).
_TRANSPARENT = {"kl_mean": 0.002}
_NEAR = {"kl_mean": 0.01, "dppl": 0.01}
_AGGRESSIVE = {"kl_mean": 0.05}
_RAMP = {"recent_ramp": 128, "recent_fine": 4.0, "precision": 14}  # finer steps for the latest tokens
_WIDE = {"max_level": 48}  # escape threshold: table size against escapes
_NARROW = {"max_level": 16}
# Magnitude contexts (formats/ANS.md §3.1) in streams of 64 rows of at most 2048 tokens: with a
# profile's per-token steps they save 2.5-12 % of the file (eval/results/kvc_entropy_levels.md),
# for 30-50 % more encode and 20-45 % more decode time (eval/results/kvc_ctx_levels.md). On for
# near-lossless (-3.8 to -7 %) and aggressive (-6 to -12 %); off for transparent, where they
# saved 2.5 % for 42-51 % more encode time (1.65x to 2.4x cachegen's in two runs). On the fixed
# steps without a profile they change the file by -1 to +0.8 % for the same time: calibrate.
_CTX = {"ctx": [3, 8, 20], "rows_per_stream": 64, "chunk": 2048}
_CTX_LOW = {"ctx": [2, 5, 12], "rows_per_stream": 64, "chunk": 2048}
register_preset("kvc-transparent", {"id": "kvc", "target_kl": 0.002, "fallback": "steps", "k_step": 0.0638, "v_step": 0.1915, **_RAMP, **_WIDE},
                "kvc at about FP8 quality: mean KL <= 0.002 (measured with a profile, else fixed steps)", target=_TRANSPARENT)
register_preset("kvc-near", {"id": "kvc", "target_kl": 0.01, "fallback": "steps", "k_step": 0.1759, "v_step": 0.4167, **_RAMP, **_CTX},
                "kvc near-lossless: mean KL <= 0.01, dPPL <= 1% (measured with a profile, else fixed steps)", target=_NEAR)
register_preset("kvc-aggressive", {"id": "kvc", "target_kl": 0.05, "fallback": "steps", "k_step": 0.4538, "v_step": 1.3613, **_RAMP, **_NARROW,
                                     **_CTX_LOW},
                "kvc aggressive: mean KL <= 0.05 (measured with a profile, else fixed steps)", target=_AGGRESSIVE)
# The -cal presets are tuned for the calibrated encoder (a file from ``kvcodec calibrate``) and
# refuse to encode without one (requires=). Sink detection off (attention estimates already give
# sinks fine steps), magnitude contexts on (formats/ANS.md §3.1; eval/results/kvc_ctx*.md),
# reconstruction offsets on K where they helped (eval/results/kvc_recon.md), ANS streams of at
# most 2048 tokens (eval/results/kvc_chunk.md).
_KREC = {"k_recon": 4}
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
