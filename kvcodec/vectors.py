"""Golden vectors: for each codec preset a small input, its KVC file and the SHA-256 of the decoded
tensors, stored in ``formats/vectors/v1/``. Written once, decoded by the tests forever.

A vector is written only when it is missing *and* the environment variable
``KVCODEC_WRITE_VECTORS=1`` asks for it; an existing vector is never overwritten. Regenerate the
missing ones with ``KVCODEC_WRITE_VECTORS=1 python formats/vectors/make_vectors.py``.

Example:
    >>> from kvcodec.vectors import vector_input, decoded_sha256
    >>> c = vector_input()
    >>> c.num_layers, c.num_tokens, str(c.dtype)
    (2, 45, 'torch.float16')
    >>> len(decoded_sha256(c))
    64
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from .cache import KVCache, LayerInfo, ModelIdentity
from .errors import FormatError

ENV = "KVCODEC_WRITE_VECTORS"
INPUT_NAME = "input.safetensors"
#: Extra vectors beyond one per preset: ``name -> (preset, encode keyword arguments)``.
EXTRA_VECTORS: dict[str, tuple[str | dict[str, Any], dict[str, Any]]] = {
    "raw.chunked16": ("raw", {"tokens_per_chunk": 16}),
    # kvc with token-delta rows (its ``pred`` planes): the presets only use them where they pay,
    # which on this small random input they do not
    "kvc-near.delta": ({"id": "kvc-near", "delta": 2}, {}),
    # kvc with magnitude contexts in its entropy stage (scope 2, formats/ANS.md §3.1): lossless, so
    # it decodes to exactly kvc-near's values
    "kvc-near.ctx": ({"id": "kvc-near", "ctx": [3, 8, 20], "rows_per_stream": 64}, {}),
    # kvc with reconstruction offsets on K (the tensor param ``rc``)
    "kvc-near.rc": ({"id": "kvc-near", "k_recon": 4}, {}),
    # kvc with its planes packed into one per tensor (the ``pack`` plane and ``pk`` directory)
    "kvc-near.pack": ({"id": "kvc-near", "pack": 1}, {}),
    # ... and with its small pieces as zstd frames (``pack: 2``)
    "kvc-near.zpack": ({"id": "kvc-near", "pack": 2}, {}),
}


def vector_input() -> KVCache:
    """The deterministic input of every vector: 2 layers (full, sliding), 45 tokens (ragged against
    16/32/64 blocks), 2 KV heads, head_dim 32, fp16, K with per-channel offsets like real K caches."""
    g = torch.Generator().manual_seed(20261130)
    layers = []
    for _ in range(2):
        k = torch.randn(45, 2, 32, generator=g) + 3 * torch.randn(1, 2, 32, generator=g)
        v = torch.randn(45, 2, 32, generator=g)
        layers.append({"k": k.half(), "v": v.half()})
    return KVCache(layers=layers, layer_info=[LayerInfo("full"), LayerInfo("sliding", 32)],
                   token_ids=torch.arange(1000, 1045), model=ModelIdentity("kvcodec/golden-vector-input"))


def decoded_sha256(cache: KVCache) -> str:
    """SHA-256 over every decoded tensor's little-endian bytes in file order (layer, then k, v, kv),
    each preceded by its ``name dtype shape`` line, so a change of shape or dtype changes it too."""
    h = hashlib.sha256()
    for i, role, t in cache.tensors():
        h.update(f"layers.{i}.{role} {str(t.dtype).replace('torch.', '')} {list(t.shape)}\n".encode())
        iv = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
        h.update(t.detach().cpu().contiguous().view(iv).numpy().astype(f"<i{t.element_size()}" if t.element_size() > 1 else "u1").tobytes())
    return h.hexdigest()


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def vector_names() -> list[str]:
    """Every vector the tests expect: one per registered preset plus :data:`EXTRA_VECTORS`."""
    from .codec import list_codecs

    return list(list_codecs()) + [n for n in EXTRA_VECTORS]


def load_input(directory: str | os.PathLike[str]) -> KVCache:
    """The stored vector input, read back from ``input.safetensors``."""
    p = Path(directory) / INPUT_NAME
    cache = KVCache.from_safetensors(p)
    # a raw dump does not carry the layer kinds; the vectors use the ones of vector_input()
    cache.layer_info = vector_input().layer_info
    return cache


def write_missing(directory: str | os.PathLike[str], names: list[str] | None = None) -> list[str]:
    """Write the vectors of ``names`` (default: all) that are missing; never overwrite one.

    Requires ``KVCODEC_WRITE_VECTORS=1``. Returns the names written.
    """
    from .codec import get_codec

    if os.environ.get(ENV) != "1":
        raise FormatError(f"refusing to write golden vectors: set {ENV}=1 to write missing ones")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    if not (d / INPUT_NAME).exists():
        vector_input().to_safetensors(d / INPUT_NAME)
    cache = load_input(d)
    written = []
    for name in names or vector_names():
        kvc, meta = d / f"{name}.kvc", d / f"{name}.json"
        if kvc.exists() or meta.exists():
            continue
        preset, kwargs = EXTRA_VECTORS.get(name, (name, {}))
        codec = get_codec(preset)
        blob = codec.encode(cache, **kwargs)
        out = codec.decode(blob)
        record = {
            "name": name,
            "preset": preset,
            "config": codec.get_config(),
            "encode_kwargs": kwargs,
            "input": INPUT_NAME,
            "input_sha256": _sha((d / INPUT_NAME).read_bytes()),
            "kvc_sha256": _sha(blob),
            "kvc_bytes": len(blob),
            "decoded_sha256": decoded_sha256(out),
            "bits_per_element": round(8 * len(blob) / cache.num_elements, 4),
        }
        kvc.write_bytes(blob)
        meta.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        written.append(name)
    return written


def check(directory: str | os.PathLike[str], name: str) -> dict[str, Any]:
    """Decode one stored vector and compare everything with its record; raise ``AssertionError``
    naming the difference. Returns the record."""
    from .api import open as open_kvc

    d = Path(directory)
    kvc, meta = d / f"{name}.kvc", d / f"{name}.json"
    if not kvc.exists() or not meta.exists():
        raise AssertionError(
            f"no golden vector for {name!r} in {d}; write the missing ones with "
            f"{ENV}=1 python formats/vectors/make_vectors.py"
        )
    rec = json.loads(meta.read_text())
    blob = kvc.read_bytes()
    assert _sha(blob) == rec["kvc_sha256"], f"{name}: {kvc.name} changed on disk"
    assert _sha((d / rec["input"]).read_bytes()) == rec["input_sha256"], f"{name}: input changed on disk"
    with open_kvc(blob) as r:
        assert r.manifest["codec"] == rec["config"], f"{name}: stored config differs from the record"
        r.verify()
        out = r.read_cache()
    got = decoded_sha256(out)
    assert got == rec["decoded_sha256"], (
        f"{name}: decoding the golden file gave {got}, recorded {rec['decoded_sha256']}: the decoder "
        f"of {rec['config']} changed its output for an existing bitstream"
    )
    return rec
