"""A minimal, independent KVC 1.0 reader written from formats/SPEC.md alone.

It imports nothing from kvcodec: only the standard library and numpy. It validates a file as SPEC §3
requires and returns the manifest and the stored planes (it does not run codecs). The test suite
(tests/test_format_spec_reader.py) checks that it and kvcodec's reader accept and reject the same
files, with the same error category, and read the same planes -- evidence that the spec is complete
enough to write a reader from.

Usage:
    python formats/kvc_min_reader.py FILE.kvc      # prints the planes, or the rejection
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
import zlib

import numpy as np

DTYPES = {"U8": "u1", "I8": "i1", "U16": "<u2", "I16": "<i2", "U32": "<u4", "I32": "<i4",
          "U64": "<u8", "I64": "<i8", "F16": "<f2", "F32": "<f4", "F64": "<f8"}
ALIGN = 64
KNOWN_FEATURES: set[str] = set()


class Reject(Exception):
    """A rejected file; ``category`` is one of truncated, format, version, checksum, codec."""

    def __init__(self, category: str, msg: str) -> None:
        super().__init__(f"[{category}] {msg}")
        self.category = category


def _fail(cat: str, msg: str):
    raise Reject(cat, msg)


def _hook(pairs):
    d = {}
    for k, v in pairs:
        if k in d:
            _fail("format", f"duplicate key {k!r}")
        d[k] = v
    return d


def _const(name):
    _fail("format", f"JSON constant {name}")


def _float(s):
    v = float(s)
    if not math.isfinite(v):
        _fail("format", "number overflows a double")
    return v


def _depth(text: str) -> int:
    """Deepest nesting of [ and { outside strings (SPEC §3.1 step 3), without recursion."""
    depth = deepest = 0
    in_str = esc = False
    for ch in text:
        if in_str:
            esc, in_str = (False, True) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _json(text: str, what: str):
    if text.count("[") + text.count("{") > 64 and _depth(text) > 64:
        _fail("format", f"{what}: nested deeper than 64")
    dec = json.JSONDecoder(object_pairs_hook=_hook, parse_constant=_const, parse_float=_float)
    try:
        obj, end = dec.raw_decode(text)
    except (ValueError, RecursionError) as e:
        _fail("format", f"{what}: bad JSON ({str(e)[:60]})")
    if text[end:].strip(" "):
        _fail("format", f"{what}: trailing data")
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        _fail("format", f"{what}: lone surrogate")
    except (ValueError, RecursionError):
        _fail("format", f"{what}: nested too deeply")
    return obj


def _is_int(v) -> bool:
    return type(v) is int


def _nat(v, lo=0, hi=2**31) -> bool:
    return _is_int(v) and lo <= v <= hi


def _crc(b) -> str:
    return f"{zlib.crc32(b) & 0xFFFFFFFF:08x}"


NAME = re.compile(r"global\.[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}|meta\.token_ids|meta\.positions|"
                  r"layers\.(0|[1-9][0-9]{0,5})\.(k|v|kv)\.(c(0|[1-9][0-9]{0,9})\.)?[A-Za-z0-9_]{1,64}")


def _order_key(name: str, chunked: bool):
    m = NAME.fullmatch(name)
    if not m or (name.startswith("layers.") and (m.group(3) is not None) != chunked):
        _fail("format", f"bad tensor name {name!r}")
    if name.startswith("global."):
        return (0, 0, 0, 0, name[7:])
    if name.startswith("meta."):
        return (1, 0 if name == "meta.token_ids" else 1, 0, 0, "")
    return (2, int(m.group(1)), "k v kv".split().index(m.group(2)), int(m.group(4) or 0), name.rsplit(".", 1)[1])


def read(data: bytes, known_codecs: set[str] | None = None):
    """Validate ``data`` per SPEC §3 and return ``(manifest, {name: array})``; raise :class:`Reject`."""
    size = len(data)
    # §3.1 steps 1-2
    if size < 8:
        _fail("truncated", "under 8 bytes")
    (n,) = struct.unpack("<Q", data[:8])
    if n > 100_000_000:
        _fail("format", "header too long")
    if 8 + n > size:
        _fail("truncated", "header past the end")
    # step 3
    raw = data[8 : 8 + n]
    if raw[:1] != b"{":
        _fail("format", "header does not start with {")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        _fail("format", "header not UTF-8")
    header = _json(text, "header")
    if not isinstance(header, dict):
        _fail("format", "header not an object")
    # step 4
    meta = header.pop("__metadata__", None)
    if not isinstance(meta, dict):
        _fail("format", "no __metadata__ object")
    if any(not isinstance(v, str) for v in meta.values()):
        _fail("format", "non-string metadata")
    # step 5 (§2)
    if meta.get("format") != "kvc":
        _fail("format", "format is not kvc")
    ver = meta.get("format_version")
    m = re.fullmatch(r"(0|[1-9][0-9]{0,3})\.(0|[1-9][0-9]{0,3})", ver or "")
    if not m:
        _fail("version", "bad format_version")
    if int(m.group(1)) != 1:
        _fail("version", "unknown major")
    # step 6
    entries = {}
    for name, e in header.items():
        if not isinstance(e, dict) or set(e) != {"dtype", "shape", "data_offsets"}:
            _fail("format", f"{name}: bad entry")
        if e["dtype"] not in DTYPES:
            _fail("format", f"{name}: dtype")
        shape, offs = e["shape"], e["data_offsets"]
        if not isinstance(shape, list) or len(shape) > 8 or not all(_nat(s, 0, 2**62) for s in shape):
            _fail("format", f"{name}: shape")
        if not isinstance(offs, list) or len(offs) != 2 or not all(_nat(o, 0, 2**62) for o in offs) or offs[1] < offs[0]:
            _fail("format", f"{name}: offsets")
        nbytes = np.dtype(DTYPES[e["dtype"]]).itemsize
        for s in shape:
            nbytes *= s
            if nbytes > 2**62:
                _fail("format", f"{name}: size overflow")
        if nbytes != offs[1] - offs[0]:
            _fail("format", f"{name}: size != span")
        entries[name] = (e["dtype"], tuple(shape), offs[0], offs[1])
    # step 7
    pos = 0
    for name, (_, _, a, b) in sorted(entries.items(), key=lambda kv: (kv[1][2], kv[1][3], kv[0])):
        if a != pos:
            _fail("format", "overlap or hole")
        pos = b
    if 8 + n + pos > size:
        _fail("truncated", "data past the end")
    if 8 + n + pos < size:
        _fail("format", "trailing bytes")
    # step 8: manifest checksum, manifest, features, codec
    text, crc = meta.get("manifest"), meta.get("manifest_crc32")
    if text is None or crc is None:
        _fail("format", "no manifest")
    if _crc(text.encode("utf-8", "surrogatepass")) != crc:
        _fail("checksum", "manifest CRC")
    man = _json(text, "manifest")
    if not isinstance(man, dict):
        _fail("format", "manifest not an object")
    feats = man.get("required_features")
    if not isinstance(feats, list) or not all(isinstance(f, str) for f in feats):
        _fail("format", "required_features")
    if any(f not in KNOWN_FEATURES for f in feats):
        _fail("version", "unknown required feature")
    _check_manifest(man)
    if known_codecs is not None and man["codec"]["id"] not in known_codecs:
        _fail("codec", "unknown codec id")
    # step 9: canonical layout
    if (8 + n) % ALIGN:
        _fail("format", "data section unaligned")
    st = man["storage"]["tensors"]
    chunked = man["chunking"]["tokens_per_chunk"] > 0
    pos, k, want = 0, 0, {}
    for name in sorted(st, key=lambda x: _order_key(x, chunked)):
        if pos % ALIGN:
            gap = ALIGN - pos % ALIGN
            want[f"pad.{k}"] = ("U8", (gap,), pos, pos + gap)
            k, pos = k + 1, pos + gap
        size_b = np.dtype(DTYPES[st[name]["dtype"]]).itemsize * math.prod(st[name]["shape"])
        want[name] = (st[name]["dtype"], tuple(st[name]["shape"]), pos, pos + size_b)
        pos += size_b
    if want != entries:
        _fail("format", "header differs from the canonical layout")
    # then: read, check CRCs and padding
    base = 8 + n
    for name, (_, _, a, b) in entries.items():
        if name.startswith("pad.") and any(data[base + a : base + b]):
            _fail("format", "non-zero padding")
    planes = {}
    for name, (dt, shape, a, b) in sorted(entries.items(), key=lambda kv: kv[1][2:]):
        buf = data[base + a : base + b]
        if name.startswith("pad."):
            continue
        if _crc(buf) != st[name]["crc32"]:
            _fail("checksum", f"{name}: CRC")
        planes[name] = np.frombuffer(buf, dtype=DTYPES[dt]).reshape(shape) if b > a else np.zeros(shape, DTYPES[dt])
    return man, planes


def _check_manifest(m: dict) -> None:
    """SPEC §4 and §7, field by field."""
    def need(d, k, typ):
        if not isinstance(d, dict) or k not in d:
            _fail("format", f"manifest: missing {k}")
        v = d[k]
        if typ is int:
            ok = _is_int(v)
        else:
            ok = isinstance(v, typ) and not (typ is not bool and isinstance(v, bool))
        if not ok:
            _fail("format", f"manifest: {k} type")
        return v

    need(m, "producer", dict)
    model = need(m, "model", dict)
    for k in ("model_id", "revision", "config_hash", "tokenizer"):
        need(model, k, str)
    if need(m, "source_dtype", str) not in ("float32", "float16", "bfloat16"):
        _fail("format", "source_dtype")
    rope = need(m, "rope", dict)
    need(rope, "applied", bool)
    need(rope, "params", dict)
    T = need(m, "num_tokens", int)
    has_tok, has_pos = need(m, "has_token_ids", bool), need(m, "has_positions", bool)
    C = need(need(m, "chunking", dict), "tokens_per_chunk", int)
    if not (_nat(T) and _nat(C)):
        _fail("format", "num_tokens / tokens_per_chunk range")
    need(need(m, "codec", dict), "id", str)
    storage = need(m, "storage", dict)
    if need(storage, "alignment", int) != 64 or need(storage, "checksum", str) != "crc32":
        _fail("format", "storage alignment/checksum")
    st = need(storage, "tensors", dict)
    layers = need(m, "layers", list)
    if len(layers) > 100_000:
        _fail("format", "too many layers")
    nchunks = 1 if C == 0 else -(-T // C)
    declared = {}  # (layer, role, chunk) -> tokens * heads * dim
    for i, L in enumerate(layers):
        kind = need(L, "kind", str)
        if kind not in ("full", "sliding", "mla"):
            _fail("format", "kind")
        w = need(L, "window", int)
        if not _nat(w) or (kind == "sliding") != (w > 0):
            _fail("format", "window")
        H = need(L, "kv_heads", int)
        if not _nat(H, 1):
            _fail("format", "kv_heads")
        if kind == "mla":
            dims = {"kv": need(L, "latent_dim", int)}
            if H != 1:
                _fail("format", "mla heads")
        else:
            dims = {"k": need(L, "head_dim_k", int), "v": need(L, "head_dim_v", int)}
        if not all(_nat(d, 1) for d in dims.values()):
            _fail("format", "head dims")
        tens = need(L, "tensors", dict)
        if set(tens) != set(dims):
            _fail("format", "roles")
        for role, t in tens.items():
            if need(t, "shape", list) != [T, H, dims[role]]:
                _fail("format", "tensor shape")
            chunks = need(t, "chunks", list)
            if len(chunks) != nchunks:
                _fail("format", "chunk count")
            for j, c in enumerate(chunks):
                want = T if C == 0 else min(C, T - j * C)
                if need(c, "tokens", int) != want:
                    _fail("format", "chunk tokens")
                need(c, "params", dict)
                declared[(i, role, j)] = want * H * dims[role]
    payload: dict = {}
    for name, e in st.items():
        _order_key(name, C > 0)  # naming rule
        if need(e, "dtype", str) not in DTYPES:
            _fail("format", "storage dtype")
        shape = need(e, "shape", list)
        if len(shape) > 8 or not all(_is_int(s) and s >= 0 for s in shape):
            _fail("format", "storage shape")
        if not re.fullmatch(r"[0-9a-f]{8}", need(e, "crc32", str)):
            _fail("format", "storage crc32")
        if name.startswith("meta."):
            if e["dtype"] != "I64" or shape != [T]:
                _fail("format", "meta tensor")
        elif name.startswith("layers."):
            g = NAME.fullmatch(name)
            key = (int(g.group(1)), g.group(2), int(g.group(4) or 0))
            if key not in declared:
                _fail("format", "plane of an undeclared tensor")
            payload[key] = payload.get(key, 0) + np.dtype(DTYPES[e["dtype"]]).itemsize * math.prod(shape)
    if has_tok != ("meta.token_ids" in st) or has_pos != ("meta.positions" in st):
        _fail("format", "meta flags")
    for key, numel in declared.items():  # §7 decoded-size bound
        if numel > 4096 * payload.get(key, 0) + 65536:
            _fail("format", "declared size beyond the payload")


if __name__ == "__main__":
    with open(sys.argv[1], "rb") as f:
        try:
            man, planes = read(f.read())
        except Reject as e:
            print(f"rejected: {e}")
            sys.exit(1)
    print(f"codec {man['codec']}, {len(man['layers'])} layers, {man['num_tokens']} tokens")
    for k, v in planes.items():
        print(f"  {k:32s} {str(v.dtype):8s} {list(v.shape)}")
