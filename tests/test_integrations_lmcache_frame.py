"""The kvcodec chunk frame (formats/lmcache-frame.md) and ChunkCoder, without LMCache: round trips,
sizes, the fixed-budget mode, and every damaged or foreign frame refused with ``out`` untouched.
The serde inside the real LMCache: tests/test_integrations_lmcache.py."""

from __future__ import annotations

import doctest
import struct
from types import SimpleNamespace

import pytest
import torch

import kvcodec
from kvcodec.errors import ChecksumError, ConfigError, FormatError, InputError
from kvcodec.integrations import lmcache as lm
from kvcodec.integrations.lmcache import FRAME_HEADER, ChunkCoder, coder_from_kwargs, key_digest


def _chunk(layers=3, tokens=64, heads=2, dim=16, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(layers, tokens, heads * dim, generator=g) + 2 * torch.randn(layers, 1, heads * dim, generator=g)
    v = torch.randn(layers, tokens, heads * dim, generator=g)
    return torch.stack([k, v]).to(dtype)


def _key(h=b"\x01" * 32, model="m/x", rank=0, salt=""):
    return SimpleNamespace(chunk_hash=h, model_name=model, kv_rank=rank, object_group_id=0, cache_salt=salt)


@pytest.mark.parametrize("codec", ["kvc-near", "kvc-aggressive", "kivi-4-ans", "fp8-e4m3", "raw"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_frame_round_trip_equals_the_codec(codec, dtype):
    chunk = _chunk(dtype=dtype)
    coder = ChunkCoder(codec, num_kv_heads=2, head_dim=16)
    frame = coder.encode(chunk, _key())
    assert len(frame) <= coder.max_bytes(chunk.shape, dtype)
    out = torch.full_like(chunk, 7)
    coder.decode_into(frame, out, _key())
    want = kvcodec.decode(ChunkCoder.payload(frame))
    for i in range(3):
        assert torch.equal(out[0, i], want.layers[i]["k"].reshape(64, 32).to(dtype))
        assert torch.equal(out[1, i], want.layers[i]["v"].reshape(64, 32).to(dtype))
    if codec == "raw":
        assert torch.equal(out, chunk)


def test_trailing_bytes_after_the_payload_are_ignored():
    chunk = _chunk()
    coder = ChunkCoder("kivi-4-ans", num_kv_heads=2, head_dim=16)
    frame = coder.encode(chunk)
    a, b = torch.zeros_like(chunk), torch.zeros_like(chunk)
    coder.decode_into(frame, a)
    coder.decode_into(frame + b"\xff" * 1000, b)
    assert torch.equal(a, b)


def _refused(coder, buf, key=None, match=None, exc=FormatError):
    out = torch.full(_chunk().shape, 3.0, dtype=torch.float16)
    with pytest.raises(exc, match=match):
        coder.decode_into(buf, out, key)
    assert bool((out == 3.0).all()), "a refused frame wrote into the output"


def test_damaged_and_foreign_frames_are_refused_and_write_nothing():
    coder = ChunkCoder("kvc-near", num_kv_heads=2, head_dim=16)
    frame = coder.encode(_chunk(), _key())
    n = FRAME_HEADER.size
    _refused(coder, b"", match="shorter than")
    _refused(coder, frame[: n - 1], match="shorter than")
    _refused(coder, b"XXXX" + frame[4:], match="magic")
    _refused(coder, frame[:4] + b"\x02" + frame[5:], match="version")
    _refused(coder, frame[:5] + b"\x03" + frame[6:], match="flags")
    _refused(coder, frame[:-1], match="declares")
    _refused(coder, frame, _key(h=b"\x02" * 32), match="another key")
    _refused(coder, frame, _key(salt="tenant-b"), match="another key")
    _refused(coder, frame, _key(rank=1), match="another key")
    body = bytearray(frame)
    body[n + (len(frame) - n) // 2] ^= 0x10
    _refused(coder, bytes(body), _key(), exc=ChecksumError)
    other = ChunkCoder("kvc-near", num_kv_heads=2, head_dim=16).encode(_chunk(layers=2), _key())
    _refused(coder, other, _key(), match="layers")
    # a length field that overflows the buffer
    big = FRAME_HEADER.pack(b"KVCL", 1, 0, 0, 2**63, bytes(16)) + frame[n:]
    _refused(coder, big, match="declares")


def _frame(flags, payload, key=None):
    return FRAME_HEADER.pack(b"KVCL", 1, flags, 0, len(payload), key_digest(key)) + payload


def test_frames_store_the_kvc_header_compressed_and_lossless():
    chunk = _chunk(layers=4, tokens=256, heads=2, dim=64)
    coder = ChunkCoder("kvc-near", num_kv_heads=2, head_dim=64)
    frame = coder.encode(chunk, _key())
    kvc = kvcodec.get_codec("kvc-near").encode(coder.to_cache(chunk, model="m/x"))
    head = 8 + struct.unpack_from("<Q", kvc)[0]
    assert frame[5] == lm.FLAG_ZSTD_HEADER
    assert ChunkCoder.payload(frame, _key()) == kvc  # the KVC file comes back byte for byte
    assert len(frame) < FRAME_HEADER.size + len(kvc) - head // 2, "the compressed header saves under half"
    # a frame with flags 0 holds the KVC file as it is, and reads the same
    plain = _frame(0, kvc, _key())
    a, b = (torch.zeros(chunk.shape, dtype=torch.float16) for _ in range(2))
    coder.decode_into(frame, a, _key())
    coder.decode_into(plain, b, _key())
    assert torch.equal(a, b)


def test_damaged_compressed_headers_are_refused():
    import zstandard

    chunk = _chunk()
    coder = ChunkCoder("kvc-near", num_kv_heads=2, head_dim=16)
    kvc = kvcodec.get_codec("kvc-near").encode(coder.to_cache(chunk))
    head = 8 + struct.unpack_from("<Q", kvc)[0]
    flags, stored = lm._store(kvc)
    assert flags == lm.FLAG_ZSTD_HEADER
    zlen = struct.unpack_from("<I", stored)[0]
    _refused(coder, _frame(1, stored[:3]), match="shorter than its 4-byte length")
    _refused(coder, _frame(1, struct.pack("<I", len(stored)) + stored[4:]), match="compressed header of")
    bad = bytearray(stored)
    bad[4 + zlen // 2] ^= 0x20
    _refused(coder, _frame(1, bytes(bad)), match="does not decompress|declares")
    _refused(coder, _frame(1, b"\0\0\0\0" + kvc), match="compressed header")  # not zstd at all

    def with_header(raw_head):
        z = zstandard.ZstdCompressor(write_content_size=True).compress(raw_head)
        return _frame(1, struct.pack("<I", len(z)) + z + kvc[head:])

    _refused(coder, with_header(kvc[:head] + b"  "), match="length field says")
    _refused(coder, with_header(kvc[:5]), match="declares 5 bytes")
    big = with_header(bytes(lm._MAX_KVC_HEADER + 1))  # a decompression bomb: refused before inflating
    _refused(coder, big, match="declares")
    nosize = zstandard.ZstdCompressor(write_content_size=False).compress(kvc[:head])
    _refused(coder, _frame(1, struct.pack("<I", len(nosize)) + nosize + kvc[head:]), match="size stated")


def test_key_digest_covers_every_key_field():
    base = key_digest(_key())
    assert len(base) == 16 and key_digest(None) == bytes(16)
    for k in (_key(h=b"\x01" * 31 + b"\x00"), _key(model="m/y"), _key(rank=2), _key(salt="s")):
        assert key_digest(k) != base
    assert key_digest(SimpleNamespace(**{**vars(_key()), "object_group_id": 1})) != base
    assert key_digest(_key()) == base


def test_fixed_budget_mode_writes_exactly_the_budget_and_decodes():
    chunk = _chunk(layers=2, tokens=256, heads=2, dim=64)  # kvc-near codes it at ~4.8 b (random data)
    errors = {}
    for bits in (8.0, 3.0, 1.0):
        coder = ChunkCoder("kvc-near", num_kv_heads=2, head_dim=64, budget_bits=bits)
        size = coder.max_bytes(chunk.shape)
        assert size == FRAME_HEADER.size + -(-int(bits * chunk.numel()) // 8)
        frame = coder.encode(chunk, _key())
        assert len(frame) == size
        assert struct.unpack_from("<Q", frame, 8)[0] <= size - FRAME_HEADER.size
        out = torch.zeros_like(chunk)
        coder.decode_into(frame, out, _key())
        errors[bits] = float((out.float() - chunk.float()).norm() / chunk.float().norm())
    # 8 b: the level as it is; smaller budgets: coarser steps, larger error
    assert errors[8.0] < errors[3.0] < errors[1.0]
    plain = torch.zeros_like(chunk)
    ChunkCoder("kvc-near", num_kv_heads=2, head_dim=64).decode_into(
        ChunkCoder("kvc-near", num_kv_heads=2, head_dim=64).encode(chunk), plain)
    assert errors[8.0] == float((plain.float() - chunk.float()).norm() / chunk.float().norm())


def test_fixed_budget_that_cannot_be_met_is_an_error():
    with pytest.raises(InputError, match="budget"):
        ChunkCoder("kvc-near", num_kv_heads=2, head_dim=16, budget_bits=0.01).encode(_chunk())
    with pytest.raises(InputError, match="fixed rate"):
        ChunkCoder("fp8-e4m3", num_kv_heads=2, head_dim=16, budget_bits=2).encode(_chunk())


def test_variable_mode_never_exceeds_its_estimate():
    # tiny chunks: per-file side information can exceed the raw data; the raw fallback bounds it
    for tokens, heads, dim in ((1, 1, 2), (2, 1, 4), (3, 2, 8)):
        chunk = _chunk(layers=1, tokens=tokens, heads=heads, dim=dim)
        coder = ChunkCoder("kvc-near", num_kv_heads=heads, head_dim=dim)
        frame = coder.encode(chunk)
        assert len(frame) <= coder.max_bytes(chunk.shape)
        out = torch.zeros_like(chunk)
        coder.decode_into(frame, out)


@pytest.mark.parametrize("kwargs,match", [
    ({"codec": "kvc-near", "head_dim": 64, "budget_bits": 3}, "num_kv_heads"),
    ({"num_kv_heads": 2, "head_dim": 0, "budget_bits": 3}, "head_dim"),
    ({"num_kv_heads": "two", "head_dim": 64, "budget_bits": 3}, "num_kv_heads"),
    ({"num_kv_heads": 2, "head_dim": 64, "budget_bits": 3, "codecs": "x"}, "unknown kwargs"),
    ({"num_kv_heads": 2, "head_dim": 64, "budget_bits": 3, "codec": "no-such-codec"}, "no-such-codec"),
    ({"num_kv_heads": 2, "head_dim": 64, "budget_bits": 3, "codec": "kvc-near-cal"}, "calibration"),
    ({"num_kv_heads": 2, "head_dim": 64, "budget_bits": 99}, "budget_bits"),
    ({"num_kv_heads": 2, "head_dim": 64}, "budget_bits > 0"),
    ({"num_kv_heads": 2, "head_dim": 64, "budget_bits": 0}, "budget_bits > 0"),
    ({"num_kv_heads": 2, "head_dim": 64, "budget_bits": "lots"}, "budget_bits > 0"),
])
def test_bad_serde_kwargs_are_clear_errors(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        coder_from_kwargs(kwargs)


def test_serde_kwargs_make_the_coder():
    c = coder_from_kwargs({"codec": "kvc-aggressive", "num_kv_heads": 2, "head_dim": 64, "budget_bits": "2.5"})
    assert (c.num_kv_heads, c.head_dim, c.budget_bits) == (2, 64, 2.5)
    assert c.max_bytes((2, 4, 256, 128)) == FRAME_HEADER.size + 2.5 * 2 * 4 * 256 * 128 / 8


def test_wrong_geometry_is_refused():
    coder = ChunkCoder("kvc-near", num_kv_heads=2, head_dim=16)
    with pytest.raises(ConfigError, match="hidden size"):
        coder.max_bytes((2, 3, 64, 48))
    with pytest.raises(ConfigError, match="KV_2LTD"):
        coder.max_bytes((3, 64, 32))
    with pytest.raises(InputError, match="hidden size"):
        coder.encode(_chunk(heads=3))


def test_docstring_examples():
    res = doctest.testmod(lm, optionflags=doctest.ELLIPSIS)
    assert res.attempted and res.failed == 0


def test_a_sequence_of_chunks_is_coded_as_placed_parts(tmp_path):
    from kvcodec.harness.calibration import QueryStats, save_query_statistics
    import numpy as np

    chunks = [_chunk(tokens=64, seed=s) for s in (1, 2)] + [_chunk(tokens=40, seed=3)]
    rng = np.random.default_rng(0)
    stats = QueryStats([rng.uniform(0.1, 4, (2, 16)).astype(np.float32) for _ in range(3)],
                       [rng.normal(size=(4, 8, 16)).astype(np.float32) for _ in range(3)], q_position=200,
                       rope_theta=10000.0, meta={"model": "test"})
    save_query_statistics(stats, tmp_path / "q.safetensors")
    coder = ChunkCoder("kvc-near", num_kv_heads=2, head_dim=16, profile=str(tmp_path / "q.safetensors"))
    keys = [_key(h=bytes([i]) * 32) for i in range(3)]
    frames = coder.encode_sequence(chunks, keys)
    kinds = []
    for frame, chunk, key in zip(frames, chunks, keys):
        out = torch.zeros_like(chunk)
        coder.decode_into(frame, out, key)
        assert (out.float() - chunk.float()).abs().max() < 2.0
        with kvcodec.open(ChunkCoder.payload(frame)) as r:
            kinds.append((r.manifest["codec"]["sinks"], r.manifest["codec"]["recent_ramp"]))
    assert kinds == [(1, 0), (0, 0), (0, 128)]  # the sink in the first, the ramp in the last
    # the same parts estimating their own attention (query_pos) get other steps: other bytes
    mid = ChunkCoder("kvc-near", num_kv_heads=2, head_dim=16, profile=str(tmp_path / "q.safetensors"),
                     part=True, query_pos=168)
    assert ChunkCoder.payload(mid.encode(chunks[1], keys[1])) != ChunkCoder.payload(frames[1], keys[1])
    # codecs without parts code each chunk as encode does
    fp8 = ChunkCoder("fp8-e4m3", num_kv_heads=2, head_dim=16)
    assert fp8.encode_sequence(chunks, keys) == [fp8.encode(c, k) for c, k in zip(chunks, keys)]
    with pytest.raises(ConfigError, match="all but the last"):
        coder.encode_sequence([chunks[2], chunks[0]])
    with pytest.raises(ConfigError, match="budget"):
        ChunkCoder("kvc-near", num_kv_heads=2, head_dim=16, budget_bits=3).encode_sequence(chunks)


def test_chunks_are_coded_whole_by_default_and_as_parts_on_request():
    whole = ChunkCoder("kvc-near", num_kv_heads=2, head_dim=16)
    part = ChunkCoder("kvc-near", num_kv_heads=2, head_dim=16, part=True)
    last = ChunkCoder("kvc-near", num_kv_heads=2, head_dim=16, part=True, last=True)
    first = ChunkCoder("kvc-near", num_kv_heads=2, head_dim=16, part=True, first=True)
    assert (whole._codec.params["sinks"], whole._codec.params["recent_ramp"]) == (1, 128)
    assert (part._codec.params["sinks"], part._codec.params["recent_ramp"]) == (0, 0)
    assert (last._codec.params["sinks"], last._codec.params["recent_ramp"]) == (0, 128)
    assert (first._codec.params["sinks"], first._codec.params["recent_ramp"]) == (1, 0)
    chunk = _chunk(tokens=256)
    fp, fw = part.encode(chunk), whole.encode(chunk)
    assert len(fp) < len(fw)  # no exact first token, no finer last 128 tokens
    with kvcodec.open(ChunkCoder.payload(fp)) as r:
        assert (r.manifest["codec"]["sinks"], r.manifest["codec"]["recent_ramp"]) == (0, 0)
    assert coder_from_kwargs({"num_kv_heads": 2, "head_dim": 16, "budget_bits": 3}).part is False
    assert coder_from_kwargs({"num_kv_heads": 2, "head_dim": 16, "budget_bits": 3, "part": "true"}).part is True
    with pytest.raises(ConfigError, match="part"):
        coder_from_kwargs({"num_kv_heads": 2, "head_dim": 16, "budget_bits": 3, "part": "maybe"})
