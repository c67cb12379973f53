"""kvcodec inside LMCache: a serde for LMCache's multiprocess storage (its L2 adapters).

LMCache (>= 0.5.6) stores KV chunks in L2 stores (Redis through ``resp``, files through ``fs``,
Mooncake Store, S3, ...) and can pass each chunk through a *serde* on the way. :func:`register`
adds one named ``"kvcodec"``; an L2 adapter uses it with a ``"serde"`` entry in its config::

    {"type": "resp", "host": "127.0.0.1", "port": 6379,
     "serde": {"type": "kvcodec", "codec": "kvc-near", "num_kv_heads": 8, "head_dim": 128,
               "profile": "/models/llama.profile.safetensors"}}

Registration must happen before LMCache builds its storage manager: start the server with
``kvcodec-lmcache ARGS`` (or ``python -m kvcodec.integrations.lmcache ARGS``), which registers
and then runs ``lmcache`` with ``ARGS`` unchanged.

Serde kwargs:
    codec: a kvcodec preset or codec config (default ``"kvc-near"``).
    num_kv_heads, head_dim: the model's KV geometry (required: LMCache's chunks are
        ``[2, layers, tokens, kv_heads * head_dim]`` and do not say how the last axis splits).
    profile: a calibration profile of the model (``kvcodec calibrate``), for the kvc levels.
    budget_bits: bits per element that every stored chunk takes, headers included (required:
        the *fixed-budget mode*). LMCache 0.5.6 sizes each object before it is serialized
        (``estimate_serialized_size``) and its ``fs`` and ``resp`` adapters load back only
        objects of exactly that size (a shorter one is reported as a miss), so each chunk is
        stored at exactly the budget: kvc codes it at the chosen level, and where that does not
        fit, with coarser steps (a larger KL target with a profile, larger steps without; logged)
        until it does. Pick the budget from the level's measured bits at your chunk size
        (eval/results/lmcache_chunks.md) with some room; a budget far below them costs quality.
    part: code each chunk as a part of a longer sequence, without a sink token or recency ramp
        of its own (default false: every chunk is coded as a whole cache, which keeps the level's
        KL; true takes a fifth fewer bits at 256 tokens but raises the KL 2.5-3x, as the chunk
        that ends the sequence loses its ramp too: :class:`ChunkCoder`).
    max_workers: serde threads (default 1).

What is stored is one *kvcodec chunk frame* (formats/lmcache-frame.md): a 32-byte header (magic
``KVCL``, version, flags, payload length, a digest of the LMCache object key) and a KVC file whose
own header (manifest, checksums: 5-9 % of a 256-token kvc chunk) is zstd-compressed. A chunk
that is damaged, truncated, foreign or stored under another key raises here; LMCache then
reports it as a miss (the prefix is recomputed) and this module logs why. It never yields
wrong tensors: KVC files are checksummed, and shapes and key are checked before anything is
written to LMCache's buffer.
"""

from __future__ import annotations

import hashlib
import logging
import math
import struct
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache import KVCache, ModelIdentity
from ..codec import Codec, get_codec
from ..errors import ConfigError, DependencyError, FormatError, InputError, KVCodecError

log = logging.getLogger(__name__)

SERDE_NAME = "kvcodec"
FRAME_MAGIC = b"KVCL"
FRAME_VERSION = 1
#: magic, version, flags, reserved, payload length, key digest
FRAME_HEADER = struct.Struct("<4sBBHQ16s")
#: flags bit 0: the KVC file's header (its first 8 + N bytes) is stored zstd-compressed, after a
#: 4-byte length (formats/lmcache-frame.md §1.1). At 256-token chunks the header (manifest,
#: per-tensor entries, checksums) is 5-9 % of the file; compressed, about an eighth of that.
FLAG_ZSTD_HEADER = 1
_KNOWN_FLAGS = FLAG_ZSTD_HEADER
#: Largest KVC header a frame may decompress to: SPEC.md's header limit (N <= 100 000 000) + 8.
_MAX_KVC_HEADER = 100_000_008
_ZLEN = struct.Struct("<I")
_KNOWN_KWARGS = ("codec", "num_kv_heads", "head_dim", "profile", "budget_bits", "part", "max_workers")
_COARSEN_TRIES = 12
_BISECT_TRIES = 3


def _frame(flags: int, payload: bytes, key: Any) -> bytes:
    """A frame: the 32-byte header (formats/lmcache-frame.md) and the stored payload."""
    return FRAME_HEADER.pack(FRAME_MAGIC, FRAME_VERSION, flags, 0, len(payload), key_digest(key)) + payload


def _store(kvc: bytes) -> tuple[int, bytes]:
    """``(flags, stored payload)`` of a KVC file: its header zstd-compressed when that is smaller
    (it always is for a real file; a file too short to have a header is stored as it is)."""
    import zstandard

    if len(kvc) < 8:
        return 0, kvc
    head = 8 + int.from_bytes(kvc[:8], "little")
    if head > len(kvc):
        return 0, kvc
    z = zstandard.ZstdCompressor(level=19, write_content_size=True, write_checksum=True).compress(kvc[:head])
    if _ZLEN.size + len(z) >= head:
        return 0, kvc
    return FLAG_ZSTD_HEADER, _ZLEN.pack(len(z)) + z + kvc[head:]


def _unstore(flags: int, stored: memoryview) -> bytes:
    """The KVC file of a stored payload (inverse of :func:`_store`).

    Raises:
        FormatError: the compressed header is truncated, not zstd, larger than SPEC.md allows, or
            not exactly 8 + N bytes.
    """
    if not flags & FLAG_ZSTD_HEADER:
        return bytes(stored)
    import zstandard

    if len(stored) < _ZLEN.size:
        raise FormatError("kvcodec frame: compressed header: the payload is shorter than its 4-byte length")
    (zlen,) = _ZLEN.unpack(stored[: _ZLEN.size])
    if zlen > len(stored) - _ZLEN.size:
        raise FormatError(f"kvcodec frame: compressed header of {zlen} bytes, the payload holds "
                          f"{len(stored) - _ZLEN.size} after its length")
    z = bytes(stored[_ZLEN.size: _ZLEN.size + zlen])
    try:
        params = zstandard.get_frame_parameters(z)
        if params.content_size in (zstandard.CONTENTSIZE_UNKNOWN, zstandard.CONTENTSIZE_ERROR) \
                or not 8 <= params.content_size <= _MAX_KVC_HEADER:
            raise FormatError(f"kvcodec frame: compressed header declares {params.content_size} bytes; "
                              f"8 to {_MAX_KVC_HEADER} with the size stated are allowed")
        head = zstandard.ZstdDecompressor().decompress(z, max_output_size=params.content_size)
    except zstandard.ZstdError as e:
        raise FormatError(f"kvcodec frame: compressed header does not decompress: {e}") from None
    want = 8 + int.from_bytes(head[:8], "little")
    if len(head) != want:
        raise FormatError(f"kvcodec frame: compressed header holds {len(head)} bytes, its length field says {want}")
    return head + bytes(stored[_ZLEN.size + zlen:])


def key_digest(key: Any) -> bytes:
    """The 16-byte digest a frame records of the LMCache ``ObjectKey`` it was stored under.

    BLAKE2b-128 of ``model_name, kv_rank, object_group_id, cache_salt`` (UTF-8 and decimal,
    each followed by a zero byte) and then the raw ``chunk_hash`` bytes; ``None`` gives 16 zero
    bytes (a frame stored without a key).
    """
    if key is None:
        return bytes(16)
    h = hashlib.blake2b(digest_size=16)
    for part in (key.model_name, str(int(key.kv_rank)), str(int(getattr(key, "object_group_id", 0))),
                 getattr(key, "cache_salt", "")):
        h.update(str(part).encode("utf-8") + b"\x00")
    h.update(bytes(key.chunk_hash))
    return h.digest()


def _chunk_shape(shape: Any) -> tuple[int, int, int]:
    """(layers, tokens, hidden) of a ``[2, layers, tokens, hidden]`` chunk, else ConfigError."""
    dims = tuple(int(d) for d in shape)
    if len(dims) != 4 or dims[0] != 2:
        raise ConfigError(f"kvcodec serde: a chunk of shape {list(dims)} is not [2, layers, tokens, hidden] "
                          "(LMCache MemoryFormat KV_2LTD); other layouts (MLA) are not supported yet")
    return dims[1], dims[2], dims[3]


def _elements(shape: Any) -> int:
    return math.prod(int(d) for d in shape)


@dataclass
class ChunkCoder:
    """Codes LMCache chunks ``[2, layers, tokens, kv_heads * head_dim]`` to and from frames.

    The LMCache-independent core of the serde: :meth:`encode` and :meth:`decode_into` work on
    plain tensors and bytes. ``budget_bits > 0`` selects the fixed-budget mode (module docstring).
    ``part`` codes each chunk as a part of a longer sequence (``KVCCodec.part_config``; ``first``
    and ``last`` say whether it starts or ends the sequence): without a sink token and a recency
    ramp per chunk, 256-token chunks take a fifth fewer bits, but where the chunk that ends the
    sequence loses its ramp too, the next-token KL rises 2.5-3x (eval/results/lmcache_chunks.md).
    A serde cannot tell which chunk ends a sequence (LMCache hands it one chunk and its hash), so
    it codes every chunk whole (``part`` off), which keeps the level's KL. A caller that knows
    where the sequence ends gives it as ``query_pos`` (its token count) with ``part``: the
    calibrated encoder then estimates attention from queries there. A caller holding the whole
    prefix does better with :meth:`encode_sequence` (the whole prefix's attention estimates).

    Example:
        >>> import torch
        >>> coder = ChunkCoder("kivi-4-ans", num_kv_heads=2, head_dim=8)
        >>> chunk = torch.randn(2, 3, 16, 16, dtype=torch.float16)
        >>> frame = coder.encode(chunk)
        >>> out = torch.zeros_like(chunk)
        >>> coder.decode_into(frame, out)
        >>> bool((out - chunk).abs().max() < 0.5)
        True
    """

    codec: Any = "kvc-near"
    num_kv_heads: int = 0
    head_dim: int = 0
    profile: str | None = None
    budget_bits: float = 0.0
    model: str = ""
    part: bool = False
    first: bool = False
    last: bool = False
    query_pos: int = 0
    _codec: Codec = field(init=False, repr=False)
    _fallback_sizes: dict = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_dim"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"kvcodec serde needs {name} as a positive int (got {v!r}): LMCache "
                                  "chunks do not say how their last axis splits into heads")
        if not isinstance(self.budget_bits, (int, float)) or isinstance(self.budget_bits, bool) \
                or not 0 <= self.budget_bits <= 32:
            raise ConfigError(f"kvcodec serde budget_bits must be a number in [0, 32] (0 = variable size), "
                              f"got {self.budget_bits!r}")
        self._codec = self._make_codec()

    # ------------------------------------------------------------------ codec choice
    def _config(self) -> dict[str, Any]:
        if isinstance(self.codec, Codec):
            config = dict(self.codec.get_config())
        elif isinstance(self.codec, dict):
            config = dict(self.codec)
        elif isinstance(self.codec, str):
            config = {"id": self.codec}
        else:
            raise ConfigError(f"kvcodec serde codec must be a name or a config dict, got {type(self.codec).__name__}")
        if self.profile:
            config["calibration"] = str(self.profile)
        return config

    def _make_codec(self, part: bool | None = None) -> Codec:
        """The codec the chunks are coded with (as a part of a sequence with ``part``, default
        the coder's own)."""
        codec = get_codec(self._config())
        codec.check_requirements()
        if (self.part if part is None else part) and hasattr(codec, "part_config"):
            codec = get_codec(codec.part_config(first=self.first, last=self.last, query_pos=self.query_pos))
        return codec

    def _coarser_codec(self, coarser: float) -> Codec:
        """The chunks' codec with steps ``coarser`` times coarser, for the budget mode."""
        if self._codec.codec_id != "kvc":
            raise InputError(f"kvcodec serde: codec {self._codec.codec_id!r} has a fixed rate and cannot "
                             "shrink a chunk to the budget")
        config = dict(self._codec.get_config())
        if config.get("target_kl") and config.get("calibration"):
            config["target_kl"] = min(10.0, config["target_kl"] * coarser)
        else:
            config.pop("target_kl", None)
            config.pop("fallback", None)
            config["k_step"] = config["k_step"] * coarser
            config["v_step"] = config["v_step"] * coarser
        return get_codec(config)

    # ------------------------------------------------------------------ sizes
    def max_bytes(self, shape: Any, dtype: torch.dtype = torch.float16) -> int:
        """The most bytes a frame of a chunk of ``shape`` and ``dtype`` takes (LMCache's pre-sized buffer).

        Fixed-budget mode: exactly the budget. Variable mode: the size of the chunk in the
        lossless ``raw`` codec, which :meth:`encode` falls back to when a codec would exceed it.
        """
        layers, tokens, hidden = _chunk_shape(shape)
        if hidden != self.num_kv_heads * self.head_dim:
            raise ConfigError(f"kvcodec serde: chunk hidden size {hidden} != num_kv_heads {self.num_kv_heads} "
                              f"x head_dim {self.head_dim}")
        if self.budget_bits:
            return FRAME_HEADER.size + math.ceil(self.budget_bits * _elements(shape) / 8)
        return FRAME_HEADER.size + self._raw_size(layers, tokens, dtype)

    def _raw_size(self, layers: int, tokens: int, dtype: torch.dtype) -> int:
        key = (layers, tokens, dtype)
        if key not in self._fallback_sizes:
            z = torch.zeros(tokens, self.num_kv_heads, self.head_dim, dtype=dtype)
            cache = KVCache.from_tensors([(z, z)] * layers, model=ModelIdentity(model_id=self.model))
            self._fallback_sizes[key] = len(get_codec("raw").encode(cache))
        return self._fallback_sizes[key]

    # ------------------------------------------------------------------ encode / decode
    def to_cache(self, chunk: torch.Tensor, model: str = "") -> KVCache:
        """A :class:`KVCache` view of a ``[2, layers, tokens, hidden]`` chunk."""
        _, _, hidden = _chunk_shape(chunk.shape)
        if hidden != self.num_kv_heads * self.head_dim:
            raise InputError(f"kvcodec serde: chunk hidden size {hidden} != num_kv_heads {self.num_kv_heads} "
                             f"x head_dim {self.head_dim}")
        return from_chunks([chunk], self.num_kv_heads, self.head_dim, model=model or self.model)

    def encode(self, chunk: torch.Tensor, key: Any = None) -> bytes:
        """The frame of one chunk (fixed-budget mode: padded with zeros to exactly the budget).

        Raises:
            InputError: the chunk cannot be coded (non-finite values, wrong geometry) or, in the
                fixed-budget mode, does not fit the budget even at the coarsest steps tried.
        """
        cache = self.to_cache(chunk.detach().cpu(), model=getattr(key, "model_name", ""))
        limit = self.max_bytes(chunk.shape, chunk.dtype) - FRAME_HEADER.size

        def coded(factor: float) -> tuple[int, bytes]:  # (flags, stored payload) at steps factor x coarser
            return _store((self._codec if factor == 1.0 else self._coarser_codec(factor)).encode(cache))

        flags, payload = coded(1.0)
        coarser, fine = 1.0, 1.0
        for _ in range(_COARSEN_TRIES if self.budget_bits else 0):
            if len(payload) <= limit:
                break
            fine, coarser = coarser, coarser * 1.5
            flags, payload = coded(coarser)
        if coarser > 1.0 and len(payload) <= limit:
            # the budget is paid in full (padding): take the finest steps that fit, between the
            # last factor that did not fit and the first that did (bisection, 1.5x -> 1.05x)
            for _ in range(_BISECT_TRIES):
                mid = (fine * coarser) ** 0.5
                tflags, trial = coded(mid)
                if len(trial) <= limit:
                    coarser, flags, payload = mid, tflags, trial
                else:
                    fine = mid
            log.info("kvcodec serde: a %s chunk fits budget_bits=%s with steps %gx coarser than %s",
                     list(chunk.shape), self.budget_bits, coarser, self._codec)
        if len(payload) > limit:
            if self.budget_bits:
                raise InputError(f"kvcodec serde: a {list(chunk.shape)} chunk needs {len(payload)} bytes even "
                                 f"with steps {coarser:g}x coarser; budget_bits={self.budget_bits} allows {limit}")
            # never larger than max_bytes (its definition), compressed header or not
            flags, payload = _store(get_codec("raw").encode(cache))
        frame = _frame(flags, payload, key)
        if self.budget_bits:
            frame += bytes(limit + FRAME_HEADER.size - len(frame))
        return frame

    def encode_sequence(self, chunks: list[torch.Tensor], keys: list[Any] | None = None) -> list[bytes]:
        """The frames of consecutive chunks of one sequence that starts with the first and ends
        with the last (variable size), for a caller that holds them all (a prefix offloaded at
        once): a kvc codec codes them as parts with the whole sequence's attention estimates
        (``KVCCodec.encode_parts``), which keeps 256-token chunks within about 10 % of the whole
        file's bits at its KL (eval/results/lmcache_chunks_256.md); other codecs code each chunk
        as :meth:`encode` does.

        Raises:
            ConfigError: in the fixed-budget mode (each chunk must then fit its own budget: use
                :meth:`encode`), or chunks of different lengths but the last.
        """
        if self.budget_bits:
            raise ConfigError("kvcodec serde: encode_sequence writes variable sizes; the fixed-budget mode "
                              "codes each chunk with encode")
        keys = [None] * len(chunks) if keys is None else list(keys)
        if len(keys) != len(chunks) or not chunks:
            raise ConfigError(f"encode_sequence: {len(chunks)} chunks and {len(keys)} keys")
        sizes = [int(c.shape[2]) for c in chunks]
        if any(n != sizes[0] for n in sizes[:-1]) or sizes[-1] > sizes[0]:
            raise ConfigError(f"encode_sequence: chunks of {sizes} tokens; all but the last must be equal")
        codec = self._make_codec(part=False) if self.part else self._codec  # encode_parts places the parts
        if not hasattr(codec, "encode_parts"):
            return [self.encode(c, k) for c, k in zip(chunks, keys)]
        cache = from_chunks([c.detach().cpu() for c in chunks], self.num_kv_heads, self.head_dim, model=self.model)
        return [_frame(*_store(blob), key) for blob, key in zip(codec.encode_parts(cache, sizes[0]), keys)]

    @staticmethod
    def payload(buf: bytes | bytearray | memoryview, key: Any = None) -> bytes:
        """The KVC file inside a frame, after checking magic, version, flags, length and key (its
        header decompressed when flags say so).

        Bytes after the payload (LMCache's buffers are pre-sized) are ignored.

        Raises:
            FormatError: not a kvcodec frame, a newer version or unknown flags, truncated, a damaged
                compressed header, or stored under another key.
        """
        mv = memoryview(buf).cast("B")
        if len(mv) < FRAME_HEADER.size:
            raise FormatError(f"kvcodec frame: {len(mv)} bytes, shorter than its {FRAME_HEADER.size}-byte header")
        magic, version, flags, reserved, length, digest = FRAME_HEADER.unpack(mv[: FRAME_HEADER.size])
        if magic != FRAME_MAGIC:
            raise FormatError(f"kvcodec frame: magic {bytes(magic)!r}, not {FRAME_MAGIC!r}: not stored by kvcodec")
        if version != FRAME_VERSION or flags & ~_KNOWN_FLAGS or reserved:
            raise FormatError(f"kvcodec frame: version {version} flags {flags} reserved {reserved}; this kvcodec "
                              f"reads version {FRAME_VERSION} with flags {_KNOWN_FLAGS} or 0 and reserved 0")
        if length > len(mv) - FRAME_HEADER.size:
            raise FormatError(f"kvcodec frame: declares {length} payload bytes, holds {len(mv) - FRAME_HEADER.size}")
        if key is not None and digest != key_digest(key):
            raise FormatError("kvcodec frame: stored under another key (model, rank, salt or chunk hash differ)")
        return _unstore(flags, mv[FRAME_HEADER.size: FRAME_HEADER.size + length])

    def decode_into(self, buf: bytes | bytearray | memoryview, out: torch.Tensor, key: Any = None) -> None:
        """Decode a frame into ``out`` (``[2, layers, tokens, hidden]``, any float dtype), on
        ``out``'s device: a CUDA ``out`` is decoded by the GPU kernels (``[cuda]`` extra), bit for
        bit the CPU's values.

        Everything is decoded and checked before ``out`` is written: on any error it is unchanged.

        Raises:
            FormatError: the frame or its KVC file is damaged, foreign, under another key, or holds
                a cache of another geometry than ``out``.
        """
        from ..api import decode

        layers, tokens, hidden = _chunk_shape(out.shape)
        cache = decode(self.payload(buf, key), device=str(out.device) if out.device.type == "cuda" else "cpu")
        if cache.num_layers != layers or cache.num_tokens != tokens:
            raise FormatError(f"kvcodec frame: holds {cache.num_layers} layers x {cache.num_tokens} tokens, "
                              f"the chunk is {layers} x {tokens}")
        for i, layer in enumerate(cache.layers):
            if set(layer) != {"k", "v"}:
                raise FormatError(f"kvcodec frame: layer {i} holds {sorted(layer)}, not K and V")
            for role in ("k", "v"):
                t = layer[role]
                if t.shape[1] * t.shape[2] != hidden:
                    raise FormatError(f"kvcodec frame: layer {i} {role} is {list(t.shape)}, "
                                      f"not {hidden} values per token")
        out.copy_(to_chunks(cache, tokens)[0].to(out.dtype))


def to_chunks(cache: KVCache, tokens_per_chunk: int = 256) -> list[torch.Tensor]:
    """Split a cache into LMCache's chunks ``[2, layers, tokens, kv_heads * head_dim]`` along the
    token axis (the last chunk may be shorter), as LMCache hands them to a serde.

    Example:
        >>> c = KVCache.from_tensors([(torch.randn(600, 2, 8), torch.randn(600, 2, 8))] * 3)
        >>> [tuple(t.shape) for t in to_chunks(c, 256)]
        [(2, 3, 256, 16), (2, 3, 256, 16), (2, 3, 88, 16)]
        >>> from_chunks(to_chunks(c, 256), 2, 8).equal(c)
        True
    """
    if tokens_per_chunk < 1:
        raise InputError(f"tokens_per_chunk must be >= 1, got {tokens_per_chunk}")
    if any("kv" in layer for layer in cache.layers):
        raise InputError("LMCache's KV_2LTD chunks hold K and V; this cache has MLA latents")
    t = cache.num_tokens
    k = torch.stack([layer["k"].reshape(t, -1) for layer in cache.layers])
    v = torch.stack([layer["v"].reshape(t, -1) for layer in cache.layers])
    kv = torch.stack([k, v])
    return [kv[:, :, s: s + tokens_per_chunk].contiguous() for s in range(0, t, tokens_per_chunk)]


def from_chunks(chunks: list[torch.Tensor], num_kv_heads: int, head_dim: int, model: str = "") -> KVCache:
    """The cache whose chunks (:func:`to_chunks`) these are, concatenated along the tokens
    (one chunk alone is a view of it); ``model`` names it in the cache's identity."""
    kv = chunks[0] if len(chunks) == 1 else torch.cat(list(chunks), dim=2)
    _, layers, tokens, _ = kv.shape
    shape = (tokens, num_kv_heads, head_dim)
    return KVCache.from_tensors([(kv[0, i].reshape(shape), kv[1, i].reshape(shape)) for i in range(layers)],
                                model=ModelIdentity(model_id=model))


# ---------------------------------------------------------------------- LMCache glue
def _lmcache() -> Any:
    try:
        from lmcache.v1.distributed.serde import async_processor, base, factory
    except ImportError as e:
        raise DependencyError("the LMCache serde needs lmcache >= 0.5.6; install it with "
                              f"pip install 'kvcodec[lmcache]' ({e})") from None
    return async_processor, base, factory


def _tensor(obj: Any, what: str) -> torch.Tensor:
    t = getattr(obj, "tensor", None)
    if t is None:
        raise InputError(f"kvcodec serde: the {what} memory object has no tensor")
    return t


def _describe(key: Any) -> str:
    if key is None:
        return "<no key>"
    h = bytes(key.chunk_hash).hex()
    return f"{key.model_name}@{key.kv_rank}@{h[:16]}"


def coder_from_kwargs(kwargs: dict[str, Any]) -> ChunkCoder:
    """A :class:`ChunkCoder` from a serde config's kwargs (module docstring), with clear errors."""
    unknown = sorted(set(kwargs) - set(_KNOWN_KWARGS))
    if unknown:
        raise ConfigError(f"kvcodec serde: unknown kwargs {unknown}; known: {list(_KNOWN_KWARGS)}")
    missing = [k for k in ("num_kv_heads", "head_dim") if k not in kwargs]
    if missing:
        raise ConfigError(f"kvcodec serde needs {missing} in its kwargs (LMCache chunks are "
                          "[2, layers, tokens, kv_heads * head_dim])")

    def _int(name: str) -> int:
        v = kwargs[name]
        try:
            return int(v) if not isinstance(v, bool) and float(v) == int(v) else -1
        except (TypeError, ValueError):
            return -1

    budget = kwargs.get("budget_bits")
    if isinstance(budget, bool) or not isinstance(budget, (int, float, str)) or not _positive(budget):
        raise ConfigError(f"kvcodec serde needs budget_bits > 0 (got {budget!r}): LMCache 0.5.6 loads back "
                          "only objects of the size it pre-sizes, so every chunk is stored at a fixed "
                          "budget of bits per element (e.g. 3.0 for kvc-near at 256-token chunks)")
    return ChunkCoder(codec=kwargs.get("codec", "kvc-near"), num_kv_heads=_int("num_kv_heads"),
                      head_dim=_int("head_dim"), profile=kwargs.get("profile"), budget_bits=float(budget),
                      part=_flag(kwargs.get("part", False)))


def _flag(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "false", "1", "0"):
        return v.lower() in ("true", "1")
    raise ConfigError(f"kvcodec serde part must be true or false, got {v!r}")


def _positive(v: Any) -> bool:
    try:
        return float(v) > 0
    except ValueError:
        return False


def create_serde(kwargs: dict[str, Any]) -> Any:
    """The factory LMCache calls with the serde config's kwargs: an ``AsyncSerdeProcessor``."""
    async_processor, base, _ = _lmcache()
    coder = coder_from_kwargs(dict(kwargs))

    class KVCodecSerializer(base.Serializer):
        def serialize(self, src: Any, dst: Any, key: Any) -> int:
            frame = coder.encode(_tensor(src, "source"), key)
            out = _tensor(dst, "destination").view(torch.uint8).reshape(-1)
            if len(frame) > out.numel():
                raise InputError(f"kvcodec serde: frame of {len(frame)} bytes, buffer of {out.numel()}")
            out[: len(frame)].copy_(torch.frombuffer(bytearray(frame), dtype=torch.uint8))
            return len(frame)

        def estimate_serialized_size(self, layout_desc: Any) -> int:
            if len(layout_desc.shapes) != 1:
                raise ConfigError(f"kvcodec serde: {len(layout_desc.shapes)} tensors per object; "
                                  "one [2, layers, tokens, hidden] chunk is supported")
            return coder.max_bytes(layout_desc.shapes[0], layout_desc.dtypes[0])

    class KVCodecDeserializer(base.Deserializer):
        def deserialize(self, src: Any, dst: Any, key: Any) -> None:
            buf = _tensor(src, "source").view(torch.uint8).reshape(-1)
            try:
                coder.decode_into(buf.numpy().data, _tensor(dst, "destination"), key)
            except KVCodecError as e:
                log.warning("kvcodec serde: stored chunk %s is unusable, reported as a cache miss: %s: %s",
                            _describe(key), type(e).__name__, e)
                raise

    workers = int(kwargs.get("max_workers", 1))
    return async_processor.AsyncSerdeProcessor(KVCodecSerializer(), KVCodecDeserializer(), max_workers=workers)


def register(name: str = SERDE_NAME) -> None:
    """Register the kvcodec serde with LMCache under ``name`` (idempotent).

    Call it in the process that builds LMCache's storage manager, before it is built (the
    launcher :func:`main` does).
    """
    _, _, factory = _lmcache()
    if name not in factory.get_registered_serde_types():
        factory.register_serde_factory(name, create_serde)


def main(argv: list[str] | None = None) -> Any:
    """``kvcodec-lmcache ARGS``: register the serde, then run LMCache's ``lmcache ARGS``."""
    register()
    try:
        from lmcache.cli.main import main as lmcache_main
    except ImportError as e:
        raise DependencyError(f"kvcodec-lmcache needs lmcache's CLI; pip install 'kvcodec[lmcache]' ({e})") from None
    return lmcache_main(argv)


if __name__ == "__main__":  # pragma: no cover - the launcher
    sys.exit(main())
