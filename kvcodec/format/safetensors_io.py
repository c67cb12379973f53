"""Byte-level safetensors reading and writing for KVC containers.

We write and parse the safetensors header ourselves: the reference parser accepts duplicate keys
and knows no format key or version, so it cannot validate a KVC file for us.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any, Iterable

import numpy as np

from ..errors import FormatError, TruncatedError, VersionError

#: numpy dtype -> safetensors dtype name, for the planes we store.
NP_TO_ST = {
    np.dtype(np.uint8): "U8",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint16): "U16",
    np.dtype(np.int16): "I16",
    np.dtype(np.uint32): "U32",
    np.dtype(np.int32): "I32",
    np.dtype(np.uint64): "U64",
    np.dtype(np.int64): "I64",
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
}
ST_TO_NP = {v: k for k, v in NP_TO_ST.items()}
MAX_HEADER = 100_000_000


def write(
    planes: Iterable[tuple[str, np.ndarray]],
    manifest: dict[str, Any],
    format_key: str,
    version: tuple[int, int],
) -> bytes:
    """Serialise planes and manifest into safetensors bytes (header padded to 8 bytes)."""
    header: dict[str, Any] = {}
    blobs: list[bytes] = []
    off = 0
    for name, arr in planes:
        if name in header:
            raise FormatError(f"duplicate plane name {name!r}")
        dt = NP_TO_ST.get(arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype)
        if dt is None:
            raise FormatError(f"plane {name!r} has unsupported dtype {arr.dtype}")
        b = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
        header[name] = {"dtype": dt, "shape": [int(s) for s in arr.shape], "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    header["__metadata__"] = {
        "format": format_key,
        "format_version": f"{version[0]}.{version[1]}",
        "manifest": json.dumps(manifest, sort_keys=True, separators=(",", ":")),
    }
    h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return b"".join([struct.pack("<Q", len(h)), h, *blobs])


class KVCFile:
    """A parsed KVC container held in memory."""

    def __init__(self, data: bytes, header: dict[str, Any], manifest: dict[str, Any], start: int):
        self._data = data
        self._header = header
        self.manifest = manifest
        self._start = start

    def names(self) -> list[str]:
        return [k for k in self._header if k != "__metadata__"]

    def get(self, name: str) -> np.ndarray:
        e = self._header[name]
        a, b = e["data_offsets"]
        return np.frombuffer(self._data, dtype=ST_TO_NP[e["dtype"]], count=(b - a) // ST_TO_NP[e["dtype"]].itemsize,
                             offset=self._start + a).reshape(e["shape"])


def open_kvc(src: bytes | str | os.PathLike[str], format_key: str, version: tuple[int, int]) -> KVCFile:
    """Parse and validate a KVC container from bytes or a path."""
    if isinstance(src, (str, os.PathLike)):
        try:
            with open(src, "rb") as f:
                data = f.read()
        except OSError as e:
            raise FormatError(f"cannot read {os.fspath(src)}: {e.strerror or e}") from None
    else:
        data = bytes(src)
    if len(data) < 8:
        raise TruncatedError(f"file is {len(data)} bytes; a KVC file starts with an 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER:
        raise FormatError(f"header length {n} exceeds the {MAX_HEADER}-byte limit")
    if 8 + n > len(data):
        raise TruncatedError(f"header length {n} runs past the end of the {len(data)}-byte file")
    try:
        header = json.loads(data[8 : 8 + n])
    except (ValueError, UnicodeDecodeError) as e:
        raise FormatError(f"header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise FormatError("header is not a JSON object")
    meta = header.get("__metadata__")
    if not isinstance(meta, dict) or meta.get("format") != format_key:
        raise FormatError(f"not a KVC file: __metadata__.format is not {format_key!r}")
    v = str(meta.get("format_version", ""))
    try:
        major, minor = (int(x) for x in v.split("."))
    except ValueError:
        raise VersionError(f"bad format_version {v!r}") from None
    if major != version[0]:
        raise VersionError(f"unsupported major version {major} (this reader knows {version[0]}.x)")
    try:
        manifest = json.loads(meta["manifest"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"manifest missing or not JSON: {e}") from None
    return KVCFile(data, header, manifest, 8 + n)
