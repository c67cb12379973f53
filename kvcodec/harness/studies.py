"""What the one-question studies under ``eval/studies/`` share: the held-out calibration file, a
second evaluation window of the built-in text, encodes timed with and without kvc's writer
threads, and the cross-layer prediction studies' RoPE rotation and ridge fit.

Example:
    >>> from kvcodec.harness.studies import calibration_path
    >>> calibration_path(1536).name
    'smollm2-eval-text-skip8192-ctx1536.qstats.safetensors'
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterator

#: The calibration text starts at this token of the built-in text, after every evaluated window
#: (eval/studies/kvc_rd.py's ``--calib-skip`` default).
CALIB_SKIP = 8192


def calibration_path(context: int) -> Path:
    """Where :func:`held_out_calibration` keeps its file for ``context`` (under the kvcodec cache
    dir; eval/studies/kvc_rd.py writes the same file with its defaults)."""
    from .models import cache_dir

    return cache_dir() / "calibration" / f"smollm2-eval-text-skip{CALIB_SKIP}-ctx{context}.qstats.safetensors"


def profile_dir() -> Path:
    """Where eval/studies/kvc_profile.py keeps each model's profile (``<model>.profile.safetensors``,
    under the kvcodec cache dir); eval/studies/kvc_alloc.py reads them there, and decoders look for
    profiles there (:func:`kvcodec.codecs.kvc.xpred.default_profile_dir`, the one definition)."""
    from ..codecs.kvc.xpred import default_profile_dir

    return default_profile_dir()


def profile_current(path: Path) -> bool:
    """Whether the profile at ``path`` was searched with today's settings and criterion."""
    from ..codecs.kvc.calibration import load_query_statistics
    from .profile import DEFAULT_MARGIN, MAX_SCORES, SEARCH_METHOD, WORST_FACTOR, search_settings

    prof = load_query_statistics(path).profile or {}
    return (prof.get("settings") == search_settings() and prof.get("search_margin") == DEFAULT_MARGIN
            and prof.get("search_worst", 1.0) == WORST_FACTOR and prof.get("search_max_scores") == MAX_SCORES
            and prof.get("search_method") == SEARCH_METHOD)


def model_profile(model_name: str, model: Any, tok: Any, out_dir: Path | None = None,
                  log: Callable[[str], None] = print) -> tuple[Path, float | None]:
    """``model``'s profile on the built-in calibration texts, as ``kvcodec calibrate`` makes it:
    the file under ``out_dir`` (default :func:`profile_dir`) when it was searched with today's
    settings, else made there (minutes). Returns its path and the seconds it took (None when
    reused)."""
    from ..codecs.kvc.calibration import save_query_statistics
    from .profile import build_profile
    from .texts import CALIBRATION_DOMAINS, calibration_text

    out_dir = profile_dir() if out_dir is None else out_dir
    path = out_dir / f"{model_name}.profile.safetensors"
    if path.is_file():
        if profile_current(path):
            log(f"{model_name}: using {path}")
            return path, None
        log(f"{model_name}: {path} was made with other search settings or criterion: remaking it")
    t0 = time.perf_counter()
    texts = {d: calibration_text(d) for d in CALIBRATION_DOMAINS}
    stats = build_profile(model, tok, texts, text_name="built-in calibration texts", progress=lambda m: log(f"  {m}"))
    secs = time.perf_counter() - t0
    out_dir.mkdir(parents=True, exist_ok=True)
    save_query_statistics(stats, path)
    return path, secs


def profiled_domain_caches(models: list[str], domains: list[str], context: int,
                           dtype: Any = None) -> Iterator[tuple[str, Path, str, Any]]:
    """``(model, profile path, domain, cache)`` for each model (loaded once, with its profile from
    :func:`model_profile`) and evaluation domain (:func:`kvcodec.harness.texts.eval_text`): the
    cache of ``context`` tokens from the text's start (one prefill, in ``dtype``; default the
    model's). A model is released before the next is loaded."""
    from .capture import capture
    from .models import load_model
    from .texts import eval_text

    for name in models:
        model, tok = load_model(name)
        path, _ = model_profile(name, model, tok, profile_dir())  # reused, or made (minutes)
        for dom in domains:
            yield name, path, dom, capture(model, tok, eval_text(dom), context, dtype=dtype)
        del model, tok


def held_out_calibration(context: int) -> Path:
    """The calibration file the studies share: SmolLM2 on the built-in text from token 8192
    (after the evaluated windows), ``context`` tokens, 4 sensitivity draws over 512 tokens — the
    file ``eval/studies/kvc_rd.py`` writes with its defaults. Made (about a minute, loading the
    model) when missing.

    Args:
        context: tokens of calibration text (the studies use their evaluation context).

    Returns:
        The path of the ``.qstats.safetensors`` file.
    """
    from . import default_text, load_model
    from .calibration import query_statistics, save_query_statistics

    cal = calibration_path(context)
    if not cal.exists():
        model, tok = load_model()
        cal.parent.mkdir(parents=True, exist_ok=True)
        save_query_statistics(query_statistics(model, tok, default_text(), context=context, skip_tokens=CALIB_SKIP,
                                               sensitivity_samples=4, continuation=512), cal)
    return cal


def text_window(tokenizer, text: str, offset: int) -> str:
    """The text from token ``offset`` on (tokenized without special tokens, decoded back), so a
    second evaluation window of the same text can be scored; the evaluator prepends BOS again.

    Raises:
        SystemExit: the text has no more than ``offset`` tokens.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if offset >= len(ids):
        raise SystemExit(f"--text-offset {offset}: the text has only {len(ids)} tokens")
    return tokenizer.decode(ids[offset:])


def preset_bits(names: list[str] | None = None, context: int = 1536) -> dict[str, float]:
    """``{preset: all-in bits per element}`` (4 decimals) of each preset that needs no setting (the
    kvc ``-cal`` presets need a calibration file and are skipped) on SmolLM2-135M's cache of the
    built-in text (:func:`kvcodec.harness.capture.default_cache`): the numbers ``kvcodec codecs``
    shows (kvcodec/data/measured_bits.json, written by eval/make_measured_bits.py)."""
    from .. import get_codec, list_codecs
    from .capture import default_cache

    cache = default_cache(context)
    out = {}
    for name in names if names is not None else list_codecs():
        c = get_codec(name)
        if not c.requires:
            out[name] = round(8.0 * len(c.encode(cache)) / cache.num_elements, 4)
    return out


def cache_sha256(cache: Any) -> str:
    """SHA-256 of a cache's K/V bytes, layer by layer (and its token ids): two caches with the
    same digest code to the same bytes. The reference cache of :func:`preset_bits` is a model's
    forward pass, whose float32 kernels round differently on CPUs with other vector units
    (AVX-512 or AVX2): eval/make_measured_bits.py records the digest it measured on."""
    import hashlib

    import torch

    h = hashlib.sha256()
    for layer in cache.layers:
        for role in sorted(layer):
            t = layer[role].detach().cpu().contiguous()
            h.update(role.encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.float32 else t.numpy().tobytes())
    if cache.token_ids is not None:
        h.update(cache.token_ids.cpu().to(torch.int64).numpy().tobytes())
    return h.hexdigest()


def timed_encodes(runs: dict[Any, tuple[Any, int]], cache: Any, repeat: int) -> tuple[dict[Any, float], dict[Any, bytes]]:
    """Fastest encode time and the bytes of each run ``{key: (codec, kvc encode_threads)}`` on
    ``cache``, the runs alternating in ``repeat`` rounds (this machine's speed drifts; only ratios
    within one call mean anything). ``KVCCodec.encode_threads`` is set for each run and restored."""
    from ..codecs.kvc.codec import KVCCodec

    shipped = KVCCodec.encode_threads
    best = {k: float("inf") for k in runs}
    blobs: dict[Any, bytes] = {}
    try:
        for _ in range(repeat):
            for k, (codec, threads) in runs.items():
                KVCCodec.encode_threads = threads
                t = time.perf_counter()
                blobs[k] = codec.encode(cache)
                best[k] = min(best[k], time.perf_counter() - t)
    finally:
        KVCCodec.encode_threads = shipped
    return best, blobs


def rope_rotate(k: Any, heads: int, theta: float, sign: int) -> Any:
    """Rotate-half RoPE of float64 ``k [T, heads * D]`` at positions ``0..T-1`` by ``sign`` (+1
    applies RoPE, -1 undoes it), with the table rotation of :mod:`kvcodec.transforms.rope` at
    base ``theta`` (eval/studies/kvc_xlayer.py, kvc_xpred.py)."""
    import numpy as np

    from ..transforms.rope import cos_sin, phase_steps

    t, d = k.shape[0], k.shape[1] // heads
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    c, sn = (x.astype(np.float64)[:, None, :] for x in cos_sin(np.arange(t), phase_steps(inv)))
    x = k.reshape(t, heads, d)
    a, b = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([a * c - sign * b * sn, b * c + sign * a * sn], axis=-1).reshape(t, -1)


def ridge_fit(xs: Any, ys: Any) -> Any:
    """Ridge least squares ``ys ~ [xs, 1] @ W`` (lambda 1e-3 of the Gram matrix's mean diagonal):
    ``W`` with the bias as its last row (the cross-layer predictors of eval/studies/kvc_xlayer.py
    and kvc_xpred.py; the fit ``kvcodec calibrate`` uses, :func:`kvcodec.harness.xpred.ridge_fit`)."""
    from .xpred import ridge_fit as fit

    return fit(xs, ys)


def ridge_predict(xs: Any, w: Any) -> Any:
    """``[xs, 1] @ w`` for ``w`` as :func:`ridge_fit` returns it (the bias its last row)."""
    return xs @ w[:-1] + w[-1]
