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
    fast = kvcodec.decode(blob)
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


def test_the_one_call_path_is_taken(monkeypatch: pytest.MonkeyPatch, calib: str) -> None:
    """With the library built, decode makes one native call per tensor and none of the passes."""
    blob = kvcodec.get_codec({"id": "kvc", "calibration": calib, "k_rope_mean": 1, "k_recon": 4,
                              "recent_ramp": 64}).encode(_cache(2))
    calls = []
    real = native.kvc_decode

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    def refuse(*a, **k):
        raise AssertionError("a separate pass ran")

    monkeypatch.setattr(native, "kvc_decode", counting)
    monkeypatch.setattr(native, "escape_join_tokens", refuse)
    monkeypatch.setattr(native, "kvc_dequantize", refuse)
    monkeypatch.setattr(native, "decode_stage", refuse)
    kvcodec.decode(blob)
    assert len(calls) == 4  # 2 layers x (k, v)


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


def test_damage_is_refused_alike() -> None:
    blob = kvcodec.get_codec({"id": "kvc", "pack": 1, "recent_ramp": 64}).encode(_cache(4))
    bad = _damage_words(blob)
    errs = []
    for mode in ("auto", "0"):
        with native_mode(mode):
            with pytest.raises(FormatError) as e:
                kvcodec.decode(bad)
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
