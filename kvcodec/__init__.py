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

from ._version import __version__
from .api import KVCReader, decode, open  # noqa: A004  (kvcodec.open: lazy, validated decoding)
from .cache import KVCache, LayerInfo, ModelIdentity
from .codec import (
    Codec,
    EncodedTensor,
    TensorContext,
    codec_ids,
    get_codec,
    list_codecs,
    register_codec,
    register_preset,
)
from .errors import KVCodecError
from . import format  # noqa: A004  (kvcodec.format: the container, planes without codecs)


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
    "get_codec",
    "list_codecs",
    "load",
    "open",
    "register_codec",
    "register_preset",
    "save",
]
