"""Hostile and damaged KVC files: every one is rejected with a specific KVCodecError subclass whose
message names the problem -- never another exception, never a hang, never an unbounded allocation.
"""

import json
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save as st_save

import kvcodec
from kvcodec.testing import spelled_out
from kvcodec import format as kvf
from kvcodec.errors import (
    ChecksumError,
    FormatError,
    KVCodecError,
    TruncatedError,
    UnknownCodecError,
    VersionError,
)

from conftest import make_cache
from kvc_tools import join, rewrite, split


def tiny_blob(codec="raw", **kw):
    """A small valid file (about 1 KB): 1 layer, 2 tokens, 1 head, dim 4, with token ids."""
    cache = make_cache(layers=1, tokens=2, heads=1, dim=4, **kw)
    return kvcodec.get_codec(codec).encode(cache)


BLOB = tiny_blob()
GOOD = kvcodec.decode(BLOB)


def reject(data, exc, match):
    with pytest.raises(exc, match=match):
        kvcodec.decode(data)
    with pytest.raises(exc, match=match):
        kvcodec.open(bytes(data)).read_cache()


# ------------------------------------------------------------------ the byte level
def test_empty_and_short_files():
    reject(b"", TruncatedError, "empty file")
    for n in range(1, 8):
        reject(BLOB[:n], TruncatedError, f"only {n} bytes")


def test_header_length_past_end_and_over_limit():
    reject(struct.pack("<Q", 5000) + b"{}", TruncatedError, "header length 5000 runs past the end")
    reject(struct.pack("<Q", 2**63) + b"{}", FormatError, "exceeds the 100000000-byte limit")
    reject(struct.pack("<Q", 100_000_001) + b"{" * 100, FormatError, "exceeds")
    reject(struct.pack("<Q", 1) + b"{", FormatError, "not valid JSON")
    reject(struct.pack("<Q", 0), FormatError, "does not start with")


def test_non_json_and_non_object_headers():
    reject(join("not json at all", b""), FormatError, r"does not start with '\{'")
    reject(join('{"a": 1', b""), FormatError, "not valid JSON")
    reject(join(b'{"__metadata__":{"format":"kvc\xff"}}', b""), FormatError, "not valid UTF-8")
    reject(join('{"__metadata__":{}} x', b""), FormatError, "trailing data")
    reject(join('{"__metadata__":{"a":NaN}}', b""), FormatError, "NaN")
    reject(join('{"x":' + "[" * 100000 + "]" * 100000 + "}", b""), FormatError, "JSON|nested")
    reject(join('{"__metadata__":{"format":"kvc","x":"\\ud800"}}', b""), FormatError, "surrogate")


def test_duplicate_keys_rejected_in_header_metadata_and_manifest():
    h, data = split(BLOB)
    text = json.dumps(h, sort_keys=True, separators=(",", ":"))
    dup = text.replace('{"__metadata__":', '{"meta.token_ids":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"__metadata__":', 1)
    reject(join(dup, data), FormatError, "duplicate key 'meta.token_ids'")
    dup_meta = text.replace('"format":"kvc"', '"format":"kvc","format":"kvc"')
    reject(join(dup_meta, data), FormatError, "duplicate key 'format'")
    reject(rewrite(BLOB, metadata=lambda m: m.update(manifest=m["manifest"][:-1] + ',"num_tokens":2}')),
           FormatError, "CRC|duplicate")

    def dup_manifest(meta):
        meta["manifest"] = meta["manifest"][:-1] + ',"num_tokens":2}'
        import zlib

        meta["manifest_crc32"] = f"{zlib.crc32(meta['manifest'].encode()):08x}"

    reject(rewrite(BLOB, metadata=dup_manifest), FormatError, "manifest: duplicate key 'num_tokens'")


def test_foreign_files_plain_safetensors_and_gguf():
    plain = st_save({"layers.0.k": np.zeros((2, 1, 4), np.float16)})
    reject(plain, FormatError, "plain safetensors file")
    with_meta = st_save({"x": np.zeros(3, np.float32)}, metadata={"format": "pt"})
    reject(with_meta, FormatError, "format is 'pt', not 'kvc'")
    no_key = st_save({"x": np.zeros(3, np.float32)}, metadata={"producer": "me"})
    reject(no_key, FormatError, "no 'format' key")
    # GGUF v3: magic, version, tensor count, metadata kv count, then metadata
    gguf = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 4) + b"name" + bytes(64)
    reject(gguf, FormatError, "GGUF file")


def test_non_string_metadata_values():
    reject(rewrite(BLOB, metadata=lambda m: m.update(extra=5)), FormatError, r"__metadata__\['extra'\] is a int")
    reject(rewrite(BLOB, header=lambda h: h.update(__metadata__=[1])), FormatError, "not a JSON object")


def test_holes_overlaps_trailing_bytes_offsets_past_end_and_overflow():
    h, data = split(BLOB)

    def with_entry(fn):
        hh = json.loads(json.dumps(h))
        fn(hh)
        return hh

    reject(join(h, data + b"\0" * 64), FormatError, "64 trailing bytes")
    reject(join(h, data[:-1]), TruncatedError, "truncated")
    last = max((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][1])
    e = h[last]

    def hole(hh):
        hh[last]["data_offsets"] = [e["data_offsets"][0] + 2, e["data_offsets"][1] + 2]

    reject(join(with_entry(hole), data + b"\0\0"), FormatError, "hole of 2 bytes")

    def overlap(hh):
        hh["pad.99"] = {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}

    reject(join(with_entry(overlap), data), FormatError, "overlaps")

    def past_end(hh):
        hh[last]["data_offsets"] = [e["data_offsets"][0], e["data_offsets"][0] + 10**9]
        hh[last]["shape"] = [10**9 // 2]

    reject(join(with_entry(past_end), data), FormatError, "truncated|shape")

    def overflow(hh):
        hh[last]["shape"] = [2**40, 2**40]

    reject(join(with_entry(overflow), data), FormatError, "overflows the size limit")

    def mismatch(hh):
        hh[last]["shape"] = [3]

    reject(join(with_entry(mismatch), data), FormatError, r"is \d+ bytes but data_offsets span")

    for bad, match in (({"dtype": "BF16"}, "unsupported dtype 'BF16'"), ({"shape": [-1]}, "out of range"),
                       ({"shape": [True]}, "not an integer"), ({"data_offsets": [0]}, r"\[begin, end\]"),
                       ({"junk": 1}, "exactly dtype, shape, data_offsets")):
        reject(join(with_entry(lambda hh: hh[last].update(bad)), data), FormatError, match)


# ------------------------------------------------------------------ the KVC level
def test_versions_and_required_features():
    reject(rewrite(BLOB, metadata=lambda m: m.update(format_version="2.0")), VersionError, "major version 2")
    reject(rewrite(BLOB, metadata=lambda m: m.update(format_version="1")), VersionError, "MAJOR.MINOR")
    reject(rewrite(BLOB, metadata=lambda m: m.pop("format_version")), VersionError, "no 'format_version'")
    reject(rewrite(BLOB, manifest=lambda m: m.update(required_features=["sparse-outliers-v9"])),
           VersionError, "requires feature 'sparse-outliers-v9'")


def test_newer_minor_version_is_read_and_unknown_optional_keys_ignored():
    def add_keys(m):
        m["future_field"] = {"anything": [1, 2]}
        m["layers"][0]["future_layer_field"] = 3
        m["storage"]["future"] = True

    newer = rewrite(BLOB, manifest=add_keys,
                    metadata=lambda meta: meta.update(format_version="1.7", future_meta="x"))
    assert kvcodec.decode(newer).equal(GOOD)
    assert kvcodec.open(newer).version == (1, 7)


def test_unknown_codec_id_and_bad_codec_params():
    reject(rewrite(BLOB, manifest=lambda m: m.update(codec={"id": "zstd-magic-9000"})),
           UnknownCodecError, "unknown codec id 'zstd-magic-9000'")
    reject(rewrite(BLOB, manifest=lambda m: m.update(codec={"id": "raw", "bogus": 1})),
           KVCodecError, "no parameter")


def test_checksum_mismatches():
    h, data = split(BLOB)
    a = h["layers.0.v.bits"]["data_offsets"][0]
    flipped = join(h, data[:a] + bytes([data[a] ^ 0x10]) + data[a + 1 :])
    reject(flipped, ChecksumError, r"tensor 'layers.0.v.bits': CRC-32 mismatch")
    reject(rewrite(BLOB, manifest=lambda m: m.update(num_tokens=3), recrc=False), ChecksumError, "manifest CRC-32")
    reject(rewrite(BLOB, manifest=lambda m: m["model"].update(model_id="x"), recrc=False), ChecksumError, "manifest")
    reject(rewrite(BLOB, metadata=lambda m: m.update(manifest_crc32="zz")), ChecksumError, "manifest CRC-32")
    # a changed checksum in a re-signed manifest is caught against the data
    def bad_tensor_crc(m):
        m["storage"]["tensors"]["layers.0.k.bits"]["crc32"] = "00000000"

    reject(rewrite(BLOB, manifest=bad_tensor_crc), ChecksumError, "layers.0.k.bits")


def test_manifest_inconsistencies_with_valid_checksums():
    cases = [
        (lambda m: m.update(num_tokens=3), "shape"),
        (lambda m: m.update(num_tokens=-1), "out of range"),
        (lambda m: m.pop("layers"), "missing 'layers'"),
        (lambda m: m.update(source_dtype="float8"), "unknown source_dtype"),
        (lambda m: m["layers"][0].update(kind="sliding"), "window must be > 0"),
        (lambda m: m["layers"][0].update(kind="mla"), "kv_heads 1|latent_dim"),
        (lambda m: m["layers"][0]["tensors"].pop("v"), "roles"),
        (lambda m: m["chunking"].update(tokens_per_chunk=1), "chunks|naming rule"),
        (lambda m: m["storage"].update(alignment=8), "alignment must be 64"),
        (lambda m: m["storage"].update(checksum="sha256"), "checksum must be 'crc32'"),
        (lambda m: m.update(has_positions=True), "meta.positions is missing"),
        (lambda m: m["storage"]["tensors"].update({"layers.5.k.bits": {"dtype": "U8", "shape": [0], "crc32": "00000000"}}),
         "names no layer"),
        (lambda m: m["storage"]["tensors"].update({"weird name": {"dtype": "U8", "shape": [0], "crc32": "00000000"}}),
         "naming rule"),
        (lambda m: m["storage"]["tensors"].pop("layers.0.k.bits"), "canonical layout|not in the header"),
        (lambda m: m["storage"]["tensors"]["layers.0.k.bits"].update(shape=[4, 2]), "canonical layout"),
        (lambda m: m["storage"]["tensors"]["layers.0.k.bits"].update(crc32="ABCDEF01"), "8 lowercase hex"),
        (lambda m: m["layers"][0].update(kv_heads=True), "type bool"),
    ]
    for fn, match in cases:
        reject(rewrite(BLOB, manifest=fn), FormatError, match)


def test_declared_sizes_beyond_the_payload_are_refused_before_allocating():
    big = 10**7

    def inflate(m):  # 10M tokens of 1 head x 4 dims declared for a few stored bytes
        m["num_tokens"] = big
        for t in m["layers"][0]["tensors"].values():
            t["shape"][0] = big
            t["chunks"][0]["tokens"] = big
        m["has_token_ids"] = False
        del m["storage"]["tensors"]["meta.token_ids"]

    h, data = split(BLOB)
    blob = rewrite(BLOB, manifest=inflate)
    with pytest.raises(FormatError, match="declares 40000000 elements but stores only 16 bytes"):
        kvcodec.open(blob)


def test_codec_decode_errors_are_wrapped():
    @kvcodec.register_codec
    class Crashy(kvcodec.Codec):
        codec_id = "test-crashy-decoder"

        def encode_tensor(self, x, ctx):
            return kvcodec.EncodedTensor({"bits": np.zeros(3, np.uint8)})

        def decode_tensor(self, enc, ctx):
            return [1, 2, 3][enc.planes["bits"].size + 5]  # IndexError

    blob = Crashy().encode(make_cache(layers=1, tokens=2))
    reject(blob, FormatError, "codec 'test-crashy-decoder' failed to decode: IndexError")

    @kvcodec.register_codec
    class WrongShape(kvcodec.Codec):
        codec_id = "test-wrong-shape"

        def encode_tensor(self, x, ctx):
            return kvcodec.EncodedTensor({"bits": np.zeros(3, np.uint8)})

        def decode_tensor(self, enc, ctx):
            return torch.zeros(1, dtype=ctx.dtype)

    reject(WrongShape().encode(make_cache(layers=1, tokens=2)), FormatError, "codec returned")


def test_nonzero_padding_is_rejected():
    h, data = split(BLOB)
    pad = next(k for k in h if k.startswith("pad."))
    a = h[pad]["data_offsets"][0]
    bad = join(h, data[:a] + b"\x01" + data[a + 1 :])
    reject(bad, FormatError, "non-zero bytes")
    with pytest.raises(FormatError, match="non-zero"):
        kvcodec.open(bad).verify()


# ------------------------------------------------------------------ exhaustive damage
def test_truncation_at_every_byte_offset_is_a_truncated_error():
    assert len(BLOB) < 2048
    for n in range(len(BLOB)):
        with pytest.raises(TruncatedError):
            kvcodec.open(BLOB[:n])


def _outcome(data):
    """None if the file decodes to exactly the original cache; else the KVCodecError raised."""
    try:
        with kvcodec.open(data) as r:
            out = r.read_cache()
    except KVCodecError as e:
        return e
    assert out.equal(GOOD) and torch.equal(out.token_ids, GOOD.token_ids), "undetected damage changed the output"
    assert out.model == GOOD.model and out.layer_info == GOOD.layer_info
    return None


def test_every_single_bit_flip_is_detected_or_harmless():
    """Flip each of the ~8000 bits of a small file: each flip raises our error or, if it decodes,
    the output is bit-identical (a flip in JSON that does not change its meaning)."""
    detected = 0
    harmless = []
    types = set()
    for i in range(len(BLOB)):
        for bit in range(8):
            b = bytearray(BLOB)
            b[i] ^= 1 << bit
            e = _outcome(bytes(b))
            if e is None:
                harmless.append(i)
            else:
                detected += 1
                types.add(type(e).__name__)
    assert detected + len(harmless) == 8 * len(BLOB)
    # The only undetected flips turn format_version "1.0" into a newer minor version ("1.1",
    # "1.2", "1.4", "1.8"), which a 1.0 reader reads identically by the versioning rules.
    minor = BLOB.index(b'"format_version":"1.0"') + len(b'"format_version":"1.')
    assert harmless == [minor] * 4, f"unexpected undetected flips at byte offsets {sorted(set(harmless))}"
    assert {"ChecksumError", "FormatError", "TruncatedError"} <= types


# ------------------------------------------------------------------ fuzzing
def _mutate(blob, data):
    kind = data.draw(st.sampled_from(["flip", "byte", "truncate", "insert", "delete", "header-json", "splice"]))
    b = bytearray(blob)
    if kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, len(b) - 1))
            b[i] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "byte":
        i = data.draw(st.integers(0, len(b) - 1))
        b[i] = data.draw(st.integers(0, 255))
    elif kind == "truncate":
        b = b[: data.draw(st.integers(0, len(b)))]
    elif kind == "insert":
        i = data.draw(st.integers(0, len(b)))
        b[i:i] = data.draw(st.binary(min_size=1, max_size=64))
    elif kind == "delete":
        i = data.draw(st.integers(0, len(b) - 1))
        del b[i : i + data.draw(st.integers(1, 64))]
    elif kind == "header-json":  # valid JSON, wrong content: re-sign the manifest so checks go deeper
        def change(m):
            path = data.draw(st.sampled_from(["num_tokens", "codec", "layers", "storage", "chunking", "rope"]))
            m[path] = data.draw(st.one_of(st.integers(-2, 2**40), st.text(max_size=5), st.none(),
                                          st.lists(st.integers(0, 3), max_size=3),
                                          st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2)))
        b = bytearray(rewrite(bytes(b), manifest=change))
    else:
        i = data.draw(st.integers(0, len(b)))
        b = b[:i] + bytearray(tiny_blob("fp16", seed=1))[i:]
    return bytes(b)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_mutated_files_raise_only_our_errors(data):
    base = data.draw(st.sampled_from([BLOB, _CHUNKED]))
    mutated = _mutate(base, data)
    try:
        with kvcodec.open(mutated) as r:
            r.read_cache()
            r.verify()
    except KVCodecError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=512), st.integers(0, 600))
def test_fuzz_random_bytes_raise_only_our_errors(tail, n):
    for data in (tail, struct.pack("<Q", n) + tail, struct.pack("<Q", len(tail)) + tail):
        with pytest.raises(KVCodecError):
            kvcodec.decode(data)


_CHUNKED = kvcodec.get_codec("fp16").encode(make_cache(layers=2, tokens=5, heads=1, dim=4), tokens_per_chunk=2)


_PRESET_FILES: dict = {}


def _preset_file(name, chunk):
    key = (name, chunk)
    if key not in _PRESET_FILES:
        _PRESET_FILES[key] = spelled_out(name).encode(make_cache(layers=2, tokens=20, heads=2, dim=32),
                                                           tokens_per_chunk=chunk)
    return _PRESET_FILES[key]


_WEIRD = st.one_of(st.integers(-(2**33), 2**33), st.sampled_from([0, 1, 2**31, 2**62, -1]), st.floats(allow_nan=False),
                   st.text(max_size=4), st.none(), st.booleans(), st.lists(st.integers(-3, 300), max_size=4),
                   st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_resigned_codec_params_reach_every_codec_and_raise_only_our_errors(data):
    """Mutated codec configs and chunk params behind a valid manifest CRC go all the way into each
    registered codec's decoder; whatever it does wrong must surface as a KVCodecError."""
    name = data.draw(st.sampled_from(kvcodec.list_codecs()))
    blob = _preset_file(name, data.draw(st.sampled_from([0, 8])))

    def change(m):
        if data.draw(st.booleans()) and len(m["codec"]) > 1:
            k = data.draw(st.sampled_from(sorted(set(m["codec"]) - {"id"})))
            m["codec"][k] = data.draw(_WEIRD)
        else:
            layer = m["layers"][data.draw(st.integers(0, len(m["layers"]) - 1))]
            t = layer["tensors"][data.draw(st.sampled_from(sorted(layer["tensors"])))]
            c = t["chunks"][data.draw(st.integers(0, len(t["chunks"]) - 1))]
            keys = sorted(c["params"]) or ["bits"]
            c["params"][data.draw(st.sampled_from(keys))] = data.draw(_WEIRD)

    try:
        with kvcodec.open(rewrite(blob, manifest=change)) as r:
            r.read_cache()
    except KVCodecError:
        pass


def test_read_layer_checks_exactly_the_padding_inside_its_span():
    cache = make_cache(layers=3, tokens=5, heads=1, dim=3)  # 30-byte planes: a pad after each
    blob = kvcodec.get_codec("raw").encode(cache)
    h, data = split(blob)
    pads = sorted((e["data_offsets"][0], k) for k, e in h.items() if k.startswith("pad."))
    assert len(pads) >= 6
    checked_inside = 0
    for off, name in pads:
        bad = join(h, data[:off] + b"\x80" + data[off + 1 :])
        r = kvcodec.open(bad)
        for i in range(3):
            start, end = r.layer_span(i)
            if start <= 8 + r.header_len + off < end:
                checked_inside += 1
                with pytest.raises(FormatError, match=f"padding tensor '{name}'"):
                    r.read_layer(i)
            else:
                assert torch.equal(r.read_layer(i)["k"], cache.layers[i]["k"])
        with pytest.raises(FormatError, match="non-zero"):
            r.read_cache()
    assert checked_inside >= 3
