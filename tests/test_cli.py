"""The CLI: main(argv) from tests, JSON on stdout, one-line errors with no traceback."""

import json

import pytest
import torch
from safetensors.torch import save_file

import kvcodec
from kvcodec.cli import main

from conftest import make_cache


def test_help_and_no_command(capsys):
    assert main(["--help"]) == 0
    assert "encode" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["encode"]) == 2  # missing arguments: argparse usage error
    assert main(["no-such-command"]) == 2


def test_codecs_json_lists_every_codec(capsys):
    assert main(["codecs", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == kvcodec.list_codecs()
    for r in rows:
        assert r["nominal_bits"] > 0
        assert kvcodec.get_codec(r["config"]).codec_id == r["id"]


@pytest.mark.parametrize("codec", ["raw", "fp16"])
def test_encode_decode_roundtrip(tmp_path, capsys, codec):
    cache = make_cache(dtype=torch.float16)
    raw, kvc, back = tmp_path / "in.safetensors", tmp_path / "c.kvc", tmp_path / "out.safetensors"
    cache.to_safetensors(raw)
    assert main(["encode", str(raw), str(kvc), "--codec", codec, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["bytes"] == kvc.stat().st_size
    assert main(["decode", str(kvc), str(back)]) == 0
    assert kvcodec.KVCache.from_safetensors(back).equal(cache)


def _one_line_error(capsys, needle):
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    assert len(err.splitlines()) == 1, err
    assert needle in err, err


def test_bad_inputs_exit_nonzero_with_one_line(tmp_path, capsys):
    raw = tmp_path / "in.safetensors"
    make_cache().to_safetensors(raw)
    assert main(["encode", str(tmp_path / "missing.safetensors"), str(tmp_path / "o"), "--codec", "raw"]) == 1
    _one_line_error(capsys, "No such file")
    assert main(["encode", str(raw), str(tmp_path / "o"), "--codec", "nope"]) == 1
    _one_line_error(capsys, "unknown codec 'nope'")
    bad_names = tmp_path / "names.safetensors"
    save_file({"layer0.key": torch.zeros(2, 1, 4)}, bad_names)
    assert main(["encode", str(bad_names), str(tmp_path / "o"), "--codec", "raw"]) == 1
    _one_line_error(capsys, "unexpected tensor name 'layer0.key'")
    bad_shape = tmp_path / "shape.safetensors"
    save_file({"layers.0.k": torch.zeros(2, 4), "layers.0.v": torch.zeros(2, 4)}, bad_shape)
    assert main(["encode", str(bad_shape), str(tmp_path / "o"), "--codec", "raw"]) == 1
    _one_line_error(capsys, "expected [tokens, heads, dim]")
    not_st = tmp_path / "junk.safetensors"
    not_st.write_bytes(b"hello world, not safetensors")
    assert main(["encode", str(not_st), str(tmp_path / "o"), "--codec", "raw"]) == 1
    _one_line_error(capsys, "not a readable safetensors file")
    assert main(["decode", str(not_st), str(tmp_path / "o")]) == 1
    _one_line_error(capsys, "error")
    assert not (tmp_path / "o").exists()  # nothing written on failure


def test_bench_on_raw_dump(tmp_path, capsys):
    raw = tmp_path / "in.safetensors"
    make_cache(tokens=20).to_safetensors(raw)
    assert main(["bench", "--input", str(raw), "--codecs", "raw,fp16", "--repeat", "1",
                 "--out", str(tmp_path / "b"), "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert [r["codec"] for r in res["rows"]] == ["raw", "fp16"]
    assert res["rows"][0]["rel_err_k"] == 0.0 and res["rows"][0]["rel_err_v"] == 0.0
    assert (tmp_path / "b" / "bench.md").read_text().count("raw") >= 1


def test_bench_interleaves_rounds_and_divides_by_the_reference(tmp_path, capsys, monkeypatch):
    from kvcodec.commands import bench

    calls = []
    real = bench._timed_round_trip

    def spy(codec, cache):
        calls.append(codec.codec_id)
        return real(codec, cache)

    monkeypatch.setattr(bench, "_timed_round_trip", spy)
    raw = tmp_path / "in.safetensors"
    make_cache(tokens=20).to_safetensors(raw)
    assert main(["bench", "--input", str(raw), "--codecs", "raw,fp8-e4m3,cachegen", "--repeat", "2",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert calls == ["raw", "fp8", "cachegen"] * 2  # round after round, not codec after codec
    rows = {r["codec"]: r for r in res["rows"]}
    assert res["reference"] == "cachegen" and rows["cachegen"]["encode_x_ref"] == 1.0
    assert rows["cachegen"]["decode_x_ref"] == 1.0 and rows["fp8-e4m3"]["bits_per_element"] < 16
    mbps = {n: (r["encode_MBps"], r["decode_MBps"]) for n, r in rows.items()}  # x_ref = MB/s ratio
    # the MB/s columns are rounded to 0.1 (on this tiny cache that can be several per cent of
    # cachegen's), the ratio to 0.001: it must lie within what those roundings allow
    c, r = mbps["cachegen"][0], mbps["raw"][0]
    lo, hi = (c - 0.05) / (r + 0.05), (c + 0.05) / max(r - 0.05, 1e-9)
    assert lo - 0.0005 <= rows["raw"]["encode_x_ref"] <= hi + 0.0005, (rows["raw"]["encode_x_ref"], c, r)
    # without the reference in the run: no ratio columns
    assert main(["bench", "--input", str(raw), "--codecs", "raw", "--repeat", "1", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["reference"] is None and "encode_x_ref" not in res["rows"][0]


def test_bench_ratios_fastest_and_median_of_rounds(monkeypatch):
    """``*_x_ref`` divides the fastest times, ``*_x_ref_med`` takes the median of each round's
    ratio: scripted times where the two differ."""
    from kvcodec.commands import bench

    enc = {"cachegen": iter([1.0, 2.0, 2.0]), "raw": iter([2.5, 3.0, 3.0])}
    dec = {"cachegen": iter([1.0, 1.0, 4.0]), "raw": iter([0.5, 3.0, 2.0])}
    real = bench._timed_round_trip

    def scripted(codec, cache):
        _, _, blob, out = real(codec, cache)
        return next(enc[codec.codec_id]), next(dec[codec.codec_id]), blob, out

    monkeypatch.setattr(bench, "_timed_round_trip", scripted)
    rows = bench.bench_interleaved([("cachegen", kvcodec.get_codec("cachegen")), ("raw", kvcodec.get_codec("raw"))],
                                   make_cache(tokens=12), repeat=3)
    r = {row["codec"]: row for row in rows}
    assert r["raw"]["encode_x_ref"] == 2.5 and r["raw"]["encode_x_ref_med"] == 1.5  # ratios 2.5, 1.5, 1.5
    assert r["raw"]["decode_x_ref"] == 0.5 and r["raw"]["decode_x_ref_med"] == 0.5  # ratios 0.5, 3.0, 0.5
    assert r["cachegen"]["encode_x_ref_med"] == r["cachegen"]["decode_x_ref_med"] == 1.0


def test_bench_with_a_calibration_file_encodes_the_cal_presets_with_it(tmp_path, capsys):
    import numpy as np

    from kvcodec.harness.calibration import QueryStats, save_query_statistics

    cache = make_cache(tokens=40)
    raw = tmp_path / "in.safetensors"
    cache.to_safetensors(raw)
    h, d = cache.layers[0]["k"].shape[1:]
    rng = np.random.default_rng(0)
    st = QueryStats([rng.uniform(0.5, 2, (h, d)).astype(np.float32) for _ in cache.layers],
                    [rng.normal(size=(h, 4, d)).astype(np.float32) for _ in cache.layers], 0, 0.0,
                    k_sens=[rng.uniform(0.1, 10, (h, d)).astype(np.float32) for _ in cache.layers])
    cal = tmp_path / "q.safetensors"
    save_query_statistics(st, cal)
    assert main(["bench", "--input", str(raw), "--codecs", "kvc-near,kvc-near-cal", "--repeat", "1",
                 "--calibration", str(cal), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["codec"] for r in rows] == ["kvc-near", "kvc-near-cal +calibration"]
    assert rows[0]["config"]["calibration"] == "" and rows[1]["config"]["calibration"] == str(cal)


def test_a_closed_pipe_ends_quietly(monkeypatch):
    class ClosedPipe:  # what stdout becomes when the reader (``| head``) has gone away
        def write(self, s):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr("sys.stdout", ClosedPipe())
    assert main(["codecs"]) == 141  # no traceback: the exception does not escape


def test_codecs_json_states_each_presets_target_and_requirements(capsys):
    import pytest as _pytest

    from kvcodec.codec import register_preset
    from kvcodec.errors import ConfigError

    assert main(["codecs", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["kvc-near"]["target"] == {"kl_mean": 0.01, "dppl": 0.01}
    assert rows["kvc-aggressive-cal"]["target"] == {"kl_mean": 0.05}
    assert rows["kvc-aggressive-cal"]["requires"] == ["calibration"] and rows["kvc-near"]["requires"] == []
    assert rows["fp8-e4m3"]["target"] is None  # a format, not a quality level
    for bad in ({}, {"kl": 0.1}, {"kl_mean": 0}, {"kl_mean": "0.1"}):
        with _pytest.raises(ConfigError, match="target"):
            register_preset("test-bad-target", {"id": "raw"}, target=bad)
