"""transformers interop: ``DynamicCache`` <-> :class:`~kvcodec.cache.KVCache` (batch 1).

transformers keeps K and V per layer as ``[batch, kv_heads, tokens, head_dim]`` (K after RoPE);
kvcodec keeps ``[tokens, kv_heads, head_dim]``. Older releases (and GPT-2 style models in them)
return a tuple of ``(K, V)`` pairs instead of a Cache object; :func:`from_dynamic_cache` accepts
both. transformers 5 renamed the ``past_key_values=`` keyword to ``cache=``;
:func:`cache_kwargs` and :func:`output_cache` hide that.

Example:
    >>> import torch
    >>> from kvcodec import KVCache
    >>> from kvcodec.integrations.transformers import to_dynamic_cache, from_dynamic_cache
    >>> c = KVCache.from_tensors([(torch.randn(5, 2, 8), torch.randn(5, 2, 8))])
    >>> dc = to_dynamic_cache(c)
    >>> tuple(dc.layers[0].keys.shape)
    (1, 2, 5, 8)
    >>> from_dynamic_cache(dc).equal(c)
    True
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..cache import KVCache, LayerInfo
from ..errors import DependencyError, InputError


def _require_transformers() -> Any:
    try:
        import transformers
    except ImportError:  # pragma: no cover - exercised only without the extra
        raise DependencyError(
            "DynamicCache conversion needs transformers; install it with pip install 'kvcodec[eval]'"
        ) from None
    return transformers


def _layer_tensors(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(K, V)]`` in transformers layout from a Cache object or a legacy tuple."""
    if hasattr(cache, "self_attention_cache"):  # EncoderDecoderCache: decoder self-attention only
        cache = cache.self_attention_cache
    if hasattr(cache, "layers"):
        out = []
        for i, layer in enumerate(cache.layers):
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if k is None or v is None or (isinstance(k, torch.Tensor) and k.numel() == 0 and k.dim() < 4):
                raise InputError(f"cache layer {i} is empty (was the model run with use_cache=True?)")
            out.append((k, v))
        return out
    if hasattr(cache, "key_cache"):  # transformers 4.x DynamicCache
        return list(zip(cache.key_cache, cache.value_cache))
    if isinstance(cache, (tuple, list)):
        return [(pair[0], pair[1]) for pair in cache]
    raise InputError(f"unsupported cache object {type(cache).__name__}")


def from_dynamic_cache(cache: Any, batch_index: int = 0, **kwargs: Any) -> KVCache:
    """Convert a transformers cache (``DynamicCache`` or legacy tuple) into a :class:`KVCache`.

    Args:
        cache: the model's cache, tensors ``[B, H, T, D]``.
        batch_index: which sequence of the batch to take.
        **kwargs: passed to :class:`KVCache` (``layer_info``, ``token_ids``, ``model`` ...).

    Raises:
        InputError: a layer is empty, or its shape is not ``[B, H, T, D]``.
    """
    layers = []
    for i, (k, v) in enumerate(_layer_tensors(cache)):
        if k.dim() != 4 or v.dim() != 4:
            raise InputError(
                f"cache layer {i} has K {list(k.shape)} / V {list(v.shape)}; expected [B, H, T, D]"
            )
        layers.append({
            "k": k[batch_index].transpose(0, 1).detach().cpu().contiguous(),
            "v": v[batch_index].transpose(0, 1).detach().cpu().contiguous(),
        })
    return KVCache(layers=layers, **kwargs)


def to_dynamic_cache(
    cache: KVCache, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Any:
    """Build a transformers ``DynamicCache`` (batch 1) holding ``cache``'s K and V.

    Every layer becomes a full (non-sliding) layer holding all tokens, so sliding-window layers
    keep their whole captured cache; the model still applies its window through the mask.

    Raises:
        InputError: the cache holds MLA latent layers (transformers caches hold K and V).
    """
    tf = _require_transformers()
    dc = tf.DynamicCache()
    for i, layer in enumerate(cache.layers):
        if "kv" in layer:
            raise InputError(f"layer {i} is an MLA latent tensor; transformers caches need K and V")
        k = layer["k"].transpose(0, 1).unsqueeze(0)
        v = layer["v"].transpose(0, 1).unsqueeze(0)
        if dtype is not None:
            k, v = k.to(dtype), v.to(dtype)
        dc.update(k.to(device).contiguous(), v.to(device).contiguous(), i)
    return dc


def cache_keyword(model: Any) -> str:
    """The forward keyword that takes the cache: ``"cache"`` (transformers >= 5.x) or
    ``"past_key_values"`` (older releases)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{keyword: cache}`` for ``model(...)``, whichever name this transformers release uses.

    Example:
        >>> out = model(ids, use_cache=True, **cache_kwargs(model, dc))   # doctest: +SKIP
    """
    return {cache_keyword(model): cache}


def output_cache(outputs: Any) -> Any:
    """The cache returned by a forward pass (``outputs.cache`` or ``outputs.past_key_values``)."""
    for name in ("cache", "past_key_values"):
        c = getattr(outputs, name, None) if not isinstance(outputs, dict) else outputs.get(name)
        if c is not None:
            return c
    raise InputError("the model returned no cache; call it with use_cache=True")


def layer_infos(config: Any, num_layers: int) -> list[LayerInfo]:
    """:class:`LayerInfo` per layer from a transformers config (``layer_types``, ``sliding_window``).

    With ``layer_types`` each layer is what it names. Without them, a config with a
    ``sliding_window`` (Mistral, Mixtral, Starcoder2, Phi-3) slides on every layer, as those
    models build one sliding-window mask for all layers, unless ``use_sliding_window`` is False.

    Example:
        >>> from types import SimpleNamespace as N
        >>> [i.kind for i in layer_infos(N(sliding_window=8), 2)], layer_infos(N(), 1)[0].kind
        (['sliding', 'sliding'], 'full')
    """
    config = getattr(config, "text_config", None) or config
    types = getattr(config, "layer_types", None)
    window = int(getattr(config, "sliding_window", 0) or 0)
    default = "sliding_attention" if window and getattr(config, "use_sliding_window", True) else "full_attention"
    infos = []
    for i in range(num_layers):
        t = types[i] if types is not None and i < len(types) else default
        if "sliding" in str(t) and window:
            infos.append(LayerInfo(kind="sliding", window=window))
        else:
            infos.append(LayerInfo(kind="full"))
    return infos


__all__ = ["cache_keyword", "cache_kwargs", "from_dynamic_cache", "layer_infos", "output_cache",
           "to_dynamic_cache"]
