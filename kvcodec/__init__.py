"""kvcodec: compression codecs and a versioned interop file format for LLM KV caches.

Example:
    >>> import torch, kvcodec
    >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(16, 2, 64), torch.randn(16, 2, 64))])
    >>> blob = kvcodec.get_codec("fp8-e4m3").encode(cache)
    >>> out = kvcodec.decode(blob)
    >>> out.num_tokens
    16
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# The public names load on first use (PEP 562): ``import kvcodec`` alone imports no torch, so the
# command line starts at once (``kvcodec --help``); ``kvcodec.get_codec`` and the rest work as if
# imported here. Name -> the submodule that defines it.
_LAZY = {
    "KVCReader": "api", "decode": "api", "decode_many": "api", "open": "api",  # kvcodec.open: lazy, validated decoding
    "KVCache": "cache", "LayerInfo": "cache", "ModelIdentity": "cache",
    "Codec": "codec", "EncodedTensor": "codec", "TensorContext": "codec", "codec_ids": "codec",
    "get_codec": "codec", "list_codecs": "codec", "register_codec": "codec", "register_preset": "codec",
    "KVCodecError": "errors",
}

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ imports them
    from . import format  # noqa: F401, A004
    from .api import KVCReader, decode, decode_many, open  # noqa: F401, A004
    from .cache import KVCache, LayerInfo, ModelIdentity  # noqa: F401
    from .codec import (  # noqa: F401
        Codec, EncodedTensor, TensorContext, codec_ids, get_codec, list_codecs, register_codec, register_preset,
    )
    from .errors import KVCodecError  # noqa: F401


def __getattr__(name: str) -> Any:
    """Import a public name, or a submodule (``kvcodec.format``, ``kvcodec.codecs``), on first use."""
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def save(cache, path, codec="kvc-near", **kwargs):  # noqa: ANN001, ANN201 - documented where it lives
    """Encode a transformers cache (any batch, sliding-window layers too) or a :class:`KVCache` to
    ``path``: :func:`kvcodec.integrations.transformers.save` (``model=``, ``input_ids=``)."""
    from .integrations.transformers import save as _save

    return _save(cache, path, codec, **kwargs)


def load(path, **kwargs):  # noqa: ANN001, ANN201
    """A transformers ``DynamicCache`` the model takes, from what :func:`save` wrote:
    :func:`kvcodec.integrations.transformers.load` (``model=``, ``input_ids=``: the last prompt
    token is left for ``generate`` to compute)."""
    from .integrations.transformers import load as _load

    return _load(path, **kwargs)


__all__ = [
    "Codec",
    "EncodedTensor",
    "KVCache",
    "KVCReader",
    "KVCodecError",
    "LayerInfo",
    "ModelIdentity",
    "TensorContext",
    "__version__",
    "codec_ids",
    "decode",
    "decode_many",
    "get_codec",
    "list_codecs",
    "load",
    "open",
    "register_codec",
    "register_preset",
    "save",
]
