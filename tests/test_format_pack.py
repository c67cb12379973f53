"""Packed planes (kvcodec.format.pack) and kvc's ``pack`` layout: exact round trips, strict reading."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec.testing import spelled_out
from kvcodec.codec import TensorContext
from kvcodec.codecs.kvc import PACK_PIECES
from kvcodec.errors import FormatError
from kvcodec.format.pack import PACK_DTYPES, pack_planes, unpack_planes
from conftest import make_cache

NAMES = ("a", "b", "c", "d")


def _planes(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "a": rng.integers(0, 255, size=7, dtype=np.uint8),
        "b": rng.standard_normal((2, 3)).astype(np.float16),
        "c": np.zeros((0, 4), dtype=np.int32),
        "d": rng.integers(-(2**31), 2**31 - 1, size=(1, 2, 3), dtype=np.int64).astype(np.int32),
    }


def test_round_trip_every_dtype_and_layout():
    planes = _planes()
    blob, d = pack_planes(planes, NAMES)
    assert blob.dtype == np.uint8 and [e[0] for e in d] == [0, 1, 2, 3]
    # a: 7 bytes at 0; b: 12 bytes at 8 (aligned to 4); c: empty at 20; d: 24 bytes at 20
    assert blob.size == 44 and not blob[7] and blob[8:20].tobytes() == planes["b"].tobytes()
    out = unpack_planes(blob, d, NAMES)
    assert set(out) == set(planes)
    for k, v in planes.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape and np.array_equal(out[k], v)
    for i, dt in enumerate(PACK_DTYPES):
        x = np.arange(5).astype(dt)
        b2, d2 = pack_planes({"a": x}, NAMES)
        assert d2 == [[0, i, 5]] and np.array_equal(unpack_planes(b2, d2, NAMES)["a"], x)
    assert unpack_planes(*pack_planes({}, NAMES), NAMES) == {}
    with pytest.raises(ValueError, match="not in"):
        pack_planes({"zz": np.zeros(1, np.uint8)}, NAMES)
    with pytest.raises(ValueError, match="cannot pack"):
        pack_planes({"a": np.zeros(1, np.int64)}, NAMES)


def test_hostile_directories_and_blobs_are_refused():
    blob, d = pack_planes(_planes(), NAMES)
    bad_dirs = [
        "x", [[0]], [[0, 0, 1, 1, 1, 1, 1]], [[9, 0, 1]], [[-1, 0, 1]], [[0, 0, 7], [0, 0, 1]],
        [[0, 7, 1]], [[0, 0, -1]], [[0, 0, 2**40]], [[0, 0, 1.0]], [[True, 0, 1]], [[0, 0, 8]],
        [[0, 0, 7]], [d[0]] * 5,
    ]
    for bad in bad_dirs:
        with pytest.raises(FormatError):
            unpack_planes(blob, bad, NAMES)
    with pytest.raises(FormatError, match="after its last piece"):
        unpack_planes(np.concatenate([blob, np.zeros(1, np.uint8)]), d, NAMES)
    with pytest.raises(FormatError, match="runs past"):
        unpack_planes(blob[:-1], d, NAMES)
    dirty = blob.copy()
    dirty[7] = 1  # the gap before piece b
    with pytest.raises(FormatError, match="padding"):
        unpack_planes(dirty, d, NAMES)
    for plane in (None, blob.astype(np.int8), blob.reshape(4, 11)):
        with pytest.raises(FormatError, match="uint8"):
            unpack_planes(plane, d, NAMES)


def test_zstd_pieces_round_trip_and_hostile_frames_are_refused():
    import zstandard

    planes = {"a": np.zeros(3000, np.uint16), "b": np.arange(10, dtype=np.uint8), "c": np.arange(6, dtype=np.int8)}
    blob, d = pack_planes(planes, NAMES, zstd_level=3, zstd_pieces=("a", "c"))
    assert d[0][:2] == [0, 17] and d[1][1] == 0 and d[2][1] == 3  # c does not shrink: stored raw
    out = unpack_planes(blob, d, NAMES)
    for k, v in planes.items():
        assert out[k].dtype == v.dtype and np.array_equal(out[k], v)
    stored = d[0][2]
    frame = blob[:stored].tobytes()

    def with_frame(f, dims=(3000,)):
        return np.frombuffer(f, np.uint8).copy(), [[0, 17, len(f), *dims]]

    assert np.array_equal(unpack_planes(*with_frame(frame), NAMES)["a"], planes["a"])
    bad = [
        (frame[:-1], (3000,), "zstd"),                                   # truncated frame
        (frame + b"\0", (3000,), "zstd"),                               # bytes after the frame
        (frame, (2999,), "declares"),                                    # directory disagrees
        (zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 6000), (3000,), "declares"),
        (b"\x01\x02\x03\x04", (3000,), "zstd"),                         # not a frame
        (zstandard.ZstdCompressor().compress(b"\0" * (1 << 20)), (1 << 19,), "decompress"),  # a bomb
    ]
    for f, dims, msg in bad:
        b2, d2 = with_frame(f, dims)
        with pytest.raises(FormatError, match=msg):
            unpack_planes(b2, d2, NAMES)
    for entry in ([0, 17], [0, 17, 0, 3000], [0, 17, 10**6, 3000], [0, 40, 5, 1]):
        with pytest.raises(FormatError):
            unpack_planes(blob, [entry], NAMES)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=64), st.lists(st.lists(st.integers(-3, 70), min_size=0, max_size=7), max_size=6))
def test_random_directories_raise_format_errors_only(data, directory):
    blob = np.frombuffer(data, dtype=np.uint8)
    try:
        out = unpack_planes(blob, directory, NAMES)
    except FormatError:
        return
    assert sum(v.nbytes for v in out.values()) <= blob.size


def test_kvc_packed_file_is_smaller_and_decodes_like_the_unpacked_one():
    cache = make_cache(layers=3, tokens=70, heads=2, dim=24, dtype=torch.float16, seed=5)
    for preset in ("kvc-near", "kvc-aggressive", "kvc-transparent-cal"):
        zpacked = spelled_out(preset)
        packed, loose = spelled_out({"id": preset, "pack": 1}), spelled_out({"id": preset, "pack": 0})
        assert zpacked.params["pack"] == 2
        b2, b1, b0 = zpacked.encode(cache), packed.encode(cache), loose.encode(cache)
        assert len(b1) < len(b0) - 3 * 2 * 4 * 150, (len(b1), len(b0))  # ~200 bytes per plane saved
        assert len(b2) < len(b1), (len(b2), len(b1))  # the tables compress
        assert kvcodec.decode(b2).equal(kvcodec.decode(b0)) and kvcodec.decode(b1).equal(kvcodec.decode(b0))
        with kvcodec.open(b2) as r:
            names = {n.rsplit(".", 1)[1] for n in r.manifest["storage"]["tensors"] if n.startswith("layers.")}
            dirs = [c["params"]["pk"] for layer in r.manifest["layers"] for t in layer["tensors"].values()
                    for c in t["chunks"]]
        assert names == {"pack"}
        assert any(e[1] >= 16 for d in dirs for e in d)  # some pieces are zstd frames...
        assert all(e[1] < 16 for d in dirs for e in d if PACK_PIECES[e[0]] in ("ans_words", "protect"))  # ...not these


def test_kvc_refuses_mixed_or_broken_packed_tensors():
    cache = make_cache(layers=1, tokens=40, heads=2, dim=16, dtype=torch.float16, seed=6)
    codec = kvcodec.get_codec("kvc-near")
    k = cache.layers[0]["k"]
    ctx = TensorContext(0, "k", tuple(k.shape), k.dtype)
    enc = codec.encode_tensor(k, ctx)
    assert set(enc.planes) == {"pack"} and enc.params["pk"]
    assert [e[0] for e in enc.params["pk"]] == sorted(e[0] for e in enc.params["pk"])
    assert {PACK_PIECES[e[0]] for e in enc.params["pk"]} <= set(PACK_PIECES)
    good = codec.decode_tensor(enc, ctx)
    assert torch.equal(good, codec.decode_tensor(codec.encode_planes(k, ctx), ctx))
    mixed = type(enc)({**enc.planes, "side": np.zeros((2, 2, 16), np.float16)}, dict(enc.params))
    with pytest.raises(FormatError, match="exactly one plane"):
        codec.decode_tensor(mixed, ctx)
    no_dir = type(enc)(dict(enc.planes), {k2: v for k2, v in enc.params.items() if k2 != "pk"})
    with pytest.raises(FormatError, match="exactly one plane"):
        codec.decode_tensor(no_dir, ctx)
    loose = codec.encode_planes(k, ctx)
    stray = type(loose)(dict(loose.planes), {**loose.params, "pk": []})
    with pytest.raises(FormatError, match="exactly one plane"):
        codec.decode_tensor(stray, ctx)
    missing_side = type(enc)(dict(enc.planes), {**enc.params, "pk": [e for e in enc.params["pk"] if e[0] != 1]})
    with pytest.raises(FormatError):
        codec.decode_tensor(missing_side, ctx)
