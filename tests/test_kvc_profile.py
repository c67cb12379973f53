"""kvc profiles: a model's quality targets mapped to its steps by measurement.

The profile as a value (:func:`parse_profile`), the steps it gives for a target
(:func:`steps_for_target`), the codec's ``target_kl`` / ``fallback`` on every encode route, the
closed loop that measures a profile (:func:`kvcodec.harness.profile.build_profile`, on a tiny
random-init model) and the ``kvcodec calibrate`` arguments."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec import open as open_kvc
from kvcodec.cli import main
from kvcodec.codecs.kvc.calibration import QueryStats, save_query_statistics
from kvcodec.codecs.kvc.profile import QUALITY_PARAMS, k_step_for, parse_profile, steps_for_target
from kvcodec.errors import ConfigError, FormatError
from kvcodec.format import write_file
from kvc_tools import small_cache as _cache, encode_routes as _routes

# ------------------------------------------------------------------------------ fixtures


def _profile(**over) -> dict:
    """A hand-made profile: KL = 0.1 * k_step**2 on the points, one verified level at 0.01."""
    prof = {
        "version": 1,
        "settings": {"k_qgamma": 1.0, "recent_ramp": 16, "recent_fine": 2.0, "k_recon": 4, "attn_clip": 3.0},
        "kv_ratio": 2.5,
        "margin": 0.5,
        "points": [[0.1, 0.001, 6.0], [0.2, 0.004, 5.0], [0.4, 0.016, 4.0], [0.8, 0.064, 3.0]],
        "levels": [{"name": "near", "target_kl": 0.01, "k_step": 0.21, "v_step": 0.7, "kl_search": 0.0044,
                    "kl_holdout": 0.006, "bits": 4.9}],
        "model": {"model_id": "test"},
    }
    prof.update(over)
    return prof


def _stats_file(cache, path, profile=None, seed=1) -> str:
    """A query-statistics file for ``cache``'s shape (with ``profile`` when given); its SHA-256."""
    rng = np.random.default_rng(seed)
    h, d = cache.layers[0]["k"].shape[1:]
    st = QueryStats([rng.uniform(0.1, 4.0, (h, d)).astype(np.float32) for _ in cache.layers],
                    [rng.normal(size=(4, 8, d)).astype(np.float32) for _ in cache.layers],
                    q_position=200, rope_theta=10000.0, meta={"model": "test"}, profile=profile)
    save_query_statistics(st, path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _manifest_codec(blob: bytes) -> dict:
    with open_kvc(blob) as r:
        return dict(r.manifest["codec"])


def _one_line_error(capsys, needle: str) -> str:
    cap = capsys.readouterr()
    err = cap.err.strip()
    assert "Traceback" not in err and cap.out == ""
    assert len(err.splitlines()) == 1, err
    assert needle in err, err
    return err


# ------------------------------------------------------------------------------ 1. parse_profile


def test_parse_profile_accepts_a_profile_and_normalises_it():
    raw = _profile(points=[[0.4, 0.016, 4.0], [0.1, 0.001, 6.0], [0.2, 0.004, 5]])  # unsorted, an int
    p = parse_profile(raw, "here")
    assert [pt[0] for pt in p.points] == [0.1, 0.2, 0.4]  # sorted by step
    assert all(isinstance(x, float) for pt in p.points for x in pt)
    assert p.kv_ratio == 2.5 and p.margin == 0.5
    assert p.settings == raw["settings"] and p.settings is not raw["settings"]
    assert p.levels[0]["k_step"] == 0.21 and p.levels[0]["kl_holdout"] == 0.006
    assert p.raw is raw
    # KL 0 is a measurement (a step too fine to matter), as is a level's zero search KL
    parse_profile(_profile(points=[[0.05, 0.0, 8.0], [0.1, 0.001, 6.0]],
                           levels=[{"target_kl": 0.01, "k_step": 0.1, "v_step": 0.2, "kl_search": 0.0}]), "here")
    # every quality parameter other than the steps may be fixed by a profile
    parse_profile(_profile(settings={k: 0 for k in QUALITY_PARAMS if k not in ("k_step", "v_step")}), "here")


def _bad_profiles():
    good = _profile()

    def with_(**kw):
        p = copy.deepcopy(good)
        p.update(kw)
        return p

    def level(**kw):
        lv = {"target_kl": 0.01, "k_step": 0.2, "v_step": 0.5}
        lv.update(kw)
        return with_(levels=[lv])

    no_ratio = copy.deepcopy(good)
    del no_ratio["kv_ratio"]
    no_points = copy.deepcopy(good)
    del no_points["points"]
    return [
        ("not a dict", [good], "not a version 1"),
        ("version 2", with_(version=2), "not a version 1"),
        ("version '1'", with_(version="1"), "not a version 1"),
        ("no version", {k: v for k, v in good.items() if k != "version"}, "not a version 1"),
        ("unknown setting", with_(settings={"max_level": 32}), "settings"),
        ("entropy setting", with_(settings={"ctx": [1, 2]}), "settings"),
        ("k_step in settings", with_(settings={"k_step": 0.3}), "settings"),
        ("v_step in settings", with_(settings={"v_step": 0.3}), "settings"),
        ("settings a list", with_(settings=[["k_gamma", 1.0]]), "settings"),
        ("no kv_ratio", no_ratio, "kv_ratio"),
        ("kv_ratio nan", with_(kv_ratio=float("nan")), "kv_ratio must be a finite number"),
        ("kv_ratio inf", with_(kv_ratio=float("inf")), "kv_ratio must be a finite number"),
        ("kv_ratio bool", with_(kv_ratio=True), "kv_ratio must be a finite number"),
        ("kv_ratio string", with_(kv_ratio="2"), "kv_ratio must be a finite number"),
        ("kv_ratio negative", with_(kv_ratio=-1.0), "kv_ratio must be in"),
        ("kv_ratio zero", with_(kv_ratio=0), "kv_ratio must be in"),
        ("margin zero", with_(margin=0.0), "margin must be in"),
        ("margin above 1", with_(margin=1.5), "margin must be in"),
        ("margin bool", with_(margin=True), "margin must be a finite number"),
        ("no points", no_points, "points must be a list"),
        ("empty points", with_(points=[]), "points must be a list"),
        ("points a dict", with_(points={"0.1": 0.001}), "points must be a list"),
        ("point too short", with_(points=[[0.1, 0.001]]), "is not [k_step, kl, bits]"),
        ("point a tuple-ish dict", with_(points=[{"k_step": 0.1}]), "is not [k_step, kl, bits]"),
        ("point a number", with_(points=[0.1]), "is not [k_step, kl, bits]"),
        ("point step zero", with_(points=[[0.0, 0.001, 6.0]]), "k_step must be in"),
        ("point step negative", with_(points=[[-0.1, 0.001, 6.0]]), "k_step must be in"),
        ("point kl negative", with_(points=[[0.1, -0.001, 6.0]]), "kl must be in"),
        ("point kl nan", with_(points=[[0.1, float("nan"), 6.0]]), "kl must be a finite number"),
        ("point kl inf", with_(points=[[0.1, float("inf"), 6.0]]), "kl must be a finite number"),
        ("point kl bool", with_(points=[[0.1, False, 6.0]]), "kl must be a finite number"),
        ("point bits null", with_(points=[[0.1, 0.001, None]]), "bits must be a finite number"),
        ("point bits huge", with_(points=[[0.1, 0.001, 65.0]]), "bits must be in"),
        ("levels missing", {k: v for k, v in good.items() if k != "levels"}, "levels must be a list"),
        ("levels a dict", with_(levels={"near": 0.01}), "levels must be a list"),
        ("level a list", with_(levels=[[0.01, 0.2, 0.5]]), "needs target_kl, k_step and v_step"),
        ("level without v_step", with_(levels=[{"target_kl": 0.01, "k_step": 0.2}]), "needs target_kl"),
        ("level target zero", level(target_kl=0.0), "level target_kl must be in"),
        ("level step negative", level(k_step=-0.2), "level k_step must be in"),
        ("level v_step nan", level(v_step=float("nan")), "level v_step must be a finite number"),
        ("level kl_search negative", level(kl_search=-1e-3), "level kl_search must be in"),
        ("level kl_holdout bool", level(kl_holdout=True), "level kl_holdout must be a finite number"),
        ("level bits a string", level(bits="4"), "level bits must be a finite number"),
    ]


@pytest.mark.parametrize("raw, msg", [pytest.param(r, m, id=i) for i, r, m in _bad_profiles()])
def test_parse_profile_rejects_what_calibrate_does_not_write(raw, msg):
    with pytest.raises(FormatError, match=re.escape(msg)) as ei:
        parse_profile(raw, "cal.safetensors")
    assert str(ei.value).startswith("cal.safetensors: ")  # names the file


def test_parse_profile_rejects_a_boolean_version():
    with pytest.raises(FormatError, match="not a version 1"):
        parse_profile(_profile(version=True), "here")


# ------------------------------------------------------------------------------ 2. steps_for_target


def _no_levels(**over):
    return parse_profile(_profile(levels=[], **over), "here")


def test_a_level_is_used_exactly_and_only_for_its_own_target():
    p = parse_profile(_profile(), "here")
    s = steps_for_target(p, 0.01)
    assert s["k_step"] == 0.21 and s["v_step"] == 0.7  # the verified entry, not kv_ratio * k_step
    assert {k: s[k] for k in p.settings} == p.settings  # and the profile's settings with it
    assert set(s) == set(p.settings) | {"k_step", "v_step"}
    # another target interpolates: aim 0.5 * 0.011 = 0.0055 between (0.2, 0.004) and (0.4, 0.016)
    s2 = steps_for_target(p, 0.011)
    want = 0.2 * (0.0055 / 0.004) ** 0.5  # KL = 0.1 step**2 on these points: log-linear slope 2
    assert s2["k_step"] == pytest.approx(want, rel=1e-12)
    assert s2["v_step"] == pytest.approx(2.5 * want, rel=1e-12)


def test_interpolation_is_log_linear_between_points():
    p = _no_levels(points=[[0.1, 0.001, 6.0], [0.3, 0.002, 5.0], [0.9, 0.05, 3.0]])
    # at each measured point: that point's step
    for k, kl, _ in p.points:
        assert k_step_for(p, kl) == pytest.approx(k, rel=1e-12)
    # between two points, log k is linear in log KL (each pair has its own slope)
    for (k0, y0, _), (k1, y1, _) in zip(p.points, p.points[1:]):
        for f in (0.1, 0.5, 0.9):
            aim = math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
            want = math.exp(math.log(k0) + f * (math.log(k1) - math.log(k0)))
            assert k_step_for(p, aim) == pytest.approx(want, rel=1e-9)
    # the target goes through the margin: target T aims at margin * T
    assert steps_for_target(p, 0.004)["k_step"] == pytest.approx(0.3, rel=1e-12)  # 0.5 * 0.004 = 0.002


def test_a_larger_target_never_gives_a_finer_step():
    rng = np.random.default_rng(0)
    for trial in range(20):
        steps = np.sort(rng.uniform(0.05, 3.0, rng.integers(1, 8)))
        kls = np.abs(rng.normal(0, 1, steps.size)) * steps ** 2 * 0.01  # noisy, not monotone
        p = _no_levels(points=[[float(s), float(k), 4.0] for s, k in zip(steps, kls)], kv_ratio=float(rng.uniform(0.3, 5)))
        targets = np.geomspace(1e-7, 10.0, 300)
        ks = np.array([steps_for_target(p, float(t))["k_step"] for t in targets])
        vs = np.array([steps_for_target(p, float(t))["v_step"] for t in targets])
        assert np.all(np.diff(ks) >= -1e-12 * ks[1:]), (trial, p.points)
        np.testing.assert_allclose(vs, p.kv_ratio * ks, rtol=1e-12)  # v_step = kv_ratio * k_step
        assert ks.max() <= steps.max() * (1 + 1e-12)  # never past the coarsest measured point


def test_a_noisy_curve_is_made_non_decreasing():
    # the point at 0.2 measured a lower KL than the finer one at 0.1 (noise): it must not make
    # 0.2 look good enough for an aim between the two
    p = _no_levels(points=[[0.1, 0.004, 6.0], [0.2, 0.002, 5.0], [0.4, 0.016, 4.0]])
    aim = 0.003
    k = k_step_for(p, aim)
    assert k < 0.1
    assert k == pytest.approx(0.1 * math.sqrt(aim / 0.004), rel=1e-12)  # below the finest: KL ~ step**2
    # at the envelope's level (0.004) the coarser step is as good: the largest one wins
    assert k_step_for(p, 0.004) == pytest.approx(0.2, rel=1e-12)
    # above it, interpolation runs from the envelope (0.2, 0.004) to (0.4, 0.016)
    assert k_step_for(p, 0.008) == pytest.approx(0.2 * math.sqrt(2), rel=1e-9)


def test_below_the_finest_point_kl_goes_as_step_squared():
    p = _no_levels()
    k0, kl0, _ = p.points[0]
    for f in (0.9, 0.25, 1e-2, 1e-4):
        assert k_step_for(p, f * kl0) == pytest.approx(k0 * math.sqrt(f), rel=1e-12)
    # a one-point profile extends the same way below, and never above its point
    one = _no_levels(points=[[0.5, 0.01, 4.0]])
    assert k_step_for(one, 0.0025) == pytest.approx(0.25, rel=1e-12)
    assert k_step_for(one, 5.0) == 0.5


def test_never_coarser_than_the_coarsest_measured_point():
    p = _no_levels()
    for target in (0.2, 1.0, 10.0):
        s = steps_for_target(p, target)
        assert s["k_step"] == pytest.approx(0.8, rel=1e-12) and s["v_step"] == pytest.approx(2.0, rel=1e-12)


def test_monotone_in_the_target_across_a_level():
    # build_profile on the tiny model below (margin 1: the points hold the search's criterion):
    # level "a" (0.01) kept 0.1414 (criterion 0.00859), the next coarser point 0.1501 missed it
    # (0.01099); a target just below 0.01 interpolates between the two, above the level's step
    p = parse_profile(_profile(margin=1.0, kv_ratio=1.965,
                               points=[[0.1343, 0.00757, 13.3], [0.1414, 0.00859, 13.28], [0.1501, 0.01099, 13.2],
                                       [0.3262, 0.0441, 11.8], [0.5, 0.10574, 10.9]],
                               levels=[{"target_kl": 0.01, "k_step": 0.1414, "v_step": 0.2779},
                                       {"target_kl": 0.05, "k_step": 0.3262, "v_step": 0.641}]), "here")
    ks = [steps_for_target(p, t)["k_step"] for t in (0.0099, 0.01, 0.0101, 0.049, 0.05)]
    assert ks == sorted(ks), ks


# ------------------------------------------------------------------------------ 3. the codec


@pytest.mark.parametrize("chunk", [0, 32])
def test_target_kl_encodes_with_the_profiles_steps_on_every_route(tmp_path, capsys, chunk):
    cache = _cache()
    f = tmp_path / "prof.safetensors"
    digest = _stats_file(cache, f, _profile())
    want = steps_for_target(parse_profile(_profile(), "x"), 0.005)
    config = {"id": "kvc", "target_kl": 0.005, "calibration": str(f)}
    routes = _routes(config, cache, tmp_path, chunk)
    blob = routes["Codec.encode"]
    assert all(b == blob for b in routes.values()), {k: hashlib.sha256(b).hexdigest()[:12] for k, b in routes.items()}
    cfg = _manifest_codec(blob)
    assert cfg["k_step"] == want["k_step"] and cfg["v_step"] == want["v_step"]
    assert 0.1 < cfg["k_step"] < 0.2 and cfg["v_step"] == pytest.approx(2.5 * cfg["k_step"])
    for k, v in _profile()["settings"].items():
        assert cfg[k] == v, k
    assert cfg["target_kl"] == 0.005 and cfg["fallback"] == "refuse"
    assert cfg["calibration_sha256"] == digest and cfg["calibration"] == str(f)
    # entropy and file-level settings stay the caller's (the codec's defaults here)
    defaults = kvcodec.get_codec({"id": "kvc"}).get_config()
    for k in ("ctx", "rows_per_stream", "chunk", "max_level", "precision", "sinks", "sink_v_ratio", "pack"):
        assert cfg[k] == defaults[k], k  # (this profile's settings leave sink_v_ratio to the caller)
    # the codec object is left as configured
    assert kvcodec.get_codec(config).params["k_step"] == defaults["k_step"]
    # the profile's steps are what coded the tensors: the same steps spelled out with the same
    # file (no target) decode to the same values
    spelled = {**{k: v for k, v in cfg.items() if k not in ("target_kl", "fallback")}, "calibration": str(f)}
    other = kvcodec.get_codec(spelled).encode(cache, tokens_per_chunk=chunk)
    assert other != blob  # the config differs (no target recorded) ...
    a, b = kvcodec.decode(blob), kvcodec.decode(other)
    assert all(torch.equal(x[r], y[r]) for x, y in zip(a.layers, b.layers) for r in ("k", "v"))  # ... the codes not
    # the file's config is a valid kvc config and the decoder needs neither the target nor the file
    assert kvcodec.get_codec(cfg).get_config()["target_kl"] == 0.005
    f.unlink()
    out = kvcodec.decode(blob)
    for x, c in zip(out.layers, cache.layers):
        for r in ("k", "v"):
            assert x[r].dtype == c[r].dtype and x[r].shape == c[r].shape
            rel = float((x[r].float() - c[r].float()).pow(2).mean() / c[r].float().var())
            assert 0 < rel < 0.05, (r, rel)


def test_a_smaller_target_gives_finer_steps_and_more_bytes(tmp_path):
    cache = _cache()
    f = tmp_path / "prof.safetensors"
    _stats_file(cache, f, _profile(levels=[]))
    blobs = {t: kvcodec.get_codec({"id": "kvc", "target_kl": t, "calibration": str(f)}).encode(cache)
             for t in (0.0005, 0.002, 0.008, 0.03)}
    ks = [_manifest_codec(b)["k_step"] for b in blobs.values()]
    sizes = [len(b) for b in blobs.values()]
    assert ks == sorted(ks) and len(set(ks)) == 4, ks
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4, sizes
    # and the error follows
    errs = []
    for b in blobs.values():
        d = kvcodec.decode(b)
        errs.append(sum(float((x["k"].float() - c["k"].float()).pow(2).mean()) for x, c in zip(d.layers, cache.layers)))
    assert errs == sorted(errs), errs


def test_a_level_preset_with_a_profile_codes_the_level_it_names(tmp_path):
    cache = _cache()
    f = tmp_path / "prof.safetensors"
    _stats_file(cache, f, _profile())
    cfg = _manifest_codec(kvcodec.get_codec({"id": "kvc-near", "calibration": str(f)}).encode(cache))
    assert cfg["target_kl"] == 0.01 and cfg["fallback"] == "steps"
    assert cfg["k_step"] == 0.21 and cfg["v_step"] == 0.7  # the profile's verified "near" level
    assert cfg["recent_ramp"] == 16  # the profile's setting over the preset's 128
    assert cfg["max_level"] == kvcodec.get_codec("kvc-near").get_config()["max_level"]  # the preset's entropy


def test_target_kl_without_a_profile_is_refused_on_every_route(tmp_path, capsys):
    cache = _cache()
    raw = tmp_path / "raw.safetensors"
    cache.to_safetensors(raw)
    stats_only = tmp_path / "stats.safetensors"
    _stats_file(cache, stats_only)
    cases = [({"id": "kvc", "target_kl": 0.005}, "kvcodec calibrate"),
             ({"id": "kvc", "target_kl": 0.005, "fallback": "refuse"}, "kvcodec calibrate"),
             ({"id": "kvc", "target_kl": 0.005, "calibration": str(stats_only)}, "no profile")]
    for config, msg in cases:
        codec = kvcodec.get_codec(config)
        with pytest.raises(ConfigError, match=msg):
            codec.encode(cache)
        with pytest.raises(ConfigError, match=msg):
            codec.encode(cache, tmp_path / "x.kvc")
        with pytest.raises(ConfigError, match=msg):
            write_file(codec, cache, tmp_path / "y.kvc")
        capsys.readouterr()
        assert main(["encode", str(raw), str(tmp_path / "z.kvc"), "--codec", json.dumps(config)]) == 1
        _one_line_error(capsys, msg)
    assert not any(p.name in ("x.kvc", "y.kvc", "z.kvc") for p in tmp_path.iterdir())


def test_fallback_steps_codes_the_given_steps_and_records_no_target(tmp_path):
    cache = _cache()
    stats_only = tmp_path / "stats.safetensors"
    _stats_file(cache, stats_only)
    base = {"id": "kvc", "k_step": 0.37, "v_step": 0.8}
    for extra in ({}, {"calibration": str(stats_only)}):
        plain = kvcodec.get_codec({**base, **extra}).encode(cache)
        fb = kvcodec.get_codec({**base, **extra, "target_kl": 0.005, "fallback": "steps"}).encode(cache)
        assert fb == plain  # byte for byte: the file does not say a target was kept
        cfg = _manifest_codec(fb)
        assert "target_kl" not in cfg and "fallback" not in cfg and cfg["k_step"] == 0.37
    # target 0 is off whatever the fallback: no profile is needed
    assert kvcodec.get_codec({**base, "fallback": "refuse"}).encode(cache) == kvcodec.get_codec(base).encode(cache)


@pytest.mark.parametrize("name", ["kvc-transparent", "kvc-near", "kvc-aggressive"])
def test_level_presets_without_calibration_encode_as_before(name, tmp_path):
    cache = _cache()
    codec = kvcodec.get_codec(name)
    cfg = codec.get_config()
    assert cfg["target_kl"] > 0 and cfg["fallback"] == "steps"
    old = kvcodec.get_codec({k: v for k, v in cfg.items() if k not in ("target_kl", "fallback")})
    blob = codec.encode(cache)
    object.__setattr__(old, "preset", name)  # the file also records the preset's name (producer.preset)
    assert blob == old.encode(cache)
    with open_kvc(blob) as r:
        assert r.manifest["producer"]["preset"] == name
    fc = _manifest_codec(blob)
    assert "target_kl" not in fc and "fallback" not in fc
    assert fc["k_step"] == cfg["k_step"] and fc["v_step"] == cfg["v_step"]


@pytest.mark.parametrize("name", ["kvc-transparent-cal", "kvc-near-cal", "kvc-aggressive-cal"])
def test_cal_presets_with_a_statistics_only_file_encode_as_before(name, tmp_path):
    cache = _cache()
    f = tmp_path / "stats.safetensors"
    _stats_file(cache, f)
    cfg = kvcodec.get_codec(name).get_config()
    old = {k: v for k, v in cfg.items() if k not in ("target_kl", "fallback")}
    blob = kvcodec.get_codec({"id": name, "calibration": str(f)}).encode(cache)
    same = kvcodec.get_codec({**old, "calibration": str(f)})
    object.__setattr__(same, "preset", name)  # the file also records the preset's name (producer.preset)
    assert blob == same.encode(cache)
    assert "target_kl" not in _manifest_codec(blob)


@pytest.mark.parametrize("settings, msg", [
    ({"k_qgamma": 99.0}, "k_qgamma"),
    ({"transform": "wavelet"}, "transform"),
    ({"recent_fine": 0.5}, "recent_fine"),
    ({"attn_clip": 0.0}, "attn_clip"),
    ({"k_recon": 17}, "k_recon"),
])
def test_a_profile_the_codec_cannot_use_is_a_format_error(tmp_path, settings, msg):
    cache = _cache()
    f = tmp_path / "prof.safetensors"
    _stats_file(cache, f, _profile(settings=settings))
    with pytest.raises(FormatError, match=f"profile settings: .*{msg}") as ei:
        kvcodec.get_codec({"id": "kvc", "target_kl": 0.005, "calibration": str(f)}).encode(cache)
    assert str(f) in str(ei.value)


@pytest.mark.parametrize("profile, msg", [
    (_profile(version=7), "not a version 1"),
    (_profile(points=[]), "points"),
    (_profile(levels=[{"target_kl": 0.005, "k_step": 1e-9, "v_step": 0.1}]), "k_step"),  # below kvc's range
])
def test_a_malformed_profile_in_a_file_is_a_format_error(tmp_path, profile, msg):
    cache = _cache()
    f = tmp_path / "prof.safetensors"
    _stats_file(cache, f, profile)
    with pytest.raises(FormatError, match=msg):
        kvcodec.get_codec({"id": "kvc", "target_kl": 0.005, "calibration": str(f)}).encode(cache)
    # without a target the profile is not read: the statistics still calibrate
    kvcodec.get_codec({"id": "kvc", "calibration": str(f)}).encode(cache)


def test_a_profile_for_another_model_is_refused(tmp_path):
    f = tmp_path / "prof.safetensors"
    _stats_file(_cache(layers=3), f, _profile())
    with pytest.raises(ConfigError, match="another model"):
        kvcodec.get_codec({"id": "kvc", "target_kl": 0.005, "calibration": str(f)}).encode(_cache(layers=2))


@pytest.mark.parametrize("bad", [-0.1, 10.5, float("nan")])
def test_target_kl_and_fallback_are_validated(bad):
    with pytest.raises(ConfigError, match="target_kl"):
        kvcodec.get_codec({"id": "kvc", "target_kl": bad})
    for fb in ("", "Steps", "ignore", None):
        with pytest.raises(ConfigError, match="fallback"):
            kvcodec.get_codec({"id": "kvc", "fallback": fb})


# ------------------------------------------------------------------------------ 4. build_profile

def _tiny_llama():
    """A 2-layer random Llama (sharp random init so that coarse steps cost real KL), a word-level
    tokenizer and a text of random words."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from kvc_tools import word_tokenizer

    tok, words = word_tokenizer(120)
    rng = np.random.default_rng(0)
    text = " ".join(words[i] for i in rng.integers(0, 40, 400))
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   bos_token_id=1, eos_token_id=0, pad_token_id=0, initializer_range=0.3)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval(), tok, text


def test_build_profile_on_a_tiny_model(monkeypatch, tmp_path):
    from kvcodec.harness import evaluate, profile as hp

    model, tok, text = _tiny_llama()
    scored: list[tuple[float, float, float, int]] = []  # (k_step, kl, bits, window) of every scoring call
    windows: list[int] = []  # the Evaluators (token windows) in the order they first score
    alive: list[object] = []
    ratio: list[float | None] = [None]
    orig = evaluate.Evaluator.score_next_token
    real_ratio = hp.kv_ratio

    def spy(self, codec, **kw):
        r = orig(self, codec, **kw)
        if id(self) not in windows:
            windows.append(id(self))
            alive.append(self)  # ids stay unique while the test runs
        scored.append((float(codec["k_step"]), r["next_token"]["kl_mean"], r["bits_per_element"],
                       windows.index(id(self)), float(codec["v_step"])))
        assert {k: codec[k] for k in hp.SEARCH_SETTINGS} == hp.SEARCH_SETTINGS
        return r

    def spy_ratio(stats):
        ratio[0] = real_ratio(stats)
        return ratio[0]

    monkeypatch.setattr(evaluate.Evaluator, "score_next_token", spy)
    monkeypatch.setattr(hp, "kv_ratio", spy_ratio)
    levels = {"a": 0.01, "b": 0.05}
    margin = 0.7
    msgs: list[str] = []
    # one text of 4 windows (81 tokens each): windows 0 and 2 search, 1 and 3 are held out
    st = hp.build_profile(model, tok, text, context=64, continuation=16, samples=16, sensitivity_samples=1,
                          levels=levels, margin=margin, max_windows=2, max_held=2, progress=msgs.append)
    raw = st.profile
    p = parse_profile(json.loads(json.dumps(raw)), "built")  # what it writes, through JSON, parses
    assert raw["version"] == 1 and {k: p.settings[k] for k in hp.SEARCH_SETTINGS} == hp.SEARCH_SETTINGS
    assert ratio[0] is not None and p.kv_ratio == ratio[0] == raw["kv_ratio_measured"]
    assert st.k_sens is not None and st.num_layers == 2
    # two search windows, then two held-out ones (scored last, once per level)
    assert len(windows) == 4
    # the balance probes (balance_level) score steps off the measured K/V ratio; the step search
    # codes every step at that ratio
    balance = {(k, v): (crit, bits, complete) for k, v, crit, bits, complete in raw["balance"]}
    assert raw["balance"] and any("balance" in m for m in msgs)  # every level met here is probed
    probes = [x for x in scored if x[3] < 2 and (x[0], x[4]) in balance]
    search = [x for x in scored if x[3] < 2 and (x[0], x[4]) not in balance]
    assert all(x[4] == pytest.approx(x[0] * ratio[0]) for x in search)
    assert all(v != pytest.approx(k * ratio[0]) for k, v in balance)
    for (k, v), (crit, bits, complete) in balance.items():
        kls = [x[1] for x in probes if (x[0], x[4]) == (k, v)]
        assert len(kls) == 2 if complete else 1 <= len(kls) <= 2
        if complete:
            assert crit == pytest.approx(max(np.mean(kls) / margin, max(kls) / hp.WORST_FACTOR), rel=1e-12)
    held = [x for x in scored if x[3] >= 2]
    assert scored[-len(held):] == held and len(held) == 2 * len(levels)
    # the budget of window scores counts every search and balance score (held-out ones aside)
    assert raw["window_scores"] == len(scored) - len(held) <= hp.MAX_TOTAL_SCORES * 2 + 2
    assert raw["search_max_total_scores"] == hp.MAX_TOTAL_SCORES
    # every point is a measurement: its criterion max(mean / margin, worst / 1.2) over the search
    # windows' KL at that step, and the mean bits; the encoder then aims at the target itself
    assert p.margin == 1.0 and str(margin) in raw["criterion"]
    # a step that one window already proves over the level searched is not scored further: it
    # guides the search by its lower bound and is never a point (points hold exact criteria)
    window_kl = {s: kls for s, kls in raw["window_kl"]}
    stopped = raw["stopped_early"]
    assert len(search) == 2 * len(p.points) + len(stopped) and len(p.points) >= len(levels)
    for k, bound, kls in stopped:
        got = [x for x in kls if x is not None]
        assert len(got) == 1 and k not in window_kl and [x[1] for x in search if x[0] == k] == got
        assert bound == pytest.approx(max(got[0] / (2 * margin), got[0] / hp.WORST_FACTOR), rel=1e-12)
        assert bound > min(levels.values())
    for k, crit, bits in p.points:
        at = [x for x in search if x[0] == k][:2]
        assert sorted(x[3] for x in at) == [0, 1], (k, scored)
        kls = [x[1] for x in sorted(at, key=lambda x: x[3])]
        assert window_kl[k] == kls
        assert crit == pytest.approx(max(np.mean(kls) / margin, max(kls) / hp.WORST_FACTOR), rel=1e-12)
        assert bits == pytest.approx(np.mean([x[2] for x in at]), rel=1e-12)
    # each level: a measured point that meets its target (mean KL within margin * target, the
    # worst window within 1.2x the target), or the finest step tried
    assert {lv["name"] for lv in raw["levels"]} == set(levels)
    finest = min(k for k, _, _ in p.points)
    for lv in raw["levels"]:
        t = levels[lv["name"]]
        assert lv["target_kl"] == t
        assert lv["k_step"] in window_kl
        assert lv["kl_search"] == pytest.approx(np.mean(window_kl[lv["k_step"]]), rel=1e-12)
        assert lv["kl_search_worst"] == max(window_kl[lv["k_step"]])
        if (lv["k_step"], lv["v_step"]) in balance:  # a balance probe beat the level's point
            assert balance[(lv["k_step"], lv["v_step"])][2] and lv["v_step"] != pytest.approx(lv["k_step"] * p.kv_ratio)
        else:
            assert lv["v_step"] == pytest.approx(lv["k_step"] * p.kv_ratio)
        met = lv["kl_search"] <= margin * t * (1 + 1e-12) and lv["kl_search_worst"] <= 1.2 * t * (1 + 1e-12)
        assert met or lv["k_step"] == finest, lv
        # the held-out windows were scored at the level's steps
        at = [x[1] for x in held if x[0] == lv["k_step"]][:2]
        assert len(at) == 2 and lv["kl_holdout"] == pytest.approx(np.mean(at), rel=1e-12)
        assert lv["kl_holdout_worst"] == max(at)
    # the finer target gets the finer (or equal) step, and at least as many bits
    a, b = ({lv["name"]: lv for lv in raw["levels"]}[n] for n in ("a", "b"))
    assert a["k_step"] <= b["k_step"] and a["bits"] >= b["bits"]
    assert not set(raw["text"]["search_windows"]) & set(raw["text"]["holdout_windows"])
    assert any("held-out" in m for m in msgs)
    # the encoder takes the verified steps for the profile's own levels
    f = tmp_path / "tiny.safetensors"
    save_query_statistics(st, f)
    from kvcodec.harness.capture import capture

    cache = capture(model, tok, text, context=48, dtype=torch.float16)
    cfg = _manifest_codec(kvcodec.get_codec({"id": "kvc", "target_kl": 0.01, "calibration": str(f)}).encode(cache))
    assert cfg["k_step"] == a["k_step"] and cfg["v_step"] == a["v_step"]


def test_the_search_never_scores_the_same_step_twice():
    from kvcodec.harness.profile import _next_step

    # two points just above the aim, and the try their secant gave, well below it (as on the tiny
    # model): the next try belongs inside the bracket (0.12, 0.15), not on 0.12 again
    pts = [(0.16, 0.0081, 13.1), (0.15, 0.0080, 13.3), (0.12, 0.0030, 13.9)]
    s = _next_step(pts, 0.0064)
    assert all(abs(s - p[0]) > 1e-9 for p in pts) and 0.12 < s < 0.15, s
    # (a KL that saturates can still send the secant back to a scored step: build_profile checks
    # its points before scoring and stops there; test_a_search_that_cannot_meet_its_aim_returns_bounded)


def test_an_unbracketed_step_uses_the_slope_of_every_point():
    from kvcodec.harness.profile import _next_step

    # a power law of slope 2.7 (Qwen2.5-Coder's KL against k_step) measured at 0.5 and 0.99, and
    # a close pair near 0.47 whose own slope (3.9) is noise: the step for a finer aim follows the
    # fit through all points, not the close pair (which sent Qwen's transparent level to a miss)
    law = lambda k: 0.0114 * (k / 0.5) ** 2.7  # noqa: E731
    pts = [(k, law(k) * f, 0.0) for k, f in ((0.5, 1.0), (0.99, 1.0), (0.4629, 0.97), (0.4764, 1.06))]
    s = _next_step(pts, 0.0018)
    assert s == pytest.approx(0.5 * (0.0018 / 0.0114) ** (1 / 2.7), rel=0.03), s


def test_the_search_goes_fine_first_from_the_predicted_step():
    from kvcodec.harness.profile import _solve_step, search_levels

    predict = lambda k: 0.02 * k ** 1.8  # noqa: E731
    s, p = _solve_step(predict, 0.0018, 0.5)
    assert p == pytest.approx(0.0018, rel=0.03) and predict(s) == p
    # the criterion: 1.3x the prediction, growing as k_step^2.7 (as on Qwen2.5-Coder): starting
    # at the predicted step of the finest level, each level is met in at most two scores
    crit = lambda k: 1.3 * predict(s) * (k / s) ** 2.7  # noqa: E731
    calls = []

    def score(k):
        calls.append(k)
        c = crit(k)
        return c, [c], 4.0 - math.log2(k)

    levels = {"aggressive": 0.05, "transparent": 0.002, "near": 0.01}
    _, _, chosen = search_levels(score, levels, 2.0, first=s)
    assert calls[0] == s and len(calls) <= 6, calls
    assert [min(levels, key=lambda n: abs(math.log(crit(k) / levels[n]))) for k in calls][-1] == "aggressive"
    for name, target in levels.items():
        assert 0.8 * target <= chosen[name]["kl_search"] <= target
    assert chosen["transparent"]["k_step"] < chosen["near"]["k_step"] < chosen["aggressive"]["k_step"]


class _KLWindow:
    """A window whose KL is ``scale * k_step**2`` (counts its scores)."""

    def __init__(self, scale):
        self.scale, self.calls = scale, 0

    def score_next_token(self, codec, kl_only=False):
        self.calls += 1
        return {"bits_per_element": 2.0, "bytes": 1, "next_token": {"kl_mean": self.scale * codec["k_step"] ** 2}}


def test_a_window_that_proves_a_step_over_the_target_stops_its_score():
    from kvcodec.harness.profile import score_windows, score_windows_until

    evs = [_KLWindow(0.02), _KLWindow(0.05), _KLWindow(0.03), _KLWindow(0.02)]
    full = score_windows(evs, {"k_step": 1.0}, 0.8)
    # in the given order the 0.02 window alone proves nothing; with the 0.05 window first it does
    crit, kls, bits, complete = score_windows_until(evs, {"k_step": 1.0}, 0.8, 1.2, 0.03, order=[1, 0, 2, 3])
    assert not complete and kls == [None, 0.05, None, None] and crit == pytest.approx(0.05 / 1.2)
    assert crit <= full[0]  # a lower bound of the criterion
    crit, kls, _, complete = score_windows_until(evs, {"k_step": 1.0}, 0.8, 1.2, 0.03)
    assert not complete and kls[:2] == [0.02, 0.05] and kls[2:] == [None, None]
    # under the target nothing stops: the same numbers as score_windows
    crit, kls, bits, complete = score_windows_until(evs, {"k_step": 1.0}, 0.8, 1.2, 1.0)
    assert complete and (crit, kls, bits) == full


def test_lower_bounds_never_flatten_the_slope():
    from kvcodec.harness.profile import _next_step

    # SmolLM2's transparent level: one exact point and two steps stopped early with lower bounds
    # that barely rise; taken as points they gave a slope of 1 and sent near to k_step 3.0
    pts = [(0.5717, 0.00191, 2.4)]
    bounds = [(0.7004, 0.00221, 2.2), (0.8132, 0.00243, 2.0)]
    s = _next_step(pts, 0.009, bounds)
    assert s == pytest.approx(0.5717 * math.sqrt(0.009 / 0.00191), rel=1e-9)
    # a bound over the aim caps the step: between the exact point below and the bound, with at
    # least the slope to the bound (the true criterion there is higher still) ...
    s = _next_step(pts, 0.009, bounds + [(1.2, 0.015, 1.5)])
    to_bound = math.log(0.015 / 0.00191) / math.log(1.2 / 0.5717)
    assert s == pytest.approx(0.5717 * (0.009 / 0.00191) ** (1 / to_bound), rel=1e-9) and s < 1.2
    # ... and from the bound alone when no exact point lies below the aim (slope 2 without points)
    assert _next_step([], 0.009, [(0.8, 0.05, 1.5)]) == pytest.approx(0.8 * math.sqrt(0.009 / 0.05), rel=1e-9)
    with pytest.raises(ValueError):  # no exact point and no bound over the aim: nothing to step from
        _next_step([], 0.009, bounds)


def test_a_search_that_stops_early_keeps_only_exact_points():
    from kvcodec.harness.profile import score_windows_until, search_levels

    evs = [_KLWindow(0.05), _KLWindow(0.02), _KLWindow(0.03), _KLWindow(0.02)]
    partial = []
    levels = {"transparent": 0.002, "near": 0.01, "aggressive": 0.05}
    points, detail, chosen = search_levels(
        lambda k, stop: score_windows_until(evs, {"k_step": k}, 0.8, 1.2, stop), levels, 2.0, first=0.5,
        partial=partial)
    assert partial, "some step was proven over its level by one window"
    assert all(None in kls for _, _, kls in partial) and not {k for k, _, _ in partial} & set(detail)
    for name, target in levels.items():  # every level met, on exact points
        lv = chosen[name]
        assert lv["k_step"] in detail and 0.8 * target <= max(np.mean(detail[lv["k_step"]]) / 0.8,
                                                             max(detail[lv["k_step"]]) / 1.2) <= target
    calls = sum(e.calls for e in evs)
    assert calls < 4 * (len(points) + len(partial))  # the stopped steps cost fewer window scores


def _search(crit_of, max_scores=8):
    from kvcodec.harness.profile import search_levels

    calls = []

    def score(k):
        calls.append(k)
        c = crit_of(k)
        return c, [c], 4.0 - math.log2(k)

    _, _, chosen = search_levels(score, {"near": 0.01}, 2.0, max_scores=max_scores)
    return calls, chosen["near"]


def test_a_level_met_low_in_its_band_gets_one_score_closer_to_its_target():
    # KL = 0.0332 k^2: the first try (0.5) meets 0.01 at 0.83x; one more, aimed at 0.96x with
    # the high-rate slope, lands inside [0.9, 1] and is what the level keeps
    calls, lv = _search(lambda k: 0.0332 * k * k)
    assert len(calls) == 2 and calls[1] == pytest.approx(0.5 * math.sqrt(0.96 / 0.83), rel=1e-6)
    assert lv["k_step"] == calls[1] and 0.009 <= lv["kl_search"] <= 0.01
    # no scores left (or refinement off): the first met step stands
    for max_scores in (None, 1):
        calls, lv = _search(lambda k: 0.0332 * k * k, max_scores)
        assert calls == [0.5] and lv["k_step"] == 0.5


def test_the_search_is_bounded_by_scores_not_seconds(monkeypatch):
    # the same scores give the same profile however slow the machine: a clock that jumps an
    # hour per call changes nothing (the refinement used to stop after 420 s)
    import itertools
    import time as _time

    ticks = itertools.count(0.0, 3600.0)
    monkeypatch.setattr(_time, "perf_counter", lambda: next(ticks))
    calls, lv = _search(lambda k: 0.0332 * k * k)
    assert len(calls) == 2 and 0.009 <= lv["kl_search"] <= 0.01


def test_a_refinement_that_misses_keeps_the_met_step_and_stops():
    calls, lv = _search(lambda k: 0.0083 if k <= 0.5 else 0.02)  # a cliff just past the met step
    assert len(calls) == 2 and calls[1] > 0.5
    assert lv["k_step"] == 0.5 and lv["kl_search"] == 0.0083


class _FakeEvaluator:
    """An Evaluator whose KL never falls below a floor (a model no step can satisfy)."""

    calls: list[float] = []

    def __init__(self, model, tok, text, context, continuation, **k):
        from kvcodec.harness.capture import capture

        # the search's predictor encodes window 0's real cache; only the scores are fake
        self.reference = capture(model, tok, token_ids=k["token_ids"][:context], dtype=torch.float16)
        self.state = None  # not a hybrid model

    def score_next_token(self, codec, kl_only=False):
        k = float(codec["k_step"])
        _FakeEvaluator.calls.append(k)
        return {"bits_per_element": 4.0 - math.log2(k), "bytes": 1,
                "next_token": {"kl_mean": 0.5 + k * k}}


def test_a_search_that_cannot_meet_its_aim_returns_bounded(monkeypatch):
    from kvcodec.harness import evaluate
    from kvcodec.harness.profile import build_profile

    model, tok, text = _tiny_llama()
    monkeypatch.setattr(evaluate, "Evaluator", _FakeEvaluator)
    _FakeEvaluator.calls = []
    levels = {"x": 0.001, "y": 0.01}
    st = build_profile(model, tok, text, context=32, continuation=8, samples=8, sensitivity_samples=1,
                       levels=levels, max_evals=3, max_windows=1)
    p = parse_profile(st.profile, "built")
    calls = _FakeEvaluator.calls
    # one search window and one held out: per level max_evals tries and 4 halvings (coarse level
    # first), then one held-out score per level: bounded
    assert len(calls) == len(levels) * (3 + 4) + len(levels), calls
    assert all(b == pytest.approx(a / 2) for a, b in zip(calls[3:7], calls[4:7]))  # the halvings
    by_name = {lv["name"]: lv for lv in st.profile["levels"]}
    for name, tried in (("y", calls[:7]), ("x", calls[7:14])):
        lv = by_name[name]
        assert lv["kl_search"] > p.margin * lv["target_kl"]  # it could not be met ...
        assert min(tried) >= lv["k_step"] == min(calls[:14])  # ... so the finest step measured is what it keeps
        assert lv["kl_holdout"] == 0.5 + lv["k_step"] ** 2
    assert by_name["x"]["k_step"] == min(k for k, _, _ in p.points)


# ------------------------------------------------------------------------------ 5. the CLI


def test_calibrate_help_mentions_the_profile(capsys):
    assert main(["calibrate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "profile" in out and "--no-profile" in out and "--margin" in out and "target_kl" in out


@pytest.mark.parametrize("args, needle, code", [
    (["--margin", "0"], "--margin", 2),  # out of range for the option alone: argparse, exit 2
    (["--margin", "1.5"], "--margin", 2),
    (["--margin", "nan"], "--margin", 2),
    (["--no-profile", "--sensitivity", "-1"], "--sensitivity", 2),
    (["--context", "1"], "--context", 2),
    (["--sensitivity", "0"], "--no-profile", 1),  # wrong only together: a one-line error, exit 1
    (["--skip-tokens", "10"], "--no-profile", 1),
])
def test_calibrate_argument_errors_exit_before_any_model_loads(args, needle, code, capsys, monkeypatch, tmp_path):
    pytest.importorskip("transformers")  # without the [eval] extra the command stops before its checks
    from kvcodec.harness import models

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", no_model)
    out = tmp_path / "p.safetensors"
    assert main(["calibrate", *args, "--out", str(out)]) == code
    if code == 1:
        _one_line_error(capsys, needle)
    else:
        err = capsys.readouterr().err
        assert "Traceback" not in err and f"argument {needle}" in err, err
    assert not out.exists()


def test_cli_encode_says_when_a_level_preset_has_no_profile(tmp_path, capsys):
    cache = _cache()
    raw = tmp_path / "raw.safetensors"
    cache.to_safetensors(raw)
    assert main(["encode", str(raw), str(tmp_path / "a.kvc"), "--codec", "kvc-near"]) == 0
    err = capsys.readouterr().err
    assert "kvc-near has no profile" in err and "kvcodec calibrate" in err
    assert main(["encode", str(raw), str(tmp_path / "b.kvc"), "--codec", "fp8-e4m3"]) == 0
    assert "profile" not in capsys.readouterr().err


def test_a_profiles_sink_v_ratio_decides_sink_detection(tmp_path):
    """The search measures without sink detection (sink_v_ratio 0 in its settings): a profile
    that says so codes no V-small token exactly whatever the caller's ratio; a profile without
    the setting leaves the caller's (kvc's default 0.3) to store them exactly."""
    cache = _cache()
    for layer in cache.layers:  # a V-small token at position 5 in every layer: a sink at ratio 0.3
        layer["v"][5] *= 0.01
    got = {}
    for name, settings in (("caller's", {"k_qgamma": 1.0}), ("profile's", {"k_qgamma": 1.0, "sink_v_ratio": 0.0})):
        f = tmp_path / f"{len(settings)}.safetensors"
        _stats_file(cache, f, _profile(settings=settings))
        blob = kvcodec.get_codec({"id": "kvc", "target_kl": 0.005, "calibration": str(f)}).encode(cache)
        cfg = _manifest_codec(blob)
        with open_kvc(blob) as r:
            sinks = r.globals().get("kvc_sinks")
        got[name] = (cfg["sink_v_ratio"], sinks, kvcodec.decode(blob))
    ratio, sinks, out = got["caller's"]
    assert ratio == 0.3 and sinks is not None and {tuple(r) for r in sinks.tolist()} >= {(i, 5) for i in range(len(cache.layers))}
    assert all(torch.equal(o["v"][5], c["v"][5]) for o, c in zip(out.layers, cache.layers))
    ratio, sinks, out = got["profile's"]
    assert ratio == 0.0 and sinks is None
    assert not all(torch.equal(o["v"][5], c["v"][5]) for o, c in zip(out.layers, cache.layers))


def _balance_model(w_v: float):
    """A two-role rate model: bits fall by half a bit per octave of each step, the criterion is
    ``0.01 k**2 + w_v v**2`` (the best ``v / k`` at equal bits is ``sqrt(0.01 / w_v)``)."""
    def bits(k: float, v: float) -> float:
        return 4.0 - 0.5 * math.log2(k) - 0.5 * math.log2(v)

    def crit(k: float, v: float) -> float:
        return 0.01 * k * k + w_v * v * v

    calls: list[tuple[float, float, float | None]] = []

    def score(k: float, v: float, stop: float | None):
        calls.append((k, v, stop))
        c = crit(k, v)
        if stop is not None and c > stop:  # one window proves it over
            return c, [c, None], bits(k, v), False
        return c, [c, c], bits(k, v), True

    return bits, crit, score, calls


@pytest.mark.parametrize("w_v, ratio0, way", [(0.02, 2.0, "finer V"), (0.0005, 1.0, "coarser V")])
def test_balance_moves_the_ratio_the_way_that_lowers_kl_at_equal_bits(w_v, ratio0, way):
    from kvcodec.harness.profile import balance_level

    bits, crit, score, calls = _balance_model(w_v)
    target = 0.05
    k0 = math.sqrt(0.9 * target / (0.01 + w_v * ratio0 ** 2))  # the step search's point at ratio0
    c0, b0 = crit(k0, ratio0 * k0), bits(k0, ratio0 * k0)
    best, tried = balance_level(score, bits, target, k0, ratio0, c0, b0, slope=2.0)
    r = best["v_step"] / best["k_step"]
    optimum = math.sqrt(0.01 / w_v)
    # moved toward the optimum, met the target, and spent the saved KL on fewer bits
    assert abs(math.log(r / optimum)) < abs(math.log(ratio0 / optimum)), (r, optimum)
    assert best["crit"] == pytest.approx(crit(best["k_step"], best["v_step"])) and best["crit"] <= target
    assert best["bits"] < b0 - 0.01
    # every probe was recorded; the first codes to the level's bits (found by encodes alone)
    assert len(tried) == len(calls) and tried[0][3] == pytest.approx(b0, abs=0.005 * b0)
    assert all(t[:2] == [c[0], c[1]] for t, c in zip(tried, calls))


def test_balance_keeps_the_ratio_when_no_probe_beats_it():
    from kvcodec.harness.profile import balance_level

    bits, crit, score, calls = _balance_model(0.01 / 1.5 ** 2)  # best v/k: 1.5
    k0 = 0.5
    c0, b0 = crit(k0, 1.5 * k0), bits(k0, 1.5 * k0)
    best, tried = balance_level(score, bits, 0.05, k0, 1.5, c0, b0, slope=2.0)
    assert (best["k_step"], best["v_step"], best["crit"], best["bits"]) == (k0, 1.5 * k0, c0, b0)
    assert best["kls"] is None and len(tried) == 2  # both ways tried, both lost (stopped early)
    assert [t[4] for t in tried] == [False, False] and [c[2] for c in calls] == [c0, c0]


def test_a_landing_that_overshoots_is_bounded_and_retried():
    from kvcodec.harness.profile import balance_level

    bits, crit, score, calls = _balance_model(0.02)  # best v/k about 0.71
    target, ratio0 = 0.05, 2.0
    k0 = math.sqrt(0.9 * target / (0.01 + 0.02 * ratio0 ** 2))
    c0, b0 = crit(k0, ratio0 * k0), bits(k0, ratio0 * k0)
    # a slope of 1 where the criterion grows as the step squared: the first landing overshoots
    best, tried = balance_level(score, bits, target, k0, ratio0, c0, b0, slope=1.0, probes=1)
    assert [t[4] for t in tried] == [True, False, True]  # probe, landing over the target, landing
    assert tried[1][2] > target and 0.9 * target <= best["crit"] <= target
    assert best["k_step"] == tried[2][0] and best["bits"] < b0 - 0.01
    # the second landing came from the bound of the first: between the probe and that step
    assert tried[0][0] < best["k_step"] < tried[1][0]


def test_balance_stops_when_the_budget_of_window_scores_is_spent():
    from kvcodec.harness.profile import balance_level

    bits, crit, score, calls = _balance_model(0.02)  # every probe toward finer V wins
    target, ratio0 = 0.05, 2.0
    k0 = math.sqrt(0.9 * target / (0.01 + 0.02 * ratio0 ** 2))
    c0, b0 = crit(k0, ratio0 * k0), bits(k0, ratio0 * k0)
    free, _ = balance_level(score, bits, target, k0, ratio0, c0, b0, slope=2.0)
    n_free = len(calls)
    assert n_free >= 3  # unbounded: probes and landings
    calls.clear()
    said: list[str] = []
    best, tried = balance_level(score, bits, target, k0, ratio0, c0, b0, slope=2.0, say=said.append,
                                room=lambda: len(calls) < 2)
    assert len(calls) == len(tried) == 2 < n_free  # two scores, then the budget said no
    assert any("budget" in m for m in said)
    # the best point scored so far is kept: a winning probe at about the level's bits
    assert best["kls"] is not None and best["crit"] < c0 and best["v_step"] / best["k_step"] < ratio0
    assert best == free or best["bits"] >= free["bits"]
    none, tried = balance_level(score, bits, target, k0, ratio0, c0, b0, slope=2.0, room=lambda: False)
    assert tried == [] and none["k_step"] == k0 and none["kls"] is None


class _BalanceEvaluator(_FakeEvaluator):
    """An Evaluator whose KL a finer V always lowers at equal bits (every balance probe wins);
    bits from the real encode of the window's cache."""

    def score_next_token(self, codec, kl_only=False):
        import kvcodec

        k, v = float(codec["k_step"]), float(codec["v_step"])
        _FakeEvaluator.calls.append(k)
        blob = kvcodec.get_codec(codec).encode(self.reference)
        return {"bits_per_element": 8.0 * len(blob) / self.reference.num_elements, "bytes": len(blob),
                "next_token": {"kl_mean": 0.002 * k * k + 0.02 * v * v}}


def test_the_budget_of_window_scores_bounds_a_calibration_whose_probes_all_win(monkeypatch):
    from kvcodec.harness import evaluate
    from kvcodec.harness.profile import build_profile

    model, tok, text = _tiny_llama()
    monkeypatch.setattr(evaluate, "Evaluator", _BalanceEvaluator)
    runs = {}
    for budget in (None, 4):
        _FakeEvaluator.calls = []
        msgs: list[str] = []
        st = build_profile(model, tok, text, context=32, continuation=8, samples=8, sensitivity_samples=1,
                           levels={"a": 0.05, "b": 0.2}, max_windows=2, max_held=1,
                           max_total_scores=budget, progress=msgs.append)
        runs[budget] = (st.profile, list(_FakeEvaluator.calls), msgs)
    free, bounded = runs[None][0], runs[4][0]
    assert free["search_max_total_scores"] is None and bounded["search_max_total_scores"] == 4
    # unbounded, the probes win and go on; bounded, they stop once 4 steps' worth (8 window
    # scores) are spent: at most one score (2 windows) past it
    assert free["window_scores"] > bounded["window_scores"] and bounded["window_scores"] <= 4 * 2 + 2
    assert any("budget" in m for m in runs[4][2]) and not any("budget" in m for m in runs[None][2])
    assert len(runs[4][1]) == bounded["window_scores"] + 2  # + one held-out score per level
    assert {lv["name"] for lv in bounded["levels"]} == {"a", "b"}  # every level still chosen
    # the coarsest level is balanced first: the budget goes where the high-rate ratio holds least
    first = next(m for m in runs[4][2] if m.startswith("balance"))
    assert first.startswith("balance (KL <= 0.2)")


class _Clock:
    """``time`` for kvcodec.harness.profile: seconds advance only by what the evaluator spends."""

    now = 0.0

    @staticmethod
    def perf_counter():
        return _Clock.now


class _TimedEvaluator(_BalanceEvaluator):
    """:class:`_BalanceEvaluator` whose every window score takes 10 s of :class:`_Clock`."""

    def score_next_token(self, codec, kl_only=False):
        _Clock.now += 10.0
        return super().score_next_token(codec, kl_only)


def test_the_time_budget_stops_the_balance_and_keeps_every_level(monkeypatch):
    from kvcodec.harness import evaluate
    from kvcodec.harness import profile as hp

    model, tok, text = _tiny_llama()
    monkeypatch.setattr(evaluate, "Evaluator", _TimedEvaluator)
    monkeypatch.setattr(hp, "time", _Clock)

    def run(budget):
        _Clock.now, _FakeEvaluator.calls = 0.0, []
        msgs: list[str] = []
        st = hp.build_profile(model, tok, text, context=32, continuation=8, samples=8, sensitivity_samples=1,
                              levels={"a": 0.05, "b": 0.2}, max_windows=2, max_held=1, max_total_scores=None,
                              time_budget=budget, progress=msgs.append)
        return st.profile, len(_FakeEvaluator.calls), _Clock.now, msgs

    free = run(None)
    none = run(1.0)  # spent before the balance starts: the search alone, then the held-out check
    search_end = 10.0 * (none[1] - 2)  # two held-out scores (one window, two levels)
    assert free[0]["stopped_by_time"] is None and not any("time budget" in m for m in free[3])
    assert "past the time budget of 1 s" in none[0]["stopped_by_time"]
    assert any("time budget" in m for m in none[3])
    assert free[1] > none[1] and none[0]["balance"] == [] and free[0]["balance"]
    far = run(1e9)  # a budget never reached changes nothing but its own record
    assert far[1:3] == free[1:3] and far[0]["time_budget"] == 1e9
    assert {**far[0], "time_budget": None} == free[0]
    # room for about two probes past the search: a probe starts only when it and the held-out
    # check (2 windows x 10 s, then 2 levels x 10 s) still end within the budget, so it does
    budget = search_end + 2 * 20.0 + 20.0 + 5.0
    mid = run(budget)
    assert none[1] < mid[1] < free[1] and mid[2] <= budget
    for got in (none, mid):
        assert {lv["name"] for lv in got[0]["levels"]} == {"a", "b"}
        for lv in got[0]["levels"]:  # every level still met on the search windows
            assert lv["kl_search"] <= got[0]["search_margin"] * lv["target_kl"]
