"""``kvc``: a transform codec for KV caches -- protected tokens, centring, weighted dead-zone
quantization, token deltas, context-modelled ANS.

The bitstream (planes, pack, pred, step codes, k_recon, magnitude contexts, decode arithmetic) is
normative in formats/codecs/kvc.md; why each stage exists and what it measured is in
docs/kvc-design.md (numbers in eval/results). The package's rooms:

* :mod:`.codec` -- :class:`KVCCodec`: config and validation, the encode pipeline, parse and decode.
* :mod:`.steps` -- step allocation: dead-zone codes, per-token step codes, recency, calibration
  multipliers.
* :mod:`.symbols` -- escapes, token deltas and their running sums, the entropy stage settings.
* :mod:`.sinks` -- protected (sink) tokens.
* :mod:`.calibration` -- the query-statistics file and attention estimates (encoder only);
  :mod:`.plan` -- the per-call calibration state.
* :mod:`.presets` -- the named presets.

Example:
    >>> import torch, kvcodec
    >>> c = kvcodec.KVCache.from_tensors([(torch.randn(64, 2, 16) + 5, torch.randn(64, 2, 16))])
    >>> codec = kvcodec.get_codec("kvc-near")
    >>> out = codec.decode(codec.encode(c))
    >>> err = (out.layers[0]["k"] - c.layers[0]["k"]).pow(2).mean() / c.layers[0]["k"].var()
    >>> bool(err < 0.05)
    True
"""

from __future__ import annotations

from . import presets  # noqa: F401  (registers the presets)
from .codec import PACK_PIECES, PACK_ZSTD_LEVEL, PACK_ZSTD_PIECES, KVCCodec
from .sinks import detect_sinks
from .steps import _attn_factor, _sens_multipliers, recency_factor, token_steps
from .symbols import _narrowest, delta_rows, escape_join, escape_split, pred_mask, running_sums, undelta_rows

__all__ = ["KVCCodec", "PACK_PIECES", "PACK_ZSTD_LEVEL", "PACK_ZSTD_PIECES", "delta_rows", "detect_sinks",
           "escape_join", "escape_split", "pred_mask", "recency_factor", "running_sums", "token_steps",
           "undelta_rows"]
