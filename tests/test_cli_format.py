"""``kvcodec info`` and ``kvcodec verify`` on good, damaged and foreign files."""

import json

import pytest
import torch

import kvcodec
from kvcodec.cli import main

from conftest import make_cache
from kvc_tools import join, split


@pytest.fixture
def kvc(tmp_path):
    cache = make_cache(layers=3, tokens=20, heads=2, dim=16)
    p = tmp_path / "c.kvc"
    kvcodec.get_codec("fp16").encode(cache, path=p)
    return p, cache


def test_info_text_and_json(kvc, capsys):
    p, cache = kvc
    assert main(["info", str(p)]) == 0
    out = capsys.readouterr().out
    assert "KVC 1.0" in out and "3 layers x 20 tokens" in out and "float16" in out
    assert out.count("\n") >= 5 + 3  # header lines plus a table row per layer
    assert main(["info", str(p), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    size = p.stat().st_size
    assert d["file_bytes"] == size and d["num_layers"] == 3 and d["num_tokens"] == 20
    assert d["bits_per_element"] == pytest.approx(8 * size / cache.num_elements, abs=1e-4)
    assert d["codec"] == {"id": "fp16"} and d["format"] == "kvc 1.0"
    assert [L["bits_per_element"] for L in d["layers"]] == [16.0, 16.0, 16.0]
    assert [L["k"] for L in d["layers"]] == [[20, 2, 16]] * 3
    # header + layers + token ids + padding add up to the file exactly
    assert d["header_bytes"] + sum(L["bytes"] for L in d["layers"]) + d["global_and_meta_bytes"] + d["padding_bytes"] == size
    assert d["bytes_by_plane"] == {"bits": 3 * 2 * 20 * 2 * 16 * 2, "meta.token_ids": 20 * 8}


def test_verify_good_file(kvc, capsys):
    p, _ = kvc
    assert main(["verify", str(p)]) == 0
    assert capsys.readouterr().out.startswith(f"OK {p}")
    assert main(["verify", str(p), "--json", "--no-decode"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is True and d["decoded"] is False and d["layers"] == 3


@pytest.mark.parametrize("damage, err", [
    ("flip-data", "ChecksumError"),
    ("truncate", "TruncatedError"),
    ("version", "VersionError"),
    ("empty", "TruncatedError"),
    ("plain", "FormatError"),
    ("missing", "FormatError"),
])
def test_verify_bad_files_exit_1_with_one_line(kvc, tmp_path, capsys, damage, err):
    p, _ = kvc
    blob = p.read_bytes()
    bad = tmp_path / "bad.kvc"
    if damage == "flip-data":
        bad.write_bytes(blob[:-5] + bytes([blob[-5] ^ 4]) + blob[-4:])
    elif damage == "truncate":
        bad.write_bytes(blob[:-100])
    elif damage == "version":
        h, data = split(blob)
        h["__metadata__"]["format_version"] = "3.1"
        bad.write_bytes(join(h, data))
    elif damage == "empty":
        bad.write_bytes(b"")
    elif damage == "plain":
        from safetensors.torch import save

        bad.write_bytes(save({"layers.0.k": torch.zeros(2, 1, 4)}))
    assert main(["verify", str(bad)]) == 1
    captured = capsys.readouterr()  # the verdict goes to stderr, nothing to stdout
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and captured.err.startswith(f"FAIL {bad}: {err}: ")
    assert main(["verify", str(bad), "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["ok"] is False and d["error"] == err and d["message"]


def test_info_on_damaged_file_is_an_error_exit_1(tmp_path, capsys):
    bad = tmp_path / "x.kvc"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(40))
    assert main(["info", str(bad)]) == 1
    assert "GGUF file" in capsys.readouterr().err


def test_info_and_verify_need_a_file_argument(capsys):
    assert main(["info"]) == 2
    assert main(["verify"]) == 2
    assert main(["verify", "--help"]) == 0
    assert "Exit 0 when the file is good" in capsys.readouterr().out


def test_info_works_without_the_codec_and_verify_fails(tmp_path, capsys):
    from kvc_tools import rewrite

    blob = kvcodec.get_codec("raw").encode(make_cache(layers=2, tokens=4))
    p = tmp_path / "future.kvc"
    p.write_bytes(rewrite(blob, manifest=lambda m: m.update(codec={"id": "codec-from-the-future", "q": 1})))
    assert main(["info", str(p), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["codec"]["id"] == "codec-from-the-future"
    assert main(["verify", str(p)]) == 1
    assert "UnknownCodecError: unknown codec id 'codec-from-the-future'" in capsys.readouterr().err
    import pytest as _pytest

    from kvcodec import format as kvf
    from kvcodec.errors import UnknownCodecError

    with kvcodec.open(p, require_codec=False) as r:
        assert r.read_plane("layers.1.v.bits").shape == (4, 2, 24)
        with _pytest.raises(UnknownCodecError):
            r.read_layer(0)
