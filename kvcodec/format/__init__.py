"""The KVC container: a versioned safetensors profile with a strict reader (formats/SPEC.md).

Public API:
    * :func:`open` (alias of :func:`open_kvc`): validate a file's header and manifest and return a
      :class:`KVCReader` for lazy access (``.manifest``, ``.read_layer(i)``, ``.read_layers(...)``,
      ``.read_plane(name)``, ``.read_cache()``, ``.verify()``).
    * :func:`write_file`: stream-encode a cache to a path or binary file object.
    * :func:`read_cache`: decode a whole file (what :func:`kvcodec.decode` does).

Example:
    >>> import torch, kvcodec
    >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(5, 2, 8), torch.randn(5, 2, 8))] * 2)
    >>> blob = kvcodec.get_codec("raw").encode(cache)
    >>> with kvcodec.format.open(blob) as r:
    ...     r.manifest["num_tokens"], r.codec.codec_id, r.read_layer(0)["k"].shape
    (5, 'raw', torch.Size([5, 2, 8]))
"""

from __future__ import annotations

from .container import KVCReader, crc32_hex, open_kvc, read_cache, write_cache, write_file
from .manifest import FORMAT_KEY, FORMAT_VERSION, KNOWN_FEATURES, tensor_name
from .safetensors_io import ALIGNMENT, MAX_HEADER_BYTES

open = open_kvc  # noqa: A001 - ``kvcodec.format.open(path)`` reads like ``io.open``

__all__ = [
    "ALIGNMENT",
    "FORMAT_KEY",
    "FORMAT_VERSION",
    "KNOWN_FEATURES",
    "KVCReader",
    "MAX_HEADER_BYTES",
    "crc32_hex",
    "open",
    "open_kvc",
    "read_cache",
    "tensor_name",
    "write_cache",
    "write_file",
]
