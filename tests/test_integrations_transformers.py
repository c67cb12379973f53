"""KVCache <-> transformers DynamicCache (batch 1), legacy tuples, the cache= keyword rename."""

from __future__ import annotations

import doctest

import pytest
import torch

transformers = pytest.importorskip("transformers")

import kvcodec.integrations.transformers as tfi  # noqa: E402
from kvcodec import KVCache  # noqa: E402
from kvcodec.errors import InputError  # noqa: E402

from conftest import make_cache  # noqa: E402


def test_module_examples_run():
    res = doctest.testmod(tfi, optionflags=doctest.ELLIPSIS)
    assert res.attempted > 0 and res.failed == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip_is_bit_exact(dtype):
    c = make_cache(layers=3, tokens=11, heads=2, dim=40, dtype=dtype)
    dc = tfi.to_dynamic_cache(c)
    assert isinstance(dc, transformers.DynamicCache)
    assert dc.layers[1].keys.shape == (1, 2, 11, 40) and dc.layers[1].keys.dtype == dtype
    assert torch.equal(dc.layers[2].values[0, 1], c.layers[2]["v"][:, 1])
    back = tfi.from_dynamic_cache(dc)
    assert back.equal(c)


def test_dtype_cast_and_kwargs_pass_through():
    c = make_cache(layers=1, tokens=3, dtype=torch.float16)
    dc = tfi.to_dynamic_cache(c, dtype=torch.float32)
    assert dc.layers[0].keys.dtype == torch.float32
    back = tfi.from_dynamic_cache(dc, token_ids=torch.arange(3), rope_applied=False)
    assert back.rope_applied is False and back.token_ids.tolist() == [0, 1, 2]


def test_legacy_tuple_and_batch_index():
    k = torch.randn(2, 3, 5, 8)  # [B, H, T, D]
    v = torch.randn(2, 3, 5, 8)
    c = tfi.from_dynamic_cache(((k, v), (k * 2, v * 2)), batch_index=1)
    assert c.num_layers == 2 and c.layers[0]["k"].shape == (5, 3, 8)
    assert torch.equal(c.layers[1]["v"], (v * 2)[1].transpose(0, 1))


def test_bad_inputs():
    with pytest.raises(InputError, match="B, H, T, D"):
        tfi.from_dynamic_cache(((torch.randn(3, 5, 8), torch.randn(3, 5, 8)),))
    with pytest.raises(InputError, match="unsupported"):
        tfi.from_dynamic_cache(object())
    with pytest.raises(InputError, match="MLA"):
        tfi.to_dynamic_cache(make_cache(layers=1, mla=True))
    with pytest.raises(InputError, match="use_cache"):
        tfi.output_cache({"logits": None})


def test_cache_keyword_follows_the_signature():
    class New:
        def forward(self, input_ids, cache=None, use_cache=None):
            pass

    class Old:
        def forward(self, input_ids, past_key_values=None, use_cache=None):
            pass

    assert tfi.cache_keyword(New()) == "cache"
    assert tfi.cache_kwargs(Old(), 1) == {"past_key_values": 1}


def test_layer_infos_from_config():
    cfg = transformers.Gemma3TextConfig(
        num_hidden_layers=3, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    kinds = [(li.kind, li.window) for li in tfi.layer_infos(cfg, 3)]
    assert kinds == [("sliding", 16), ("full", 0), ("sliding", 16)]
    assert all(li.kind == "full" for li in tfi.layer_infos(transformers.GPT2Config(n_layer=2), 2))
    assert KVCache  # imported for the doctest namespace


def test_layer_infos_follow_how_each_family_builds_its_masks():
    """Mistral-style configs (a sliding_window, no layer_types) slide on every layer; layer_types
    name each layer; use_sliding_window False or no window means full attention."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    from kvcodec.integrations.transformers import layer_infos

    tiny = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=3, vocab_size=64)
    mistral = layer_infos(MistralConfig(sliding_window=8, **tiny), 3)
    assert [(i.kind, i.window) for i in mistral] == [("sliding", 8)] * 3
    assert [i.kind for i in layer_infos(MistralConfig(sliding_window=None, **tiny), 3)] == ["full"] * 3
    assert [i.kind for i in layer_infos(LlamaConfig(**tiny), 3)] == ["full"] * 3
    q = Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=1, **tiny)
    assert [i.kind for i in layer_infos(q, 3)] == ["full" if t == "full_attention" else "sliding" for t in q.layer_types]
    assert [i.kind for i in layer_infos(Qwen2Config(use_sliding_window=False, sliding_window=16, **tiny), 3)] == ["full"] * 3
