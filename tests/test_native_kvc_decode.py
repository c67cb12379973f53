"""kvc's one-call native decode (kvcodec.native.kvc_decode, csrc/kvc_decode.c) against the
separate passes it replaces (``KVCODEC_NATIVE=0``: the numpy/constriction reference), bit for bit,
on every kind of tensor kvc writes: per-channel K with and without per-token step offsets,
token-mode and per-channel V, reconstruction offsets, rotating means, token-delta rows, escapes,
protected tokens inside the sequence, float16 / bfloat16 / float32; and the same errors on
damaged files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec import native
from kvcodec.codecs.kvc.calibration import LayerAttention, QueryStats, default_inv_freq, save_query_statistics
from kvcodec.errors import FormatError

from _decode_paths import native_mode
from kvc_tools import manifest_of, rewrite, split

pytestmark = pytest.mark.skipif(not native.available(), reason="the native CPU coder does not build here")

T, H, D = 300, 2, 32


def _true_rotate(x: np.ndarray, inv: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """RoPE (half style) of ``x [T, H, D]`` at ``pos``."""
    ang = pos[:, None] * inv[None, :]
    c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., : D // 2], x[..., D // 2:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def _cache(seed: int, dtype: torch.dtype = torch.float16, sink_mid: bool = False) -> kvcodec.KVCache:
    """K = RoPE(mean + noise) with a few outliers (escapes), V with a slow drift (delta rows)."""
    rng = np.random.default_rng(seed)
    inv = default_inv_freq(D, 1e4)
    layers = []
    for _ in range(2):
        mu = rng.normal(size=(H, D)) * 5
        k = _true_rotate(mu[None] + rng.normal(size=(T, H, D)), inv, np.arange(T))
        k[rng.integers(0, T, 6), 0, rng.integers(0, D, 6)] *= 400.0  # far outside the regular alphabet
        v = rng.normal(size=(T, H, D)) * 0.2 + np.cumsum(rng.normal(size=(T, 1, D)) * 0.3, axis=0)
        if sink_mid:  # a quiet token in the middle: sink detection protects it (coded tokens not one run)
            v[T // 2] *= 1e-3
        layers.append((torch.tensor(k, dtype=dtype), torch.tensor(v, dtype=dtype)))
    return kvcodec.KVCache.from_tensors(layers)


@pytest.fixture(scope="module")
def calib(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(3)
    inv = default_inv_freq(D, 1e4)
    st = QueryStats([np.abs(rng.normal(size=(H, D))).astype(np.float32) + 0.1] * 2,
                    [rng.normal(size=(4, 3, D)).astype(np.float32)] * 2, q_position=T, rope_theta=1e4,
                    attention=[LayerAttention("rotary", inv), LayerAttention("none")])
    p = str(tmp_path_factory.mktemp("kvd") / "cal.safetensors")
    save_query_statistics(st, p)
    return p


CONFIGS = {
    "plain": {"id": "kvc"},
    "steps-per-token": {"id": "kvc", "recent_ramp": 64, "recent_fine": 4.0, "ctx": [3, 8, 20]},
    "recon-delta-escapes": {"id": "kvc", "k_recon": 4, "delta": 2, "max_level": 4, "k_step": 0.2},
    "v-per-channel": {"id": "kvc", "v_scale": "head", "v_center": True, "recent": 5, "sinks": 3},
    "sinks-mid": {"id": "kvc", "sink_v_ratio": 0.05},
    "coarse": {"id": "kvc", "k_step": 3.0, "v_step": 4.0, "recent_ramp": 32},
}


def _features(blob: bytes) -> set[str]:
    """What the file's tensors use, so each case provably covers what it is named for."""
    out = set()
    for layer in manifest_of(blob)["layers"]:
        for role, t in layer["tensors"].items():
            for c in t["chunks"]:
                p = c["params"]
                pieces = {e[0] for e in p["pk"]}
                out |= {f for f, on in (("k_tok", p.get("k_tok")), ("recon", p.get("rc")), ("delta", 3 in pieces),
                                        ("esc", 2 in pieces), ("rope", p.get("rope")),
                                        (f"{role}-side", 1 in pieces), ("not-one-run", p["n"] + p["sinks"]
                                                                         + p["recent"] != c["tokens"])) if on}
    return out


#: what each case must exercise
COVERS = {"plain": {"esc", "delta", "k-side"}, "steps-per-token": {"k_tok"},
          "recon-delta-escapes": {"recon", "esc", "delta"}, "v-per-channel": {"v-side"},
          "sinks-mid": {"not-one-run"}, "coarse": set()}


def _both(blob: bytes) -> tuple[kvcodec.KVCache, kvcodec.KVCache]:
    """The native decode (the file's jobs queued and run in one call on one thread, checked equal
    to the threads decoding tensor by tensor) and the reference passes."""
    fast = kvcodec.decode(blob, threads=1)
    assert _same_bits(fast, kvcodec.decode(blob, threads=2))
    with native_mode("0"):
        ref = kvcodec.decode(blob)
    return fast, ref


def _same_bits(a: kvcodec.KVCache, b: kvcodec.KVCache) -> bool:
    return all(torch.equal(x[r].view(torch.int16 if x[r].dtype != torch.float32 else torch.int32),
                           y[r].view(torch.int16 if y[r].dtype != torch.float32 else torch.int32))
               for x, y in zip(a.layers, b.layers) for r in x)


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_one_call_equals_the_passes(name: str, dtype: torch.dtype, calib: str) -> None:
    cache = _cache(7, dtype, sink_mid=name == "sinks-mid")
    blob = kvcodec.get_codec(CONFIGS[name]).encode(cache)
    assert COVERS[name] <= _features(blob)
    fast, ref = _both(blob)
    assert _same_bits(fast, ref)
    # and with a calibration: attention-weighted per-token steps, rotating K means on layer 0
    cal = {**CONFIGS[name], "calibration": calib, "k_rope_mean": 1, "k_attn": 1.0, "v_attn": 0.5}
    blob = kvcodec.get_codec(cal).encode(cache)
    assert "rope" in _features(blob)
    fast, ref = _both(blob)
    assert _same_bits(fast, ref)


@pytest.mark.parametrize("threads", [1, 2])
def test_the_one_call_path_is_taken(monkeypatch: pytest.MonkeyPatch, calib: str, threads: int) -> None:
    """With the library built, decode lays out one native job per tensor and runs none of the
    passes: on one thread, every job of the file in one batch; on two, each tensor's at once."""
    import kvcodec.codecs.kvc.codec as kvc_codec
    import kvcodec.native.kvc as nk

    blob = kvcodec.get_codec({"id": "kvc", "calibration": calib, "k_rope_mean": 1, "k_recon": 4,
                              "recent_ramp": 64}).encode(_cache(2))
    jobs, batches = [], []
    real_job, real_run = kvc_codec.kvc_decode_job, nk.run_decodes

    def counting(*a, **k):
        jobs.append(1)
        return real_job(*a, **k)

    def batching(js):
        batches.append(len(js))
        return real_run(js)

    def refuse(*a, **k):
        raise AssertionError("a separate pass ran")

    monkeypatch.setattr(kvc_codec, "kvc_decode_job", counting)
    monkeypatch.setattr(nk, "run_decodes", batching)
    monkeypatch.setattr(native, "escape_join_tokens", refuse)
    monkeypatch.setattr(native, "kvc_dequantize", refuse)
    monkeypatch.setattr(native, "decode_stage", refuse)
    kvcodec.decode(blob, threads=threads)
    assert len(jobs) == 4  # 2 layers x (k, v)
    assert batches == ([4] if threads == 1 else [1, 1, 1, 1])


def test_a_batch_stops_at_its_first_bad_job(calib: str) -> None:
    """run_decodes: the jobs before a damaged one are written (and their ``after`` run), the
    damaged one raises its located error, the ones after it are not run."""
    import kvcodec.native.kvc as nk

    good = kvcodec.get_codec({"id": "kvc", "pack": 1}).encode(_cache(4))
    bad = _damage_words(good)
    with nk.deferred_decodes() as jobs:
        with kvcodec.open(good) as r:
            first = r.read_layer(0)
        with kvcodec.open(bad) as r:
            second = r.read_layer(0)
        with kvcodec.open(good) as r:
            third = r.read_layer(0)
    assert len(jobs) == 6
    for t in third.values():
        t.fill_(float("nan"))
    ran = []
    for i, j in enumerate(jobs):
        j.after = (lambda i=i: ran.append(i))
    with pytest.raises(FormatError) as e:
        nk.run_decodes(jobs)
    with pytest.raises(FormatError) as alone:  # the error the file raises decoded tensor by tensor
        kvcodec.decode(bad, threads=2)
    assert type(e.value) is type(alone.value) and str(e.value) == str(alone.value)
    assert str(e.value).startswith("layers.0.k: ")
    assert ran == [0, 1]
    want = kvcodec.decode(good, threads=2).layers[0]
    assert all(torch.equal(first[r], want[r]) for r in ("k", "v"))
    assert all(bool(torch.isnan(third[r]).all()) for r in ("k", "v"))  # never written
    assert set(second) == {"k", "v"}


def test_chunked_files_and_parts_agree(calib: str) -> None:
    cache = _cache(9)
    codec = kvcodec.get_codec({"id": "kvc", "calibration": calib, "k_rope_mean": 1, "recent_ramp": 64})
    fast, ref = _both(codec.encode(cache, tokens_per_chunk=64))
    assert _same_bits(fast, ref)
    for blob in codec.encode_parts(cache, 128):
        fast, ref = _both(blob)
        assert _same_bits(fast, ref)


def _first_k_pack(blob: bytes) -> tuple[int, int]:
    """Byte range of layer 0's K ``pack`` plane in ``blob``."""
    h, _ = split(blob)
    import struct

    (n,) = struct.unpack("<Q", blob[:8])
    a, b = h["layers.0.k.pack"]["data_offsets"]
    return 8 + n + a, 8 + n + b


def _damage_words(blob: bytes) -> bytes:
    """Flip bits in the middle of layer 0's K plane and fix its CRC, so the stage sees the damage."""
    import zlib

    a, b = _first_k_pack(blob)
    raw = bytearray(blob)
    mid = (a + b) // 2
    for i in range(mid, mid + 8):
        raw[i] ^= 0x5A
    crc = f"{zlib.crc32(bytes(raw[a:b])) & 0xFFFFFFFF:08x}"

    def fix(m):
        m["storage"]["tensors"]["layers.0.k.pack"]["crc32"] = crc
    return rewrite(bytes(raw), manifest=fix)


@pytest.mark.parametrize("threads", [1, 2])
def test_damage_is_refused_alike(threads: int) -> None:
    blob = kvcodec.get_codec({"id": "kvc", "pack": 1, "recent_ramp": 64}).encode(_cache(4))
    bad = _damage_words(blob)
    errs = []
    for mode in ("auto", "0"):
        with native_mode(mode):
            with pytest.raises(FormatError) as e:
                kvcodec.decode(bad, threads=threads)
            errs.append(type(e.value))
            assert "layers.0.k" in str(e.value)
    assert errs[0] is errs[1], errs  # the same error class on both paths


def test_a_step_code_out_of_range_is_refused_alike() -> None:
    """A token-mode V whose step_base pushes a token's step code past the range."""
    blob = kvcodec.get_codec({"id": "kvc"}).encode(_cache(5))

    def push(m):
        m["layers"][0]["tensors"]["v"]["chunks"][0]["params"]["step_base"] = [400, 400]
    bad = rewrite(blob, manifest=push)
    for mode in ("auto", "0"):
        with native_mode(mode):
            with pytest.raises(FormatError, match="step code outside"):
                kvcodec.decode(bad)


@pytest.mark.parametrize("inference", [False, True])
def test_decode_many_under_inference_mode(inference: bool) -> None:
    """A caller under torch.inference_mode (vLLM's worker) gets inference tensors, which only that
    mode may change in place: decode_many's threads decode under the caller's mode, tokens that
    are not one run (a protected token in the middle: written after the native call) included."""
    cache = _cache(7, sink_mid=True)
    blob = kvcodec.get_codec(CONFIGS["sinks-mid"]).encode(cache)
    assert "not-one-run" in _features(blob)
    want = kvcodec.decode(blob, threads=1)
    with torch.inference_mode(inference):
        got = kvcodec.decode_many([blob, blob, blob], threads=2)
    for x in got:
        assert isinstance(x, kvcodec.KVCache), x
        assert _same_bits(x, want)
