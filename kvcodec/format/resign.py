"""Take a KVC file apart and put it back together, re-signed: the structure-aware mutations of the
hostile-file tests and the differential fuzzer (eval/fuzz_diff.py).

:func:`split_file` returns the manifest and every stored tensor as a numpy array;
:func:`join_file` writes them back in the canonical layout (formats/SPEC.md §3.3, §5) with fresh
CRC-32s of every tensor and of the manifest, and the manifest's ``storage.tensors`` rebuilt from
the arrays. A change made between the two (a plane's values, dtype or shape, a chunk's params, an
extra plane) therefore reaches the codec's decoder instead of failing a checksum. Nothing here
validates: that is the reader's job.

Example:
    >>> import torch, kvcodec
    >>> x = torch.randn(8, 2, 16).half()
    >>> blob = kvcodec.get_codec("fp8-e4m3").encode(kvcodec.KVCache.from_tensors([(x, x)]))
    >>> manifest, tensors = split_file(blob)
    >>> join_file(manifest, tensors) == blob
    True
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from typing import Any

import numpy as np

from .safetensors_io import DTYPES, dtype_name

_ROLE = {"k": 0, "v": 1, "kv": 2}
_LAYER = re.compile(r"layers\.(\d+)\.(k|v|kv)\.(?:c(\d+)\.)?(.+)")


def split_file(blob: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """``(manifest, {name: array})`` of a KVC file (padding tensors dropped). Trusts the file."""
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8 : 8 + n])
    manifest = json.loads(header["__metadata__"]["manifest"])
    data = memoryview(blob)[8 + n :]
    tensors = {}
    for name, e in header.items():
        if name == "__metadata__" or name.startswith("pad."):
            continue
        b, end = e["data_offsets"]
        dt = DTYPES[e["dtype"]]
        tensors[name] = np.frombuffer(bytes(data[b:end]), dtype=dt).reshape(e["shape"]).copy()
    return manifest, tensors


def canonical_key(name: str) -> tuple:
    """Sort key of the canonical order (formats/SPEC.md §5)."""
    if name.startswith("global."):
        return (0, name)
    if name.startswith("meta."):
        return (1, 0 if name == "meta.token_ids" else 1, name)
    m = _LAYER.fullmatch(name)
    if m is None:  # not a valid name: put it last, the reader rejects it anyway
        return (3, name)
    return (2, int(m.group(1)), _ROLE[m.group(2)], int(m.group(3) or 0), m.group(4))


def _crc(b: bytes) -> str:
    return f"{zlib.crc32(b) & 0xFFFFFFFF:08x}"


def join_file(manifest: dict[str, Any], tensors: dict[str, np.ndarray], version: str = "1.0") -> bytes:
    """A KVC file of ``tensors`` (any numpy dtype KVC stores) in canonical order and layout, with
    ``manifest["storage"]["tensors"]`` rebuilt from them and every CRC-32 recomputed."""
    m = json.loads(json.dumps(manifest))
    storage: dict[str, Any] = {}
    header: dict[str, Any] = {}
    parts: list[bytes] = []
    pos, pads = 0, 0
    for name in sorted(tensors, key=canonical_key):
        a = np.ascontiguousarray(tensors[name])
        raw = a.tobytes()
        if pos % 64:
            g = 64 - pos % 64
            header[f"pad.{pads}"] = {"data_offsets": [pos, pos + g], "dtype": "U8", "shape": [g]}
            parts.append(bytes(g))
            pads += 1
            pos += g
        dt = dtype_name(a.dtype)
        header[name] = {"data_offsets": [pos, pos + len(raw)], "dtype": dt, "shape": list(a.shape)}
        storage[name] = {"crc32": _crc(raw), "dtype": dt, "shape": list(a.shape)}
        parts.append(raw)
        pos += len(raw)
    m.setdefault("storage", {})["tensors"] = storage
    text = json.dumps(m, sort_keys=True, separators=(",", ":"))
    header["__metadata__"] = {"format": "kvc", "format_version": version, "manifest": text,
                              "manifest_crc32": _crc(text.encode())}
    h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    h += b" " * (-(8 + len(h)) % 64)
    return struct.pack("<Q", len(h)) + h + b"".join(parts)


__all__ = ["canonical_key", "join_file", "split_file"]
