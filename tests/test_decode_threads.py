"""The reader decodes a codec's tensors on threads (``Codec.decode_threads``) a few layers ahead:
the same values as one thread, bit for bit, whole files and chunked ones, with and without
prediction across layers; a bad tensor raises the error it raises on one thread."""

from __future__ import annotations

import threading

import pytest
import torch

import kvcodec
import kvcodec.codecs.kvc.codec as kvc_codec
from kvcodec.errors import FormatError
from kvc_tools import rewrite, small_cache
from test_kvc_xpred import cfg, drifting_cache, profile_file


def _both(monkeypatch, blob):
    """``blob`` decoded with kvc on one thread, then on two (and the threads that decoded)."""
    seen: set[str] = set()
    real = kvc_codec.KVCCodec.decode_tensor

    def spy(self, enc, ctx):
        seen.add(threading.current_thread().name)
        return real(self, enc, ctx)

    monkeypatch.setattr(kvc_codec.KVCCodec, "decode_tensor", spy)
    monkeypatch.setattr(kvc_codec.KVCCodec, "decode_threads", 1)
    one = kvcodec.decode(blob)
    assert seen == {threading.current_thread().name}
    seen.clear()
    monkeypatch.setattr(kvc_codec.KVCCodec, "decode_threads", 2)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    two = kvcodec.decode(blob)
    return one, two, seen


def _same(a, b):
    assert a.num_layers == b.num_layers
    for la, lb in zip(a.layers, b.layers):
        for r in la:
            assert torch.equal(la[r].view(torch.int16), lb[r].view(torch.int16)), r


@pytest.mark.parametrize("chunk", [0, 100])
def test_two_threads_decode_the_same_values(monkeypatch, tmp_path, chunk):
    cache = drifting_cache(layers=5, t=300, positions=torch.arange(40, 340))
    prof = profile_file(tmp_path / "p.safetensors", cache, kind="random")
    for config in ("kvc-near", cfg(prof), cfg(prof, xpred=0)):
        blob = kvcodec.get_codec(config).encode(cache, tokens_per_chunk=chunk)
        one, two, seen = _both(monkeypatch, blob)
        _same(one, two)
        assert len(seen) > 1 and all(n.startswith("kvcodec-decode") for n in seen)


def test_other_codecs_stay_on_one_thread(monkeypatch):
    cache = small_cache(layers=3, t=40)
    seen: set[str] = set()
    c = kvcodec.get_codec("cachegen")
    real = type(c).decode_tensor

    def spy(self, enc, ctx):
        seen.add(threading.current_thread().name)
        return real(self, enc, ctx)

    monkeypatch.setattr(type(c), "decode_tensor", spy)
    kvcodec.decode(c.encode(cache))
    assert seen == {threading.current_thread().name}


def test_a_corrupt_tensor_raises_as_on_one_thread(monkeypatch):
    cache = small_cache(layers=4, t=64)
    blob = kvcodec.get_codec("kvc-near").encode(cache)

    def bad(m):  # a step base that no encoder writes, in the third layer's V
        m["layers"][2]["tensors"]["v"]["chunks"][0]["params"]["step_base"] = [10**6] * 2
    broken = rewrite(blob, bad)
    errors = []
    for threads in (1, 2):
        monkeypatch.setattr(kvc_codec.KVCCodec, "decode_threads", threads)
        monkeypatch.setattr("os.cpu_count", lambda: 2)
        with pytest.raises(FormatError) as e:
            kvcodec.decode(broken)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "layers.2.v" in errors[0]


def test_threads_one_keeps_everything_on_the_callers_thread(monkeypatch, tmp_path):
    """``kvcodec.decode(..., threads=1)`` (what the vLLM connector asks when it decodes chunks side
    by side): no pool, no split of the prediction pass, the same values; bad values refused."""
    from kvcodec.errors import InputError

    cache = drifting_cache(layers=3, t=300, positions=torch.arange(300))
    prof = profile_file(tmp_path / "p.safetensors", cache, kind="random")
    blob = kvcodec.get_codec(cfg(prof)).encode(cache)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    started = []
    real_start = threading.Thread.start

    def start(self):
        started.append(self.name)
        return real_start(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    one = kvcodec.decode(blob, threads=1)
    assert started == []
    two = kvcodec.decode(blob)
    assert any(n.startswith("kvc-xpred") for n in started) and any(n.startswith("kvcodec-decode") for n in started)
    _same(one, two)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InputError, match="threads"):
            kvcodec.decode(blob, threads=bad)


@pytest.mark.parametrize("threads", [0, 1, 2])
def test_decode_many_gives_what_decode_gives(tmp_path, threads):
    """kvcodec.decode_many: every file as kvcodec.decode gives it, bit for bit, whatever the
    codec (kvc with and without prediction across layers, cachegen, raw), with the checks on
    this thread and the decoding on ``threads`` others; a damaged, foreign or garbage file
    gives its error in its place and the others still decode."""
    cache = drifting_cache(layers=4, t=300, positions=torch.arange(40, 340))
    prof = profile_file(tmp_path / "p.safetensors", cache, kind="random")
    blobs = [kvcodec.get_codec(c).encode(cache) for c in ("kvc-near", cfg(prof), cfg(prof, xpred=0))]
    blobs += kvcodec.get_codec("kvc-near").encode_parts(cache, 128)
    blobs += [kvcodec.get_codec(c).encode(cache.tokens(0, 64)) for c in ("cachegen", "raw")]

    def bump(m):
        m["layers"][1]["tensors"]["v"]["chunks"][0]["params"]["step_base"] = [400] * 2
    bad = rewrite(blobs[0], manifest=bump)
    got = kvcodec.decode_many([*blobs, bad, b"KVC?", blobs[0]], threads=threads, profiles=[prof])
    assert len(got) == len(blobs) + 3
    for blob, out in zip([*blobs, blobs[0]], [*got[:len(blobs)], got[-1]]):
        assert isinstance(out, kvcodec.KVCache)
        _same(out, kvcodec.decode(blob, profiles=[prof]))
        want = kvcodec.decode(blob, profiles=[prof])
        for a, b in ((out.positions, want.positions), (out.token_ids, want.token_ids)):
            assert (a is None and b is None) or torch.equal(a, b)
        assert out.model == want.model and out.layer_info == want.layer_info and out.rope == want.rope
    with pytest.raises(FormatError) as alone:
        kvcodec.decode(bad)
    assert type(got[-3]) is type(alone.value) and str(got[-3]) == str(alone.value)
    assert isinstance(got[-2], FormatError)


def test_decode_many_runs_its_threads_initializer_and_checks_its_threads():
    from kvcodec.errors import InputError

    blob = kvcodec.get_codec("kvc-near").encode(small_cache(layers=2, t=40))
    names = []
    got = kvcodec.decode_many([blob] * 3, threads=2, initializer=lambda: names.append(threading.current_thread().name))
    assert all(isinstance(x, kvcodec.KVCache) for x in got)
    assert names and all(n.startswith("kvcodec-decode") for n in names)
    for bad in (-1, 1.5, "2"):
        with pytest.raises(InputError, match="threads"):
            kvcodec.decode_many([blob], threads=bad)
