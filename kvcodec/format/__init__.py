"""The KVC container: a versioned safetensors profile with a strict reader (formats/SPEC.md).

It knows nothing of codecs or devices. Public API:
    * :func:`open_container`: validate a file's header and manifest and return a
      :class:`ContainerReader` for lazy access to its planes (``.manifest``, ``.read_plane(name)``,
      ``.read_layer_planes(i)``, ``.verify()``). To decode values use :func:`kvcodec.open`.
    * :func:`write_file`: stream-encode a cache to a path or binary file object.

Example:
    >>> import torch, kvcodec
    >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(5, 2, 8), torch.randn(5, 2, 8))] * 2)
    >>> blob = kvcodec.get_codec("raw").encode(cache)
    >>> with kvcodec.format.open_container(blob) as r:
    ...     r.manifest["num_tokens"], r.manifest["codec"]["id"], r.read_plane("layers.0.k.bits").shape
    (5, 'raw', (5, 2, 8))
"""

from __future__ import annotations

from .container import ContainerReader, crc32_hex, open_container, write_cache, write_file
from .manifest import FORMAT_KEY, FORMAT_VERSION, KNOWN_FEATURES, tensor_name
from .safetensors_io import ALIGNMENT, MAX_HEADER_BYTES

__all__ = [
    "ALIGNMENT",
    "ContainerReader",
    "FORMAT_KEY",
    "FORMAT_VERSION",
    "KNOWN_FEATURES",
    "MAX_HEADER_BYTES",
    "crc32_hex",
    "open_container",
    "tensor_name",
    "write_cache",
    "write_file",
]
