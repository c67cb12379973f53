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
    "open",
    "register_codec",
    "register_preset",
]
