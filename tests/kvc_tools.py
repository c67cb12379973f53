"""Helpers for the format tests: take a valid KVC file apart and put a modified one together.

Kept out of the package: these build deliberately broken files.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any, Callable


def split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """(header dict, data section) of a safetensors file."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join(header: dict[str, Any] | str | bytes, data: bytes, align: int = 64) -> bytes:
    """Serialise a header (dict, or raw JSON text) and data into safetensors bytes."""
    if isinstance(header, dict):
        h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    elif isinstance(header, str):
        h = header.encode()
    else:
        h = header
    h += b" " * (-(8 + len(h)) % align)
    return struct.pack("<Q", len(h)) + h + data


def manifest_of(blob: bytes) -> dict[str, Any]:
    return json.loads(split(blob)[0]["__metadata__"]["manifest"])


def rewrite(
    blob: bytes,
    manifest: Callable[[dict[str, Any]], Any] | None = None,
    metadata: Callable[[dict[str, str]], Any] | None = None,
    header: Callable[[dict[str, Any]], Any] | None = None,
    recrc: bool = True,
) -> bytes:
    """A copy of ``blob`` with the manifest / metadata / header changed in place by the given
    functions; the manifest CRC is recomputed unless ``recrc`` is False."""
    h, data = split(blob)
    meta = h["__metadata__"]
    if manifest is not None:
        m = json.loads(meta["manifest"])
        manifest(m)
        meta["manifest"] = json.dumps(m, sort_keys=True, separators=(",", ":"))
        if recrc:
            meta["manifest_crc32"] = f"{zlib.crc32(meta['manifest'].encode()) & 0xFFFFFFFF:08x}"
    if metadata is not None:
        metadata(meta)
    if header is not None:
        header(h)
    return join(h, data)
