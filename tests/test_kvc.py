"""The kvc transform codec: error bounds, protected tokens, escapes, determinism, bad files."""

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.codec import TensorContext
from kvcodec.codecs.kvc import escape_join, escape_split
from kvcodec.errors import ConfigError, FormatError
from kvcodec.quant.deadzone import step_from_code

from conftest import make_cache

KVC_PRESETS = [n for n in kvcodec.list_codecs() if n.startswith("kvc")]


def _kv_cache(t=80, h=2, d=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(t, h, d, generator=g) * torch.rand(1, h, d, generator=g) * 3 + 8 * torch.randn(1, h, d, generator=g)
    v = torch.randn(t, h, d, generator=g) * torch.rand(t, h, 1, generator=g) * 4
    return kvcodec.KVCache.from_tensors([(k.to(dtype), v.to(dtype))])


def test_presets_exist_and_order_by_rate():
    assert {"kvc-transparent", "kvc-near", "kvc-aggressive"} <= set(KVC_PRESETS)
    cache = _kv_cache(t=400, h=2, d=32)
    bits = [kvcodec.get_codec(n).bits_per_element(cache) for n in ("kvc-transparent", "kvc-near", "kvc-aggressive")]
    assert bits[0] > bits[1] > bits[2], bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_k_error_within_half_step_and_sinks_exact(dtype):
    cache = _kv_cache(dtype=dtype)
    codec = kvcodec.get_codec({"id": "kvc", "k_step": 0.3, "sinks": 2, "recent": 3})
    out = codec.decode(codec.encode(cache))
    k, kh = cache.layers[0]["k"], out.layers[0]["k"]
    # protected tokens are bit-exact
    for sl in (slice(0, 2), slice(-3, None)):
        assert torch.equal(kh[sl].view(torch.int16 if dtype != torch.float32 else torch.int32),
                           k[sl].view(torch.int16 if dtype != torch.float32 else torch.int32))
    # coded tokens: |err| <= step/2 (+ output rounding), with the step read back from the file
    ctx = TensorContext(0, "k", tuple(k.shape), dtype)
    enc = codec.encode_planes(k, ctx)
    step = torch.from_numpy(step_from_code(enc.planes["side"][1].astype(np.int64)))
    err = (kh[2:-3].float() - k[2:-3].float()).abs()
    ulp = k[2:-3].float().abs() * (2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11 if dtype == torch.float16 else 1e-6)
    assert bool((err <= step / 2 + ulp + 1e-6).all()), float((err - step / 2 - ulp).max())


def test_v_per_token_steps_bound_error_relative_to_token_rms():
    cache = _kv_cache(t=120, h=3, d=24)
    vs = 0.4
    codec = kvcodec.get_codec({"id": "kvc", "v_step": vs, "sinks": 0})
    v, vh = cache.layers[0]["v"], codec.decode(codec.encode(cache)).layers[0]["v"]
    rms = v.pow(2).mean(-1, keepdim=True).sqrt()
    # step = v_step * rms on the 1/8-octave grid (within 2**(1/16)); error <= step / 2
    assert bool(((vh - v).abs() <= 0.5 * vs * rms * 2 ** (1 / 16) + 1e-6).all())


def test_smaller_steps_give_smaller_error_and_more_bits():
    cache = _kv_cache(t=300, d=32)
    errs, bits = [], []
    for s in (0.1, 0.3, 1.0):
        c = kvcodec.get_codec({"id": "kvc", "k_step": s, "v_step": s})
        blob = c.encode(cache)
        out = c.decode(blob)
        errs.append(sum(float((out.layers[0][r] - cache.layers[0][r]).pow(2).mean()) for r in "kv"))
        bits.append(len(blob))
    assert errs[0] < errs[1] < errs[2] and bits[0] > bits[1] > bits[2]


def test_escapes_carry_outliers_exactly():
    cache = _kv_cache(t=64, d=8)
    cache.layers[0]["k"][10, 0, 3] = 5000.0  # thousands of steps away: escape path
    cache.layers[0]["v"][20, 1, 5] = -3000.0
    codec = kvcodec.get_codec({"id": "kvc", "max_level": 4, "v_scale": "head", "k_step": 0.3, "v_step": 0.3})
    enc = codec.encode_planes(cache.layers[0]["k"], TensorContext(0, "k", (64, 2, 8), torch.float32))
    assert enc.params["L"] == 4 and enc.planes["esc"].size > 0
    out = codec.decode(codec.encode(cache))
    assert abs(float(out.layers[0]["k"][10, 0, 3]) - 5000.0) < 50
    assert abs(float(out.layers[0]["v"][20, 1, 5]) + 3000.0) < 50


def test_escape_split_join_round_trip_and_rejects_bad_counts():
    rng = np.random.default_rng(0)
    c = np.round(rng.standard_cauchy(size=(5, 300))).astype(np.int64)
    for lv in (1, 2, 7, 1000):
        sym, esc, L = escape_split(c, lv)
        assert sym.min() >= 0 and sym.max() < 2 * L
        assert np.array_equal(escape_join(sym, esc, L), c)
    sym, esc, L = escape_split(c, 3)
    with pytest.raises(FormatError, match="escape"):
        escape_join(sym, esc[:-1], L)
    with pytest.raises(FormatError, match="inside the regular range"):
        escape_join(sym, np.zeros_like(esc), L)


@pytest.mark.parametrize("shape,mla", [((50, 1, 128), False), ((30, 2, 256), False), ((40, 1, 40), True),
                                       ((33, 3, 17), False), ((1, 2, 64), False), ((0, 2, 64), False)])
@pytest.mark.parametrize("name", ["kvc-near", "kvc-aggressive"])
def test_geometries(shape, mla, name):
    t, h, d = shape
    g = torch.Generator().manual_seed(t + d)
    if mla:
        cache = kvcodec.KVCache(layers=[{"kv": torch.randn(t, 1, d, generator=g).half()}])
    else:
        cache = kvcodec.KVCache.from_tensors([(torch.randn(t, h, d, generator=g).half(), torch.randn(t, h, d, generator=g).half())])
    c = kvcodec.get_codec(name)
    out = c.decode(c.encode(cache))
    p = c.params
    # every element is within (1 - rho) * step of its value; steps are <= max_step * rms * 2**(1/16)
    bound = min(0.9, ((1 - p["rho"]) * max(p["k_step"], p["v_step"]) * 2 ** (1 / 16)) ** 2)
    for (_, _, a), (_, _, b) in zip(cache.tensors(), out.tensors()):
        assert a.shape == b.shape and b.dtype == a.dtype
        if a.numel():
            rel = float((a.float() - b.float()).pow(2).mean() / a.float().pow(2).mean())
            assert rel < bound, (shape, rel, bound)


def test_hadamard_option_and_fallback_on_other_widths():
    for d, expect in ((16, "hadamard"), (24, "none")):
        cache = _kv_cache(t=60, d=d)
        c = kvcodec.get_codec({"id": "kvc", "transform": "hadamard", "k_step": 0.2})
        enc = c.encode_planes(cache.layers[0]["k"], TensorContext(0, "k", (60, 2, d), torch.float32))
        assert enc.params["transform"] == expect
        out = c.decode(c.encode(cache))
        rel = float((out.layers[0]["k"] - cache.layers[0]["k"]).pow(2).mean() / cache.layers[0]["k"].var())
        assert rel < 0.01


def test_deterministic_bytes_and_decode():
    cache = make_cache(dtype=torch.float16, dim=32, tokens=70)
    c = kvcodec.get_codec("kvc-near")
    a, b = c.encode(cache), c.encode(cache)
    assert a == b
    assert kvcodec.decode(a).equal(kvcodec.decode(a))


def test_channel_weighting_moves_precision_to_high_energy_channels():
    cache = _kv_cache(t=200, d=16)
    k = cache.layers[0]["k"]
    ctx = TensorContext(0, "k", tuple(k.shape), torch.float32)
    flat = kvcodec.get_codec({"id": "kvc", "k_gamma": 0.0}).encode_planes(k, ctx).planes["side"][1]
    wt = kvcodec.get_codec({"id": "kvc", "k_gamma": 1.0}).encode_planes(k, ctx).planes["side"][1]
    energy = k.double().pow(2).mean(0).numpy()
    assert len(set(flat[0].tolist())) == 1  # gamma 0: one step per head
    # gamma 1: larger second moment -> smaller step code
    assert np.corrcoef(energy[0], wt[0].astype(float))[0, 1] < -0.8


def test_bad_params_and_corrupt_files():
    for bad in ({"rho": 0.7}, {"k_step": 0.0}, {"v_scale": "chan"}, {"transform": "pca"}, {"sinks": -1},
                {"max_level": 0}, {"precision": 5}, {"k_gamma": 9.0}):
        with pytest.raises(ConfigError):
            kvcodec.get_codec({"id": "kvc", **bad})
    cache = _kv_cache(t=40, d=8)
    c = kvcodec.get_codec("kvc-near")
    k = cache.layers[0]["k"]
    ctx = TensorContext(0, "k", tuple(k.shape), torch.float32)
    enc = c.encode_planes(k, ctx)
    assert c.decode_tensor(enc, ctx).shape == k.shape
    for mutate in (
        lambda e: e.params.update(n=e.params["n"] + 1),
        lambda e: e.params.update(L=0),
        lambda e: e.params.pop("transform"),
        lambda e: e.planes.pop("side"),
        lambda e: e.planes.update(protect=e.planes["protect"][:0]),
        lambda e: e.planes.update(esc=np.array([1, 2, 3], np.int32)),
        lambda e: e.planes.update(side=np.full((2, 2, 8), np.nan, np.float16)),
        lambda e: e.planes.pop("ans_words"),
    ):
        e2 = type(enc)({k2: v.copy() for k2, v in enc.planes.items()}, dict(enc.params))
        mutate(e2)
        with pytest.raises(FormatError):
            c.decode_tensor(e2, ctx)


def test_detected_sinks_are_stored_exactly_and_validated():
    from kvcodec.codecs.kvc import detect_sinks

    g = torch.Generator().manual_seed(5)
    k = torch.randn(90, 2, 16, generator=g) * 3
    v = torch.randn(90, 2, 16, generator=g)
    v[[7, 50]] *= 0.05  # small-V tokens: sink candidates
    assert detect_sinks(v, 0.3).tolist() == [7, 50]
    assert detect_sinks(v, 0.3, skip=8).tolist() == [50]
    assert detect_sinks(torch.zeros(0, 2, 16), 0.3).size == 0
    cache = kvcodec.KVCache.from_tensors([(k, v), (k, v * 10)])
    codec = kvcodec.get_codec({"id": "kvc", "sink_v_ratio": 0.3, "k_step": 1.0})
    glob = codec.encode_globals(cache)
    assert glob["kvc_sinks"].tolist() == [[0, 7], [0, 50], [1, 7], [1, 50]]
    out = codec.decode(codec.encode(cache))
    for i in range(2):
        for r in "kv":
            assert torch.equal(out.layers[i][r][[0, 7, 50]], cache.layers[i][r][[0, 7, 50]])
        assert not torch.equal(out.layers[i]["k"][8], cache.layers[i]["k"][8])
    # the decoder checks the sink list against the tensor
    ctx = TensorContext(0, "k", (90, 2, 16), torch.float32, globals=glob)
    enc = codec.encode_planes(k, ctx)
    for bad in (np.array([[0, 90]], np.int32), np.array([[0, 7]], np.int64), np.array([0, 7], np.int32)):
        with pytest.raises(FormatError):
            codec.decode_tensor(enc, TensorContext(0, "k", (90, 2, 16), torch.float32, globals={"kvc_sinks": bad}))


def test_v_token_mode_side_and_empty_esc_planes_are_optional():
    cache = _kv_cache(t=40, d=8)
    c = kvcodec.get_codec("kvc-near")
    v = cache.layers[0]["v"]
    ctx = TensorContext(0, "v", tuple(v.shape), torch.float32)
    enc = c.encode_planes(v, ctx)
    assert "side" not in enc.planes  # token-mode V, not centred: nothing to store
    if enc.planes.get("esc") is None:
        assert enc.params["L"] >= 1
    ref = c.decode_tensor(enc, ctx)
    # files written before the planes became optional carry zeros / an empty list: same result
    old = type(enc)({**enc.planes, "side": np.zeros((2, 2, 8), np.float16),
                     "esc": enc.planes.get("esc", np.zeros(0, np.int32))}, dict(enc.params))
    assert torch.equal(c.decode_tensor(old, ctx), ref)
    # a centred V needs its means
    cc = kvcodec.get_codec({"id": "kvc", "v_center": True})
    e2 = cc.encode_planes(v, ctx)
    assert "side" in e2.planes
    e2.planes.pop("side")
    with pytest.raises(FormatError):
        cc.decode_tensor(e2, ctx)


def test_stage_geometry_that_disagrees_with_the_params_is_refused_before_decoding():
    """A manifest whose levels L disagree with the stage's alphabet (A = 2L): the stage checks
    its geometry against the tensor's before it allocates, and the error names the tensor."""
    from kvc_tools import rewrite

    blob = kvcodec.get_codec("kvc-near").encode(make_cache(layers=1, tokens=20, heads=2, dim=16))
    assert kvcodec.decode(blob).num_tokens == 20

    def levels(m):
        m["layers"][0]["tensors"]["k"]["chunks"][0]["params"]["L"] = 8

    with pytest.raises(FormatError, match=r"layers\.0\.k: kvc entropy stage: .*expected"):
        kvcodec.decode(rewrite(blob, manifest=levels))


def test_chunked_encode_with_a_sink_beyond_the_first_chunk_is_a_clear_error():
    """The file-level sink positions apply inside every chunk (the format as written so far), so a
    detected sink past the first chunk cannot be coded chunked: a ConfigError that says what to do,
    not a FormatError from the encoder's own checks. Unchunked, or without detection, it codes."""
    from kvcodec.errors import ConfigError

    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(48, 2, 16, generator=g), torch.randn(48, 2, 16, generator=g)
    v[40] *= 0.01  # a secondary sink: small V
    cache = kvcodec.KVCache.from_tensors([(k.half(), v.half())])
    with pytest.raises(ConfigError, match="sink detection .* chunks of 16 tokens"):
        kvcodec.get_codec("kvc-near").encode(cache, tokens_per_chunk=16)
    assert kvcodec.decode(kvcodec.get_codec("kvc-near").encode(cache)).num_tokens == 48
    plain = kvcodec.get_codec({"id": "kvc-near", "sink_v_ratio": 0.0})
    assert kvcodec.decode(plain.encode(cache, tokens_per_chunk=16)).num_tokens == 48
