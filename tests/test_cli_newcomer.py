"""The newcomer's path through the CLI (issue 22): help that explains, an instant start, argument
errors before any model loads, preset names shown and recorded, a readable codec list, and
warnings on stderr where a preset would quietly fall short of its promise."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kvcodec
from kvcodec.cli import COMMANDS, build_parser, main

from conftest import make_cache

ROOT = Path(__file__).resolve().parents[1]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flat(text: str) -> str:
    return " ".join(text.split())  # help wraps lines anywhere: compare word sequences


# ------------------------------------------------------------------------------ 1. help


def test_every_command_has_a_description_and_shows_its_defaults():
    subs = _subparsers()
    assert sorted(subs) == sorted(COMMANDS)
    for name, sp in subs.items():
        assert sp.description and len(sp.description) > 40, f"{name} has no description"
        text = _flat(sp.format_help())
        assert _flat(sp.description)[:40] in text
        for a in sp._actions:
            if not a.option_strings or a.default is None or a.default is False or a.default is argparse.SUPPRESS:
                continue
            # every option with a real default shows it, in its own words or as "(default: X)"
            assert "default" in (a.help or "") or f"(default: {a.default})" in text, (name, a.option_strings)
    bench = _flat(subs["bench"].format_help())
    assert "(default: 3)" in bench and "(default: 1024)" in bench


def test_encode_help_explains_presets_json_configs_and_points_to_codecs(capsys):
    assert main(["encode", "--help"]) == 0
    out = _flat(capsys.readouterr().out)
    assert "`kvcodec codecs`" in out and "JSON config" in out and "(default: fp8-e4m3)" in out
    assert '--codec \'{"id": "kvc", "target_kl": 0.005, "calibration": "cal.safetensors"}\'' in out
    # the examples are kept as written, one per line
    assert main(["encode", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  kvcodec encode kv.safetensors kv.kvc --codec kvc-near" in lines


# ------------------------------------------------------------------------------ 2. start-up and argument errors


def _run_fresh(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_version_and_every_help_import_no_torch():
    out = _run_fresh(
        "import sys\n"
        "from kvcodec.cli import COMMANDS, main\n"
        "import kvcodec\n"
        "assert kvcodec.__file__.startswith(%r), kvcodec.__file__\n"
        "codes = [main(['--version']), main(['--help'])] + [main([c, '--help']) for c in COMMANDS]\n"
        "heavy = sorted(m for m in ('torch', 'numpy', 'safetensors', 'transformers') if m in sys.modules)\n"
        "print('RESULT', codes, heavy)\n" % str(ROOT / "kvcodec"))
    result = out.splitlines()[-1]
    assert result == f"RESULT {[0] * (2 + len(COMMANDS))} []", result
    assert f"kvcodec {kvcodec.__version__}" in out


def test_the_registry_loads_the_builtin_codecs_whatever_module_comes_first():
    # with the package lazy, a program that starts from a submodule still sees every preset
    out = _run_fresh("from kvcodec.codec import get_codec, list_codecs\n"
                     "print(len(list_codecs()), get_codec('kvc-near').preset)")
    assert out.split() == [str(len(kvcodec.list_codecs())), "kvc-near"]


@pytest.mark.parametrize("argv", [
    ["bench", "--repeat", "0"],
    ["bench", "--context", "-5"],
    ["bench", "--context", "zero"],
    ["capture", "--context", "0", "--out", "x.safetensors"],
    ["eval", "--context", "0", "--codecs", "raw"],
    ["eval", "--continuation", "-1", "--codecs", "raw"],
    ["calibrate", "--samples", "0", "--out", "x.safetensors"],
    ["calibrate", "--time-budget", "-60", "--out", "x.safetensors"],
    ["encode", "in.safetensors", "out.kvc", "--tokens-per-chunk", "-1"],
], ids=lambda a: " ".join(a[:3]))
def test_bad_counts_are_usage_errors_before_any_model_loads(argv, monkeypatch, capsys, tmp_path):
    from kvcodec.harness import capture, models

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", no_model)
    monkeypatch.setattr(capture, "default_cache", no_model)
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "must be an integer >=" in err and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())  # nothing written


# ------------------------------------------------------------------------------ 3. preset names


@pytest.fixture
def raw(tmp_path):
    p = tmp_path / "in.safetensors"
    make_cache(layers=2, tokens=24, heads=2, dim=16).to_safetensors(p)
    return p


def _info_codec(text: str) -> tuple[str, dict]:
    """The preset line and the (possibly wrapped) JSON of ``kvcodec info``'s codec."""
    lines = text.splitlines()
    i = next(n for n, line in enumerate(lines) if line.startswith("  codec      "))
    preset = next(line for line in lines if line.startswith("  preset     "))[13:]
    j = i + 1
    while lines[j].startswith(" " * 13):
        j += 1
    return preset, json.loads("".join(line.strip() for line in lines[i:j])[len("codec"):])


def test_encode_reports_and_records_the_preset_and_info_shows_it(raw, tmp_path, capsys):
    out = tmp_path / "near.kvc"
    assert main(["encode", str(raw), str(out), "--codec", "kvc-near"]) == 0
    assert "(kvc-near, " in capsys.readouterr().out  # the preset, not the family "kvc"
    assert main(["encode", str(raw), str(out), "--codec", "kvc-near", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["preset"] == "kvc-near" and summary["codec"]["id"] == "kvc"
    with kvcodec.open(out) as r:
        assert r.manifest["producer"]["preset"] == "kvc-near"
        config = r.manifest["codec"]
    # kvc-near codes without its target here, so only the recorded name can tell it apart
    assert "target_kl" not in config
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    preset, shown = _info_codec(text)
    assert preset == "kvc-near" and shown == config and list(shown)[0] == "id"
    assert "'" not in text  # no Python repr
    codec_lines = text.split("\n  codec      ")[1].split("\n  cache")[0].splitlines()
    codec_lines[0] = "  codec      " + codec_lines[0]
    assert len(codec_lines) > 1 and max(len(line) for line in codec_lines) <= 100  # wrapped
    assert main(["info", str(out), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["preset"] == "kvc-near" and d["preset_recorded"] is True


def test_info_names_the_preset_of_an_unnamed_config_and_none_for_a_custom_one(raw, tmp_path, capsys):
    same, other = tmp_path / "same.kvc", tmp_path / "other.kvc"
    assert main(["encode", str(raw), str(same), "--codec", '{"id": "kivi", "bits": 4}', "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["preset"] is None  # given by codec id: no name to record
    assert main(["encode", str(raw), str(other), "--codec", '{"id": "kivi", "bits": 4, "group": 16}']) == 0
    capsys.readouterr()
    with kvcodec.open(same) as r:
        assert "preset" not in r.manifest["producer"]
    assert main(["info", str(same), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["preset"] == "kivi-4" and d["preset_recorded"] is False
    assert main(["info", str(same)]) == 0
    assert _info_codec(capsys.readouterr().out)[0].startswith("kivi-4 (not recorded")
    assert main(["info", str(other)]) == 0
    preset, shown = _info_codec(capsys.readouterr().out)
    assert preset == "-" and shown["group"] == 16


# ------------------------------------------------------------------------------ 4. the codec list


def test_codecs_table_is_readable(capsys):
    assert main(["codecs"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["name", "nominal", "b", "SmolLM2", "b", "lossless", "description"]
    assert all(len(line) <= 100 for line in lines), max(lines, key=len)
    assert not [line for line in lines if line != line.rstrip()]  # no trailing spaces
    firsts = [line.split()[0] for line in lines[1:] if line and not line.startswith(" ")]
    assert set(kvcodec.list_codecs()) <= set(firsts)
    # a wrapped description continues under its column
    col = lines[0].index("description")
    assert any(line.startswith(" " * col) and line[col] != " " for line in lines[1:])


# ------------------------------------------------------------------------------ 5. warnings


def test_a_level_preset_without_calibration_warns_on_stderr(raw, tmp_path, capsys):
    assert main(["encode", str(raw), str(tmp_path / "a.kvc"), "--codec", "kvc-near", "--json"]) == 0
    captured = capsys.readouterr()
    json.loads(captured.out)  # stdout stays one JSON document
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "warning: kvc-near" in err[0] and "kvcodec calibrate" in err[0]
    assert main(["encode", str(raw), str(tmp_path / "b.kvc"), "--codec", "fp8-e4m3"]) == 0
    assert capsys.readouterr().err == ""
    assert main(["bench", "--input", str(raw), "--codecs", "kvc-near,fp8-e4m3", "--repeat", "1", "--json"]) == 0
    captured = capsys.readouterr()
    assert [r["codec"] for r in json.loads(captured.out)["rows"]] == ["kvc-near", "fp8-e4m3"]
    warnings = [line for line in captured.err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "kvc-near" in warnings[0] and "--calibration" in warnings[0]
    assert main(["bench", "--input", str(raw), "--codecs", "fp8-e4m3", "--repeat", "1"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_cal_preset_without_calibration_stops_before_reading_the_input(tmp_path, capsys):
    missing = tmp_path / "missing.safetensors"
    assert main(["encode", str(missing), str(tmp_path / "o.kvc"), "--codec", "kvc-near-cal"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "needs 'calibration'" in err[0]  # not "cannot read": the codec is checked first
