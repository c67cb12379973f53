"""Harness on randomly initialised tiny models: Gemma3-like (MQA, head_dim 80, sliding window),
Qwen2-like (GQA) and GPT-2-like (MHA, learned positions). No downloads, a few seconds each."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from kvcodec.codec import Codec  # noqa: E402
from kvcodec.harness.capture import capture, default_text, load_raw  # noqa: E402
from kvcodec.harness.evaluate import Evaluator, expand_settings, record_queries  # noqa: E402
from kvcodec.integrations.transformers import cache_kwargs, to_dynamic_cache  # noqa: E402
from kvcodec.metrics import attention_errors  # noqa: E402

TEXT = default_text()[:6000]


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer over the built-in text (offline, no hub)."""
    words = sorted(set(TEXT.split()))
    vocab = {"<unk>": 0, "<s>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>")


def make_model(kind: str, vocab: int):
    common = dict(vocab_size=vocab, bos_token_id=1, eos_token_id=0, pad_token_id=0)
    if kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, head_dim=80, sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            max_position_embeddings=512, **common)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(
            hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, **common)
    else:
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, **common)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


GEOMETRY = {  # kind -> (layers, kv_heads, q_heads, head_dim, rope, kinds)
    "gemma3": (3, 1, 4, 80, True, ["sliding", "sliding", "full"]),
    "qwen2": (2, 2, 4, 16, True, ["full", "full"]),
    "gpt2": (2, 4, 4, 16, False, ["full", "full"]),
}


@pytest.mark.parametrize("kind", sorted(GEOMETRY))
def test_capture_shapes_and_continuation(kind, tokenizer):
    layers, hkv, hq, d, rope, kinds = GEOMETRY[kind]
    model = make_model(kind, len(tokenizer))
    cache = capture(model, tokenizer, TEXT, context=24)
    assert cache.num_layers == layers and cache.num_tokens == 24
    # Sliding-window layers keep all 24 tokens although their window is 8.
    assert all(layer["k"].shape == (24, hkv, d) and layer["v"].shape == (24, hkv, d)
               for layer in cache.layers)
    assert [li.kind for li in cache.layer_info] == kinds
    assert all(li.window == (8 if li.kind == "sliding" else 0) for li in cache.layer_info)
    assert cache.rope_applied is rope
    assert cache.token_ids[0].item() == tokenizer.bos_token_id
    assert torch.equal(cache.positions, torch.arange(24))
    assert len(cache.model.config_hash) == 16 and ":" in cache.model.tokenizer
    # Continuing from the captured cache reproduces the full forward pass.
    ids = torch.cat([cache.token_ids, torch.tensor([5, 9, 2, 7, 3, 11])])
    with torch.no_grad():
        full = model(ids[None]).logits[0, 24:]
        out = model(ids[None, 24:], use_cache=True, **cache_kwargs(model, to_dynamic_cache(cache))).logits[0]
    torch.testing.assert_close(out, full, rtol=1e-4, atol=1e-4)
    # The recorded queries, put through our attention, give the model's own attention pattern:
    # identity gives exactly zero error.
    with record_queries(model) as store, torch.no_grad():
        model(ids[None, 24:], use_cache=True, **cache_kwargs(model, to_dynamic_cache(cache)))
    assert sorted(store) == list(range(layers))
    assert store[0]["q"].shape == (6, hq, d)
    assert store[0]["scaling"] > 0
    e = attention_errors(store[0]["q"], cache.layers[0]["k"], cache.layers[0]["v"],
                         cache.layers[0]["k"], cache.layers[0]["v"])
    assert e["out_rel_l2"].max() == 0
    assert model.config._attn_implementation in ("sdpa", "eager")  # restored afterwards


@pytest.mark.parametrize("kind", ["gemma3", "qwen2"])
def test_evaluator_lossless_is_exactly_zero(kind, tokenizer):
    model = make_model(kind, len(tokenizer))
    ev = Evaluator(model, tokenizer, TEXT, context=32, continuation=8, attn_queries=4)
    raw = ev.evaluate("raw")
    assert raw["error"] is None and raw["lossless"] is True
    assert raw["next_token"]["kl_mean"] == 0 and raw["next_token"]["delta_ppl"] == 0
    assert raw["next_token"]["top1_agreement"] == 1
    assert raw["attention"]["out_rel_l2"] == 0 and raw["attention"]["attn_kl"] == 0
    fp8 = ev.evaluate("fp8-e4m3")
    assert 0 < fp8["attention"]["v_rel_l2"] < 0.05
    assert fp8["bits_per_element"] < raw["bits_per_element"]
    assert len(fp8["per_layer"]) == GEOMETRY[kind][0]
    assert len(fp8["per_layer"][0]["out_rel_l2"]) == 4 and len(fp8["per_layer"][0]["k_rel_l2"]) == GEOMETRY[kind][1]
    # A failing codec is recorded, not raised, so one bug does not sink a whole suite.
    broken = ev.evaluate(_Broken(), name="broken")
    assert broken["error"] == "ValueError: boom" and "next_token" not in broken


class _Broken(Codec):  # deliberately not registered
    codec_id = "test-broken"

    def encode_tensor(self, x, ctx):
        raise ValueError("boom")

    def decode_tensor(self, enc, ctx):  # pragma: no cover
        raise AssertionError


@pytest.mark.parametrize("kind", ["qwen2"])
def test_timings_leave_out_first_use_costs(kind, tokenizer):
    """The evaluator encodes a few tokens untimed first (first-use costs: native library, tables),
    then times the whole cache; the report's ΔPPL is in percent of the reference and its family
    column names the codec, not its parameters."""
    import kvcodec
    from kvcodec.harness.report import markdown_table

    seen = []
    base = type(kvcodec.get_codec("kivi-4"))

    class Counting(base):  # kivi-4 itself, recording the caches it is asked to encode
        def encode(self, cache, *a, **kw):
            seen.append(cache.num_tokens)
            return super().encode(cache, *a, **kw)

    model = make_model(kind, len(tokenizer))
    ev = Evaluator(model, tokenizer, TEXT, context=48, continuation=8, attn_queries=4)
    rec = ev.evaluate(Counting(**kvcodec.get_codec("kivi-4").params), name="kivi-4")
    assert rec["error"] is None and seen == [32, 48]
    table = markdown_table([rec])
    nt = rec["next_token"]
    assert "| ΔPPL % |" in table.splitlines()[0]
    assert f"| {100 * nt['delta_ppl'] / nt['ppl_ref']:+.2f} |" in table
    rec["family"] = "kvc(chunk=2048,precision=14)"
    assert "| kivi-4 | kvc |" in markdown_table([rec]) and "chunk=2048" not in markdown_table([rec])


def test_expand_settings_sweep_dedupes():
    names = [n for n, _ in expand_settings(["kivi-4", "kivi-2"], sweep=True)]
    assert names[:2] == ["kivi-4", "kivi-2"]
    assert len(names) == len(set(names)) and "kivi-4" in names
    assert "kivi-4[bits=3]" in names


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    d = tmp_path_factory.mktemp("tiny-qwen2")
    make_model("qwen2", len(tokenizer)).save_pretrained(d)
    tokenizer.save_pretrained(d)
    (d / "text.txt").write_text(TEXT, encoding="utf-8")
    return d


def test_cli_capture_local_model(model_dir, tmp_path, capsys):
    from kvcodec.cli import main

    out = tmp_path / "kv.safetensors"
    rc = main(["capture", "--model", str(model_dir), "--text", str(model_dir / "text.txt"),
               "--context", "20", "--out", str(out), "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["tokens"] == 20 and summary["kv_heads"] == 2 and summary["layers"] == 2
    cache = load_raw(out)
    assert cache.num_tokens == 20 and cache.dtype == torch.float16
    assert cache.model.model_id == str(model_dir) and cache.model.revision.startswith("files-sha256:")
    # Text too short for the context: one-line error, exit 1.
    (tmp_path / "short.txt").write_text("a b c")
    assert main(["capture", "--model", str(model_dir), "--text", str(tmp_path / "short.txt"),
                 "--context", "20", "--out", str(out)]) == 1
    assert "tokens" in capsys.readouterr().err


def test_cli_eval_json_and_run_directory(model_dir, tmp_path, capsys):
    from kvcodec.cli import main

    run = tmp_path / "run"
    rc = main(["eval", "--model", str(model_dir), "--text", str(model_dir / "text.txt"),
               "--codecs", "raw,fp8-e4m3,kivi-2", "--context", "32", "--continuation", "8",
               "--out", str(run), "--json", "--quiet"])
    assert rc == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)  # stdout holds only the JSON
    assert doc["schema"] == "kvcodec.eval/1"
    assert [r["name"] for r in doc["results"]] == ["raw", "fp8-e4m3", "kivi-2"]
    assert doc["results"][0]["next_token"]["kl_mean"] == 0
    assert doc["run"]["context"] == 32 and doc["run"]["continuation"] == 8
    assert json.loads((run / "results.json").read_text())["results"][2]["name"] == "kivi-2"
    assert "| kivi-2 | kivi |" in (run / "results.md").read_text()
    assert (run / "results_rd.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_eval_bad_codec_fails_fast(capsys):
    from kvcodec.cli import main

    assert main(["eval", "--codecs", "raw,no-such-codec"]) == 1
    err = capsys.readouterr().err
    assert "no-such-codec" in err and "Traceback" not in err


KVC_PRESETS = ["kvc-transparent", "kvc-near", "kvc-aggressive"]


@pytest.mark.parametrize("kind", sorted(GEOMETRY))
def test_kvc_presets_run_unchanged_on_other_architectures(kind, tokenizer, tmp_path):
    """kvc's presets, plain and calibrated, with the settings tuned on SmolLM2 and nothing
    retuned, on random-init caches of other shapes: sliding-window layers, MQA and head_dim 80
    (gemma3), GQA with RoPE (qwen2), no RoPE and four KV heads (gpt2). Every one decodes to the
    cache's shapes, compresses below fp16, keeps its rate ordering, and the calibrated ones
    spend fewer bits than the plain ones they share a bar with."""
    from kvcodec.harness.calibration import query_statistics, save_query_statistics

    model = make_model(kind, len(tokenizer))
    ev = Evaluator(model, tokenizer, TEXT, context=64, continuation=16, attn_queries=4)
    cal = tmp_path / f"{kind}.qstats.safetensors"
    save_query_statistics(query_statistics(model, tokenizer, TEXT, context=64, skip_tokens=200, samples=8,
                                           sensitivity_samples=1, continuation=16), cal)
    bits = {}
    for name in KVC_PRESETS + [p + "-cal" for p in KVC_PRESETS]:
        codec = {"id": name, "calibration": str(cal)} if name.endswith("-cal") else name
        rec = ev.evaluate(codec, name=name)
        assert rec["error"] is None, (name, rec["error"])
        assert 0 <= rec["next_token"]["kl_mean"] < 0.5 and rec["bits_per_element"] < 16
        assert len(rec["per_layer"]) == GEOMETRY[kind][0]
        bits[name] = rec["bits_per_element"]
    for family in ("", "-cal"):
        b = [bits[p + family] for p in KVC_PRESETS]
        assert b[0] > b[1] > b[2], (family, b)
    assert all(bits[p + "-cal"] < bits[p] for p in KVC_PRESETS), bits
