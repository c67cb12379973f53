import json

import pytest
import torch

import kvcodec
from kvcodec.testing import spelled_out
from kvcodec.errors import ConfigError, InputError, KVCodecError, UnknownCodecError

from conftest import make_cache


@pytest.mark.parametrize("name", kvcodec.list_codecs())
def test_config_registry_roundtrip(name):
    c = kvcodec.get_codec(name)
    cfg = c.get_config()
    assert cfg["id"] == c.codec_id
    assert kvcodec.get_codec(cfg) == c
    assert kvcodec.get_codec(json.dumps(cfg)) == c
    assert eval(repr(c), {"kvcodec": kvcodec}) == c
    json.dumps(cfg)  # JSON-able


@pytest.mark.parametrize("name", kvcodec.list_codecs())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_every_codec_roundtrips_shape_and_dtype(name, dtype):
    cache = make_cache(dtype=dtype, dim=32)
    codec = spelled_out(name)
    blob = codec.encode(cache)
    out = kvcodec.decode(blob)
    assert out.num_layers == cache.num_layers
    assert out.token_ids is not None and torch.equal(out.token_ids, cache.token_ids)
    for (i, r, a), (_, _, b) in zip(cache.tensors(), out.tensors()):
        assert b.shape == a.shape and b.dtype == a.dtype, (name, i, r)
        assert torch.isfinite(b.float()).all()
    # the all-in size is what encode returned
    assert codec.bits_per_element(cache) == pytest.approx(8 * len(blob) / cache.num_elements)


@pytest.mark.parametrize("name", [n for n in kvcodec.list_codecs() if kvcodec.get_codec(n).lossless])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_lossless_codecs_are_bit_identical(name, dtype):
    cache = make_cache(dtype=dtype)
    assert kvcodec.decode(spelled_out(name).encode(cache)).equal(cache)


def test_fp16_is_bit_identical_on_fp16():
    cache = make_cache(dtype=torch.float16)
    assert kvcodec.decode(kvcodec.get_codec("fp16").encode(cache)).equal(cache)


def test_unknown_codec_and_bad_params():
    with pytest.raises(UnknownCodecError, match="unknown codec 'nope'"):
        kvcodec.get_codec("nope")
    with pytest.raises(UnknownCodecError):
        kvcodec.get_codec({"id": "nope"})
    with pytest.raises(ConfigError, match="no parameter"):
        kvcodec.get_codec({"id": "raw", "bogus": 1})
    with pytest.raises(ConfigError):
        kvcodec.get_codec("{not json")
    assert issubclass(UnknownCodecError, KVCodecError)


def test_nan_input_rejected():
    cache = make_cache(dtype=torch.float32)
    cache.layers[1]["v"][3, 0, 0] = float("nan")
    for name in kvcodec.list_codecs():
        with pytest.raises(InputError, match="NaN or Inf"):
            spelled_out(name).encode(cache)


def test_mla_and_empty_caches():
    for cache in (make_cache(mla=True, dim=40), make_cache(tokens=0), make_cache(tokens=1)):
        for name in kvcodec.list_codecs():
            out = kvcodec.decode(spelled_out(name).encode(cache))
            assert [t.shape for _, _, t in out.tensors()] == [t.shape for _, _, t in cache.tensors()]


def test_a_config_id_may_name_a_preset_with_overrides():
    near = kvcodec.get_codec("kvc-near-cal")
    c = kvcodec.get_codec({"id": "kvc-near-cal", "k_step": 0.5})
    assert c.get_config() == {**near.get_config(), "k_step": 0.5}  # the preset's settings, then the overrides
    assert kvcodec.get_codec('{"id": "kivi-2"}') == kvcodec.get_codec("kivi-2")
    with pytest.raises(kvcodec.errors.UnknownCodecError):
        kvcodec.get_codec({"id": "no-such-preset"})



HUGE_INTS = [2**32 + 1, 2**64, -(2**63), 10**30]
INT_PARAMS = [(n, k) for n in kvcodec.list_codecs() for k, v in kvcodec.get_codec(n).params.items()
              if isinstance(v, int) and not isinstance(v, bool)]


@pytest.mark.parametrize("name,key", INT_PARAMS)
def test_huge_integer_params_do_not_allocate(name, key):
    """A file's codec config is untrusted: an enormous integer parameter is either accepted (some
    are unbounded: chunk sizes, sink counts) or refused with a ConfigError, and in both cases
    without first being used to size anything (``1 << 2**32`` alone is a 512 MiB int)."""
    import tracemalloc

    config = kvcodec.get_codec(name).get_config()
    for v in HUGE_INTS:
        tracemalloc.start()
        try:
            try:
                kvcodec.get_codec({**config, key: v})
            except ConfigError:
                pass
        finally:
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
        assert peak < 8 << 20, f"{name}: {key}={v} allocated {peak >> 20} MiB before refusing"
