"""kvc's rotating K means (``k_rope_mean``, formats/codecs/kvc.md §3.1, §10): the normative
rotation, the encoder's use of it, the decoder's checks and every decode path agreeing."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.transforms import rope as R
from kvcodec.codecs.kvc.calibration import LayerAttention, QueryStats, default_inv_freq, save_query_statistics
from kvcodec.errors import ConfigError, FormatError
from kvcodec.format.resign import join_file, split_file

from _decode_paths import decode_paths, disagreement

#: SHA-256 of the sine table's little-endian float32 bytes (the spec's S, formats/codecs/kvc.md §10)
SIN_TABLE_SHA256 = "a542f52ff1cbec5ab141f0d22021f518e871f1cd777d22a8b85f1581e2c14718"


def _true_rotate(x: np.ndarray, inv: np.ndarray, pos: np.ndarray, offset: int = 0, style: str = "half",
                 sign: float = 1.0) -> np.ndarray:
    """The model's own RoPE in float64 (transformers' rotate-half, or interleaved pairs)."""
    a, b = R.pairs(len(inv), offset, style)
    ang = sign * pos[:, None].astype(np.float64) * inv.astype(np.float64)[None]
    c, s = np.cos(ang)[:, None], np.sin(ang)[:, None]
    out = x.astype(np.float64).copy()
    xa, xb = out[..., a].copy(), out[..., b].copy()
    out[..., a] = xa * c - xb * s
    out[..., b] = xb * c + xa * s
    return out


def test_sin_table_is_pinned() -> None:
    t = R.sin_table()
    assert t.dtype == np.float32 and t.shape == (65536,) and not t.flags.writeable
    assert hashlib.sha256(t.astype("<f4").tobytes()).hexdigest() == SIN_TABLE_SHA256
    assert t[0] == 0 and t[32768] == 0 and t[16384] == 1 and t[49152] == -1
    ref = np.sin(np.arange(65536) * (2 * math.pi / 65536))
    assert np.max(np.abs(t - ref)) < 6e-8


def test_rotation_follows_the_model_rope() -> None:
    rng = np.random.default_rng(1)
    for d, off, r2, style in ((64, 0, 32, "half"), (16, 0, 8, "interleaved"), (24, 8, 4, "half"), (80, 0, 16, "half")):
        inv = default_inv_freq(2 * r2, 1e4) if d != 80 else default_inv_freq(32, 1e6)
        mu = rng.normal(size=(3, d)).astype(np.float32) * 5
        pos = np.array([0, 1, 7, 1000, 32767, 131071, 10**6], np.int64)
        got = R.rotated_means(mu, pos, R.phase_steps(inv), off, style)
        want = _true_rotate(np.broadcast_to(mu, (len(pos),) + mu.shape), inv, pos, off, style)
        # the phase is exact to 2**-32 turns per position, the table to 2**-17 turns
        tol = 5 * (2 * math.pi * (2.0**-17 + pos.max() * 2.0**-33)) * float(np.abs(mu).max())
        assert np.max(np.abs(got - want)) < tol
        # channels outside the pairs keep the mean
        a, b = R.pairs(r2, off, style)
        rest = np.setdiff1d(np.arange(d), np.concatenate([a, b]))
        assert np.array_equal(got[:, :, rest], np.broadcast_to(mu[:, rest], (len(pos), 3, len(rest))))


def test_unrotated_mean_recovers_the_mean_before_rope() -> None:
    rng = np.random.default_rng(2)
    inv = default_inv_freq(16, 1e4)
    mu = rng.normal(size=(2, 16)) * 10
    pos = np.arange(500, 900)
    k = _true_rotate(np.broadcast_to(mu, (400, 2, 16)) + 0.01 * rng.normal(size=(400, 2, 16)), inv, pos)
    got = R.unrotated_mean(k, pos, R.phase_steps(inv), 0, "half")
    assert np.max(np.abs(got - mu)) < 0.01
    # and the plain mean of the rotated K does not
    assert np.max(np.abs(k.mean(0) - mu)) > 1.0


def _no_compiler() -> bool:
    from kvcodec import native

    return native.build._compiler() is None


@pytest.mark.skipif(_no_compiler(), reason="no C compiler on this machine")
@pytest.mark.parametrize("n,h,d,r2,off,style", [(1536, 3, 64, 32, 0, "half"), (37, 2, 16, 4, 4, "interleaved"),
                                                (5, 1, 8, 3, 2, "half"), (1, 2, 6, 3, 0, "interleaved"),
                                                (300, 2, 80, 16, 8, "half"),
                                                (3, 1, 1300, 600, 50, "half")])  # past KVN_ROPE_MAX_PAIRS
def test_native_means_equal_the_reference_bit_for_bit(n, h, d, r2, off, style) -> None:
    """csrc/rope.c against the numpy references: random positions past 2**32, random steps,
    partial rotary, float32 and float16 K over many binades."""
    from kvcodec import native

    assert native.available(), native.status()  # with a compiler the library builds
    from kvcodec.native import rope as NR

    rng = np.random.default_rng(n)
    pos = rng.integers(0, 2**40, n)
    steps = rng.integers(0, 2**32, r2).astype(np.uint32)
    for dt in (np.float32, np.float16):
        k = (rng.normal(size=(n, h, d)) * np.exp(rng.uniform(-5, 5, (n, h, d)))).astype(dt)
        a = NR.unrotated_mean(k, pos, steps, off, style, R.sin_table())
        b = R.unrotated_mean_reference(k, pos, steps, off, style)
        assert np.array_equal(a.view(np.uint64), b.view(np.uint64)), dt
    mu = (rng.normal(size=(h, d)) * 10).astype(np.float32)
    a = NR.rotated_means(mu, pos, steps, off, style, R.sin_table())
    ref = R.rotated_means_reference(mu, pos, steps, off, style)
    assert np.array_equal(a.view(np.uint32), ref.view(np.uint32))
    y = (rng.normal(size=(n, h, d)) * np.exp(rng.uniform(-5, 5, (n, h, d)))).astype(np.float32)
    z, rot = NR.rope_centre(y, mu, pos, steps, off, style, True, R.sin_table())
    assert np.array_equal(rot.view(np.uint32), ref.view(np.uint32))
    assert np.array_equal(z.view(np.uint32), (y - ref).view(np.uint32))
    z2, none = R.rope_centred(y, mu, pos, steps, off, style, keep_rot=False)
    assert none is None and np.array_equal(z2.view(np.uint32), z.view(np.uint32))
    c, s = R.cos_sin(pos, steps)
    assert not c.flags.writeable and R.cos_sin(pos, steps)[0] is c  # kept for the next layer
    with pytest.raises(ValueError):
        NR.rotated_means(mu, pos, steps, d - 1, style, R.sin_table())  # pairs past the head


def test_phase_step_rounding() -> None:
    st = R.phase_steps(np.array([0.0, math.pi, 2 * math.pi - 1e-12, 1e-9]))
    assert st.dtype == np.uint32 and st.tolist() == [0, 2**31, 0, 1]


# ---------------------------------------------------------------------- the codec

T, H, D = 260, 2, 16


def _cache(rng: np.random.Generator, positions: torch.Tensor | None = None, start: int = 0) -> kvcodec.KVCache:
    """K = RoPE(constant + noise) at positions ``start ..`` with the default RoPE of base 1e4."""
    inv = default_inv_freq(D, 1e4)
    layers = []
    for _ in range(2):
        mu = rng.normal(size=(H, D)) * 6
        k = _true_rotate(mu[None] + rng.normal(size=(T, H, D)), inv, np.arange(start, start + T))
        layers.append((torch.tensor(k, dtype=torch.float16), torch.tensor(rng.normal(size=(T, H, D)), dtype=torch.float16)))
    cache = kvcodec.KVCache.from_tensors(layers)
    if positions is not None:
        import dataclasses

        cache = dataclasses.replace(cache, positions=positions)
    return cache


@pytest.fixture(scope="module")
def calib(tmp_path_factory: pytest.TempPathFactory) -> str:
    rng = np.random.default_rng(3)
    inv = default_inv_freq(D, 1e4)
    st = QueryStats([np.ones((H, D), np.float32)] * 2, [rng.normal(size=(4, 3, D)).astype(np.float32)] * 2,
                    q_position=T, rope_theta=1e4,
                    attention=[LayerAttention("rotary", inv), LayerAttention("none")])
    p = str(tmp_path_factory.mktemp("rope") / "cal.safetensors")
    save_query_statistics(st, p)
    return p


def _tensor_params(blob: bytes) -> dict:
    m, _ = split_file(blob)
    return {(i, role): [c["params"] for c in t["chunks"]] for i, layer in enumerate(m["layers"])
            for role, t in layer["tensors"].items()}


def _k_mse(a: kvcodec.KVCache, b: kvcodec.KVCache, layer: int) -> float:
    return float(((a.layers[layer]["k"].float() - b.layers[layer]["k"].float()) ** 2).mean())


def test_rotating_means_centre_what_rope_turned(calib: str) -> None:
    cache = _cache(np.random.default_rng(4))
    plain = kvcodec.get_codec({"id": "kvc", "calibration": calib, "k_step": 0.3})
    rot = kvcodec.get_codec({"id": "kvc", "calibration": calib, "k_step": 0.3, "k_rope_mean": 1})
    b0, b1 = plain.encode(cache), rot.encode(cache)
    d0, d1 = kvcodec.decode(b0), kvcodec.decode(b1)
    # layer 0 rotates (the calibration says so): its residual is the noise, not the turning mean
    assert _k_mse(d1, cache, 0) < _k_mse(d0, cache, 0) / 10
    # layer 1 does not (LayerAttention "none"): centred as before, bit for bit
    assert torch.equal(d1.layers[1]["k"], d0.layers[1]["k"])
    p = _tensor_params(b1)
    assert p[(0, "k")][0]["rope"] == [0, 0, 0, D // 2] and "rope" not in p[(1, "k")][0]
    assert "rope" not in p[(0, "v")][0]
    assert split_file(b1)[0]["codec"]["k_rope_mean"] == 1
    assert "k_rope_mean" not in split_file(b0)[0]["codec"]  # files without it keep their bytes


def test_every_decode_path_agrees(calib: str) -> None:
    blob = kvcodec.get_codec({"id": "kvc", "calibration": calib, "k_step": 0.3, "k_rope_mean": 1,
                              "k_recon": 4}).encode(_cache(np.random.default_rng(5)))
    res = decode_paths(blob)
    assert disagreement(res) is None, (disagreement(res), res)


def test_parts_and_chunks_centre_as_well_as_the_whole(calib: str) -> None:
    """Parts and chunks count positions from their own first token: their means absorb the
    offset (rotations commute), so each codes as well as the whole."""
    rng = np.random.default_rng(7)
    cache = _cache(rng)
    codec = kvcodec.get_codec({"id": "kvc", "calibration": calib, "k_step": 0.3, "k_rope_mean": 1})
    parts = codec.encode_parts(cache, 100)
    assert all(_tensor_params(b)[(0, "k")][0]["rope"] == [0, 0, 0, D // 2] for b in parts)
    k = torch.cat([kvcodec.decode(b).layers[0]["k"] for b in parts]).float()
    whole = kvcodec.decode(codec.encode(cache)).layers[0]["k"].float()
    err = lambda x: float(((x - cache.layers[0]["k"].float()) ** 2).mean())  # noqa: E731
    assert err(k) < 2 * err(whole)
    chunked = codec.encode(cache, tokens_per_chunk=100)
    assert len(_tensor_params(chunked)[(0, "k")]) == 3 and all("rope" in c for c in _tensor_params(chunked)[(0, "k")])
    assert err(kvcodec.decode(chunked).layers[0]["k"].float()) < 2 * err(whole)


def test_a_late_start_codes_alike(calib: str) -> None:
    rng = np.random.default_rng(8)
    cache = _cache(rng, positions=torch.arange(5000, 5000 + T), start=5000)
    codec = kvcodec.get_codec({"id": "kvc", "calibration": calib, "k_step": 0.3, "k_rope_mean": 1})
    blob = codec.encode(cache)
    assert _tensor_params(blob)[(0, "k")][0]["rope"] == [0, 0, 0, D // 2]
    plain = kvcodec.get_codec({"id": "kvc", "calibration": calib, "k_step": 0.3})
    assert _k_mse(kvcodec.decode(blob), cache, 0) < _k_mse(kvcodec.decode(plain.encode(cache)), cache, 0) / 10
    # positions that do not follow one another: plain means (the decoder counts from one start)
    gaps = torch.arange(T) * 2
    blob = codec.encode(_cache(rng, positions=gaps))
    assert "rope" not in _tensor_params(blob)[(0, "k")][0]


def test_without_calibration_nothing_turns() -> None:
    cache = _cache(np.random.default_rng(9))
    a = kvcodec.get_codec({"id": "kvc", "k_rope_mean": 1}).encode(cache)
    assert all("rope" not in p[0] for p in _tensor_params(a).values())


def test_bad_config_is_refused() -> None:
    with pytest.raises(ConfigError, match="k_rope_mean"):
        kvcodec.get_codec({"id": "kvc", "k_rope_mean": 2})
    with pytest.raises(ConfigError, match="k_rope_mean"):
        kvcodec.get_codec({"id": "kvc", "k_rope_mean": True})


def _edit(blob: bytes, fn) -> bytes:
    m, t = split_file(blob)
    fn(m, t)
    return join_file(m, t)


def _set_rope(value):
    def fn(m, t):
        m["layers"][0]["tensors"]["k"]["chunks"][0]["params"]["rope"] = value
    return fn


def _on_v(m, t):
    m["layers"][0]["tensors"]["v"]["chunks"][0]["params"]["rope"] = [0, 0, 0, D // 2]


def _drop_table(m, t):
    del t["global.kvc_rope"]


def _int32_table(m, t):
    t["global.kvc_rope"] = t["global.kvc_rope"].astype(np.int32)


def _empty_table(m, t):
    t["global.kvc_rope"] = np.zeros((0, 8), np.uint32)


@pytest.mark.parametrize("edit", [
    _set_rope([0, 0, 0]), _set_rope([0, 0, 0, D // 2, 0]), _set_rope([1, 0, 0, D // 2]),
    _set_rope([0, 1, 0, D // 2]), _set_rope([0, 0, 2, D // 2]), _set_rope([0, 0, 0, 0]),
    _set_rope([0, 0, 0, D // 2 + 1]), _set_rope([-1, 0, 0, D // 2]), _set_rope([0, 0, 0, 8.0]),
    _set_rope([0, 0, True, D // 2]), _set_rope({"u": 0}), _on_v, _drop_table, _int32_table, _empty_table,
], ids=["three", "five", "row", "offset", "style", "no-pairs", "pairs", "negative-row", "float", "bool", "object",
        "on-v", "no-table", "int32-table", "empty-table"])
def test_bad_rope_params_are_rejected_on_every_path(calib: str, edit) -> None:
    codec = kvcodec.get_codec({"id": "kvc", "calibration": calib, "k_step": 0.3, "k_rope_mean": 1, "pack": 0})
    blob = _edit(codec.encode(_cache(np.random.default_rng(11))), edit)
    res = decode_paths(blob)
    assert disagreement(res) is None, (disagreement(res), res)
    for k in ("native", "fallback", "verify", "gpu-host"):
        if k in res:
            assert res[k] == ("reject", "FormatError"), (k, res)
    with pytest.raises(FormatError):
        kvcodec.decode(blob)


def test_a_table_wider_than_the_pairs_decodes(calib: str) -> None:
    """A row longer than the tensor's pairs (another layer's width): its first P entries."""
    def widen(m, t):
        t["global.kvc_rope"] = np.concatenate([t["global.kvc_rope"], np.full((1, 3), 7, np.uint32)], axis=1)

    codec = kvcodec.get_codec({"id": "kvc", "calibration": calib, "k_step": 0.3, "k_rope_mean": 1, "pack": 0})
    blob = codec.encode(_cache(np.random.default_rng(12)))
    res = decode_paths(_edit(blob, widen))
    assert disagreement(res) is None and res["fallback"] == decode_paths(blob)["fallback"], res


def test_rope_centred_without_the_native_library_gives_the_same_bits(monkeypatch) -> None:
    from kvcodec import native
    from kvcodec.native import rope as NR

    rng = np.random.default_rng(5)
    pos = rng.integers(0, 2**33, 50)
    steps = rng.integers(0, 2**32, 8).astype(np.uint32)
    y = rng.normal(size=(50, 2, 16)).astype(np.float32) * 30
    mu = rng.normal(size=(2, 16)).astype(np.float32)
    fast = R.rope_centred(y, mu, pos, steps, 0, "half")

    def unsupported(*a, **k):
        raise native.Unsupported("the reference")

    monkeypatch.setattr(NR, "rope_centre", unsupported)
    monkeypatch.setattr(NR, "rotated_means", unsupported)
    ref = R.rope_centred(y, mu, pos, steps, 0, "half")
    for a, b in zip(fast, ref):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
