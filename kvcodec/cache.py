"""KVCache: the in-memory model of one sequence's key/value cache.

Layout (NHD): each layer holds K and V as ``[tokens, kv_heads, head_dim]`` tensors, or, for an
MLA-style model, one latent tensor ``kv`` shaped ``[tokens, 1, latent_dim]``. Layers may differ in
geometry (head_dim of K and V may differ; sliding-window layers are stored whole).

Example:
    >>> import torch
    >>> from kvcodec import KVCache
    >>> c = KVCache.from_tensors([(torch.zeros(5, 2, 8), torch.ones(5, 2, 8))])
    >>> c.num_layers, c.num_tokens, c.num_elements
    (1, 5, 160)
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from .errors import InputError

#: Source dtypes a cache may hold, by their names in files and manifests.
SOURCE_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in SOURCE_DTYPES.items()}

#: Metadata key of a raw dump holding identity, RoPE state and layer kinds (JSON).
RAW_META_KEY = "kvcodec.cache"
_LEGACY_META_KEY = "kvcodec.capture"  # written by early harness captures

#: Tensor roles inside a layer. Full attention stores ``k`` and ``v``; MLA stores ``kv``.
ROLES = ("k", "v", "kv")


@dataclass
class ModelIdentity:
    """Who produced the cache: enough for an engine to refuse a cache from another model.

    Attributes:
        model_id: model name or path (for example ``"HuggingFaceTB/SmolLM2-135M-Instruct"``).
        revision: model revision or file hash, if known.
        config_hash: hash of the model config (geometry, RoPE), if known.
        tokenizer: tokenizer name or revision, if known.
    """

    model_id: str = ""
    revision: str = ""
    config_hash: str = ""
    tokenizer: str = ""

    def to_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "ModelIdentity":
        d = d or {}
        return cls(**{f.name: str(d.get(f.name, "")) for f in dataclasses.fields(cls)})


@dataclass
class LayerInfo:
    """Geometry of one layer's cache.

    Attributes:
        kind: ``"full"``, ``"sliding"`` (with ``window``) or ``"mla"`` (one latent tensor).
        window: sliding-window size in tokens, or 0.
    """

    kind: str = "full"
    window: int = 0


@dataclass
class KVCache:
    """Per-layer K and V tensors of one sequence (batch 1), in ``[T, H, D]`` layout.

    Attributes:
        layers: one dict per layer mapping role (``"k"``, ``"v"`` or ``"kv"``) to a tensor.
        layer_info: one :class:`LayerInfo` per layer.
        token_ids: optional int64 ``[T]`` token ids (the engine-neutral identity anchor).
        positions: optional int64 ``[T]`` positions.
        model: the :class:`ModelIdentity`.
        rope_applied: whether K holds rotary embeddings already (transformers caches do).
        rope: RoPE parameters (``theta``, scaling) as a JSON-able dict, if known.
    """

    layers: list[dict[str, torch.Tensor]]
    layer_info: list[LayerInfo] = field(default_factory=list)
    token_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    model: ModelIdentity = field(default_factory=ModelIdentity)
    rope_applied: bool = True
    rope: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.layer_info:
            self.layer_info = [
                LayerInfo(kind="mla" if "kv" in layer else "full") for layer in self.layers
            ]
        self.validate()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_tensors(
        cls, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], **kwargs: Any
    ) -> "KVCache":
        """Build a cache from ``[(K, V), ...]`` pairs, each ``[T, H, D]``."""
        return cls(layers=[{"k": k, "v": v} for k, v in pairs], **kwargs)

    def validate(self) -> None:
        """Check shapes, dtypes and roles; raise :class:`InputError` naming the problem."""
        if len(self.layer_info) != len(self.layers):
            raise InputError(
                f"layer_info has {len(self.layer_info)} entries for {len(self.layers)} layers"
            )
        dtype = None
        tokens = None
        for i, layer in enumerate(self.layers):
            roles = set(layer)
            if roles not in ({"k", "v"}, {"kv"}):
                raise InputError(
                    f"layer {i} has tensors {sorted(roles)}; expected ['k', 'v'] or ['kv'] (MLA)"
                )
            for role, t in layer.items():
                if not isinstance(t, torch.Tensor):
                    raise InputError(f"layers.{i}.{role} is {type(t).__name__}, not a tensor")
                if t.dim() != 3:
                    raise InputError(
                        f"layers.{i}.{role} has shape {list(t.shape)}; expected [tokens, heads, dim]"
                    )
                if t.dtype not in DTYPE_NAMES:
                    raise InputError(
                        f"layers.{i}.{role} has dtype {t.dtype}; expected float32, float16 or bfloat16"
                    )
                if dtype is None:
                    dtype = t.dtype
                elif t.dtype != dtype:
                    raise InputError(f"layers.{i}.{role} has dtype {t.dtype}, others {dtype}")
                if tokens is None:
                    tokens = t.shape[0]
                elif t.shape[0] != tokens:
                    raise InputError(
                        f"layers.{i}.{role} has {t.shape[0]} tokens, others have {tokens}"
                    )
            if "k" in layer and layer["k"].shape[1] != layer["v"].shape[1]:
                raise InputError(
                    f"layer {i}: K has {layer['k'].shape[1]} heads but V has {layer['v'].shape[1]}"
                )
        for name in ("token_ids", "positions"):
            t = getattr(self, name)
            if t is not None and (t.dim() != 1 or (tokens is not None and t.shape[0] != tokens)):
                raise InputError(f"{name} has shape {list(t.shape)}; expected [{tokens}]")

    # ------------------------------------------------------------------ properties
    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def num_tokens(self) -> int:
        for layer in self.layers:
            for t in layer.values():
                return int(t.shape[0])
        return 0

    @property
    def dtype(self) -> torch.dtype:
        for layer in self.layers:
            for t in layer.values():
                return t.dtype
        return torch.float16

    @property
    def num_elements(self) -> int:
        """Number of cached values (K and V of all layers)."""
        return sum(t.numel() for layer in self.layers for t in layer.values())

    def fp16_bytes(self) -> int:
        """Size of this cache stored as fp16: the reference for compression ratios."""
        return 2 * self.num_elements

    def tensors(self) -> Iterator[tuple[int, str, torch.Tensor]]:
        """Yield ``(layer, role, tensor)`` in file order."""
        for i, layer in enumerate(self.layers):
            for role in ROLES:
                if role in layer:
                    yield i, role, layer[role]

    def tokens(self, start: int, end: int) -> "KVCache":
        """Tokens ``[start, end)`` of every layer (views), with their ids and positions.

        Example:
            >>> c = KVCache.from_tensors([(torch.zeros(10, 1, 4), torch.zeros(10, 1, 4))], token_ids=torch.arange(10))
            >>> c.tokens(2, 5).num_tokens, c.tokens(2, 5).token_ids.tolist()
            (3, [2, 3, 4])
        """
        return dataclasses.replace(
            self, layers=[{r: t[start:end] for r, t in layer.items()} for layer in self.layers],
            layer_info=list(self.layer_info),
            token_ids=None if self.token_ids is None else self.token_ids[start:end],
            positions=None if self.positions is None else self.positions[start:end], rope=dict(self.rope))

    def to(self, dtype: torch.dtype) -> "KVCache":
        """A copy with every tensor cast to ``dtype``."""
        return dataclasses.replace(
            self, layers=[{r: t.to(dtype) for r, t in layer.items()} for layer in self.layers]
        )

    def equal(self, other: "KVCache") -> bool:
        """True when every tensor is bit-identical (same dtype, shape and bits; NaNs compare by bits)."""
        if len(self.layers) != len(other.layers):
            return False
        for a, b in zip(self.layers, other.layers):
            if set(a) != set(b):
                return False
            for r in a:
                x, y = a[r], b[r]
                if x.dtype != y.dtype or x.shape != y.shape:
                    return False
                iv = {2: torch.int16, 4: torch.int32}[x.element_size()]
                if not torch.equal(x.contiguous().view(iv), y.contiguous().view(iv)):
                    return False
        return True

    # ------------------------------------------------------------------ raw safetensors dumps
    def to_safetensors(self, path: str | os.PathLike[str]) -> None:
        """Write a raw dump: tensors ``layers.{i}.k`` / ``layers.{i}.v`` (MLA: ``layers.{i}.kv``).

        Token ids and positions, when present, are stored as ``token_ids`` and ``positions``; the
        model identity, RoPE state and layer kinds as JSON under the metadata key
        ``kvcodec.cache``, so :meth:`from_safetensors` restores the whole cache.
        The write is atomic (temporary file, fsync, rename).
        """
        from safetensors.torch import save

        from .format.atomic import atomic_write_bytes

        tensors = {f"layers.{i}.{r}": t.contiguous() for i, r, t in self.tensors()}
        if self.token_ids is not None:
            tensors["token_ids"] = self.token_ids.to(torch.int64).contiguous()
        if self.positions is not None:
            tensors["positions"] = self.positions.to(torch.int64).contiguous()
        info = {
            "model": self.model.to_dict(),
            "rope_applied": bool(self.rope_applied),
            "rope": self.rope,
            "layer_info": [dataclasses.asdict(li) for li in self.layer_info],
        }
        meta = {"kvcodec.raw": "1", "model_id": self.model.model_id,
                "rope_applied": "1" if self.rope_applied else "0",
                RAW_META_KEY: json.dumps(info, sort_keys=True, default=str)}
        atomic_write_bytes(path, save(tensors, metadata=meta))

    @classmethod
    def from_safetensors(cls, path: str | os.PathLike[str]) -> "KVCache":
        """Read a raw dump written by :meth:`to_safetensors` (or by any tool using its names).

        Raises:
            InputError: the file is missing, unreadable, or its tensor names or shapes are wrong.
        """
        from safetensors import SafetensorError
        from safetensors.torch import load

        path = os.fspath(path)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise InputError(f"cannot read {path}: {e.strerror or e}") from None
        try:
            tensors = load(data)
        except (SafetensorError, ValueError, RuntimeError) as e:
            raise InputError(f"{path} is not a readable safetensors file: {e}") from None
        meta = _safetensors_metadata(data)
        return cls.from_tensor_dict(tensors, meta, source=path)

    @classmethod
    def from_tensor_dict(
        cls, tensors: dict[str, torch.Tensor], meta: dict[str, str] | None = None, source: str = "input"
    ) -> "KVCache":
        """Build a cache from a flat ``{"layers.{i}.k": ...}`` dict (see :meth:`to_safetensors`)."""
        meta = meta or {}
        layers: dict[int, dict[str, torch.Tensor]] = {}
        extra: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            if name in ("token_ids", "positions"):
                extra[name] = t.to(torch.int64)
                continue
            parts = name.split(".")
            if len(parts) != 3 or parts[0] != "layers" or not parts[1].isdigit() or parts[2] not in ROLES:
                raise InputError(
                    f"{source}: unexpected tensor name {name!r}; expected layers.<i>.k, "
                    "layers.<i>.v or layers.<i>.kv"
                )
            layers.setdefault(int(parts[1]), {})[parts[2]] = t
        if not layers:
            raise InputError(f"{source}: no layers.<i>.k / layers.<i>.v tensors found")
        n = max(layers) + 1
        missing = [i for i in range(n) if i not in layers]
        if missing:
            raise InputError(f"{source}: layers {missing[:5]} are missing (layers must be 0..{n - 1})")
        cache = cls(
            layers=[layers[i] for i in range(n)],
            token_ids=extra.get("token_ids"),
            positions=extra.get("positions"),
            model=ModelIdentity(model_id=meta.get("model_id", "")),
            rope_applied=meta.get("rope_applied", "1") != "0",
        )
        raw = meta.get(RAW_META_KEY) or meta.get(_LEGACY_META_KEY)
        if raw:
            try:
                info = json.loads(raw)
                cache.model = ModelIdentity.from_dict(info.get("model"))
                cache.rope_applied = bool(info.get("rope_applied", True))
                cache.rope = dict(info.get("rope") or {})
                infos = [LayerInfo(kind=str(d["kind"]), window=int(d.get("window", 0)))
                         for d in info.get("layer_info", [])]
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                raise InputError(f"{source}: bad {RAW_META_KEY} metadata: {e}") from None
            if len(infos) == cache.num_layers:
                cache.layer_info = infos
        return cache


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    import struct

    n = struct.unpack("<Q", data[:8])[0]
    try:
        meta = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
    except ValueError:
        return {}
    return {k: v for k, v in meta.items() if isinstance(v, str)}
