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
from typing import Any, BinaryIO, Callable, Sequence

from . import codecs  # noqa: F401  (registers the built-in codecs)
from .cache import KVCache
from .codec import get_codec
from .decoding import KVCReader, open_with
from .errors import KVCodecError
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


def decode_many(sources: Sequence[Any], max_elements_per_byte: int = MAX_ELEMENTS_PER_BYTE,
                profiles: Sequence[str | os.PathLike[str]] = (), threads: int | None = None,
                initializer: Callable[[], None] | None = None) -> list[KVCache | KVCodecError]:
    """Decode several KVC files on the CPU (the chunks of one prefix, say), each as
    :func:`decode` does, bit for bit. This thread reads and checks each file while ``threads``
    others (default 2 on a machine of two or more CPUs, else 0: all on this thread) run the
    decoding of the files before it (:meth:`KVCReader.staged_cache`): checking is Python and
    holds the interpreter's lock, decoding lets go of it, so the two overlap (two: files
    predicted across layers spend as long again in their prediction passes). Files of 256
    tokens decoded side by side on two threads, each whole, spent much of their time waiting
    for the lock instead. ``initializer``: run first on each of those threads (to set its CPU
    affinity, say).

    Returns one entry per source, in order: its :class:`KVCache`, or the :class:`KVCodecError`
    it raised (a damaged or foreign file does not stop the others).

    Example:
        >>> import torch, kvcodec
        >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(5, 2, 8), torch.randn(5, 2, 8))])
        >>> blob = kvcodec.get_codec("kvc-near").encode(cache)
        >>> [type(x).__name__ for x in kvcodec.decode_many([blob, b"not a file", blob])]
        ['KVCache', 'FormatError', 'KVCache']
    """
    from concurrent.futures import ThreadPoolExecutor

    from .errors import InputError

    if threads is None:
        threads = 2 if (os.cpu_count() or 1) > 1 else 0
    if type(threads) is not int or threads < 0:
        raise InputError(f"threads must be an integer >= 0, got {threads!r}")
    import torch

    # the caller's inference mode, on our threads too (it is per thread): a caller under
    # torch.inference_mode (vLLM's worker) makes inference tensors, which only that mode may change
    inference = torch.is_inference_mode_enabled()
    pool = ThreadPoolExecutor(threads, thread_name_prefix="kvcodec-decode", initializer=initializer) if threads else None
    out: list[Any] = []
    try:
        for src in sources:
            try:
                r = open(src, max_elements_per_byte=max_elements_per_byte, profiles=profiles)
            except KVCodecError as e:
                out.append(e)
                continue
            try:
                finish = r.staged_cache()
            except BaseException as e:
                r.close()
                if not isinstance(e, KVCodecError):
                    raise
                out.append(e)
                continue

            def run(r: KVCReader = r, finish: Callable[[], KVCache] = finish) -> KVCache:
                with r, torch.inference_mode(inference):
                    return finish()

            out.append(pool.submit(run) if pool is not None else _outcome(run))
        return [_result(x) for x in out]
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


def _outcome(run: Callable[[], KVCache]) -> KVCache | KVCodecError:
    try:
        return run()
    except KVCodecError as e:
        return e


def _result(x: Any) -> KVCache | KVCodecError:
    from concurrent.futures import Future

    if not isinstance(x, Future):
        return x
    try:
        return x.result()
    except KVCodecError as e:
        return e


__all__ = ["KVCReader", "decode", "decode_many", "open"]
