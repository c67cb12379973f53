"""Capture the KV cache of a transformers decoder model on real text.

:func:`capture` runs one prefill over ``context`` tokens and returns the cache as a
:class:`~kvcodec.cache.KVCache` with the model identity, token ids, positions, RoPE state and
layer kinds recorded. Sliding-window layers keep their full cache (the capture uses a cache with
no window, the model applies its window through the mask). :func:`default_cache` does this for
the built-in model and text once and keeps the result on disk as a raw safetensors dump.

Example:
    >>> from kvcodec.harness import load_model, default_text            # doctest: +SKIP
    >>> from kvcodec.harness.capture import capture                      # doctest: +SKIP
    >>> model, tok = load_model()                                       # doctest: +SKIP
    >>> cache = capture(model, tok, default_text(), context=512)        # doctest: +SKIP
    >>> cache.num_layers, cache.num_tokens, cache.layers[0]["k"].shape  # doctest: +SKIP
    (30, 512, torch.Size([512, 3, 64]))
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from ..cache import DTYPE_NAMES, SOURCE_DTYPES, KVCache
from ..errors import InputError
from ..integrations.transformers import model_identity, rope_info  # noqa: F401  (exported here too)

#: File name of the vendored Jargon File excerpt (see kvcodec/data/PROVENANCE.md).
DEFAULT_TEXT_FILE = "jargon_4.4.7_excerpt.txt"


def default_text() -> str:
    """The built-in evaluation text: chapters of the Jargon File 4.4.7 (public domain).

    Example:
        >>> from kvcodec.harness.capture import default_text
        >>> default_text().startswith("Chapter 1. Hacker Slang and Hacker Culture")
        True
    """
    return resources.files("kvcodec.data").joinpath(DEFAULT_TEXT_FILE).read_text(encoding="utf-8")


def read_text(path: str | os.PathLike[str] | None) -> str:
    """The text of ``path`` (UTF-8), or the built-in text when ``path`` is ``None``.

    Raises:
        InputError: the file cannot be read or is not UTF-8.
    """
    if path is None:
        return default_text()
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read text file {os.fspath(path)}: {e}") from None


def tokenize(tokenizer: Any, text: str, num_tokens: int | None) -> torch.Tensor:
    """The first ``num_tokens`` token ids of ``text`` as int64 ``[num_tokens]`` (``None``: all).

    A BOS token is prepended when the tokenizer defines one and does not add it itself, so the
    model sees text the way it was trained to (an attention sink at position 0).

    Raises:
        InputError: the text is shorter than ``num_tokens`` tokens.
    """
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    if num_tokens is None:
        num_tokens = len(ids)
    if len(ids) < num_tokens:
        raise InputError(f"the text has {len(ids)} tokens; {num_tokens} are needed")
    return torch.tensor(ids[:num_tokens], dtype=torch.int64)


@torch.no_grad()
def capture(
    model: Any,
    tokenizer: Any,
    text: str | None = None,
    context: int = 2048,
    dtype: torch.dtype | None = None,
    token_ids: torch.Tensor | None = None,
) -> KVCache:
    """Prefill ``context`` tokens of ``text`` and return the model's KV cache.

    Args:
        model: a transformers causal LM (any decoder: Llama, Qwen2, Gemma3, GPT-2 ...; hybrid
            models with linear-attention or convolution layers give their attention layers).
        tokenizer: its tokenizer (used only when ``text`` is given).
        text: text to tokenize; default: the built-in text.
        context: number of tokens to prefill.
        dtype: dtype of the returned cache (default: the model's).
        token_ids: explicit ``[T]`` token ids instead of ``text``.

    Returns:
        A :class:`KVCache` with ``[T, kv_heads, head_dim]`` K and V per layer (per attention
        layer of a hybrid model), token ids, positions ``0..T-1``, model identity, RoPE state
        and layer kinds.

    Raises:
        InputError: the text is too short, the model has layers that are neither attention with
            a KV cache nor recurrent layers transformers' cache holds
            (:func:`~kvcodec.integrations.transformers.require_kv_layers`), or it returns no
            usable cache.
    """
    return capture_with_state(model, tokenizer, text, context, dtype, token_ids)[0]


@torch.no_grad()
def capture_with_state(
    model: Any,
    tokenizer: Any,
    text: str | None = None,
    context: int = 2048,
    dtype: torch.dtype | None = None,
    token_ids: torch.Tensor | None = None,
) -> tuple[KVCache, Any]:
    """:func:`capture`, and for a hybrid model the recurrent layers' state after the prefill
    (:class:`~kvcodec.integrations.transformers.HybridState`; None for a model whose every
    layer is attention): what the harness needs to run the model on a decoded cache."""
    from ..integrations.transformers import (
        HybridState,
        cache_kwargs,
        from_dynamic_cache,
        kv_layer_map,
        last_logits_kwargs,
        layer_infos,
        output_cache,
        require_kv_layers,
    )
    from .models import require_eval

    require_eval()
    import transformers

    require_kv_layers(model)
    if token_ids is None:
        if context < 1:
            raise InputError(f"context must be >= 1 tokens, got {context}")
        token_ids = tokenize(tokenizer, text if text is not None else default_text(), context)
    token_ids = token_ids.to(torch.int64).reshape(-1)
    device = next(model.parameters()).device
    kv_map = kv_layer_map(model)
    if kv_map is None:
        # An empty DynamicCache without a config has only full layers: sliding-window layers keep
        # every token instead of the last `window` ones.
        dc = transformers.DynamicCache()
    else:  # the model's own layers for its recurrent ones; full layers for the attention ones
        from transformers.cache_utils import DynamicLayer, LinearAttentionAndFullAttentionLayer

        dc = transformers.DynamicCache(config=model.config)
        for i in kv_map:
            layer = dc.layers[i]
            if not hasattr(layer, "update_recurrent_state"):
                dc.layers[i] = DynamicLayer()
            elif getattr(layer, "is_sliding", False):  # attention and a state in one layer: keep every token
                dc.layers[i] = LinearAttentionAndFullAttentionLayer(number_of_states=layer.number_of_states)
    out = model(token_ids[None].to(device), use_cache=True, **cache_kwargs(model, dc), **last_logits_kwargs(model))
    dc = output_cache(out)
    state = None
    if kv_map is not None:
        layers = list(dc.layers)
        state = HybridState(model.config, kv_map, {i: layer for i, layer in enumerate(layers)
                                                   if i not in kv_map or hasattr(layer, "update_recurrent_state")})
        dc = [(layers[i].keys, layers[i].values) for i in kv_map]
    applied, rope = rope_info(model.config)
    kv = from_dynamic_cache(
        dc,
        token_ids=token_ids.cpu(),
        positions=torch.arange(token_ids.numel(), dtype=torch.int64),
        model=model_identity(model, tokenizer),
        rope_applied=applied,
        rope=rope,
    )
    n = kv.num_layers
    if kv_map is None:
        kv.layer_info = layer_infos(model.config, n)
    else:
        cfg = getattr(model.config, "text_config", None) or model.config
        infos = layer_infos(model.config, int(cfg.num_hidden_layers))
        kv.layer_info = [infos[i] for i in kv_map]
    for i, layer in enumerate(kv.layers):
        for r, t in layer.items():
            if t.shape[0] != token_ids.numel():
                raise InputError(
                    f"layer {i} cached {t.shape[0]} of {token_ids.numel()} tokens; "
                    "the model trimmed its cache"
                )
    if dtype is not None:
        kv = kv.to(dtype)
    return kv, state


# ---------------------------------------------------------------------- raw dumps with identity
def save_raw(cache: KVCache, path: str | os.PathLike[str]) -> None:
    """Write a raw safetensors dump with identity, RoPE state and layer kinds, atomically.

    Same as :meth:`KVCache.to_safetensors`, kept as the harness's name for it.
    """
    cache.to_safetensors(path)


def load_raw(path: str | os.PathLike[str]) -> KVCache:
    """Read a raw dump with its identity, RoPE state and layer kinds (:meth:`KVCache.from_safetensors`).

    Raises:
        InputError: the file is missing or not a valid raw dump.
    """
    return KVCache.from_safetensors(path)


def default_cache(context: int = 2048, dtype: torch.dtype = torch.float16) -> KVCache:
    """The KV cache of the built-in model (SmolLM2-135M-Instruct) on the built-in text.

    Captured once per ``(context, dtype)`` and kept as a raw safetensors dump in the cache
    directory (``$KVCODEC_CACHE_DIR`` or ``~/.cache/kvcodec/captures``); later calls read it.

    Example:
        >>> from kvcodec.harness import default_cache   # doctest: +SKIP
        >>> c = default_cache(context=256)              # doctest: +SKIP
        >>> (c.num_layers, c.num_tokens, c.dtype)       # doctest: +SKIP
        (30, 256, torch.float16)
    """
    from .models import _converted_dir, cache_dir, default_gguf, load_model, require_eval

    require_eval()
    if dtype not in DTYPE_NAMES:
        raise InputError(f"dtype must be one of {sorted(SOURCE_DTYPES)}, got {dtype}")
    key = _converted_dir(default_gguf()).name
    path = cache_dir() / "captures" / f"{key}-jargon-ctx{int(context)}-{DTYPE_NAMES[dtype]}.safetensors"
    if path.exists():
        return load_raw(path)
    model, tok = load_model()
    cache = capture(model, tok, default_text(), context=context, dtype=dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_raw(cache, path)
    return cache


__all__ = ["capture", "default_cache", "default_text", "load_raw", "model_identity", "read_text",
           "capture_with_state", "rope_info", "save_raw", "tokenize"]
