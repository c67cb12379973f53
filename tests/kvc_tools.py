"""Helpers for the format tests: take a valid KVC file apart and put a modified one together.

Kept out of the package: these build deliberately broken files.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any, Callable


def split(blob: bytes) -> tuple[dict[str, Any], bytes]:
    """(header dict, data section) of a safetensors file."""
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join(header: dict[str, Any] | str | bytes, data: bytes, align: int = 64) -> bytes:
    """Serialise a header (dict, or raw JSON text) and data into safetensors bytes."""
    if isinstance(header, dict):
        h = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    elif isinstance(header, str):
        h = header.encode()
    else:
        h = header
    h += b" " * (-(8 + len(h)) % align)
    return struct.pack("<Q", len(h)) + h + data


def manifest_of(blob: bytes) -> dict[str, Any]:
    return json.loads(split(blob)[0]["__metadata__"]["manifest"])


def rewrite(
    blob: bytes,
    manifest: Callable[[dict[str, Any]], Any] | None = None,
    metadata: Callable[[dict[str, str]], Any] | None = None,
    header: Callable[[dict[str, Any]], Any] | None = None,
    recrc: bool = True,
) -> bytes:
    """A copy of ``blob`` with the manifest / metadata / header changed in place by the given
    functions; the manifest CRC is recomputed unless ``recrc`` is False."""
    h, data = split(blob)
    meta = h["__metadata__"]
    if manifest is not None:
        m = json.loads(meta["manifest"])
        manifest(m)
        meta["manifest"] = json.dumps(m, sort_keys=True, separators=(",", ":"))
        if recrc:
            meta["manifest_crc32"] = f"{zlib.crc32(meta['manifest'].encode()) & 0xFFFFFFFF:08x}"
    if metadata is not None:
        metadata(meta)
    if header is not None:
        header(h)
    return join(h, data)


def small_cache(layers: int = 2, t: int = 96, h: int = 2, d: int = 16, seed: int = 0):
    """A small fp16 cache with K per-channel offsets and scales and V per-token scales, like real
    caches (the kvc calibration and profile tests)."""
    import torch

    import kvcodec

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        k = torch.randn(t, h, d, generator=g) * (torch.rand(1, h, d, generator=g) * 3) + 4 * torch.randn(1, h, d, generator=g)
        v = torch.randn(t, h, d, generator=g) * (0.5 + torch.rand(t, h, 1, generator=g))
        out.append((k.half(), v.half()))
    return kvcodec.KVCache.from_tensors(out)


def word_tokenizer(n_words: int):
    """A word-level tokenizer of the words ``w0 .. w{n_words-1}`` (ids 2 .. n_words + 1; 0
    ``<unk>``, 1 ``<s>``) for tiny models: ``(tokenizer, words)``."""
    import tokenizers
    import transformers

    words = [f"w{i}" for i in range(n_words)]
    vocab = {"<unk>": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>"), words


def query_stats(cache: Any, hq: int = 4, n: int = 8, seed: int = 1, theta: float = 10000.0):
    """Random query statistics for ``cache`` (energies, ``hq`` heads x ``n`` sampled queries per
    layer, RoPE base ``theta``): a calibration file's content for tests without a model."""
    import numpy as np

    from kvcodec.harness.calibration import QueryStats

    rng = np.random.default_rng(seed)
    h, d = cache.layers[0]["k"].shape[1:]
    energy = [rng.uniform(0.1, 4.0, (h, d)).astype(np.float32) for _ in cache.layers]
    sample = [rng.normal(size=(hq, n, d)).astype(np.float32) for _ in cache.layers]
    return QueryStats(energy, sample, q_position=200, rope_theta=theta, meta={"model": "test"})


def encode_routes(config: Any, cache: Any, tmp_path: Any, chunk: int = 0) -> dict[str, bytes]:
    """The bytes every encode route writes for ``config`` (a name, JSON text or dict), by route:
    ``Codec.encode``, ``encode(path=)``, ``format.write_file`` and the CLI's ``kvcodec encode``."""
    import kvcodec
    from kvcodec.cli import main
    from kvcodec.format import write_file

    raw = tmp_path / "raw.safetensors"
    cache.to_safetensors(raw)
    codec = kvcodec.get_codec(config)
    out = {"Codec.encode": codec.encode(cache, tokens_per_chunk=chunk)}
    codec.encode(cache, tmp_path / "a.kvc", tokens_per_chunk=chunk)
    out["encode(path=)"] = (tmp_path / "a.kvc").read_bytes()
    write_file(codec, cache, tmp_path / "b.kvc", tokens_per_chunk=chunk)
    out["format.write_file"] = (tmp_path / "b.kvc").read_bytes()
    args = ["encode", str(raw), str(tmp_path / "c.kvc"), "--codec",
            config if isinstance(config, str) else json.dumps(config), "--tokens-per-chunk", str(chunk)]
    assert main(args) == 0
    out["kvcodec encode"] = (tmp_path / "c.kvc").read_bytes()
    return out

