"""Byte level of the KVC container: a strict safetensors header parser and a canonical writer.

We parse the safetensors header ourselves instead of trusting ``safetensors``: the reference
parser silently accepts duplicate JSON keys and knows no format key or version, and a KVC reader
must validate every size and offset *before* it allocates or reads anything (formats/SPEC.md §3).

Nothing here knows about layers or codecs; :mod:`kvcodec.format.container` builds on it.

Example:
    >>> import numpy as np
    >>> from kvcodec.format import safetensors_io as sio
    >>> layout = sio.plan_layout([("a", "U8", (3,)), ("b", "I32", (2,))])
    >>> [(e.name, e.start, e.end) for e in layout]
    [('a', 0, 3), ('pad.0', 3, 64), ('b', 64, 72)]
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO, Iterable

import numpy as np

from ..errors import FormatError, TruncatedError

#: safetensors dtype name -> little-endian numpy dtype. Only dtypes numpy can represent natively:
#: codec planes are numpy arrays (FP8/FP4 codes travel as U8).
DTYPES: dict[str, np.dtype] = {
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "U16": np.dtype("<u2"),
    "I16": np.dtype("<i2"),
    "U32": np.dtype("<u4"),
    "I32": np.dtype("<i4"),
    "U64": np.dtype("<u8"),
    "I64": np.dtype("<i8"),
    "F16": np.dtype("<f2"),
    "F32": np.dtype("<f4"),
    "F64": np.dtype("<f8"),
}
_NP_TO_NAME = {(d.kind, d.itemsize): n for n, d in DTYPES.items()}

#: Every non-padding tensor starts at an absolute file offset that is a multiple of this.
ALIGNMENT = 64
#: Largest header accepted (the same limit as the safetensors reference implementation).
MAX_HEADER_BYTES = 100_000_000
#: Largest rank and largest byte size of one stored tensor (overflow guards; 2**62 bytes is far
#: beyond any real file but keeps every sum of offsets inside a signed 64-bit integer).
MAX_RANK = 8
MAX_TENSOR_BYTES = 1 << 62
#: Deepest nesting of arrays and objects in the header and the manifest (formats/SPEC.md §3.1 step 3):
#: checked on the text before parsing, so acceptance does not depend on the caller's stack depth
#: (a KVC manifest nests 9 deep).
MAX_JSON_DEPTH = 64
PAD_PREFIX = "pad."


def dtype_name(dt: np.dtype) -> str:
    """The safetensors name of a numpy dtype (either byte order), or raise :class:`FormatError`."""
    dt = np.dtype(dt)
    name = _NP_TO_NAME.get((dt.kind, dt.itemsize)) if dt.kind in "uif" else None
    if name is None:
        raise FormatError(f"dtype {dt} cannot be stored in a KVC file; use one of {sorted(DTYPES)}")
    return name


# ---------------------------------------------------------------------- sources
class Source:
    """Random-access bytes: an in-memory buffer or a seekable binary file.

    ``read(offset, n)`` returns exactly ``n`` bytes or raises :class:`TruncatedError`; it is the
    only way the reader touches the data, so tests can count the bytes read.
    """

    size: int

    def read(self, offset: int, n: int) -> bytes | memoryview:  # pragma: no cover - interface
        raise NotImplementedError

    def close(self) -> None:
        pass


class BufferSource(Source):
    """A source over bytes-like data; slices are zero-copy memoryviews."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self._mv = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
        self.size = len(self._mv)

    def read(self, offset: int, n: int) -> memoryview:
        if offset < 0 or n < 0 or offset + n > self.size:
            raise TruncatedError(f"read of {n} bytes at offset {offset} runs past the end ({self.size} bytes)")
        return self._mv[offset : offset + n]


class FileSource(Source):
    """A source over a seekable binary file object (opened from a path when given one)."""

    def __init__(self, f: BinaryIO, close: bool = False, name: str = "<file>") -> None:
        self._f = f
        self._close = close
        self.name = name
        try:
            f.seek(0, io.SEEK_END)
            self.size = f.tell()
        except (OSError, ValueError, AttributeError) as e:
            raise FormatError(f"{name}: not a seekable binary file: {e}") from None

    def read(self, offset: int, n: int) -> bytes:
        if offset < 0 or n < 0 or offset + n > self.size:
            raise TruncatedError(f"{self.name}: read of {n} bytes at offset {offset} runs past the end ({self.size} bytes)")
        try:
            self._f.seek(offset)
            b = self._f.read(n) if n else b""
        except (OSError, ValueError) as e:
            raise FormatError(f"{self.name}: read failed: {e}") from None
        if b is not None and not isinstance(b, (bytes, bytearray)):
            raise FormatError(f"{self.name}: read() returned {type(b).__name__}; open the file in binary mode")
        if b is None or len(b) != n:
            raise TruncatedError(
                f"{self.name}: file shrank while reading: wanted {n} bytes at offset {offset}, got "
                f"{0 if b is None else len(b)}"
            )
        return b

    def close(self) -> None:
        if self._close:
            self._f.close()


def as_source(src: Any) -> Source:
    """A :class:`Source` for a path, bytes-like object or seekable binary file object."""
    if isinstance(src, Source):
        return src
    if isinstance(src, (bytes, bytearray, memoryview)):
        return BufferSource(src)
    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        try:
            f = io.open(path, "rb")
        except OSError as e:
            raise FormatError(f"cannot read {path}: {e.strerror or e}") from None
        try:
            return FileSource(f, close=True, name=path)
        except BaseException:
            f.close()
            raise
    if hasattr(src, "read") and hasattr(src, "seek"):
        return FileSource(src, close=False, name=getattr(src, "name", "<file>"))
    raise FormatError(f"expected a path, bytes or a binary file object, got {type(src).__name__}")


# ---------------------------------------------------------------------- header parsing
@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file; ``start``/``end`` are offsets into the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class RawHeader:
    """A parsed, structurally valid safetensors header (not yet checked as a KVC file)."""

    header_len: int
    data_start: int
    file_size: int
    metadata: dict[str, str]
    raw_entries: dict[str, Any]
    entries: list[Entry] | None = None  # filled by validate_entries, in offset order


class _Reject(Exception):
    """Raised inside JSON hooks; converted to FormatError by the caller."""


def _pairs_no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)  # one C call; a key given twice leaves fewer entries than pairs
    if len(d) == len(pairs):
        return d
    seen: set[str] = set()
    for k, _ in pairs:
        if k in seen:
            raise _Reject(f"duplicate key {k!r}")
        seen.add(k)
    raise AssertionError("unreachable: fewer keys than pairs without a repeated key")


def _no_constant(name: str) -> Any:
    raise _Reject(f"non-standard JSON constant {name}")


def _finite_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise _Reject(f"number {s[:40]} overflows a double")
    return v


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_DECODER = json.JSONDecoder(
    object_pairs_hook=_pairs_no_duplicates, parse_constant=_no_constant, parse_float=_finite_float
)


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # unrolled: no per-character backtracking state


def json_depth(text: str) -> int:
    """Deepest nesting of ``[``/``{`` in JSON text, strings skipped; iterative (numpy over the bytes),
    so it needs no stack however deep the text nests.

    Example:
        >>> json_depth('{"a": [1, {"b": "[[["}]}')
        3
    """
    if text.count("[") + text.count("{") <= 1:
        return text.count("[") + text.count("{")
    if "\\" not in text and text.count('"') % 2 == 0:
        # no escapes and whole strings only: every second piece between quotes is a string, and
        # dropping those is what the pattern does (4x faster on a manifest)
        bare = "".join(text.split('"')[::2])
    else:
        bare = _JSON_STRING.sub("", text)
    a = np.frombuffer(bare.encode("utf-8", "replace"), dtype=np.uint8)
    step = np.zeros(256, dtype=np.int8)
    step[[ord("["), ord("{")]] = 1
    step[[ord("]"), ord("}")]] = -1
    depth, deepest = 0, 0
    for i in range(0, a.size, 1 << 14):  # small temporaries: opening a file stays near one layer's memory
        run = np.cumsum(step[a[i:i + (1 << 14)]], dtype=np.int64) + depth
        if run.size:
            deepest, depth = max(deepest, int(run.max())), int(run[-1])
    return deepest


def strict_json_loads(text: str, what: str) -> Any:
    """Parse one JSON document strictly: no duplicate keys, no NaN/Infinity, no trailing data
    except spaces, no nesting deeper than :data:`MAX_JSON_DEPTH`; any failure is a
    :class:`FormatError` naming ``what``.
    """
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and json_depth(text) > MAX_JSON_DEPTH:
        raise FormatError(f"{what} is nested deeper than {MAX_JSON_DEPTH} levels of arrays/objects")
    try:
        obj, end = _DECODER.raw_decode(text)
    except _Reject as e:
        raise FormatError(f"{what}: {e}") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, too many digits, deep nesting
        raise FormatError(f"{what} is not valid JSON: {str(e)[:200]}") from None
    if text[end:].strip(" "):
        raise FormatError(f"{what} has trailing data after the JSON document (only spaces may follow)")
    if _SURROGATE_ESCAPE.search(text) is None:  # the cheap test first: only escapes make surrogates
        return obj
    try:  # JSON escapes can smuggle lone surrogates, which no UTF-8 text holds
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise FormatError(f"{what} holds a string with a lone UTF-16 surrogate escape") from None
    except (ValueError, RecursionError):
        raise FormatError(f"{what} is nested too deeply") from None
    return obj


def read_raw_header(source: Source) -> RawHeader:
    """Read and parse the 8-byte length and the JSON header; check only what is generic.

    Raises:
        TruncatedError: the file is under 8 bytes or the header runs past its end.
        FormatError: a GGUF file, an oversized header, bad UTF-8 or JSON, duplicate keys,
            a missing or non-string ``__metadata__``.
    """
    size = source.size
    if size == 0:
        raise TruncatedError("empty file (0 bytes): a KVC file starts with an 8-byte header length")
    if size < 8:
        raise TruncatedError(f"file is only {size} bytes: a KVC file starts with an 8-byte header length")
    head = bytes(source.read(0, 8))
    if head[:4] == b"GGUF":
        raise FormatError("this is a GGUF file (magic 'GGUF'), not a KVC file")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER_BYTES:
        raise FormatError(f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit (not a KVC file?)")
    if 8 + n > size:
        raise TruncatedError(f"header length {n} runs past the end of the {size}-byte file")
    raw = bytes(source.read(8, n))
    if raw[:1] != b"{":
        raise FormatError("header does not start with '{': not a safetensors/KVC file")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FormatError(f"header is not valid UTF-8 (byte {e.start})") from None
    header = strict_json_loads(text, "header")
    if not isinstance(header, dict):
        raise FormatError("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is None:
        raise FormatError("no __metadata__ in the header: a plain safetensors file, not a KVC file")
    if not isinstance(meta, dict):
        raise FormatError("__metadata__ is not a JSON object")
    for k, v in meta.items():
        if not isinstance(v, str):
            raise FormatError(f"__metadata__[{k!r}] is a {type(v).__name__}; safetensors metadata values must be strings")
    return RawHeader(header_len=n, data_start=8 + n, file_size=size, metadata=meta, raw_entries=header)


def _int(v: Any, what: str, lo: int = 0, hi: int = MAX_TENSOR_BYTES) -> int:
    if type(v) is not int:
        raise FormatError(f"{what} is {json.dumps(v)[:40]}, not an integer")
    if not lo <= v <= hi:
        raise FormatError(f"{what} = {v} is out of range [{lo}, {hi}]")
    return v


def parse_entry(name: str, e: Any) -> Entry:
    """Validate one header entry: dtype, shape and offsets, with overflow-safe size arithmetic."""
    if not isinstance(e, dict):
        raise FormatError(f"tensor {name!r}: header entry is not a JSON object")
    if set(e) != {"dtype", "shape", "data_offsets"}:
        raise FormatError(f"tensor {name!r}: header entry must have exactly dtype, shape, data_offsets; has {sorted(e)}")
    dt = e["dtype"]
    if not isinstance(dt, str) or dt not in DTYPES:
        raise FormatError(f"tensor {name!r}: unsupported dtype {dt!r} (KVC allows {', '.join(DTYPES)})")
    shape = e["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_RANK:
        raise FormatError(f"tensor {name!r}: shape must be a list of at most {MAX_RANK} integers")
    dims = tuple(_int(s, f"tensor {name!r}: shape entry") for s in shape)
    offs = e["data_offsets"]
    if not isinstance(offs, list) or len(offs) != 2:
        raise FormatError(f"tensor {name!r}: data_offsets must be [begin, end]")
    a = _int(offs[0], f"tensor {name!r}: data_offsets begin")
    b = _int(offs[1], f"tensor {name!r}: data_offsets end")
    if b < a:
        raise FormatError(f"tensor {name!r}: data_offsets end {b} < begin {a}")
    nbytes = DTYPES[dt].itemsize
    for d in dims:  # Python ints cannot overflow, but we refuse sizes no file could hold
        nbytes *= d
        if nbytes > MAX_TENSOR_BYTES:
            raise FormatError(f"tensor {name!r}: shape {list(dims)} x {dt} overflows the size limit")
    if nbytes != b - a:
        raise FormatError(
            f"tensor {name!r}: shape {list(dims)} x {dt} is {nbytes} bytes but data_offsets span {b - a}"
        )
    return Entry(name, dt, dims, a, b)


def validate_entries(h: RawHeader) -> list[Entry]:
    """Check every tensor entry and that the data section is covered exactly: no holes, no
    overlaps, no trailing bytes, nothing past the end of the file."""
    entries = [parse_entry(name, e) for name, e in h.raw_entries.items()]
    entries.sort(key=lambda e: (e.start, e.end, e.name))
    pos = 0
    for e in entries:
        if e.start < pos:
            raise FormatError(f"tensor {e.name!r} (bytes {e.start}..{e.end}) overlaps the previous tensor ending at {pos}")
        if e.start > pos:
            raise FormatError(f"hole of {e.start - pos} bytes in the data before tensor {e.name!r} (offset {pos})")
        pos = e.end
    data_size = h.file_size - h.data_start
    if pos > data_size:
        raise TruncatedError(
            f"file is truncated: tensors need {pos} data bytes but only {data_size} follow the header"
        )
    if pos < data_size:
        raise FormatError(f"{data_size - pos} trailing bytes after the last tensor")
    h.entries = entries
    return entries


# ---------------------------------------------------------------------- writing
def plan_layout(tensors: Iterable[tuple[str, str, tuple[int, ...]]]) -> list[Entry]:
    """Canonical data layout: tensors in the given order, each starting at a multiple of
    :data:`ALIGNMENT`, gaps filled by zero-byte ``U8`` padding tensors ``pad.0``, ``pad.1`` ...

    Padding tensors keep the file a valid safetensors file with no holes.
    """
    out: list[Entry] = []
    pos = 0
    npad = 0
    for name, dt, shape in tensors:
        gap = -pos % ALIGNMENT
        if gap:
            out.append(Entry(f"{PAD_PREFIX}{npad}", "U8", (gap,), pos, pos + gap))
            npad += 1
            pos += gap
        n = DTYPES[dt].itemsize * math.prod(shape)
        out.append(Entry(name, dt, tuple(int(s) for s in shape), pos, pos + n))
        pos += n
    return out


def build_header(layout: list[Entry], metadata: dict[str, str]) -> bytes:
    """The 8-byte length plus canonical header JSON, space-padded so data starts at a multiple of
    :data:`ALIGNMENT` (safetensors allows trailing spaces in the header)."""
    header: dict[str, Any] = {
        e.name: {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [e.start, e.end]} for e in layout
    }
    header["__metadata__"] = dict(metadata)
    h = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()
    h += b" " * (-(8 + len(h)) % ALIGNMENT)
    if len(h) > MAX_HEADER_BYTES:
        raise FormatError(f"header would be {len(h)} bytes, over the {MAX_HEADER_BYTES}-byte limit")
    return struct.pack("<Q", len(h)) + h
