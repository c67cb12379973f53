"""A cache offloaded as chunk objects keyed by a prefix-hash chain; any stored prefix reloads alone.

Engines reuse a cache by its *prefix*: a request that starts with the same tokens as a stored
one can load the stored chunks and compute only the rest. :func:`put_prefix` cuts a cache into
chunks of ``chunk_tokens`` tokens, codes each as an independent KVC file recording its token ids (kvc
codes it as a part of a longer sequence, ``KVCCodec.encode_parts``: the first chunk keeps its
exact sink token, the last stored chunk, which ends the prefix, keeps the finer steps for the
latest tokens, the chunks between get neither, and every chunk's attention-weighted steps are
those of the whole prefix's file), and stores it
under :func:`chunk_keys`; :func:`get_prefix` walks the keys of a new token sequence and loads
the longest stored prefix of whole chunks.

The key of chunk ``i`` (tokens ``[i*C, (i+1)*C)``) is ``{namespace}/{h_i}`` with

    h_0 = SHA-256(b"kvcodec-prefix-v1\\0" + model + b"\\0" + salt + b"\\0" + ids_0)
    h_i = SHA-256(h_{i-1} + ids_i)                       (raw 32-byte digests; hex in the key)

where ``model`` and ``salt`` are UTF-8 and ``ids_i`` the chunk's token ids as little-endian int64.
So a chunk's key names the whole prefix up to it: equal keys mean equal prefixes (up to SHA-256
collisions), chunks are written once and never replaced, and two models or tenants (``salt``)
never share a key. Only whole chunks are stored; a shorter tail is left to recompute.

Example:
    >>> import torch, kvcodec
    >>> from kvcodec.integrations.stores import open_store
    >>> ids = torch.arange(300)
    >>> cache = kvcodec.KVCache.from_tensors([(torch.randn(300, 2, 8), torch.randn(300, 2, 8))], token_ids=ids)
    >>> store = open_store("memory://prefix-doc")
    >>> put_prefix(store, cache, "kivi-4-ans", chunk_tokens=128, model="m")
    2
    >>> get_prefix(store, torch.cat([ids, torch.tensor([7, 8])]), chunk_tokens=128, model="m").num_tokens
    256
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from ...cache import KVCache
from ...errors import FormatError, InputError
from .base import Store

_DOMAIN = b"kvcodec-prefix-v1\x00"


def chunk_keys(token_ids: Any, chunk_tokens: int = 256, model: str = "", salt: str = "",
               namespace: str = "kvc") -> list[str]:
    """The keys of the whole chunks of ``token_ids`` (module docstring: the hash chain)."""
    if chunk_tokens < 1:
        raise InputError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    ids = torch.as_tensor(token_ids)
    if ids.dim() != 1:
        raise InputError(f"token_ids must be 1-D, got shape {list(ids.shape)}")
    ids = ids.to(torch.int64).cpu()
    prev = _DOMAIN + model.encode() + b"\x00" + salt.encode() + b"\x00"  # h_0's prefix
    keys = []
    for i in range(ids.numel() // chunk_tokens):
        part = ids[i * chunk_tokens:(i + 1) * chunk_tokens].numpy().astype("<i8").tobytes()
        prev = hashlib.sha256(prev + part).digest()
        keys.append(f"{namespace}/{prev.hex()}")
    return keys


def put_prefix(store: Store, cache: KVCache, codec: Any = "kvc-near", chunk_tokens: int = 256, model: str = "",
               salt: str = "", namespace: str = "kvc") -> int:
    """Store the whole chunks of ``cache`` (which must carry ``token_ids``) that the store does not
    hold yet; return how many chunks the store holds for this prefix afterwards.

    ``model`` defaults to the cache's ``model.model_id``. kvc codecs code each chunk as a part
    of a longer sequence (module docstring: sinks in the first, the recency ramp in the last).
    """
    from ...codec import Codec, get_codec

    if cache.token_ids is None:
        raise InputError("put_prefix keys chunks by their token ids: the cache has none")
    c = codec if isinstance(codec, Codec) else get_codec(codec)
    keys = chunk_keys(cache.token_ids, chunk_tokens, model or cache.model.model_id, salt, namespace)
    missing = {i for i, key in enumerate(keys) if not store.exists(key)}
    if not missing:
        return len(keys)
    stored = cache.tokens(0, len(keys) * chunk_tokens)
    if hasattr(c, "encode_parts"):  # kvc: parts of one sequence, the whole cache's attention estimates
        blobs = c.encode_parts(stored, chunk_tokens, only=missing)
    else:
        blobs = [c.encode(stored.tokens(i * chunk_tokens, (i + 1) * chunk_tokens)) if i in missing else None
                 for i in range(len(keys))]
    for i in sorted(missing):
        store.put(keys[i], blobs[i])
    return len(keys)


def get_prefix(store: Store, token_ids: Any, chunk_tokens: int = 256, model: str = "", salt: str = "",
               namespace: str = "kvc", device: str = "cpu") -> KVCache | None:
    """The longest stored prefix of whole chunks of ``token_ids``, decoded, or ``None``.

    Each chunk's recorded token ids are checked against ``token_ids``.

    Raises:
        FormatError: a stored chunk is damaged or holds other tokens than its key names.
    """
    from ...api import decode

    ids = torch.as_tensor(token_ids).to(torch.int64).cpu()
    parts = []
    for i, key in enumerate(chunk_keys(ids, chunk_tokens, model, salt, namespace)):
        blob = store.get(key)
        if blob is None:
            break
        part = decode(blob, device=device)
        want = ids[i * chunk_tokens:(i + 1) * chunk_tokens]
        if part.token_ids is None or not torch.equal(part.token_ids.cpu(), want):
            raise FormatError(f"stored chunk {key} holds other tokens than its key names")
        parts.append(part)
    if not parts:
        return None
    first = parts[0]
    layers = [{r: torch.cat([p.layers[i][r] for p in parts]) for r in first.layers[i]} for i in range(first.num_layers)]
    return KVCache(layers=layers, layer_info=list(first.layer_info), token_ids=torch.cat([p.token_ids for p in parts]),
                   model=first.model, rope_applied=first.rope_applied, rope=dict(first.rope))


__all__ = ["chunk_keys", "get_prefix", "put_prefix"]
