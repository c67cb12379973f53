"""The Codec interface and the registry of named codecs.

A codec is a configuration (a JSON object whose ``"id"`` is a pinned string) plus code. Its
``encode`` turns a :class:`~kvcodec.cache.KVCache` into the bytes of a KVC container and its
``decode`` turns them back. Codecs work tensor by tensor (:meth:`Codec.encode_tensor`), which lets
the container stream layer by layer; a codec that needs whole-cache side information (calibrated
tables, bins) returns it from :meth:`Codec.encode_globals` and it is stored once per file.

Example:
    >>> import torch, kvcodec
    >>> codec = kvcodec.get_codec("fp16")
    >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(4, 2, 8).half(), torch.randn(4, 2, 8).half())])
    >>> codec.decode(codec.encode(cache)).equal(cache)
    True
    >>> kvcodec.get_codec(codec.get_config()) == codec
    True
"""

from __future__ import annotations

import copy
import importlib
import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

import numpy as np
import torch

from .cache import KVCache
from .planes import EncodedTensor, TensorContext
from .errors import ConfigError, InputError, UnknownCodecError


@dataclass(frozen=True)
class Prepared:
    """What :meth:`Codec.prepare` returns for one encode call.

    Attributes:
        config: the codec config recorded in the file (it may differ from the codec's own, e.g.
            kvc fills in the SHA-256 of the calibration file it read).
        state: per-call state handed to every :meth:`Codec.encode_tensor` as ``ctx.state``.
        close: called once when the call ends (releases threads), or None.
        encode_threads: how many tensors of this call may be coded at once, where it differs
            from the codec's ``encode_threads`` (None: the codec's).
    """

    config: dict[str, Any]
    state: Any = None
    close: Any = None
    encode_threads: int | None = None


@dataclass(frozen=True)
class EncodePlan:
    """One encode call, prepared once: the input checked, side inputs (calibration) read and
    hashed, file-level planes computed. Every route that writes a file (:meth:`Codec.encode`,
    :func:`kvcodec.format.write_file`, ``kvcodec encode``, eval, bench) writes from one of these,
    so they all write the same bytes. Use it as a context manager (:meth:`Codec.plan`).

    Attributes:
        codec: the codec (never modified).
        cache: the cache to code.
        config: the codec config recorded in the file's manifest.
        globals: file-level planes (:meth:`Codec.encode_globals`).
        state: the codec's per-call state (``ctx.state`` of every tensor).
        tokens_per_chunk: chunk length of the token axis (0: one chunk per tensor).
        encode_threads: how many tensors the writer may code at once (the codec's
            ``encode_threads``, or what its :meth:`Codec.prepare` said for this call).
    """

    codec: "Codec"
    cache: KVCache
    config: dict[str, Any]
    globals: dict[str, np.ndarray]
    state: Any
    tokens_per_chunk: int
    close: Any = None
    encode_threads: int = 1

    def __enter__(self) -> "EncodePlan":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.close is not None:
            self.close()


def _freeze(v: Any) -> Any:
    """Lists (and nested ones) as tuples, so a codec's params cannot be changed in place."""
    if isinstance(v, (list, tuple)):
        return tuple(_freeze(x) for x in v)
    return v


def _thaw(v: Any) -> Any:
    if isinstance(v, tuple):
        return [_thaw(x) for x in v]
    return v


class Codec(ABC):
    """Base class of every codec. Subclasses set ``codec_id`` and ``defaults``.

    ``defaults`` maps each parameter name to its default; the constructor accepts exactly those
    names. The config is ``{"id": codec_id, **params}``; equality and ``repr`` derive from it.
    A codec is immutable (``params`` is a read-only mapping, list values are tuples) and keeps no
    state between calls, so one object can be shared between threads; per-call state lives in
    the :class:`EncodePlan` (:meth:`prepare`).
    """

    codec_id: ClassVar[str] = ""
    defaults: ClassVar[dict[str, Any]] = {}
    #: Parameters validated by type: the value must be an instance of the default's type.
    lossless: ClassVar[bool] = False
    #: How many tensors of one encode call the writer may code at once, on threads (their
    #: :meth:`encode_tensor` calls share the call's ``ctx.state``): 1 unless the codec says its
    #: tensors code safely side by side. Bytes never depend on it: the writer keeps the order.
    encode_threads: ClassVar[int] = 1
    #: How many tensors the reader may decode at once on the CPU (:meth:`decode_tensor` calls
    #: on threads, a few layers ahead): 1 unless the codec's decoder is safe side by side and
    #: gains (its native passes release the GIL). Values never depend on it.
    decode_threads: ClassVar[int] = 1

    def __init__(self, **params: Any) -> None:
        unknown = set(params) - set(self.defaults)
        if unknown:
            raise ConfigError(
                f"codec {self.codec_id!r} has no parameter(s) {sorted(unknown)}; "
                f"known: {sorted(self.defaults)}"
            )
        merged = copy.deepcopy(self.defaults)
        for k, v in params.items():
            d = self.defaults[k]
            if isinstance(d, bool) != isinstance(v, bool) or (
                d is not None and not isinstance(v, type(d)) and not (isinstance(d, float) and isinstance(v, int))
            ):
                raise ConfigError(
                    f"codec {self.codec_id!r}: parameter {k!r} must be {type(d).__name__}, "
                    f"got {v!r}"
                )
            merged[k] = float(v) if isinstance(d, float) else v
        object.__setattr__(self, "params", merged)
        #: parameters that must be set (non-empty) to encode: a preset's promise (register_preset)
        object.__setattr__(self, "requires", ())
        object.__setattr__(self, "preset", None)
        self.check_params()  # on the plain values (JSON types), then frozen
        object.__setattr__(self, "params", MappingProxyType({k: _freeze(v) for k, v in merged.items()}))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"codec objects are immutable: cannot set {name!r} (build another with get_codec)")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"codec objects are immutable: cannot delete {name!r}")

    def check_params(self) -> None:
        """Validate ``self.params``; raise :class:`ConfigError`. Subclasses extend this."""

    # ------------------------------------------------------------------ config
    def get_config(self) -> dict[str, Any]:
        """The JSON-able config that rebuilds this codec through :func:`get_codec`."""
        return {"id": self.codec_id, **{k: _thaw(copy.deepcopy(v)) for k, v in self.params.items()}}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Codec":
        cfg = dict(config)
        cid = cfg.pop("id", cls.codec_id)
        if cid != cls.codec_id:
            raise ConfigError(f"config id {cid!r} does not match codec {cls.codec_id!r}")
        return cls(**cfg)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Codec) and self.get_config() == other.get_config()

    def __hash__(self) -> int:
        return hash(json.dumps(self.get_config(), sort_keys=True))

    def __repr__(self) -> str:
        return f"kvcodec.get_codec({self.get_config()!r})"

    # ------------------------------------------------------------------ sizes
    @property
    def nominal_bits(self) -> float:
        """Approximate bits per element of the coded values, before side information."""
        return 16.0

    # ------------------------------------------------------------------ tensor coding
    def encode_globals(self, cache: KVCache, state: Any = None) -> dict[str, np.ndarray]:
        """File-level planes (calibration, shared tables) computed from the whole cache
        (``state``: what :meth:`prepare` returned for it, when the caller prepared)."""
        return {}

    @abstractmethod
    def encode_tensor(self, x: torch.Tensor, ctx: TensorContext) -> EncodedTensor:
        """Code one ``[T, H, D]`` tensor."""

    @abstractmethod
    def decode_tensor(self, enc: EncodedTensor, ctx: TensorContext) -> torch.Tensor:
        """Decode one tensor; return ``ctx.shape`` in ``ctx.dtype`` on the CPU."""

    # ------------------------------------------------------------------ whole caches
    def prepare(self, cache: KVCache) -> Prepared:
        """Per-call preparation (read side inputs, compute per-call state). The default keeps no
        state. Subclasses that override it must not modify ``self``."""
        return Prepared(self.get_config())

    def check_requirements(self) -> None:
        """Raise ConfigError when a setting the codec's preset promised to have is empty.

        Example:
            >>> import kvcodec
            >>> kvcodec.get_codec("kvc-near-cal").check_requirements()
            Traceback (most recent call last):
            ...
            kvcodec.errors.ConfigError: preset 'kvc-near-cal' needs 'calibration': ...
        """
        missing = [k for k in self.requires if not self.params.get(k)]
        if missing:
            raise ConfigError(
                f"preset {self.preset!r} needs {' and '.join(repr(k) for k in missing)}: it was tuned with "
                f"one and would not keep its quality promise without; give one, e.g. "
                f"{{\"id\": \"{self.preset}\", \"{missing[0]}\": \"FILE\"}} (kvcodec calibrate makes it)"
            )

    def plan(self, cache: KVCache, tokens_per_chunk: int = 0) -> EncodePlan:
        """Check ``cache`` once and prepare one encode call (see :class:`EncodePlan`).

        Raises:
            InputError: the cache is malformed or holds NaN/Inf.
            ConfigError: a bad ``tokens_per_chunk``, or the codec needs a setting it lacks (a
                ``-cal`` preset without its calibration file).
        """
        if type(tokens_per_chunk) is not int or tokens_per_chunk < 0:
            raise ConfigError(f"tokens_per_chunk must be an integer >= 0, got {tokens_per_chunk!r}")
        self.check_requirements()
        cache.validate()
        for i, role, t in cache.tensors():
            # amax propagates NaN and is ~6x faster than isfinite().all() on fp16 CPU tensors
            if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t.abs().amax())):
                raise InputError(f"layers.{i}.{role} holds NaN or Inf values; refusing to encode")
        prep = self.prepare(cache)
        try:
            globals_ = {k: np.ascontiguousarray(v) for k, v in self.encode_globals(cache, prep.state).items()}
        except BaseException:
            if prep.close is not None:
                prep.close()
            raise
        threads = self.encode_threads if prep.encode_threads is None else prep.encode_threads
        return EncodePlan(self, cache, prep.config, globals_, prep.state, tokens_per_chunk, prep.close, threads)

    def encode(
        self, cache: KVCache, path: str | os.PathLike[str] | None = None, *, tokens_per_chunk: int = 0
    ) -> bytes:
        """Encode a cache into KVC container bytes; also write them atomically to ``path``.

        ``tokens_per_chunk > 0`` codes the token axis in independent chunks of that many tokens,
        so a reader can decode a range of chunks alone (formats/SPEC.md, chunking).
        """
        from .format import container

        with self.plan(cache, tokens_per_chunk) as plan:
            return container.write_cache(plan, path=path)

    def decode(self, data: bytes | str | os.PathLike[str], device: str = "cpu",
               profiles: Any = ()) -> KVCache:
        """Decode KVC bytes (or a path, or a binary file) written by this codec into a :class:`KVCache`
        (``profiles``: see :func:`kvcodec.open`).

        Raises:
            FormatError: the file is damaged or foreign (subclasses name the problem), or it was
                written by another codec.
        """
        from .decoding import read_with

        return read_with(data, self, device=device, profiles=profiles)

    def bits_per_element(self, cache: KVCache) -> float:
        """Exact all-in size of ``encode(cache)`` in bits per cached value (headers included)."""
        return 8.0 * len(self.encode(cache)) / max(1, cache.num_elements)


# ---------------------------------------------------------------------- registry
_CODECS: dict[str, type[Codec]] = {}


@dataclass(frozen=True)
class _Preset:
    """A registered preset: its codec config and what :func:`register_preset` was told of it."""

    config: dict[str, Any]
    description: str
    requires: tuple[str, ...]
    target: dict[str, float] | None


_PRESETS: dict[str, _Preset] = {}

#: The package whose import registers the built-in codecs. The registry loads it on first use (the
#: way numcodecs' registry loads its entry points): ``import kvcodec`` stays light (``kvcodec
#: --help`` imports no torch), yet every lookup sees the built-in codecs whichever kvcodec module a
#: program imported first. By name, not an import statement: the codecs depend on this module.
BUILTIN_CODECS = "kvcodec.codecs"
_builtins_loaded = False


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True  # first: the modules it imports register through this registry
    try:
        importlib.import_module(BUILTIN_CODECS)
    except BaseException:
        _builtins_loaded = False
        raise


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: register a codec class under its pinned ``codec_id``."""
    _load_builtins()
    cid = cls.__dict__.get("codec_id")
    if not cid or not isinstance(cid, str):
        raise ConfigError(f"{cls.__name__} must define a string codec_id")
    if cid in _CODECS and _CODECS[cid] is not cls:
        raise ConfigError(f"codec id {cid!r} is already registered by {_CODECS[cid].__name__}")
    _CODECS[cid] = cls
    return cls


#: The quality measures a preset's target may name: mean next-token KL against the uncompressed
#: cache, and the relative perplexity change (0.01 = 1 %).
TARGET_KEYS = ("kl_mean", "dppl")


def register_preset(name: str, config: dict[str, Any], description: str = "",
                    requires: tuple[str, ...] = (), target: dict[str, float] | None = None) -> None:
    """Register a named preset (for example ``"kivi-4"``) for a registered codec config.

    ``requires`` names parameters the preset cannot keep its promise without (kvc's ``-cal``
    presets: ``calibration``); encoding with the preset while one is empty raises ConfigError.
    ``target`` is the quality the preset promises (keys in :data:`TARGET_KEYS`), or None.
    """
    _load_builtins()
    if name in _PRESETS and _PRESETS[name].config != config:
        raise ConfigError(f"preset {name!r} is already registered with another config")
    if target is not None and (not target or set(target) - set(TARGET_KEYS)
                               or not all(isinstance(v, float) and v > 0 for v in target.values())):
        raise ConfigError(f"preset {name!r}: target must map some of {TARGET_KEYS} to floats > 0, got {target!r}")
    _PRESETS[name] = _Preset(dict(config), description, tuple(requires),
                             None if target is None else dict(target))


def get_codec(name_or_config: str | dict[str, Any] | Codec) -> Codec:
    """Return a codec from a preset name, a codec id, a JSON string, or a config dict.

    A config's ``id`` may also name a preset: its settings, then the config's other keys on top
    (``{"id": "kvc-near-cal", "calibration": "m.qstats.safetensors"}``).

    Raises:
        UnknownCodecError: the name or id is not registered (the message lists known names).
        ConfigError: the config has unknown or invalid parameters.
    """
    if isinstance(name_or_config, Codec):
        return name_or_config
    _load_builtins()
    if isinstance(name_or_config, str):
        s = name_or_config.strip()
        if s.startswith("{"):
            try:
                config = json.loads(s)
            except ValueError as e:
                raise ConfigError(f"codec config is not valid JSON: {e}") from None
        elif s in _PRESETS:
            config = {"id": s}
        elif s in _CODECS:
            config = {"id": s}
        else:
            raise UnknownCodecError(
                f"unknown codec {s!r}; known: {', '.join(list_codecs())}"
            )
    elif isinstance(name_or_config, dict):
        config = name_or_config
    else:
        raise ConfigError(f"expected a codec name or config dict, got {type(name_or_config).__name__}")
    if not isinstance(config, dict) or not isinstance(config.get("id"), str):
        raise ConfigError(f"codec config needs a string 'id': {config!r}")
    preset = None
    if config["id"] not in _CODECS and config["id"] in _PRESETS:
        preset = config["id"]
        config = {**_PRESETS[preset].config, **{k: v for k, v in config.items() if k != "id"}}
    cls = _CODECS.get(config["id"])
    if cls is None:
        raise UnknownCodecError(
            f"unknown codec id {config['id']!r}; known ids: {', '.join(sorted(_CODECS))}"
        )
    codec = cls.from_config(config)
    if preset is not None:
        object.__setattr__(codec, "preset", preset)
        object.__setattr__(codec, "requires", _PRESETS[preset].requires)
    return codec


def list_codecs() -> list[str]:
    """Names of every registered preset, in registration order."""
    _load_builtins()
    return list(_PRESETS)


def preset_target(name: str) -> dict[str, float] | None:
    """The quality target a preset promises (``{"kl_mean": 0.01, ...}``), or None.

    Example:
        >>> preset_target("kvc-near")
        {'kl_mean': 0.01, 'dppl': 0.01}
    """
    _load_builtins()
    target = _PRESETS[name].target if name in _PRESETS else None
    return None if target is None else dict(target)


def preset_description(name: str) -> str:
    _load_builtins()
    return _PRESETS[name].description if name in _PRESETS else ""


def preset_for_config(config: dict[str, Any]) -> str | None:
    """The first registered preset (in registration order) whose full config equals ``config``,
    or None: the name of a file's settings when the file does not record one.

    Example:
        >>> preset_for_config(get_codec("kivi-4").get_config())
        'kivi-4'
        >>> preset_for_config({**get_codec("kivi-4").get_config(), "group": 64}) is None
        True
    """
    _load_builtins()
    for name in _PRESETS:
        try:
            if get_codec(name).get_config() == config:
                return name
        except ConfigError:
            continue
    return None


def codec_ids() -> list[str]:
    """Every registered codec id."""
    _load_builtins()
    return sorted(_CODECS)


__all__ = [
    "Codec",
    "EncodePlan",
    "EncodedTensor",
    "Prepared",
    "TensorContext",
    "codec_ids",
    "get_codec",
    "list_codecs",
    "preset_description",
    "preset_for_config",
    "register_codec",
    "register_preset",
]
