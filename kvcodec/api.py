"""kvcodec's top-level functions: open and decode a KVC file with whatever codec it names.

Example:
    >>> import torch, kvcodec
    >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(5, 2, 8), torch.randn(5, 2, 8))] * 2)
    >>> blob = kvcodec.get_codec("raw").encode(cache)
    >>> with kvcodec.open(blob) as r:
    ...     r.manifest["num_tokens"], r.codec.codec_id, r.read_layer(0)["k"].shape
    (5, 'raw', torch.Size([5, 2, 8]))
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO, Sequence

from . import codecs  # noqa: F401  (registers the built-in codecs)
from .cache import KVCache
from .codec import get_codec
from .decoding import KVCReader, open_with
from .format.manifest import MAX_ELEMENTS_PER_BYTE


def open(src: bytes | bytearray | memoryview | str | os.PathLike[str] | BinaryIO,  # noqa: A001 - like io.open
         require_codec: bool = True, max_elements_per_byte: int = MAX_ELEMENTS_PER_BYTE,
         profiles: Sequence[str | os.PathLike[str]] = ()) -> KVCReader:
    """Open a KVC file (path, bytes, or seekable binary file object) for lazy, validated decoding.

    With ``require_codec=False`` a file whose codec is not installed still opens for inspection
    (manifest, sizes, raw planes); decoding it raises the :class:`UnknownCodecError`.

    Decoding work is linear in the elements a file declares, at most ``max_elements_per_byte``
    (default and maximum 4096, formats/SPEC.md §7) per stored byte. A service decoding untrusted
    files, especially without the native coder, bounds its work per input byte by lowering it
    (real kvc files hold fewer than 100 elements per byte; a constant tensor may hold more).

    Raises:
        TruncatedError, FormatError, VersionError, ChecksumError, UnknownCodecError: the file is
        damaged, foreign, too new, or names a codec this installation lacks.
    """
    return open_with(src, get_codec, require_codec=require_codec, max_elements_per_byte=max_elements_per_byte,
                     profiles=profiles)


def decode(data: Any, device: str = "cpu", max_elements_per_byte: int = MAX_ELEMENTS_PER_BYTE,
           profiles: Sequence[str | os.PathLike[str]] = (), threads: int | None = None) -> KVCache:
    """Decode KVC bytes, a path or a binary file with whatever codec the file names.

    ``device="cuda"`` (or ``"cuda:N"``) decodes with the GPU kernels where the codec has them.
    ``profiles``: as for :func:`open`. ``threads``: at most this many CPU threads (default: the
    codec's own, at most the CPUs; 1 where the caller decodes several files side by side).

    Raises:
        FormatError: the file is damaged or foreign; the subclass (TruncatedError, VersionError,
            ChecksumError) names the problem. UnknownCodecError: the codec is not installed.
    """
    with open(data, max_elements_per_byte=max_elements_per_byte, profiles=profiles) as r:
        return r.read_cache(device=device, threads=threads)


__all__ = ["KVCReader", "decode", "open"]
