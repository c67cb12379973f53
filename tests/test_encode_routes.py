"""Every route that writes a KVC file goes through one preparation step (Codec.plan): the same
bytes from Codec.encode, encode(path=), format.write_file and `kvcodec encode`, one error for a
bad calibration file or a -cal preset without one, and codec objects that are immutable and
safe to share between threads."""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.cli import main
from kvcodec.codecs.kvc.calibration import QueryStats, save_query_statistics
from kvcodec.errors import ConfigError, FormatError, InputError
from kvcodec import open as open_kvc
from kvcodec.format import write_file
from kvcodec.testing import spelled_out
from kvc_tools import encode_routes as _routes


def _cache(layers=2, t=40, h=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        k = torch.randn(t, h, d, generator=g) * 2 + 3 * torch.randn(1, h, d, generator=g)
        v = torch.randn(t, h, d, generator=g) * (0.5 + torch.rand(t, h, 1, generator=g))
        out.append((k.half(), v.half()))
    return kvcodec.KVCache.from_tensors(out)


def _calibration(cache, path, seed=1):
    rng = np.random.default_rng(seed)
    h, d = cache.layers[0]["k"].shape[1:]
    save_query_statistics(QueryStats([rng.uniform(0.1, 4.0, (h, d)).astype(np.float32) for _ in cache.layers],
                                     [rng.normal(size=(4, 6, d)).astype(np.float32) for _ in cache.layers],
                                     q_position=100, rope_theta=10000.0), path)
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("chunk", [0, 16])
@pytest.mark.parametrize("preset", ["kvc-near-cal", "kvc-aggressive-cal"])
def test_calibrated_config_writes_the_same_calibrated_bytes_on_every_route(tmp_path, preset, chunk, capsys):
    cache = _cache()
    cal = tmp_path / "cal.safetensors"
    digest = _calibration(cache, cal)
    routes = _routes({"id": preset, "calibration": str(cal)}, cache, tmp_path, chunk)
    first = routes["Codec.encode"]
    assert all(b == first for b in routes.values()), {k: hashlib.sha256(b).hexdigest()[:12] for k, b in routes.items()}
    with open_kvc(first) as r:
        assert r.manifest["codec"]["calibration_sha256"] == digest
    # and the calibration changed the file (the bug this guards against wrote a plain one)
    plain = spelled_out(preset).encode(cache, tokens_per_chunk=chunk)
    assert plain != first


@pytest.mark.parametrize("name", ["fp8-e4m3", "kivi-2-ans", "cachegen", "kvc-near"])
def test_plain_codecs_write_the_same_bytes_on_every_route(tmp_path, name):
    routes = _routes(name, _cache(), tmp_path, chunk=16)
    assert len(set(routes.values())) == 1


def _bad_calibrations(tmp_path, cache):
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a calibration file")
    other = tmp_path / "other.safetensors"
    _calibration(_cache(layers=3), other)  # another model: 3 layers
    return [(tmp_path / "missing.safetensors", InputError, "cannot be read"),
            (tmp_path, InputError, "cannot be read"),  # a directory
            (junk, FormatError, "not a safetensors file"),
            (other, ConfigError, "another model")]


def test_a_bad_calibration_file_is_one_clear_error_on_every_route(tmp_path, capsys):
    cache = _cache()
    raw = tmp_path / "raw.safetensors"
    cache.to_safetensors(raw)
    for path, err, msg in _bad_calibrations(tmp_path, cache):
        codec = kvcodec.get_codec({"id": "kvc-near-cal", "calibration": str(path)})
        with pytest.raises(err, match=msg):
            codec.encode(cache)
        with pytest.raises(err, match=msg):
            codec.encode(cache, tmp_path / "x.kvc")
        with pytest.raises(err, match=msg):
            write_file(codec, cache, tmp_path / "y.kvc")
        capsys.readouterr()
        cfg = '{"id": "kvc-near-cal", "calibration": "%s"}' % path
        assert main(["encode", str(raw), str(tmp_path / "z.kvc"), "--codec", cfg]) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.strip().splitlines()
        assert len(lines) == 1 and msg in lines[0], captured.err
        assert not any(p.name in ("x.kvc", "y.kvc", "z.kvc") for p in tmp_path.iterdir())  # nothing written
        assert not any(p.name.startswith(".kvc-spool") for p in tmp_path.iterdir())


def test_a_cal_preset_without_calibration_is_refused_on_every_route(tmp_path, capsys):
    cache = _cache()
    raw = tmp_path / "raw.safetensors"
    cache.to_safetensors(raw)
    for name in ("kvc-transparent-cal", "kvc-near-cal", "kvc-aggressive-cal"):
        for config in (name, {"id": name}, {"id": name, "k_step": 0.5}):
            codec = kvcodec.get_codec(config)
            with pytest.raises(ConfigError, match=f"preset '{name}' needs 'calibration'"):
                codec.encode(cache)
            with pytest.raises(ConfigError, match="needs 'calibration'"):
                write_file(codec, cache, tmp_path / "y.kvc")
        assert main(["encode", str(raw), str(tmp_path / "z.kvc"), "--codec", name]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "needs 'calibration'" in err[0] and "kvcodec calibrate" in err[0]
        assert main(["bench", "--input", str(raw), "--codecs", name, "--repeat", "1"]) == 1
        assert "needs 'calibration'" in capsys.readouterr().err
    assert not (tmp_path / "y.kvc").exists() and not (tmp_path / "z.kvc").exists()
    # the settings spelled out under the codec id are plain kvc: no promise, no refusal
    assert kvcodec.decode(spelled_out("kvc-near-cal").encode(cache)).num_layers == 2


def test_codecs_are_immutable():
    codec = kvcodec.get_codec("kvc-near-cal")
    with pytest.raises(AttributeError, match="immutable"):
        codec.params = {}
    with pytest.raises(AttributeError, match="immutable"):
        codec.foo = 1
    with pytest.raises(TypeError):
        codec.params["k_step"] = 1.0  # a read-only mapping
    with pytest.raises(AttributeError):
        codec.params["ctx"].append(4)  # lists are tuples inside
    assert codec.get_config()["ctx"] == [3, 8, 20]
    cfg = codec.get_config()
    cfg["ctx"].append(99)
    assert codec.get_config()["ctx"] == [3, 8, 20]  # a copy


def test_one_codec_object_shared_between_threads_writes_what_each_call_writes_alone(tmp_path):
    caches = [_cache(seed=s) for s in range(4)]
    cal = tmp_path / "cal.safetensors"
    _calibration(caches[0], cal)
    for config in ({"id": "kvc-near-cal", "calibration": str(cal)}, "fp8-e4m3", "cachegen"):
        codec = kvcodec.get_codec(config)
        alone = [codec.encode(c) for c in caches]
        got: dict[int, bytes] = {}
        errors: list[BaseException] = []
        barrier = threading.Barrier(8)

        def work(j):
            try:
                barrier.wait()
                for _ in range(2):
                    b = codec.encode(caches[j % 4])
                    assert got.setdefault(j, b) == b
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(j,)) for j in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert all(got[j] == alone[j % 4] for j in range(8))
