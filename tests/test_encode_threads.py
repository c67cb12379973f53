"""The writer codes a codec's tensors on threads (``Codec.encode_threads``): same bytes as one at a
time, on every route that writes a kvc file, errors raised as before."""

from __future__ import annotations

import threading

import pytest
import torch

import kvcodec
import kvcodec.codecs.kvc.codec as kvc_codec
from kvcodec.errors import InputError
from kvcodec.harness.calibration import save_query_statistics
from kvc_tools import query_stats as _stats
from kvc_tools import small_cache


def _both(monkeypatch, make):
    """``make()`` with kvc coding one tensor at a time, then four at once (the threads seen)."""
    seen: set[str] = set()
    real = kvc_codec.KVCCodec.encode_tensor

    def spy(self, x, ctx):
        seen.add(threading.current_thread().name)
        return real(self, x, ctx)

    monkeypatch.setattr(kvc_codec.KVCCodec, "encode_tensor", spy)
    monkeypatch.setattr(kvc_codec.KVCCodec, "encode_threads", 1)
    one = make()
    assert seen == {threading.current_thread().name}
    seen.clear()
    monkeypatch.setattr(kvc_codec.KVCCodec, "encode_threads", 4)
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    many = make()
    return one, many, seen


@pytest.mark.parametrize("chunk", [0, 24])
def test_threaded_kvc_writes_the_same_bytes_and_a_calibrated_call_stays_on_one_thread(monkeypatch, tmp_path, chunk):
    cache = small_cache(layers=5, t=96)
    p = tmp_path / "q.safetensors"
    save_query_statistics(_stats(cache), p)
    caller = threading.current_thread().name
    for config, threaded in (("kvc-near", True), ("kvc-aggressive", True),
                             ({"id": "kvc-near", "calibration": str(p)}, False),
                             ({"id": "kvc-aggressive", "calibration": str(p), "query_pos": 300}, False)):
        codec = kvcodec.get_codec(config)
        one, many, seen = _both(monkeypatch, lambda: codec.encode(cache, tokens_per_chunk=chunk))
        assert one == many
        if threaded:  # really on the writer's threads
            assert len(seen) > 1 and all(n.startswith("kvcodec-encode") for n in seen)
        else:  # kvc's prepare says 1 for a calibrated call (it gained nothing on threads)
            assert seen == {caller}
            with codec.plan(cache) as plan:
                assert plan.encode_threads == 1
        back = kvcodec.decode(many)
        assert back.num_tokens == cache.num_tokens and back.num_layers == cache.num_layers


def test_threaded_parts_and_file_routes_match(monkeypatch, tmp_path):
    cache = small_cache(layers=4, t=80)
    codec = kvcodec.get_codec("kvc-near")
    one, many, seen = _both(monkeypatch, lambda: codec.encode_parts(cache, 32))
    assert one == many and len(many) == 3 and len(seen) > 1
    from kvcodec.format import write_file

    def to_file():
        out = tmp_path / "c.kvc"
        write_file(codec, cache, out)
        return out.read_bytes()

    one, many, seen = _both(monkeypatch, to_file)
    assert one == many == codec.encode(cache) and len(seen) > 1


def test_an_error_on_a_thread_is_raised_and_stops_the_writer(monkeypatch):
    cache = small_cache(layers=12, t=40)
    real = kvc_codec.KVCCodec.encode_tensor
    started: list[int] = []

    def failing(self, x, ctx):
        started.append(ctx.layer)
        if ctx.layer == 2 and ctx.role == "v":
            raise InputError("layers.2.v: refused")
        return real(self, x, ctx)

    monkeypatch.setattr(kvc_codec.KVCCodec, "encode_tensor", failing)
    monkeypatch.setattr(kvc_codec.KVCCodec, "encode_threads", 2)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    with pytest.raises(InputError, match="layers.2.v: refused"):
        kvcodec.get_codec("kvc-near").encode(cache)
    assert max(started) <= 4  # bounded look-ahead: the later layers never started


def test_a_codec_that_does_not_say_so_codes_on_the_callers_thread(monkeypatch):
    from kvcodec.codecs.kivi import KIVICodec

    assert KIVICodec.encode_threads == 1
    names: set[str] = set()
    real = KIVICodec.encode_tensor

    def spy(self, x, ctx):
        names.add(threading.current_thread().name)
        return real(self, x, ctx)

    monkeypatch.setattr(KIVICodec, "encode_tensor", spy)
    kvcodec.get_codec("kivi-4").encode(small_cache(layers=3, t=40))
    assert names == {threading.current_thread().name}


def test_a_zero_token_cache_still_writes(monkeypatch):
    cache = kvcodec.KVCache.from_tensors([(torch.zeros(0, 2, 16, dtype=torch.float16),) * 2] * 3)
    monkeypatch.setattr(kvc_codec.KVCCodec, "encode_threads", 4)
    for chunk in (0, 16):
        blob = kvcodec.get_codec("kvc-near").encode(cache, tokens_per_chunk=chunk)
        assert kvcodec.decode(blob).num_tokens == 0
