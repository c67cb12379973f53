"""KVC container: a safetensors file whose ``__metadata__`` carries a format key, a version and a
canonical JSON manifest (see formats/SPEC.md).

This module maps codecs and caches onto the container: :func:`write_cache` and :func:`read_cache`.
The byte-level layout (header parsing, validation, checksums) lives in :mod:`kvcodec.format.safetensors_io`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .. import __version__
from ..cache import DTYPE_NAMES, SOURCE_DTYPES, KVCache, LayerInfo, ModelIdentity
from ..errors import FormatError
from . import safetensors_io as sio

if TYPE_CHECKING:
    from ..codec import Codec

FORMAT_KEY = "kvc"
FORMAT_VERSION = (1, 0)


def tensor_name(layer: int, role: str, plane: str) -> str:
    """The container name of one plane of one layer's tensor."""
    return f"layers.{layer}.{role}.{plane}"


def build_manifest(codec: "Codec", cache: KVCache, params: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest of a cache coded by ``codec``; ``params`` maps ``"{i}.{role}"`` to tensor params."""
    layers = []
    for i, layer in enumerate(cache.layers):
        info = cache.layer_info[i]
        layers.append(
            {
                "kind": info.kind,
                "window": int(info.window),
                "tensors": {
                    r: {"shape": [int(s) for s in t.shape], "params": params.get(f"{i}.{r}", {})}
                    for r, t in layer.items()
                },
            }
        )
    return {
        "producer": f"kvcodec {__version__}",
        "model": cache.model.to_dict(),
        "source_dtype": DTYPE_NAMES[cache.dtype],
        "rope": {"applied": bool(cache.rope_applied), **cache.rope},
        "num_tokens": cache.num_tokens,
        "has_token_ids": cache.token_ids is not None,
        "has_positions": cache.positions is not None,
        "codec": codec.get_config(),
        "layers": layers,
    }


def write_cache(
    codec: "Codec",
    cache: KVCache,
    globals_: dict[str, np.ndarray],
    path: str | os.PathLike[str] | None = None,
) -> bytes:
    """Encode every tensor of ``cache`` with ``codec`` and return the container bytes."""
    from ..codec import TensorContext

    planes: list[tuple[str, np.ndarray]] = []
    params: dict[str, dict[str, Any]] = {}
    for name, arr in globals_.items():
        planes.append((f"global.{name}", arr))
    if cache.token_ids is not None:
        planes.append(("meta.token_ids", cache.token_ids.to(torch.int64).numpy()))
    if cache.positions is not None:
        planes.append(("meta.positions", cache.positions.to(torch.int64).numpy()))
    for i, role, t in cache.tensors():
        ctx = TensorContext(
            layer=i, role=role, shape=tuple(t.shape), dtype=t.dtype,
            layer_kind=cache.layer_info[i].kind, globals=globals_,
        )
        enc = codec.encode_tensor(t.detach().cpu().contiguous(), ctx)
        params[f"{i}.{role}"] = enc.params
        for pname, arr in enc.planes.items():
            planes.append((tensor_name(i, role, pname), np.ascontiguousarray(arr)))
    manifest = build_manifest(codec, cache, params)
    data = sio.write(planes, manifest, FORMAT_KEY, FORMAT_VERSION)
    if path is not None:
        from .atomic import atomic_write_bytes

        atomic_write_bytes(path, data)
    return data


def read_cache(
    data: bytes | str | os.PathLike[str], codec: "Codec | None" = None, device: str = "cpu"
) -> KVCache:
    """Decode a KVC container into a cache. ``codec`` must match the file's codec if given."""
    from ..codec import EncodedTensor, TensorContext, get_codec

    f = sio.open_kvc(data, FORMAT_KEY, FORMAT_VERSION)
    m = f.manifest
    file_codec = get_codec(m["codec"])
    if codec is not None and codec.codec_id != file_codec.codec_id:
        raise FormatError(
            f"file was written by codec {file_codec.codec_id!r}, not {codec.codec_id!r}"
        )
    dtype = SOURCE_DTYPES.get(m.get("source_dtype", ""))
    if dtype is None:
        raise FormatError(f"unknown source_dtype {m.get('source_dtype')!r}")
    globals_ = {n[len("global."):]: f.get(n) for n in f.names() if n.startswith("global.")}
    layers: list[dict[str, torch.Tensor]] = []
    infos: list[LayerInfo] = []
    for i, lm in enumerate(m["layers"]):
        layer = {}
        for role, tm in lm["tensors"].items():
            prefix = f"layers.{i}.{role}."
            enc = EncodedTensor(
                planes={n[len(prefix):]: f.get(n) for n in f.names() if n.startswith(prefix)},
                params=tm.get("params", {}),
            )
            ctx = TensorContext(
                layer=i, role=role, shape=tuple(tm["shape"]), dtype=dtype,
                layer_kind=lm.get("kind", "full"), globals=globals_,
            )
            if device == "cpu":
                t = file_codec.decode_tensor(enc, ctx)
            else:
                from ..gpu import decode_tensor_device

                t = decode_tensor_device(file_codec, enc, ctx, device)
            if tuple(t.shape) != ctx.shape:
                raise FormatError(
                    f"layers.{i}.{role}: decoded shape {list(t.shape)} != declared {list(ctx.shape)}"
                )
            layer[role] = t
        layers.append(layer)
        infos.append(LayerInfo(kind=lm.get("kind", "full"), window=int(lm.get("window", 0))))
    tok = f.get("meta.token_ids") if "meta.token_ids" in f.names() else None
    pos = f.get("meta.positions") if "meta.positions" in f.names() else None
    rope = dict(m.get("rope", {}))
    applied = bool(rope.pop("applied", True))
    return KVCache(
        layers=layers,
        layer_info=infos,
        token_ids=torch.from_numpy(tok.copy()) if tok is not None else None,
        positions=torch.from_numpy(pos.copy()) if pos is not None else None,
        model=ModelIdentity.from_dict(m.get("model")),
        rope_applied=applied,
        rope=rope,
    )
