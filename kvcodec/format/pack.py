"""Several planes of one tensor in one ``uint8`` plane, with a directory of small integers.

The container stores each plane as a safetensors tensor with a header entry, a manifest entry
(dtype, shape, CRC-32) and 64-byte alignment: about 200 bytes per plane. A codec that writes many
small planes per tensor (kvc: up to nine) pays that for each; on a 1536-token SmolLM2 cache the
header was 7 % of a kvc-aggressive file. Packing them into one plane keeps one entry and one CRC.

Layout (normative for the codecs that use it; kvc's ``pack`` plane):

* the directory is a list of entries ``[piece, dtype, dim0, dim1, ...]`` (0 to 4 dims), one per
  piece in the order the pieces are stored; ``piece`` indexes the codec's list of piece names
  (each at most once), ``dtype`` indexes :data:`PACK_DTYPES`;
* piece ``i`` starts at the first multiple of 4 at or after the end of piece ``i - 1`` (the first
  at 0) and holds ``prod(dims)`` little-endian elements; the gaps are zero bytes;
* the plane ends exactly where the last piece ends (an empty directory: an empty plane);
* a piece MAY be stored as one zstd frame instead (:func:`pack_planes` with ``zstd_level``): its
  entry is ``[piece, 16 + dtype, stored_bytes, dim0, ...]`` and its ``stored_bytes`` are a single
  frame whose header declares the content size, ``prod(dims) * itemsize`` (at most ``256 *
  stored_bytes + 65536``), and that decompresses to exactly that many bytes with nothing after
  the frame. kvcodec stores a piece this way only
  when the frame is smaller (on SmolLM2 the entropy tables shrink to ~40 %, escaped codes to
  ~70 %: 0.025 bit per element of a kvc-near-cal file at 1536 tokens).

Example:
    >>> import numpy as np
    >>> blob, d = pack_planes({"b": np.arange(3, dtype=np.uint8), "a": np.ones((2, 2), np.float16)}, ("a", "b"))
    >>> d, blob.size
    ([[0, 6, 2, 2], [1, 0, 3]], 11)
    >>> {k: v.tolist() for k, v in unpack_planes(blob, d, ("a", "b")).items()}
    {'a': [[1.0, 1.0], [1.0, 1.0]], 'b': [0, 1, 2]}
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ..errors import FormatError

#: Element types of packed pieces, by index (little-endian).
PACK_DTYPES = (np.dtype("u1"), np.dtype("<u2"), np.dtype("<u4"), np.dtype("i1"), np.dtype("<i2"), np.dtype("<i4"),
               np.dtype("<f2"))
#: the same in this machine's byte order (what :func:`unpack_planes` returns)
_NATIVE_DTYPES = tuple(d.newbyteorder("=") for d in PACK_DTYPES)
_ALIGN = 4
_MAX_DIMS = 4
_MAX_DIM = 2**31 - 1


def _aligned(x: int) -> int:
    return -(-x // _ALIGN) * _ALIGN


_ZSTD = 16  # a dtype field at or above this marks a zstd-compressed piece
_ZSTD_RATIO = 256  # a compressed piece may expand to at most this many times its bytes (+ 64 KiB)


_local = threading.local()  # one zstd compressor per (thread, level): making one costs more than a small frame


def _compressor(level: int):
    import zstandard

    cache = _local.__dict__.setdefault("zstd", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def pack_planes(planes: dict[str, np.ndarray], names: tuple[str, ...], zstd_level: int = 0,
                zstd_pieces: tuple[str, ...] | None = None) -> tuple[np.ndarray, list[list[int]]]:
    """``(uint8 plane, directory)`` holding ``planes`` in the order of ``names``. With
    ``zstd_level > 0`` each piece named in ``zstd_pieces`` (all when None) is stored as a zstd
    frame at that level when the frame is smaller than its bytes.

    Raises:
        ValueError: a plane whose name is not in ``names``, whose dtype is not in
            :data:`PACK_DTYPES` or that has more than 4 dims (an encoder bug, not bad input).
    """
    unknown = sorted(set(planes) - set(names))
    if unknown:
        raise ValueError(f"cannot pack planes {unknown}: not in {names}")
    directory: list[list[int]] = []
    parts: list[tuple[int, np.ndarray]] = []
    end = 0
    for i, name in enumerate(names):
        if name not in planes:
            continue
        a = np.asarray(planes[name])
        dt = a.dtype.newbyteorder("<") if a.dtype.itemsize > 1 else a.dtype
        if dt not in PACK_DTYPES or a.ndim > _MAX_DIMS:
            raise ValueError(f"cannot pack plane {name!r}: {a.dtype}{list(a.shape)}")
        start = _aligned(end)
        code = PACK_DTYPES.index(dt)
        shape = [int(v) for v in a.shape]
        entry = [i, code, *shape]
        if zstd_level > 0 and a.nbytes > 0 and (zstd_pieces is None or name in zstd_pieces):
            raw = np.ascontiguousarray(a, dtype=dt).tobytes()
            frame = _compressor(zstd_level).compress(raw)
            if len(frame) < len(raw) and len(raw) <= _ZSTD_RATIO * len(frame) + 65536:  # what readers accept
                a = np.frombuffer(frame, dtype=np.uint8)
                entry = [i, _ZSTD + code, len(frame), *shape]
        parts.append((start, a))
        end = start + a.nbytes
        directory.append(entry)
    out = np.zeros(end, dtype=np.uint8)
    for start, a in parts:  # one copy of each plane, straight into place
        dst = out[start:start + a.nbytes].view(a.dtype.newbyteorder("<") if a.dtype.itemsize > 1 else a.dtype)
        dst[...] = a.reshape(-1)
    return out, directory


def unpack_planes(blob: Any, directory: Any, names: tuple[str, ...], where: str = "pack") -> dict[str, np.ndarray]:
    """The planes a packed plane holds (owned, aligned copies), after checking everything.

    Raises:
        FormatError: the plane is not 1-D ``uint8``; the directory is not a list of integer lists
            as described above (unknown or repeated piece, unknown dtype, more than 4 dims,
            dims outside ``[0, 2**31 - 1]``); the pieces do not fit the plane exactly; a gap byte is not zero.
    """
    b = np.asarray(blob) if blob is not None else None
    if b is None or b.dtype != np.uint8 or b.ndim != 1:
        got = "missing" if b is None else f"{b.dtype}{list(b.shape)}"
        raise FormatError(f"{where}: packed plane must be uint8[N], got {got}")
    b = np.ascontiguousarray(b)
    if not isinstance(directory, list) or len(directory) > len(names):
        raise FormatError(f"{where}: pack directory must be a list of at most {len(names)} entries")
    out: dict[str, np.ndarray] = {}
    end = 0
    size = int(b.size)
    for e in directory:
        if type(e) is not list or not 2 <= len(e) <= 2 + _MAX_DIMS or any(type(v) is not int for v in e):
            # (type(v) is int: JSON integers, not bools or subclasses)
            raise FormatError(f"{where}: pack directory entry {e!r} is not [piece, dtype, dims...] (integers)")
        piece, dt, dims = e[0], e[1], e[2:]
        if not 0 <= piece < len(names) or names[piece] in out:
            raise FormatError(f"{where}: pack directory names piece {piece} (unknown or repeated)")
        stored = None
        if _ZSTD <= dt < _ZSTD + len(PACK_DTYPES):  # a zstd frame: [piece, 16 + dtype, stored, dims...]
            if not dims:
                raise FormatError(f"{where}: pack entry {e!r} of a compressed piece lacks its stored size")
            dt, stored, dims = dt - _ZSTD, dims[0], dims[1:]
            if not 1 <= stored <= size:
                raise FormatError(f"{where}: pack piece {names[piece]!r} stores {stored} compressed bytes in a "
                                  f"{size}-byte plane")
        if not 0 <= dt < len(PACK_DTYPES):
            raise FormatError(f"{where}: pack directory dtype {e[1]} unknown")
        if any(v < 0 or v > _MAX_DIM for v in dims):
            raise FormatError(f"{where}: pack piece {names[piece]!r} has dims {dims} outside [0, {_MAX_DIM}]")
        # what the piece may hold: the plane's bytes, or for a zstd frame at most _ZSTD_RATIO times
        # its stored bytes (the encoder's frames of kvc's pieces stay far below that)
        limit = size if stored is None else min(_ZSTD_RATIO * stored + 65536, _MAX_DIM)
        count = 1
        for v in dims:  # Python integers: no overflow; bounded at every step
            count *= v
            if count > limit:
                break
        nbytes = count * PACK_DTYPES[dt].itemsize
        if stored is not None and nbytes > limit:
            raise FormatError(f"{where}: pack piece {names[piece]!r} would decompress {stored} bytes to more than "
                              f"{limit}")
        start = _aligned(end)
        span = nbytes if stored is None else stored  # the bytes the piece takes in the plane
        if start + span > size:
            raise FormatError(f"{where}: pack piece {names[piece]!r} ({span} bytes at {start}) runs past the "
                              f"plane's {size} bytes")
        if start > end and b[end:start].tobytes() != bytes(start - end):
            raise FormatError(f"{where}: pack padding before piece {names[piece]!r} is not zero")
        if stored is None:
            data = b[start:start + nbytes]
        else:
            raw = _unzstd(b[start:start + stored].tobytes(), nbytes, f"{where}: pack piece {names[piece]!r}")
            data = np.frombuffer(raw, dtype=np.uint8)
        # one copy: an aligned array of its own, in native byte order
        out[names[piece]] = data.view(PACK_DTYPES[dt]).reshape(dims).astype(_NATIVE_DTYPES[dt], copy=True)
        end = start + span
    if end != size:
        raise FormatError(f"{where}: packed plane has {size - end} bytes after its last piece")
    return out


def _unzstd(frame: bytes, nbytes: int, where: str) -> bytes:
    """The content of ONE zstd frame that declares ``nbytes`` and holds exactly that, nothing after.
    The declared size is read from the frame header before anything is decompressed, so a frame
    cannot make the reader allocate more than the directory promised (which the caller bounds by
    ``256 * stored + 65536`` bytes)."""
    import zstandard

    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise FormatError(f"{where}: not a zstd frame ({e})") from None
    if declared != nbytes:
        raise FormatError(f"{where}: zstd frame declares {declared} bytes, the directory {nbytes}")
    dec = _local.__dict__.get("unzstd")
    if dec is None:  # one decompressor per thread: making one costs more than a small frame
        dec = _local.unzstd = zstandard.ZstdDecompressor()
    d = dec.decompressobj()
    try:
        raw = d.decompress(frame)
    except zstandard.ZstdError as e:
        raise FormatError(f"{where}: corrupt zstd frame ({e})") from None
    if len(raw) != nbytes or not d.eof or d.unused_data:
        raise FormatError(f"{where}: zstd frame is incomplete or has bytes after it")
    return raw


def stored_bytes(entry: list[int]) -> int:
    """The bytes a (valid) directory entry's piece takes in its packed plane, padding excluded:
    a zstd frame's stored size, else ``prod(dims) * itemsize``.

    Example:
        >>> stored_bytes([0, 2, 3, 5]), stored_bytes([1, 16 + 2, 40, 3, 5])
        (60, 40)
    """
    if entry[1] >= _ZSTD:
        return int(entry[2])
    n = PACK_DTYPES[entry[1]].itemsize
    for v in entry[2:]:
        n *= v
    return int(n)


__all__ = ["PACK_DTYPES", "pack_planes", "stored_bytes", "unpack_planes"]
