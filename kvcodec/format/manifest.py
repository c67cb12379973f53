"""The KVC manifest: tensor naming, canonical order, and strict validation (formats/SPEC.md §4-§6).

The manifest is a canonical JSON object stored in the safetensors ``__metadata__``. This module
validates a parsed manifest completely -- every type, every count, every cross-reference -- so
that the reader can trust it before it reads or allocates anything.

Example:
    >>> from kvcodec.format.manifest import parse_tensor_name
    >>> parse_tensor_name("layers.3.k.codes", chunked=False)
    ('layer', 3, 'k', 0, 'codes')
    >>> parse_tensor_name("layers.3.v.c2.scales", chunked=True)
    ('layer', 3, 'v', 2, 'scales')
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError, FormatError, VersionError
from . import safetensors_io as sio

FORMAT_KEY = "kvc"
FORMAT_VERSION = (1, 0)
#: Features this reader implements; a file listing any other in ``required_features`` is refused.
KNOWN_FEATURES: frozenset[str] = frozenset()
CHECKSUM = "crc32"
ROLE_ORDER = {"k": 0, "v": 1, "kv": 2}
LAYER_KINDS = ("full", "sliding", "mla")
SOURCE_DTYPE_NAMES = ("float32", "float16", "bfloat16")

#: Decoded-size guard: a tensor chunk may declare at most this many elements per stored byte of
#: its planes (a rate of 1/512 bit per element), plus a fixed allowance for tiny chunks.
#: This bounds what a hostile file can make us allocate by a constant factor of its size.
MAX_ELEMENTS_PER_BYTE = 4096
ELEMENT_ALLOWANCE = 65536
MAX_LAYERS = 100_000
MAX_DIM = 1 << 31

PLANE_RE = re.compile(r"[A-Za-z0-9_]{1,64}")
GLOBAL_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
META_NAMES = ("meta.token_ids", "meta.positions")
_LAYER_RE = re.compile(r"layers\.(0|[1-9][0-9]{0,5})\.(k|v|kv)\.(?:c(0|[1-9][0-9]{0,9})\.)?([A-Za-z0-9_]{1,64})")


def tensor_name(layer: int, role: str, plane: str, chunk: int | None = None) -> str:
    """The stored name of one plane: ``layers.{i}.{role}.{plane}``, or with chunking
    ``layers.{i}.{role}.c{j}.{plane}``."""
    return f"layers.{layer}.{role}.{plane}" if chunk is None else f"layers.{layer}.{role}.c{chunk}.{plane}"


def parse_tensor_name(name: str, chunked: bool) -> tuple[str, int, str, int, str]:
    """Classify a stored tensor name: ``(kind, layer, role, chunk, plane)``; kind is ``"global"``,
    ``"meta"`` or ``"layer"``. Raises :class:`FormatError` for names outside the naming rule."""
    if name.startswith("global."):
        p = name[len("global."):]
        if GLOBAL_RE.fullmatch(p):
            return ("global", -1, "", -1, p)
    elif name in META_NAMES:
        return ("meta", -1, "", META_NAMES.index(name), name[5:])
    else:
        m = _LAYER_RE.fullmatch(name)
        if m and (m.group(3) is not None) == chunked:
            return ("layer", int(m.group(1)), m.group(2), int(m.group(3) or 0), m.group(4))
    raise FormatError(f"tensor name {name!r} does not follow the KVC naming rule" + (
        " (this file is chunked: layers.<i>.<role>.c<j>.<plane>)" if chunked else ""))


def canonical_key(name: str, chunked: bool) -> tuple:
    """Sort key of the canonical tensor order: globals by name, meta, then layers, roles k, v, kv,
    chunks, planes by name."""
    kind, layer, role, chunk, plane = parse_tensor_name(name, chunked)
    if kind == "global":
        return (0, 0, 0, 0, plane)
    if kind == "meta":
        return (1, chunk, 0, 0, "")
    return (2, layer, ROLE_ORDER[role], chunk, plane)


def canonical_json(obj: Any) -> str:
    """The canonical JSON text: sorted keys, no whitespace, ASCII only, no NaN/Infinity."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


# ---------------------------------------------------------------------- validated view
@dataclass
class ChunkInfo:
    start: int
    tokens: int
    params: dict[str, Any]
    planes: dict[str, str] = field(default_factory=dict)  # plane -> stored tensor name


@dataclass
class TensorInfo:
    role: str
    shape: tuple[int, int, int]
    chunks: list[ChunkInfo]


@dataclass
class LayerManifest:
    index: int
    kind: str
    window: int
    tensors: dict[str, TensorInfo]


@dataclass
class Manifest:
    """A validated manifest plus the indexes the reader needs."""

    raw: dict[str, Any]
    num_tokens: int
    tokens_per_chunk: int
    source_dtype: str
    layers: list[LayerManifest]
    storage: dict[str, dict[str, Any]]  # name -> {"dtype", "shape", "crc32"}
    globals: dict[str, str]  # plane -> stored name

    @property
    def chunked(self) -> bool:
        return self.tokens_per_chunk > 0


def _need(d: dict, key: str, typ: type | tuple, where: str) -> Any:
    if key not in d:
        raise FormatError(f"manifest: {where} is missing {key!r}")
    v = d[key]
    ok = isinstance(v, typ) and not (isinstance(v, bool) and typ in (int, (int, float)))
    if not ok:
        raise FormatError(f"manifest: {where}.{key} has type {type(v).__name__}")
    return v


def _nat(d: dict, key: str, where: str, lo: int = 0, hi: int = MAX_DIM) -> int:
    v = _need(d, key, int, where)
    if not lo <= v <= hi:
        raise FormatError(f"manifest: {where}.{key} = {v} is out of range [{lo}, {hi}]")
    return v


def check_version(metadata: dict[str, str]) -> tuple[int, int]:
    """Check the format key and version in ``__metadata__`` (SPEC §2)."""
    fmt = metadata.get("format")
    if fmt is None:
        raise FormatError("__metadata__ has no 'format' key: a safetensors file, but not a KVC file")
    if fmt != FORMAT_KEY:
        raise FormatError(f"__metadata__ format is {fmt[:40]!r}, not {FORMAT_KEY!r}: not a KVC file")
    v = metadata.get("format_version")
    if v is None:
        raise VersionError("__metadata__ has no 'format_version'")
    m = re.fullmatch(r"(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})", v)
    if not m:
        raise VersionError(f"format_version {v[:20]!r} is not MAJOR.MINOR")
    major, minor = int(m.group(1)), int(m.group(2))
    if major != FORMAT_VERSION[0]:
        raise VersionError(
            f"KVC major version {major} is not supported (this reader reads {FORMAT_VERSION[0]}.x)"
        )
    return major, minor


def validate(m: Any, max_elements_per_byte: int = MAX_ELEMENTS_PER_BYTE) -> Manifest:
    """Validate a parsed manifest (SPEC §4) and return the indexed view.

    ``max_elements_per_byte`` may lower the decoded-size bound (SPEC §7) below the format's
    4096 elements per stored byte: decoding work is linear in the declared elements, so a reader
    of untrusted files bounds its work per input byte with it.

    Raises:
        VersionError: ``required_features`` names a feature this reader does not implement.
        FormatError: anything else is missing, mistyped, inconsistent or over a limit.
    """
    if type(max_elements_per_byte) is not int or not 1 <= max_elements_per_byte <= MAX_ELEMENTS_PER_BYTE:
        raise ConfigError(f"max_elements_per_byte must be an integer in [1, {MAX_ELEMENTS_PER_BYTE}], "
                          f"got {max_elements_per_byte!r}")
    if not isinstance(m, dict):
        raise FormatError("manifest is not a JSON object")
    feats = _need(m, "required_features", list, "manifest")
    if not all(isinstance(f, str) for f in feats):
        raise FormatError("manifest: required_features must be a list of strings")
    for f in feats:
        if f not in KNOWN_FEATURES:
            raise VersionError(f"file requires feature {f[:60]!r}, which this reader does not implement")
    _need(m, "producer", dict, "manifest")
    model = _need(m, "model", dict, "manifest")
    for k in ("model_id", "revision", "config_hash", "tokenizer"):
        _need(model, k, str, "model")
    src = _need(m, "source_dtype", str, "manifest")
    if src not in SOURCE_DTYPE_NAMES:
        raise FormatError(f"manifest: unknown source_dtype {src[:20]!r}")
    rope = _need(m, "rope", dict, "manifest")
    _need(rope, "applied", bool, "rope")
    _need(rope, "params", dict, "rope")
    T = _nat(m, "num_tokens", "manifest")
    has_tok = _need(m, "has_token_ids", bool, "manifest")
    has_pos = _need(m, "has_positions", bool, "manifest")
    ch = _need(m, "chunking", dict, "manifest")
    C = _nat(ch, "tokens_per_chunk", "chunking")
    codec = _need(m, "codec", dict, "manifest")
    _need(codec, "id", str, "codec")
    storage_d = _need(m, "storage", dict, "manifest")
    if _need(storage_d, "alignment", int, "storage") != sio.ALIGNMENT:
        raise FormatError(f"manifest: storage.alignment must be {sio.ALIGNMENT}")
    if _need(storage_d, "checksum", str, "storage") != CHECKSUM:
        raise FormatError(f"manifest: storage.checksum must be {CHECKSUM!r}")
    stored = _need(storage_d, "tensors", dict, "storage")
    layers_raw = _need(m, "layers", list, "manifest")
    if len(layers_raw) > MAX_LAYERS:
        raise FormatError(f"manifest: {len(layers_raw)} layers exceeds the limit of {MAX_LAYERS}")

    n_chunks = 1 if C == 0 else -(-T // C)
    layers: list[LayerManifest] = []
    for i, lr in enumerate(layers_raw):
        w = f"layers[{i}]"
        if not isinstance(lr, dict):
            raise FormatError(f"manifest: {w} is not an object")
        kind = _need(lr, "kind", str, w)
        if kind not in LAYER_KINDS:
            raise FormatError(f"manifest: {w}.kind {kind[:20]!r} is not one of {LAYER_KINDS}")
        window = _nat(lr, "window", w)
        if (kind == "sliding") != (window > 0):
            raise FormatError(f"manifest: {w}: window must be > 0 exactly for sliding layers")
        heads = _nat(lr, "kv_heads", w, 1)
        if kind == "mla":
            dims = {"kv": _nat(lr, "latent_dim", w, 1)}
            if heads != 1:
                raise FormatError(f"manifest: {w}: an MLA layer has kv_heads 1")
        else:
            dims = {"k": _nat(lr, "head_dim_k", w, 1), "v": _nat(lr, "head_dim_v", w, 1)}
        tens = _need(lr, "tensors", dict, w)
        if set(tens) != set(dims):
            raise FormatError(f"manifest: {w}.tensors has roles {sorted(tens)}; a {kind} layer has {sorted(dims)}")
        tinfos: dict[str, TensorInfo] = {}
        for role in sorted(tens, key=ROLE_ORDER.__getitem__):
            tw = f"{w}.tensors.{role}"
            tr = tens[role]
            if not isinstance(tr, dict):
                raise FormatError(f"manifest: {tw} is not an object")
            shape = _need(tr, "shape", list, tw)
            if shape != [T, heads, dims[role]]:
                raise FormatError(f"manifest: {tw}.shape {shape} != [num_tokens, kv_heads, dim] = {[T, heads, dims[role]]}")
            chunks_raw = _need(tr, "chunks", list, tw)
            if len(chunks_raw) != n_chunks:
                raise FormatError(f"manifest: {tw} has {len(chunks_raw)} chunks; {T} tokens at {C} per chunk make {n_chunks}")
            chunks = []
            for j, cr in enumerate(chunks_raw):
                cw = f"{tw}.chunks[{j}]"
                if not isinstance(cr, dict):
                    raise FormatError(f"manifest: {cw} is not an object")
                start = j * C
                want = T if C == 0 else min(C, T - start)
                got = _nat(cr, "tokens", cw)
                if got != want:
                    raise FormatError(f"manifest: {cw}.tokens = {got}, expected {want}")
                chunks.append(ChunkInfo(start, want, _need(cr, "params", dict, cw)))
            tinfos[role] = TensorInfo(role, (T, heads, dims[role]), chunks)
        layers.append(LayerManifest(i, kind, window, tinfos))

    globals_: dict[str, str] = {}
    storage: dict[str, dict[str, Any]] = {}
    seen_meta = set()
    for name, e in stored.items():
        if name.startswith(sio.PAD_PREFIX):
            raise FormatError(f"manifest: storage lists padding tensor {name!r}")
        kind, li, role, j, plane = parse_tensor_name(name, C > 0)
        sw = f"storage.tensors[{name!r}]"
        if not isinstance(e, dict):
            raise FormatError(f"manifest: {sw} is not an object")
        dt = _need(e, "dtype", str, sw)
        if dt not in sio.DTYPES:
            raise FormatError(f"manifest: {sw}.dtype {dt[:20]!r} is not supported")
        shp = _need(e, "shape", list, sw)
        if len(shp) > sio.MAX_RANK or any(type(s) is not int or s < 0 for s in shp):
            raise FormatError(f"manifest: {sw}.shape is not a list of natural numbers")
        crc = _need(e, "crc32", str, sw)
        if not re.fullmatch(r"[0-9a-f]{8}", crc):
            raise FormatError(f"manifest: {sw}.crc32 {crc[:20]!r} is not 8 lowercase hex digits")
        storage[name] = e
        if kind == "global":
            globals_[plane] = name
        elif kind == "meta":
            seen_meta.add(name)
            if dt != "I64" or shp != [T]:
                raise FormatError(f"manifest: {name} must be I64 of shape [{T}]")
        else:
            if li >= len(layers) or role not in layers[li].tensors or j >= n_chunks:
                raise FormatError(f"manifest: stored tensor {name!r} names no layer/role/chunk of this file")
            layers[li].tensors[role].chunks[j].planes[plane] = name
    for flag, name in ((has_tok, "meta.token_ids"), (has_pos, "meta.positions")):
        if flag != (name in seen_meta):
            raise FormatError(f"manifest: {name} is {'missing' if flag else 'stored but not declared'}")

    # Decoded-size guard: refuse before any allocation a chunk whose declared element count the
    # stored payload cannot plausibly produce.
    for lm in layers:
        for ti in lm.tensors.values():
            for j, c in enumerate(ti.chunks):
                numel = c.tokens * ti.shape[1] * ti.shape[2]
                payload = 0
                for n in c.planes.values():
                    sz = sio.DTYPES[storage[n]["dtype"]].itemsize
                    for s in storage[n]["shape"]:
                        sz *= s
                    payload += sz
                if numel > max_elements_per_byte * payload + ELEMENT_ALLOWANCE:
                    raise FormatError(
                        f"layers.{lm.index}.{ti.role} chunk {j} declares {numel} elements but stores only "
                        f"{payload} bytes (more than {max_elements_per_byte} elements per byte): refusing to allocate"
                    )
    return Manifest(raw=m, num_tokens=T, tokens_per_chunk=C, source_dtype=src, layers=layers,
                    storage=storage, globals=globals_)
