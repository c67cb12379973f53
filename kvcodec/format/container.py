"""KVC container: write a prepared encode call into a KVC file and read its planes back, strictly
and lazily.

A KVC file is a valid safetensors file whose ``__metadata__`` holds a format key, a
``MAJOR.MINOR`` version, a canonical JSON manifest and the CRC-32 of that manifest
(formats/SPEC.md). The writer is deterministic (same input and config -> same bytes), aligns every
tensor to 64 bytes and writes files atomically. The reader validates the whole header and manifest
before it reads any tensor data and checks the CRC-32 of every tensor it reads. The container
knows nothing of codecs or devices: it stores and returns planes (:mod:`kvcodec.planes`); the
decoding reader (:mod:`kvcodec.decoding`, ``kvcodec.open``) turns them into values.

Example:
    >>> import torch, kvcodec
    >>> from kvcodec import format as kvf
    >>> cache = kvcodec.KVCache.from_tensors([(torch.ones(4, 2, 8), torch.zeros(4, 2, 8))] * 3)
    >>> blob = kvcodec.get_codec("raw").encode(cache)
    >>> with kvf.open_container(blob) as r:
    ...     r.num_layers, r.read_layer_planes(1)["k"][0][1].planes["bits"].shape
    (3, (4, 2, 8))
"""

from __future__ import annotations

import bisect
import json
import os
import tempfile
import zlib
from typing import TYPE_CHECKING, Any, BinaryIO, Iterable, Iterator, Sequence

import numpy as np
import torch

from .._version import __version__
from ..cache import DTYPE_NAMES, SOURCE_DTYPES, KVCache, LayerInfo
from ..planes import EncodedTensor, TensorContext
from ..errors import ConfigError, FormatError, InputError, KVCodecError, TruncatedError
from . import manifest as mf
from . import safetensors_io as sio
from .atomic import atomic_write_chunks
from .manifest import FORMAT_KEY, FORMAT_VERSION, canonical_json, tensor_name

if TYPE_CHECKING:
    from ..codec import Codec, EncodePlan

__all__ = [
    "FORMAT_KEY",
    "FORMAT_VERSION",
    "ContainerReader",
    "crc32_hex",
    "open_container",
    "tensor_name",
    "write_cache",
    "write_file",
]

_COPY_CHUNK = 1 << 16  # small: the copy buffer counts against streaming peak memory


def crc32_hex(data: bytes | memoryview) -> str:
    """CRC-32 (ISO-HDLC / zlib polynomial 0x04C11DB7, reflected) as 8 lowercase hex digits.

    >>> crc32_hex(b"123456789")
    'cbf43926'
    """
    return f"{zlib.crc32(data) & 0xFFFFFFFF:08x}"


# ====================================================================== writer
class _Plane:
    """One encoded plane: its stored name, dtype, shape, little-endian bytes and CRC-32."""

    __slots__ = ("name", "dtype", "shape", "nbytes", "crc", "data")

    def __init__(self, name: str, arr: np.ndarray) -> None:
        self.name = name
        self.dtype = sio.dtype_name(arr.dtype)
        le = np.ascontiguousarray(arr).astype(sio.DTYPES[self.dtype], copy=False)
        self.shape = tuple(int(s) for s in le.shape)
        self.data: bytes | None = le.tobytes()
        self.nbytes = len(self.data)
        self.crc = crc32_hex(self.data)


def _json_params(params: Any, where: str) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: codec params must be a dict, got {type(params).__name__}")
    try:
        return json.loads(canonical_json(params))
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: codec params are not finite JSON: {e}") from None


def _encode_planes(plan: "EncodePlan",
                   params_out: dict[tuple[int, str], list[dict[str, Any]]]) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(stored name, array)`` in canonical order, encoding one tensor chunk at a time."""
    codec, cache, globals_, tokens_per_chunk = plan.codec, plan.cache, plan.globals, plan.tokens_per_chunk
    chunked = tokens_per_chunk > 0
    for g in sorted(globals_):
        if not mf.GLOBAL_RE.fullmatch(g):
            raise ConfigError(f"codec {codec.codec_id!r}: global plane name {g!r} breaks the naming rule")
        yield f"global.{g}", globals_[g]
    if cache.token_ids is not None:
        yield "meta.token_ids", cache.token_ids.detach().cpu().to(torch.int64).numpy()
    if cache.positions is not None:
        yield "meta.positions", cache.positions.detach().cpu().to(torch.int64).numpy()
    T = cache.num_tokens

    def jobs() -> Iterator[tuple[int, str, int, torch.Tensor, TensorContext]]:
        for i, role, t in cache.tensors():
            params_out[(i, role)] = []  # in tensor order, also for a tensor of no tokens
            for j, s in enumerate([0] if not chunked else range(0, T, tokens_per_chunk)):
                x = t if not chunked else t[s : s + tokens_per_chunk]
                x = x.detach().cpu().contiguous()
                yield i, role, j, x, TensorContext(layer=i, role=role, shape=tuple(x.shape), dtype=x.dtype,
                                                   layer_kind=cache.layer_info[i].kind, globals=globals_,
                                                   state=plan.state, start=s)

    for i, role, j, x, enc in _encoded(codec, jobs(), plan.encode_threads):
        params_out[(i, role)].append({"tokens": int(x.shape[0]),
                                      "params": _json_params(enc.params, f"layers.{i}.{role}")})
        for p in sorted(enc.planes):
            if not mf.PLANE_RE.fullmatch(p):
                raise ConfigError(f"codec {codec.codec_id!r}: plane name {p!r} must match [A-Za-z0-9_]{{1,64}}")
            arr = enc.planes[p]
            if not isinstance(arr, np.ndarray):
                raise ConfigError(f"codec {codec.codec_id!r}: plane {p!r} is {type(arr).__name__}, not a numpy array")
            yield tensor_name(i, role, p, j if chunked else None), arr


def _encoded(codec: Any, jobs: Iterator[tuple[int, str, int, torch.Tensor, TensorContext]], threads: int,
             ) -> Iterator[tuple[int, str, int, torch.Tensor, Any]]:
    """``(layer, role, chunk, tensor, EncodedTensor)`` for each job, in the jobs' order: coded one
    at a time, or ``threads`` at once (at most that many more ahead of the one yielded, so memory
    stays bounded) where the machine has the CPUs. The native coders release the GIL: on 2 cores
    kvc's presets encode 1536-token caches of both models in 0.63-0.74x the one-thread time
    (eval/results/encode_threads.md); with the calibration search's settings (magnitude contexts,
    reconstruction offsets) on a Qwen3-0.6B-shaped cache they gained nothing
    (eval/results/kvc_calib_time.md), for reasons not yet measured."""
    n = min(int(threads), os.cpu_count() or 1)
    if n <= 1:
        for i, role, j, x, ctx in jobs:
            yield i, role, j, x, codec.encode_tensor(x, ctx)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(n, thread_name_prefix="kvcodec-encode") as pool:
        ahead: deque = deque()
        try:
            for job in jobs:
                ahead.append((job, pool.submit(codec.encode_tensor, job[3], job[4])))
                if len(ahead) > n:
                    (i, role, j, x, _), fut = ahead.popleft()
                    yield i, role, j, x, fut.result()
            while ahead:
                (i, role, j, x, _), fut = ahead.popleft()
                yield i, role, j, x, fut.result()
        finally:  # an error (or a consumer that stops): nothing more starts, what runs ends
            for _, fut in ahead:
                fut.cancel()


def build_manifest(config: dict[str, Any], cache: KVCache, params: dict[tuple[int, str], list[dict[str, Any]]],
                   storage: dict[str, dict[str, Any]], tokens_per_chunk: int,
                   preset: str | None = None) -> dict[str, Any]:
    """The manifest of ``cache`` coded with the codec ``config`` (SPEC §4); ``preset``, the name the
    codec was chosen by, is recorded with the producer (informative: no reader depends on it)."""
    layers = []
    for i, layer in enumerate(cache.layers):
        info = cache.layer_info[i]
        kind = info.kind if info.kind in mf.LAYER_KINDS else "full"
        lm: dict[str, Any] = {"kind": kind, "window": int(info.window) if kind == "sliding" else 0}
        if "kv" in layer:
            lm.update(kv_heads=int(layer["kv"].shape[1]), latent_dim=int(layer["kv"].shape[2]))
        else:
            lm.update(kv_heads=int(layer["k"].shape[1]), head_dim_k=int(layer["k"].shape[2]),
                      head_dim_v=int(layer["v"].shape[2]))
        lm["tensors"] = {r: {"shape": [int(s) for s in t.shape], "chunks": params[(i, r)]} for r, t in layer.items()}
        layers.append(lm)
    return {
        "producer": {"name": "kvcodec", "version": __version__, **({"preset": preset} if preset else {})},
        "model": cache.model.to_dict(),
        "source_dtype": DTYPE_NAMES[cache.dtype],
        "rope": {"applied": bool(cache.rope_applied), "params": dict(cache.rope)},
        "num_tokens": cache.num_tokens,
        "has_token_ids": cache.token_ids is not None,
        "has_positions": cache.positions is not None,
        "chunking": {"tokens_per_chunk": int(tokens_per_chunk)},
        "codec": config,
        "layers": layers,
        "storage": {"alignment": sio.ALIGNMENT, "checksum": mf.CHECKSUM, "tensors": storage},
        "required_features": [],
    }


def _check_cache(cache: KVCache, tokens_per_chunk: int) -> None:
    if type(tokens_per_chunk) is not int or tokens_per_chunk < 0:
        raise ConfigError(f"tokens_per_chunk must be an integer >= 0, got {tokens_per_chunk!r}")
    for i, info in enumerate(cache.layer_info):
        if info.kind not in mf.LAYER_KINDS:
            raise InputError(f"layer {i}: kind {info.kind!r} is not one of {mf.LAYER_KINDS}")
        if (info.kind == "sliding") != (info.window > 0):
            raise InputError(f"layer {i}: a window > 0 is required exactly for sliding layers")
        if (info.kind == "mla") != ("kv" in cache.layers[i]):
            raise InputError(f"layer {i}: kind {info.kind!r} does not match its tensors {sorted(cache.layers[i])}")
    if cache.num_layers > mf.MAX_LAYERS:
        raise InputError(f"{cache.num_layers} layers exceeds the format limit of {mf.MAX_LAYERS}")


def _assemble(plan: "EncodePlan", spool: BinaryIO | None) -> tuple[bytes, list[sio.Entry], list[_Plane]]:
    """Encode everything. Plane bytes go to ``spool`` (each at its aligned position) when given,
    else they are kept in memory. Returns the header bytes, the layout and the planes."""
    codec, cache, tokens_per_chunk = plan.codec, plan.cache, plan.tokens_per_chunk
    _check_cache(cache, tokens_per_chunk)
    params: dict[tuple[int, str], list[dict[str, Any]]] = {}
    planes: list[_Plane] = []
    pos = 0
    for name, arr in _encode_planes(plan, params):
        p = _Plane(name, arr)
        if spool is not None:  # same bytes and padding as plan_layout, written as we go
            assert p.data is not None
            gap = -pos % sio.ALIGNMENT
            spool.write(b"\0" * gap)
            spool.write(p.data)
            pos += gap + p.nbytes
            p.data = None
        planes.append(p)
    storage = {p.name: {"dtype": p.dtype, "shape": list(p.shape), "crc32": p.crc} for p in planes}
    manifest = build_manifest(plan.config, cache, params, storage, tokens_per_chunk, getattr(codec, "preset", None))
    try:
        text = canonical_json(manifest)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"manifest is not finite JSON (codec {codec.codec_id!r} config or params): {e}") from None
    layout = sio.plan_layout((p.name, p.dtype, p.shape) for p in planes)
    meta = {
        "format": FORMAT_KEY,
        "format_version": f"{FORMAT_VERSION[0]}.{FORMAT_VERSION[1]}",
        "manifest": text,
        "manifest_crc32": crc32_hex(text.encode("utf-8")),
    }
    return sio.build_header(layout, meta), layout, planes


def _memory_chunks(header: bytes, layout: list[sio.Entry], planes: list[_Plane]) -> Iterator[bytes]:
    yield header
    by_name = {p.name: p for p in planes}
    for e in layout:
        if e.name in by_name:
            d = by_name[e.name].data
            assert d is not None
            yield d
        else:
            yield b"\0" * e.nbytes


def write_cache(plan: "EncodePlan", path: str | os.PathLike[str] | None = None) -> bytes:
    """Encode a prepared call (:meth:`kvcodec.Codec.plan`) into KVC bytes; if ``path`` is given,
    also write them there atomically. Used by :meth:`kvcodec.Codec.encode`.

    For caches too large to hold their encoding twice in memory, use :func:`write_file`.
    """
    header, layout, planes = _assemble(plan, spool=None)
    data = b"".join(_memory_chunks(header, layout, planes))
    if path is not None:
        atomic_write_chunks(path, [data])
    return data


def write_file(
    codec: "Codec",
    cache: KVCache,
    dest: str | os.PathLike[str] | BinaryIO,
    tokens_per_chunk: int = 0,
) -> int:
    """Stream-encode ``cache`` into ``dest`` (a path, written atomically, or a writable binary
    file object); return the number of bytes written.

    Memory stays near one tensor's encoding (a few, for a codec that codes them on threads:
    ``Codec.encode_threads``): planes are spooled to a temporary file beside
    ``dest`` as each layer is coded, then copied behind the header (whose offsets and checksums
    are only known at the end). The bytes are identical to :func:`write_cache`'s.

    Example:
        >>> import os, tempfile, torch, kvcodec
        >>> from kvcodec.format import write_file
        >>> c = kvcodec.KVCache.from_tensors([(torch.ones(2, 1, 4), torch.ones(2, 1, 4))])
        >>> p = os.path.join(tempfile.mkdtemp(), "c.kvc")
        >>> write_file(kvcodec.get_codec("raw"), c, p) == os.path.getsize(p)
        True
    """
    with codec.plan(cache, tokens_per_chunk) as plan:  # the one preparation step of every encode
        return _write_plan(plan, dest)


def _write_plan(plan: "EncodePlan", dest: str | os.PathLike[str] | BinaryIO) -> int:
    spool_dir = os.path.dirname(os.path.abspath(os.fspath(dest))) if isinstance(dest, (str, os.PathLike)) else None
    try:
        spool_file = tempfile.TemporaryFile(dir=spool_dir, prefix=".kvc-spool-")
    except OSError as e:
        raise InputError(f"cannot write {os.fspath(dest)}: {e.strerror or e}") from None
    with spool_file as spool:
        header, layout, planes = _assemble(plan, spool=spool)
        spool_size = spool.tell()

        def chunks() -> Iterator[bytes]:
            yield header
            spool.seek(0)
            left = spool_size
            while left:
                b = spool.read(min(_COPY_CHUNK, left))
                if not b:
                    raise TruncatedError("spool file ended early")
                left -= len(b)
                yield b

        if isinstance(dest, (str, os.PathLike)):
            return atomic_write_chunks(dest, chunks())
        n = 0
        for c in chunks():
            dest.write(c)
            n += len(c)
        return n


# ====================================================================== reader
class ContainerReader:
    """A validated KVC file opened for lazy reading of its planes. Create it with
    :func:`open_container`; :func:`kvcodec.open` returns the decoding reader built on it.

    Opening reads only the header; it validates the header, the manifest (and its checksum), the
    tensor naming, the canonical layout and the decoded-size limits. Each ``read_*`` call then reads
    only the bytes it needs and checks their CRC-32. It knows nothing of codecs or devices: it
    returns :class:`~kvcodec.planes.EncodedTensor` planes and their params.

    Attributes:
        manifest: the manifest as a dict (validated).
        file_size: total bytes.
        version: ``(major, minor)`` of the file.

    Example:
        >>> import torch, kvcodec
        >>> c = kvcodec.KVCache.from_tensors([(torch.ones(3, 1, 4), torch.ones(3, 1, 4))] * 4)
        >>> r = kvcodec.format.open_container(kvcodec.get_codec("fp16").encode(c))
        >>> r.manifest["codec"]["id"], r.read_plane("layers.1.k.bits").shape
        ('fp16', (3, 1, 4))
    """

    def __init__(self, source: sio.Source, max_elements_per_byte: int = mf.MAX_ELEMENTS_PER_BYTE) -> None:
        self._src = source
        try:
            h = sio.read_raw_header(source)
            self.version = mf.check_version(h.metadata)
            entries = sio.validate_entries(h)
            text = h.metadata.get("manifest")
            crc = h.metadata.get("manifest_crc32")
            if text is None or crc is None:
                raise FormatError("__metadata__ lacks 'manifest' or 'manifest_crc32'")
            if crc32_hex(text.encode("utf-8", "surrogatepass")) != crc:
                raise _checksum_error(f"manifest CRC-32 mismatch (stored {crc[:16]!r})")
            raw = sio.strict_json_loads(text, "manifest")
            self._m = mf.validate(raw, max_elements_per_byte)
            self._check_layout(entries, h.data_start)
        except BaseException:
            source.close()
            raise
        self._data_start = h.data_start
        self.header_len = h.header_len
        self.file_size = source.size
        self.metadata = h.metadata
        self.manifest: dict[str, Any] = raw
        self._entries = {e.name: e for e in entries}
        self._pads = [e for e in entries if e.name.startswith(sio.PAD_PREFIX)]  # in offset order
        self._pad_starts = [e.start for e in self._pads]
        self._globals: dict[str, np.ndarray] | None = None
        self.dtype = SOURCE_DTYPES[self._m.source_dtype]

    # ------------------------------------------------------------------ validation
    def _check_layout(self, entries: list[sio.Entry], data_start: int) -> None:
        if data_start % sio.ALIGNMENT:
            raise FormatError(f"data section starts at byte {data_start}, not a multiple of {sio.ALIGNMENT}")
        st = self._m.storage
        chunked = self._m.chunked
        names = sorted(st, key=lambda n: mf.canonical_key(n, chunked))
        want = sio.plan_layout((n, st[n]["dtype"], tuple(st[n]["shape"])) for n in names)
        got = {e.name: e for e in entries}
        if len(got) != len(want):
            extra = sorted(set(got) - {e.name for e in want})[:3]
            missing = sorted({e.name for e in want} - set(got))[:3]
            raise FormatError(
                f"header holds {len(got)} tensors but the manifest's canonical layout has {len(want)}"
                f" (unexpected: {extra}, missing: {missing})"
            )
        for w in want:
            g = got.get(w.name)
            if g is None:
                raise FormatError(f"tensor {w.name!r} of the manifest is not in the header")
            if (g.dtype, g.shape, g.start, g.end) != (w.dtype, w.shape, w.start, w.end):
                raise FormatError(
                    f"tensor {w.name!r}: header says {g.dtype}{list(g.shape)} at [{g.start},{g.end}], "
                    f"canonical layout from the manifest gives {w.dtype}{list(w.shape)} at [{w.start},{w.end}]"
                )

    # ------------------------------------------------------------------ properties
    @property
    def num_layers(self) -> int:
        return len(self._m.layers)

    @property
    def num_tokens(self) -> int:
        return self._m.num_tokens

    @property
    def tokens_per_chunk(self) -> int:
        """Tokens per chunk (0: the file is not chunked, one chunk per tensor)."""
        return self._m.tokens_per_chunk

    @property
    def num_chunks(self) -> int:
        return len(self._m.layers[0].tensors[next(iter(self._m.layers[0].tensors))].chunks) if self._m.layers else 0

    @property
    def num_elements(self) -> int:
        return sum(t.shape[0] * t.shape[1] * t.shape[2] for lm in self._m.layers for t in lm.tensors.values())

    def tensor_names(self) -> list[str]:
        """Stored tensor names in file order (padding excluded)."""
        return [e.name for e in sorted(self._entries.values(), key=lambda e: (e.start, e.end))
                if not e.name.startswith(sio.PAD_PREFIX)]

    def layer_span(self, i: int) -> tuple[int, int]:
        """Absolute ``[start, end)`` byte span of layer ``i``'s planes (padding inside included)."""
        es = [self._entries[n] for t in self._layer(i).tensors.values() for c in t.chunks for n in c.planes.values()]
        if not es:
            return (self._data_start, self._data_start)
        return (self._data_start + min(e.start for e in es), self._data_start + max(e.end for e in es))

    def layer_nbytes(self, i: int) -> int:
        """Stored bytes of layer ``i`` (its planes, without padding)."""
        return sum(self._entries[n].nbytes for t in self._layer(i).tensors.values() for c in t.chunks
                   for n in c.planes.values())

    def read_plane_nbytes(self, name: str) -> int:
        """Stored size in bytes of one tensor (from the validated header; nothing is read)."""
        if name not in self._entries:
            raise InputError(f"no stored tensor {name!r} in this file")
        return self._entries[name].nbytes

    def layer_info(self, i: int) -> LayerInfo:
        lm = self._layer(i)
        return LayerInfo(kind=lm.kind, window=lm.window)

    def _layer(self, i: int) -> mf.LayerManifest:
        if type(i) is not int or not 0 <= i < len(self._m.layers):
            raise InputError(f"layer {i!r} out of range: the file has {len(self._m.layers)} layers")
        return self._m.layers[i]

    # ------------------------------------------------------------------ raw planes
    def _read_span(self, start: int, end: int) -> bytes | memoryview:
        return self._src.read(start, end - start)

    def _plane_from(self, buf: bytes | memoryview, base: int, name: str) -> np.ndarray:
        e = self._entries[name]
        mv = memoryview(buf)[e.start + self._data_start - base : e.end + self._data_start - base]
        want = self._m.storage[name]["crc32"]
        if crc32_hex(mv) != want:
            raise _checksum_error(f"tensor {name!r}: CRC-32 mismatch (stored {want})")
        dt = sio.DTYPES[e.dtype]
        if e.nbytes == 0:
            a = np.zeros(e.shape, dtype=dt)
        else:
            a = np.frombuffer(mv, dtype=dt).reshape(e.shape)
        a.flags.writeable = False
        return a

    def _check_pads(self, buf: bytes | memoryview, base: int, start: int, end: int) -> None:
        """Check that every padding tensor inside the absolute span ``[start, end)`` is zero."""
        lo = bisect.bisect_left(self._pad_starts, start - self._data_start)
        hi = bisect.bisect_left(self._pad_starts, end - self._data_start)
        for e in self._pads[lo:hi]:  # only the pads inside the span: O(log n) per layer read
            a = e.start + self._data_start
            if any(memoryview(buf)[a - base : a - base + e.nbytes]):
                raise FormatError(f"padding tensor {e.name!r} holds non-zero bytes")

    def check_padding(self) -> None:
        """Read every padding tensor (at most 63 bytes each) and check that it is all zero."""
        for e in self._pads:
            a = self._data_start + e.start
            if any(bytes(self._read_span(a, a + e.nbytes))):
                raise FormatError(f"padding tensor {e.name!r} holds non-zero bytes")

    def read_plane(self, name: str) -> np.ndarray:
        """One stored tensor by name, checksum-verified, read-only."""
        if name not in self._entries or name.startswith(sio.PAD_PREFIX):
            raise InputError(f"no stored tensor {name!r} in this file")
        e = self._entries[name]
        a, b = self._data_start + e.start, self._data_start + e.end
        return self._plane_from(self._read_span(a, b), a, name)

    def globals(self) -> dict[str, np.ndarray]:
        """The file-level planes (``global.*``), read and verified once."""
        if self._globals is None:
            self._globals = {p: self.read_plane(n) for p, n in self._m.globals.items()}
        return self._globals

    def token_ids(self) -> torch.Tensor | None:
        if "meta.token_ids" not in self._m.storage:
            return None
        return torch.from_numpy(self.read_plane("meta.token_ids").copy())

    def positions(self) -> torch.Tensor | None:
        if "meta.positions" not in self._m.storage:
            return None
        return torch.from_numpy(self.read_plane("meta.positions").copy())

    # ------------------------------------------------------------------ encoded tensors
    def chunk_context(self, i: int, role: str, j: int) -> TensorContext:
        """The :class:`~kvcodec.planes.TensorContext` of chunk ``j`` of tensor ``role`` of layer ``i``."""
        lm = self._layer(i)
        ti = lm.tensors[role]
        c = ti.chunks[j]
        return TensorContext(layer=lm.index, role=ti.role, shape=(c.tokens, ti.shape[1], ti.shape[2]),
                             dtype=self.dtype, layer_kind=lm.kind, globals=self.globals())

    def chunk_label(self, i: int, role: str, j: int) -> str:
        """``layers.<i>.<role>`` (and `` chunk <j>`` in a chunked file), for messages."""
        return f"layers.{i}.{role}" + (f" chunk {j}" if self._m.chunked else "")

    def read_layer_planes(self, i: int, chunks: Sequence[int] | range | None = None
                          ) -> dict[str, list[tuple[int, EncodedTensor]]]:
        """The encoded chunks of layer ``i`` (optionally only some): ``{role: [(chunk index,
        EncodedTensor), ...]}``. Reads only that layer's bytes (one read when every chunk is
        wanted, whose padding is checked too) and verifies every CRC-32."""
        lm = self._layer(i)
        roles = list(lm.tensors.values())
        n_chunks = len(roles[0].chunks)
        sel = list(range(n_chunks)) if chunks is None else list(chunks)
        for j in sel:
            if type(j) is not int or not 0 <= j < n_chunks:
                raise InputError(f"chunk {j!r} out of range: layer {i} has {n_chunks} chunks")
        whole = chunks is None or sel == list(range(n_chunks))
        if whole:
            start, end = self.layer_span(i)
            buf = self._read_span(start, end)
            self._check_pads(buf, start, start, end)
        out: dict[str, list[tuple[int, EncodedTensor]]] = {}
        for ti in roles:
            out[ti.role] = []
            for j in sel:
                c = ti.chunks[j]
                if whole:
                    planes = {p: self._plane_from(buf, start, n) for p, n in c.planes.items()}
                else:
                    planes = {p: self.read_plane(n) for p, n in c.planes.items()}
                out[ti.role].append((j, EncodedTensor(planes=planes, params=c.params)))
        return out

    def tensor_shape(self, i: int, role: str) -> tuple[int, int, int]:
        """The decoded shape ``[T, H, D]`` of tensor ``role`` of layer ``i``."""
        t = self._layer(i).tensors[role].shape
        return (int(t[0]), int(t[1]), int(t[2]))

    def verify(self) -> dict[str, Any]:
        """Check every CRC-32 and the padding (nothing is decoded). Returns a summary; raises a
        :class:`FormatError` subclass on failure."""
        return self._verify(self.read_layer_planes, decoded=False)

    def _verify(self, check_layer: Any, decoded: bool) -> dict[str, Any]:
        """Padding, the file-level planes, then ``check_layer(i)`` for every layer; the summary."""
        self.check_padding()
        for n in self.tensor_names():
            if not self._is_layer_plane(n):
                self.read_plane(n)
        for i in range(self.num_layers):
            check_layer(i)
        return {"ok": True, "tensors": len(self.tensor_names()), "layers": self.num_layers,
                "bytes": self.file_size, "decoded": decoded}

    def _is_layer_plane(self, n: str) -> bool:
        return n.startswith("layers.")

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._src.close()

    def __enter__(self) -> "ContainerReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _checksum_error(msg: str) -> Exception:
    from ..errors import ChecksumError

    return ChecksumError(msg)


def open_container(src: bytes | bytearray | memoryview | str | os.PathLike[str] | BinaryIO,
                   max_elements_per_byte: int = mf.MAX_ELEMENTS_PER_BYTE) -> ContainerReader:
    """Open a KVC file (path, bytes, or seekable binary file object) for lazy, validated reading of
    its planes. To decode values, use :func:`kvcodec.open`. ``max_elements_per_byte`` lowers the
    decoded-size bound (formats/SPEC.md §7), which bounds the decoding work per input byte.

    Raises:
        TruncatedError, FormatError, VersionError, ChecksumError: the file is damaged, foreign or
        too new.
    """
    return ContainerReader(sio.as_source(src), max_elements_per_byte)
