"""The newcomer's path through the CLI (issue 22): help that explains, an instant start, argument
errors before any model loads, preset names shown and recorded, a readable codec list, and
warnings on stderr where a preset would quietly fall short of its promise."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import kvcodec
from kvcodec.cli import build_parser, main

from conftest import make_cache

ROOT = Path(__file__).resolve().parents[1]


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flat(text: str) -> str:
    return " ".join(text.split())  # help wraps lines anywhere: compare word sequences


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
