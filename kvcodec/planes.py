"""What passes between the container and the codecs: one tensor's coded planes and its context.

The container (:mod:`kvcodec.format`) stores and reads :class:`EncodedTensor` objects without
knowing what the planes mean; a codec turns them into values given a :class:`TensorContext`.
This module depends on nothing else in kvcodec, so every layer can use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


@dataclass
class TensorContext:
    """What a codec knows about the tensor it is coding.

    Attributes:
        layer: layer index.
        role: ``"k"``, ``"v"`` or ``"kv"`` (MLA latent).
        shape: ``(tokens, heads, head_dim)``.
        dtype: the source dtype, which ``decode_tensor`` must return.
        layer_kind: ``"full"``, ``"sliding"`` or ``"mla"``.
        globals: file-level planes from :meth:`Codec.encode_globals` (read-only).
    """

    layer: int
    role: str
    shape: tuple[int, int, int]
    dtype: torch.dtype
    layer_kind: str = "full"
    globals: dict[str, np.ndarray] = field(default_factory=dict)
    #: the codec's per-call state from :meth:`Codec.prepare` (None for codecs that keep none)
    state: Any = None
    #: where the tensor's first token lies in the cache (a chunk's offset; the writer sets it)
    start: int = 0

    @property
    def numel(self) -> int:
        t, h, d = self.shape
        return t * h * d


@dataclass
class EncodedTensor:
    """One tensor's coded form: named numpy planes plus small JSON parameters.

    Every plane is stored in the container as ``layers.{i}.{role}.{plane}``; ``params`` goes into
    the manifest. Both must hold every parameter needed to decode.
    """

    planes: dict[str, np.ndarray]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(int(p.nbytes) for p in self.planes.values())


__all__ = ["EncodedTensor", "TensorContext"]
