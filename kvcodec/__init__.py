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

__version__ = "0.1.0"

from .cache import KVCache, LayerInfo, ModelIdentity  # noqa: E402
from .codec import (  # noqa: E402
    Codec,
    EncodedTensor,
    TensorContext,
    codec_ids,
    get_codec,
    list_codecs,
    register_codec,
    register_preset,
)
from .errors import KVCodecError  # noqa: E402
from . import format  # noqa: E402,A004  (kvcodec.format.open: lazy, validated reading)


def decode(data, device: str = "cpu") -> KVCache:
    """Decode KVC bytes, a path or a binary file with whatever codec the file names.

    Raises:
        FormatError: the file is damaged or foreign; the subclass (TruncatedError, VersionError,
            ChecksumError) names the problem. UnknownCodecError: the codec is not installed.
    """
    from .format.container import read_cache

    return read_cache(data, device=device)


__all__ = [
    "Codec",
    "EncodedTensor",
    "KVCache",
    "KVCodecError",
    "LayerInfo",
    "ModelIdentity",
    "TensorContext",
    "__version__",
    "codec_ids",
    "decode",
    "get_codec",
    "list_codecs",
    "register_codec",
    "register_preset",
]
