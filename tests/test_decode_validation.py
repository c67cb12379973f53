"""One validation per codec, shared by every decoder (issue 19): CRC-valid files that their encoder
cannot have written are rejected with a FormatError on every path (native, fallback, verify, the
GPU decoders through the host build), and files it can write decode identically on all of them.
Each file is rebuilt with fresh CRC-32s (kvcodec.format.resign), so the damage reaches the codec."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import kvcodec
from _decode_paths import decode_paths, disagreement
from kvcodec.entropy.stage import EntropyStage, add_prefix, take_prefix
from kvcodec.errors import FormatError
from kvcodec.format.resign import join_file, split_file
from kvcodec.format.safetensors_io import MAX_JSON_DEPTH, strict_json_loads


def _cache(dtype=torch.float16, tokens=24, layers=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    return kvcodec.KVCache.from_tensors(
        [((torch.randn(tokens, 2, 16, generator=g) * 2).to(dtype), (torch.randn(tokens, 2, 16, generator=g)).to(dtype))
         for _ in range(layers)])


def _edit(blob: bytes, fn) -> bytes:
    m, t = split_file(blob)
    fn(m, t)
    return join_file(m, t)


def _chunk(m, layer=0, role="k", j=0):
    return m["layers"][layer]["tensors"][role]["chunks"][j]["params"]


def _all_reject(blob: bytes, match: str | None = None) -> dict:
    res = decode_paths(blob)
    assert disagreement(res) is None, (disagreement(res), res)
    for k in ("native", "fallback", "verify", "gpu-host"):
        if k in res:
            assert res[k] == ("reject", "FormatError"), (k, res)
    if match:
        with pytest.raises(FormatError, match=match):
            kvcodec.decode(blob)
    return res


def _all_ok(blob: bytes) -> dict:
    res = decode_paths(blob)
    assert disagreement(res) is None, (disagreement(res), res)
    assert res["fallback"][0] == "ok", res
    return res


def _restage(t, name_prefix, alphabet, precision=17):
    """Re-encode a tensor's stage under ``name_prefix`` (e.g. ``layers.0.k.anc_``) with another
    alphabet: the symbols stay, the tables cover ``alphabet`` symbols."""
    pre = name_prefix
    planes = take_prefix({k: v for k, v in t.items() if k.startswith(pre)}, pre)
    sym = EntropyStage().decode(planes, layout="tokens")
    for k in [k for k in t if k.startswith(pre)]:
        del t[k]
    new = EntropyStage(precision=precision, chunk=4096, tables="row").encode(
        sym.astype(np.int64).astype(np.uint16 if alphabet <= 65536 else np.int32), alphabet=alphabet, layout="tokens")
    t.update(add_prefix(new, pre))


# ------------------------------------------------------------------ big alphabets (cachegen)
@pytest.mark.parametrize("anchor_levels", [4097, 32769, 65537])
def test_cachegen_anchor_levels_beyond_the_encoder_are_rejected(anchor_levels):
    blob = kvcodec.get_codec("cachegen").encode(_cache(layers=1))

    def fn(m, t):
        for role in ("k", "v"):
            _chunk(m, role=role)["anchor_levels"] = anchor_levels
            _restage(t, f"layers.0.{role}.anc_", anchor_levels)

    _all_reject(_edit(blob, fn), match="anchor_levels")


@pytest.mark.parametrize("levels", [4097, 32769, 65537, 65538])
def test_cachegen_recorded_levels_beyond_the_encoder_are_rejected(levels):
    blob = kvcodec.get_codec("cachegen").encode(_cache(layers=1))

    def fn(m, t):
        t["global.cachegen_levels"] = np.full_like(t["global.cachegen_levels"], levels)
        for role in ("k", "v"):
            _chunk(m, role=role)["levels"] = levels
            _restage(t, f"layers.0.{role}.ans_", levels)

    _all_reject(_edit(blob, fn), match="cachegen_levels")


@pytest.mark.parametrize("bins", [65537, 65538, 131072])
def test_cachegen_lmcache_bins_beyond_the_encoder_are_rejected(bins):
    blob = kvcodec.get_codec("cachegen-lmcache").encode(_cache(layers=1))

    def fn(m, t):
        t["global.cachegen_bins"] = np.full_like(t["global.cachegen_bins"], bins)
        for role in ("k", "v"):
            _chunk(m, role=role)["bins"] = bins
            _restage(t, f"layers.0.{role}.ans_", bins, precision=18)

    _all_reject(_edit(blob, fn), match="cachegen_bins")


def test_cachegen_lmcache_bins_past_int16_decode_the_same_on_every_path():
    """bins 32770 is within the bound (codes < 65536): the fallback no longer narrows to int16."""
    blob = kvcodec.get_codec("cachegen-lmcache").encode(_cache(layers=1))

    def fn(m, t):
        t["global.cachegen_bins"] = np.full_like(t["global.cachegen_bins"], 32770)
        for role in ("k", "v"):
            _chunk(m, role=role)["bins"] = 32770
            _restage(t, f"layers.0.{role}.ans_", 32770)

    res = _all_ok(_edit(blob, fn))
    assert {v for k, v in res.items() if k in ("native", "fallback", "gpu-host")} == {res["fallback"]}


def test_cachegen_lmcache_config_bins_bounded():
    with pytest.raises(kvcodec.errors.ConfigError, match="65536"):
        kvcodec.get_codec({"id": "cachegen-lmcache", "precision": 18, "early_bins": 65538})


# ------------------------------------------------------------------ non-finite output
@pytest.mark.parametrize("code", [0x7C, 0x7F, 0xFC, 0xFE])
def test_fp8_e5m2_inf_and_nan_codes_are_rejected(code):
    blob = kvcodec.get_codec("fp8-e5m2").encode(_cache())

    def fn(m, t):
        c = t["layers.1.v.codes"].copy()
        c[3, 1, 5] = code
        t["layers.1.v.codes"] = c

    _all_reject(_edit(blob, fn), match="NaN or Inf codes")


def test_fp8_e4m3_nan_code_is_rejected():
    blob = kvcodec.get_codec("fp8-e4m3").encode(_cache())

    def fn(m, t):
        t["layers.0.k.codes"] = t["layers.0.k.codes"].copy()
        t["layers.0.k.codes"][0, 0, 0] = 0xFF

    _all_reject(_edit(blob, fn), match="NaN or Inf codes")


@pytest.mark.parametrize("value", [1e30, 147.0, float("inf"), float("nan"), 0.0, -1.0, 1e-40])
def test_fp8_scales_outside_what_encode_writes_are_rejected(value):
    blob = kvcodec.get_codec("fp8-e4m3").encode(_cache())

    def fn(m, t):
        t["layers.0.k.scale"] = t["layers.0.k.scale"].copy()
        t["layers.0.k.scale"].reshape(-1)[0] = value

    _all_reject(_edit(blob, fn), match="fp8 scale")


def test_fp8_largest_scale_of_a_float32_source_is_accepted():
    """The bound depends on the source dtype: a float32 cache may have scales up to FLT_MAX/448."""
    x = torch.zeros(4, 1, 16)
    x[0, 0, 0] = float(np.finfo(np.float32).max)
    blob = kvcodec.get_codec("fp8-e4m3").encode(kvcodec.KVCache.from_tensors([(x, x)]))
    res = _all_ok(blob)
    assert torch.isfinite(kvcodec.decode(blob).layers[0]["k"]).all()
    assert res["verify"][0] == "ok"


@pytest.mark.parametrize("value", [1e38, 25.0, float("nan"), 0.0, -0.5])
def test_nvfp4_tensor_scale_outside_what_encode_writes_is_rejected(value):
    blob = kvcodec.get_codec("nvfp4").encode(_cache())

    def fn(m, t):
        t["layers.0.v.tensor_scale"] = np.array([value], dtype=np.float32)

    _all_reject(_edit(blob, fn), match="tensor_scale")


def test_cachegen_extremes_saturate_identically_on_every_path():
    """fp16 65504 with bins 32 (M = 15): scale16 = 4368 and 15 * 4368 = 65520 rounds to inf in
    fp16; every decoder saturates to 65504 instead (formats/SPEC.md §11.1), so verify passes."""
    x = torch.randn(12, 2, 16).half()
    x[3, 1, 7] = 65504.0
    x[5, 0, 2] = -65504.0
    for name in ("cachegen-lmcache", "cachegen"):
        blob = kvcodec.get_codec(name).encode(kvcodec.KVCache.from_tensors([(x, x)]))
        res = _all_ok(blob)
        assert res["verify"][0] == "ok"
        out = kvcodec.decode(blob).layers[0]["k"]
        assert torch.isfinite(out).all() and float(out[3, 1, 7]) == 65504.0, name


# ------------------------------------------------------------------ strict types and planes
@pytest.mark.parametrize("value", ["32", 32.9, 32.0, True, None, [32]])
def test_kvc_integer_params_are_strict(value):
    blob = kvcodec.get_codec("kvc-near").encode(_cache())

    def fn(m, t):
        p = _chunk(m)
        assert type(p["L"]) is int
        p["L"] = value

    _all_reject(_edit(blob, fn))


def test_kvc_k_tok_true_is_not_one():
    # k_tok is written by the -cal presets; True must not pass for 1
    codec = kvcodec.get_codec({"id": "kvc", "pack": 0})
    blob = codec.encode(_cache())

    def fn(m, t):
        _chunk(m)["k_tok"] = True

    _all_reject(_edit(blob, fn), match="k_tok")


@pytest.mark.parametrize("name,key,value", [
    ("fp8-e4m3", "block", 32.0), ("fp8-e4m3", "block", True), ("nvfp4", "pad", False),
    ("kivi-4", "bits", 4.0), ("kivi-4", "group", "32"), ("kivi-4-ans", "delta", False),
    ("cachegen", "group", 10.0), ("cachegen-lmcache", "bins", 32.0), ("kivi-4", "bits", 9),
])
def test_params_of_the_wrong_json_type_are_rejected(name, key, value):
    blob = kvcodec.get_codec(name).encode(_cache(dtype=torch.float16, tokens=40))

    def fn(m, t):
        _chunk(m)[key] = value

    _all_reject(_edit(blob, fn))


def test_uint16_row_table_with_few_tables_is_rejected():
    blob = kvcodec.get_codec("kivi-4-ans").encode(_cache())

    def fn(m, t):
        rt = t["layers.0.k.ans_row_table"]
        assert rt.dtype == np.uint8
        t["layers.0.k.ans_row_table"] = rt.astype(np.uint16)

    _all_reject(_edit(blob, fn), match="row_table")


@pytest.mark.parametrize("name,plane", [("fp8-e4m3", "codes"), ("fp8-e5m2", "scale"), ("nvfp4", "codes"),
                                        ("kivi-4", "scale"), ("cachegen", "scale")])
def test_planes_of_another_shape_are_rejected(name, plane):
    blob = kvcodec.get_codec(name).encode(_cache())

    def fn(m, t):
        a = t[f"layers.0.k.{plane}"]
        t[f"layers.0.k.{plane}"] = a.reshape(-1) if a.ndim > 1 else a.reshape(1, -1)

    _all_reject(_edit(blob, fn), match=plane)


@pytest.mark.parametrize("name", ["fp16", "fp8-e4m3", "nvfp4", "kivi-4", "kivi-2-ans", "kivi-4-delta-ans", "cachegen",
                                  "cachegen-lmcache", "kvc-near", "kvc"])
def test_unknown_planes_are_rejected(name):
    blob = kvcodec.get_codec(name).encode(_cache())

    def fn(m, t):
        t["layers.1.v.extra"] = np.zeros(3, dtype=np.uint8)

    res = _all_reject(_edit(blob, fn))
    assert res["min-reader"][0] == "ok"  # the container is valid; the codec rejects it


def test_unknown_plane_in_an_unpacked_kvc_tensor_is_rejected():
    blob = kvcodec.get_codec({"id": "kvc-near", "pack": 0}).encode(_cache())

    def fn(m, t):
        t["layers.0.k.ans_extra"] = np.zeros(3, dtype=np.uint8)

    _all_reject(_edit(blob, fn), match="unknown kvc plane")


# ------------------------------------------------------------------ JSON depth
def _nested(depth: int):
    v: object = 1
    for _ in range(depth - 1):
        v = [v]
    return v


def _deep_manifest_file(depth: int) -> bytes:
    blob = kvcodec.get_codec("fp16").encode(_cache(layers=1))

    def fn(m, t):
        m["rope"]["params"]["deep"] = _nested(depth)

    return _edit(blob, fn)


def _at_stack_depth(frames: int, fn):
    if frames == 0:
        return fn()
    return _at_stack_depth(frames - 1, fn)


@pytest.mark.parametrize("frames", [0, 100, 400])
def test_json_depth_limit_does_not_depend_on_the_callers_stack(frames):
    deep = _deep_manifest_file(900)
    with pytest.raises(FormatError, match="deeper than 64"):
        _at_stack_depth(frames, lambda: kvcodec.decode(deep))
    ok = _deep_manifest_file(MAX_JSON_DEPTH - 3)  # root, rope, params, then the list
    assert _at_stack_depth(frames, lambda: kvcodec.decode(ok)).num_layers == 1


def test_json_depth_check_ignores_brackets_in_strings():
    text = json.dumps({"a": "[" * 500 + "{" * 500, "b": _nested(MAX_JSON_DEPTH)})  # 64 deep in all
    assert strict_json_loads(text, "x")["a"].startswith("[[")
    with pytest.raises(FormatError, match="deeper than 64"):
        strict_json_loads(json.dumps({"b": _nested(MAX_JSON_DEPTH + 1)}), "x")


def test_json_depth_fast_split_equals_the_string_pattern():
    """json_depth drops strings by splitting on quotes when the text has no escape and whole
    strings only; the depth it finds equals the string pattern's on texts with brackets inside
    strings, escaped quotes, an unterminated string and unbalanced brackets."""
    from kvcodec.format.safetensors_io import _JSON_STRING, json_depth

    def by_pattern(text):
        if text.count("[") + text.count("{") <= 1:  # json_depth's own shortcut
            return text.count("[") + text.count("{")
        depth = deepest = 0
        for ch in _JSON_STRING.sub("", text):
            depth += (ch in "[{") - (ch in "]}")
            deepest = max(deepest, depth)
        return deepest

    rng = np.random.default_rng(5)
    alphabet = list('[]{}",:ab \\')
    texts = ['{"a": "[[[", "b": [[{"c": "]]"}]]}', '{"a": "x\\"[[[", "b": [1]}', '[["unterminated [[[ [',
             '{"k": [[[[]]]], "s": "}}}}"}', json.dumps({"a": "[" * 70, "b": _nested(5)})]
    texts += ["".join(rng.choice(alphabet, int(rng.integers(2, 80)))) for _ in range(400)]
    for t in texts:
        assert json_depth(t) == by_pattern(t), t


def test_duplicate_keys_are_rejected_by_name_at_any_depth():
    with pytest.raises(FormatError, match="duplicate key 'b'"):
        strict_json_loads('{"a": 1, "b": 2, "c": {"d": 1}, "b": 3}', "x")
    with pytest.raises(FormatError, match="duplicate key 'd'"):
        strict_json_loads('{"a": [{"d": 1, "e": 2, "d": 1}]}', "x")
    assert strict_json_loads('{"a": {"a": {"a": 1}}}', "x") == {"a": {"a": {"a": 1}}}


def test_deep_manifest_agrees_on_every_path():
    res = decode_paths(_deep_manifest_file(900))
    assert disagreement(res) is None, res
    assert res["min-reader"][0] == "reject"
