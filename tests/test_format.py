"""KVC v1 writer and reader: canonical bytes, alignment, safetensors compatibility, metadata round
trips, chunking, atomic writes, lazy reads (formats/SPEC.md)."""

import io
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

import kvcodec
from kvcodec.testing import spelled_out
from kvcodec import KVCache, LayerInfo, ModelIdentity
from kvcodec import format as kvf
from kvcodec.errors import FormatError, InputError, KVCodecError

from conftest import make_cache
from kvc_tools import manifest_of, split

ROOT = Path(__file__).resolve().parents[1]


def rich_cache(tokens=21, dtype=torch.float16):
    """Full, sliding and MLA layers with different head dims, positions, identity and RoPE."""
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return KVCache(
        layers=[{"k": r(tokens, 2, 16), "v": r(tokens, 2, 8)},
                {"k": r(tokens, 2, 16), "v": r(tokens, 2, 8)},
                {"kv": r(tokens, 1, 24)}],
        layer_info=[LayerInfo("full"), LayerInfo("sliding", 4096), LayerInfo("mla")],
        token_ids=torch.arange(100, 100 + tokens),
        positions=torch.arange(tokens) + 5,
        model=ModelIdentity("org/model-é", "abc123", "cfg:9f", "tok@v2"),
        rope_applied=False,
        rope={"theta": 10000.0, "scaling": {"type": "linear", "factor": 2.0}},
    )


def test_crc32_check_value():
    # the standard CRC-32 (ISO-HDLC) check value, as formats/SPEC.md states it
    assert kvf.crc32_hex(b"123456789") == "cbf43926"


@pytest.mark.parametrize("name", kvcodec.list_codecs())
def test_every_preset_is_deterministic_aligned_and_opens_in_safetensors(name, tmp_path):
    cache = make_cache(layers=2, tokens=33, dim=32)
    codec = spelled_out(name)
    blob = codec.encode(cache)
    assert codec.encode(cache) == blob  # canonical: same input and config, same bytes
    assert kvcodec.get_codec(codec.get_config()).encode(cache) == blob
    (n,) = struct.unpack("<Q", blob[:8])
    assert (8 + n) % 64 == 0
    header, data = split(blob)
    for tname, e in header.items():
        if tname != "__metadata__" and not tname.startswith("pad."):
            assert (8 + n + e["data_offsets"][0]) % 64 == 0, tname
    p = tmp_path / "c.kvc"
    p.write_bytes(blob)
    reader = kvcodec.open(p)
    with safe_open(str(p), "np") as f:
        assert f.metadata()["format"] == "kvc" and f.metadata()["format_version"] == "1.0"
        names = [k for k in f.keys() if not k.startswith("pad.")]
        assert sorted(names) == sorted(reader.tensor_names())
        for k in names:
            assert np.array_equal(f.get_tensor(k), reader.read_plane(k)), k
    reader.close()


def test_header_and_manifest_are_canonical_json():
    blob = kvcodec.get_codec("raw").encode(rich_cache())
    (n,) = struct.unpack("<Q", blob[:8])
    text = blob[8 : 8 + n].rstrip(b" ")
    h = json.loads(text)
    assert text == json.dumps(h, sort_keys=True, separators=(",", ":")).encode()
    m = h["__metadata__"]["manifest"]
    assert m == json.dumps(json.loads(m), sort_keys=True, separators=(",", ":"))
    assert h["__metadata__"]["manifest_crc32"] == f"{zlib.crc32(m.encode()):08x}"
    # padding tensors are U8, 1..63 bytes, zero
    data = blob[8 + n :]
    for k, e in h.items():
        if k.startswith("pad."):
            a, b = e["data_offsets"]
            assert e["dtype"] == "U8" and 1 <= b - a < 64 and data[a:b] == bytes(b - a)


def test_manifest_records_geometry_identity_rope_and_checksums():
    cache = rich_cache()
    blob = kvcodec.get_codec("fp16").encode(cache)
    m = manifest_of(blob)
    assert m["producer"] == {"name": "kvcodec", "version": kvcodec.__version__}
    assert m["model"] == {"model_id": "org/model-é", "revision": "abc123", "config_hash": "cfg:9f",
                          "tokenizer": "tok@v2"}
    assert m["source_dtype"] == "float16" and m["num_tokens"] == 21
    assert m["rope"] == {"applied": False, "params": {"theta": 10000.0, "scaling": {"type": "linear", "factor": 2.0}}}
    assert [(l["kind"], l["window"], l["kv_heads"]) for l in m["layers"]] == [("full", 0, 2), ("sliding", 4096, 2), ("mla", 0, 1)]
    assert (m["layers"][0]["head_dim_k"], m["layers"][0]["head_dim_v"], m["layers"][2]["latent_dim"]) == (16, 8, 24)
    assert m["codec"] == {"id": "fp16"} and m["required_features"] == []
    header, data = split(blob)
    st = m["storage"]["tensors"]
    assert set(st) == {k for k in header if k != "__metadata__" and not k.startswith("pad.")}
    for k, e in st.items():
        a, b = header[k]["data_offsets"]
        assert e["crc32"] == f"{zlib.crc32(data[a:b]):08x}"
        assert (e["dtype"], e["shape"]) == (header[k]["dtype"], header[k]["shape"])


def test_rich_cache_roundtrip_keeps_everything():
    cache = rich_cache(dtype=torch.bfloat16)
    out = kvcodec.decode(kvcodec.get_codec("raw").encode(cache))
    assert out.equal(cache)
    assert out.layer_info == cache.layer_info
    assert torch.equal(out.token_ids, cache.token_ids) and torch.equal(out.positions, cache.positions)
    assert out.model == cache.model and out.rope == cache.rope and out.rope_applied is False


@pytest.mark.parametrize("tokens_per_chunk", [1, 7, 21, 64])
def test_chunked_files_roundtrip_and_read_chunk_ranges(tokens_per_chunk):
    cache = rich_cache(tokens=21, dtype=torch.float32)
    blob = kvcodec.get_codec("raw").encode(cache, tokens_per_chunk=tokens_per_chunk)
    assert kvcodec.decode(blob).equal(cache)
    with kvcodec.open(blob) as r:
        nc = -(-21 // tokens_per_chunk)
        assert r.tokens_per_chunk == tokens_per_chunk and r.num_chunks == nc
        sel = range(nc // 2, nc)
        part = r.read_layer(1, chunks=sel)
        lo = sel.start * tokens_per_chunk
        assert torch.equal(part["k"], cache.layers[1]["k"][lo:])
        assert any(".c0." in n for n in r.tensor_names())
        with pytest.raises(InputError, match="chunk"):
            r.read_layer(0, chunks=[nc])


def test_empty_and_single_token_caches_chunked():
    for cache in (make_cache(tokens=0), make_cache(tokens=1, mla=True)):
        for c in (0, 4):
            out = kvcodec.decode(kvcodec.get_codec("fp16").encode(cache, tokens_per_chunk=c))
            assert [t.shape for _, _, t in out.tensors()] == [t.shape for _, _, t in cache.tensors()]


def test_write_file_streams_the_same_bytes(tmp_path):
    cache = rich_cache()
    codec = kvcodec.get_codec("raw")
    blob = codec.encode(cache, tokens_per_chunk=8)
    p = tmp_path / "s.kvc"
    assert kvf.write_file(codec, cache, p, tokens_per_chunk=8) == len(blob)
    assert p.read_bytes() == blob
    bio = io.BytesIO()
    kvf.write_file(codec, cache, bio, tokens_per_chunk=8)
    assert bio.getvalue() == blob
    # encode(path=...) writes the same bytes
    assert codec.encode(cache, path=tmp_path / "e.kvc", tokens_per_chunk=8) == (tmp_path / "e.kvc").read_bytes()
    # and the readers accept paths, bytes, bytearray, memoryview and file objects alike
    for src in (p, str(p), blob, bytearray(blob), memoryview(blob), io.BytesIO(blob)):
        assert kvcodec.decode(src).equal(cache)


class _FailingCodec(kvcodec.Codec):
    codec_id = "test-fails-at-layer-2"

    def encode_tensor(self, x, ctx):
        if ctx.layer == 2:
            raise InputError("deliberate failure in layer 2")
        return kvcodec.EncodedTensor({"bits": x.contiguous().view(torch.int16).numpy()})

    def decode_tensor(self, enc, ctx):  # pragma: no cover - never reached
        raise AssertionError


def test_writes_are_atomic_and_leave_no_temporary_files(tmp_path):
    good = kvcodec.get_codec("raw").encode(make_cache(), path=tmp_path / "c.kvc")
    cache = make_cache(layers=4)
    with pytest.raises(InputError, match="layer 2"):
        _FailingCodec().encode(cache, path=tmp_path / "c.kvc")
    with pytest.raises(InputError, match="layer 2"):
        kvf.write_file(_FailingCodec(), cache, tmp_path / "c.kvc")
    assert (tmp_path / "c.kvc").read_bytes() == good
    assert sorted(os.listdir(tmp_path)) == ["c.kvc"]
    umask = os.umask(0o022)
    os.umask(umask)
    assert (tmp_path / "c.kvc").stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600


def test_writer_rejects_bad_plane_names_dtypes_and_params():
    class Bad(kvcodec.Codec):
        codec_id = "test-bad-planes"
        mode = "name"

        def encode_tensor(self, x, ctx):
            a = np.zeros(3, np.uint8)
            if self.mode == "name":
                return kvcodec.EncodedTensor({"has.dot": a})
            if self.mode == "dtype":
                return kvcodec.EncodedTensor({"p": np.zeros(3, np.complex64)})
            return kvcodec.EncodedTensor({"p": a}, {"scale": float("nan")})

        def decode_tensor(self, enc, ctx):  # pragma: no cover
            raise AssertionError

    for mode, match in (("name", "plane name"), ("dtype", "cannot be stored"), ("params", "finite JSON")):
        Bad.mode = mode
        with pytest.raises(KVCodecError, match=match):
            Bad().encode(make_cache(layers=1))


class _CountingFile(io.RawIOBase):
    """A file wrapper that counts the bytes read through it."""

    def __init__(self, path):
        self._f = open(path, "rb")
        self.bytes_read = 0
        self.reads = []

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, off, whence=0):
        return self._f.seek(off, whence)

    def tell(self):
        return self._f.tell()

    def read(self, n=-1):
        pos = self._f.tell()
        b = self._f.read(n)
        self.bytes_read += len(b)
        self.reads.append((pos, len(b)))
        return b

    def close(self):
        self._f.close()
        super().close()


def test_reading_one_layer_of_30_reads_only_that_layers_bytes(tmp_path):
    cache = make_cache(layers=30, tokens=64, heads=2, dim=32)
    p = tmp_path / "c30.kvc"
    kvcodec.get_codec("fp16").encode(cache, path=p)
    size = p.stat().st_size
    f = _CountingFile(p)
    r = kvcodec.open(f)
    header_bytes, n_open = f.bytes_read, len(f.reads)
    assert header_bytes == 8 + r.header_len  # opening reads the header only
    layer = r.read_layer(17)
    assert torch.equal(layer["k"], cache.layers[17]["k"]) and torch.equal(layer["v"], cache.layers[17]["v"])
    start, end = r.layer_span(17)
    assert f.bytes_read - header_bytes == end - start
    assert end - start < r.layer_nbytes(17) + 64  # the span is the layer's planes plus alignment padding
    assert all(start <= pos and pos + n <= end for pos, n in f.reads[n_open:])
    assert f.bytes_read < header_bytes + 2 * (size - 8 - r.header_len) / 30
    r.close()


def test_reading_a_chunk_reads_only_that_chunk(tmp_path):
    cache = make_cache(layers=4, tokens=256, heads=2, dim=32)
    p = tmp_path / "chunked.kvc"
    kvcodec.get_codec("fp16").encode(cache, path=p, tokens_per_chunk=32)
    f = _CountingFile(p)
    r = kvcodec.open(f)
    before = f.bytes_read
    part = r.read_layer(2, chunks=[3])
    assert torch.equal(part["v"], cache.layers[2]["v"][96:128])
    plane_bytes = 2 * 32 * 2 * 32 * 2  # K and V, 32 tokens x 2 heads x 32 dims x fp16
    assert f.bytes_read - before == plane_bytes
    r.close()


def test_reader_properties_and_bad_layer_index():
    blob = kvcodec.get_codec("raw").encode(rich_cache())
    r = kvcodec.open(blob)
    assert (r.num_layers, r.num_tokens, r.version, r.dtype) == (3, 21, (1, 0), torch.float16)
    assert r.num_elements == rich_cache().num_elements
    assert r.layer_info(1) == LayerInfo("sliding", 4096)
    assert [t for t in r.tensor_names() if t.startswith("meta.")] == ["meta.token_ids", "meta.positions"]
    assert r.verify() == {"ok": True, "tensors": 7, "layers": 3, "bytes": len(blob), "decoded": True}
    for bad in (-1, 3, "0", 1.0):
        with pytest.raises(InputError, match="out of range"):
            r.read_layer(bad)
    with pytest.raises(InputError, match="no stored tensor"):
        r.read_plane("pad.0")


def test_codec_mismatch_on_decode():
    blob = kvcodec.get_codec("raw").encode(make_cache())
    with pytest.raises(FormatError, match="written by codec 'raw'"):
        kvcodec.get_codec("fp16").decode(blob)


@pytest.mark.parametrize("cache_fn", [lambda: make_cache(tokens=0), lambda: make_cache(tokens=1, mla=True), rich_cache])
@pytest.mark.parametrize("chunk", [0, 3])
def test_safe_open_reads_edge_case_files(tmp_path, cache_fn, chunk):
    cache = cache_fn()
    p = tmp_path / "e.kvc"
    kvcodec.get_codec("raw").encode(cache, path=p, tokens_per_chunk=chunk)
    with safe_open(str(p), "pt") as f, kvcodec.open(p) as r:
        assert sorted(k for k in f.keys() if not k.startswith("pad.")) == sorted(r.tensor_names())
        for k in r.tensor_names():
            assert np.array_equal(f.get_tensor(k).numpy(), r.read_plane(k))
    assert kvcodec.decode(p).equal(cache)


def test_text_mode_file_objects_are_refused_clearly(tmp_path):
    p = tmp_path / "c.kvc"
    kvcodec.get_codec("raw").encode(make_cache(), path=p)
    with open(p, "r", encoding="latin-1") as f, pytest.raises(FormatError, match="binary mode"):
        kvcodec.open(f)
    with pytest.raises(FormatError, match="cannot read"):
        kvcodec.open(tmp_path)  # a directory
    with pytest.raises(FormatError, match="expected a path, bytes or a binary file"):
        kvcodec.open(12)


def test_unwritable_destinations_raise_input_error(tmp_path):
    codec, cache = kvcodec.get_codec("raw"), make_cache(layers=1)
    for write in (lambda p: codec.encode(cache, path=p), lambda p: kvf.write_file(codec, cache, p)):
        with pytest.raises(InputError, match="cannot write .*No such file or directory"):
            write(tmp_path / "missing-dir" / "c.kvc")
        with pytest.raises(InputError, match="cannot write"):
            write(tmp_path)  # a directory cannot be replaced by a file
    assert sorted(os.listdir(tmp_path)) == []


def test_a_reader_may_lower_the_elements_per_byte_bound(tmp_path):
    """Decoding work is linear in the declared elements (formats/SPEC.md §7): a reader of untrusted
    files lowers the bound; a constant cache (all elements in almost no bytes) is then refused
    before anything is decoded, and a file within the bound still decodes."""
    import pytest as _pytest

    from kvcodec.errors import ConfigError, FormatError

    flat = kvcodec.KVCache.from_tensors([(torch.zeros(2048, 2, 64).half(), torch.zeros(2048, 2, 64).half())])
    blob = kvcodec.get_codec("kvc-near").encode(flat)
    per_byte = flat.num_elements / len(blob)
    assert per_byte > 64
    assert kvcodec.decode(blob).equal(flat)
    with _pytest.raises(FormatError, match="more than 16 elements per byte"):
        kvcodec.decode(blob, max_elements_per_byte=16)
    with _pytest.raises(FormatError, match="elements per byte"):
        kvcodec.format.open_container(blob, max_elements_per_byte=16)
    noisy = kvcodec.KVCache.from_tensors([(torch.randn(2048, 2, 64).half(), torch.randn(2048, 2, 64).half())])
    assert kvcodec.decode(kvcodec.get_codec("kvc-near").encode(noisy), max_elements_per_byte=16).num_tokens == 2048
    for bad in (0, 4097, 1.5, True):
        with _pytest.raises(ConfigError, match="max_elements_per_byte"):
            kvcodec.open(blob, max_elements_per_byte=bad)
