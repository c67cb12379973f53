"""kvcodec.save -> kvcodec.load -> generate, on small randomly initialised transformers models with
full and sliding-window layers, batch 1 and 2: lossless codecs continue exactly as the model does
without a cache; the last prompt token is left for generate; identity and tokens are checked."""

from __future__ import annotations

import pytest
import torch

import kvcodec
from kvcodec.errors import InputError
from kvcodec.integrations.transformers import cache_kwargs, output_cache

transformers = pytest.importorskip("transformers")

V, W = 96, 8
_COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=0, pad_token_id=0)
MODELS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON, head_dim=16)),
    "gemma2": lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **_COMMON, head_dim=32, sliding_window=W, attn_logit_softcapping=5.0, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"])),
    "mistral": lambda: transformers.MistralForCausalLM(transformers.MistralConfig(**_COMMON, head_dim=16, sliding_window=W)),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    torch.manual_seed(0)
    return MODELS[request.param]().eval()


def _generate(model, ids, cache=None, n=6):
    kw = {} if cache is None else cache_kwargs(model, cache)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              pad_token_id=0, **kw)


def _sliding(model):
    return "sliding_attention" in (getattr(model.config, "layer_types", None) or []) or \
        bool(getattr(model.config, "sliding_window", 0))


@pytest.mark.parametrize("batch", [1, 2])
def test_save_load_generate_continues_exactly(model, batch, tmp_path):
    g = torch.Generator().manual_seed(batch)
    prompt = torch.randint(2, V, (batch, 20), generator=g)  # longer than the sliding window
    with torch.no_grad():
        head = output_cache(model(prompt[:, :-1], use_cache=True))
        full = output_cache(model(prompt, use_cache=True))
    # the recommended way: the cache of the prompt without its last token
    path = tmp_path / "prompt.kvc"
    n = kvcodec.save(head, path, "raw", model=model, input_ids=prompt[:, :-1])
    assert n > 0 and (path.is_file() if batch == 1 else sorted(p.name for p in path.iterdir()) == ["00000.kvc", "00001.kvc"])
    loaded = kvcodec.load(path, model=model, input_ids=prompt)
    assert loaded.get_seq_length() == 19
    assert torch.equal(_generate(model, prompt, loaded), _generate(model, prompt))
    # the cache of the whole prompt: continues a longer prompt that starts with it ...
    kvcodec.save(full, tmp_path / "full", "raw", model=model, input_ids=prompt)
    longer = torch.cat([prompt, torch.randint(2, V, (batch, 5), generator=g)], dim=1)
    got = _generate(model, longer, kvcodec.load(tmp_path / "full", model=model, input_ids=longer))
    assert torch.equal(got, _generate(model, longer))
    # ... and the same prompt, cut by one token, where no layer slides; a sliding layer refuses
    if _sliding(model):
        with pytest.raises(InputError, match="sliding window"):
            kvcodec.load(tmp_path / "full", model=model, input_ids=prompt)
    else:
        cut = kvcodec.load(tmp_path / "full", model=model, input_ids=prompt)
        assert cut.get_seq_length() == 19
        assert torch.equal(_generate(model, prompt, cut), _generate(model, prompt))


def test_without_input_ids_the_whole_cache_comes_back(model, tmp_path):
    prompt = torch.randint(2, V, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        kvcodec.save(output_cache(out), tmp_path / "c.kvc", "raw", model=model)
        loaded = kvcodec.load(tmp_path / "c.kvc", model=model)
        assert loaded.get_seq_length() == 20
        nxt = torch.tensor([[5]])
        want = model(nxt, **cache_kwargs(model, output_cache(out))).logits
        got = model(nxt, **cache_kwargs(model, loaded)).logits
    assert torch.equal(got, want)


def test_lossy_codec_continues_closely(model, tmp_path):
    prompt = torch.randint(2, V, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        cache = output_cache(model(prompt[:, :-1], use_cache=True))
        kvcodec.save(cache, tmp_path / "p", "kvc-near", model=model, input_ids=prompt[:, :-1])
        loaded = kvcodec.load(tmp_path / "p", model=model, input_ids=prompt)
        ref = torch.log_softmax(model(prompt).logits[:, -1], -1)
        got = torch.log_softmax(model(prompt[:, -1:], **cache_kwargs(model, loaded)).logits[:, -1], -1)
    kl = float((ref.exp() * (ref - got)).sum(-1).max())
    assert 0 < kl < 0.05


def test_identity_and_tokens_are_checked(tmp_path, capsys):
    torch.manual_seed(0)
    a, b = MODELS["llama"]().eval(), MODELS["mistral"]().eval()
    prompt = torch.randint(2, V, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        kvcodec.save(output_cache(a(prompt, use_cache=True)), tmp_path / "a.kvc", "raw", model=a, input_ids=prompt)
    with kvcodec.open(tmp_path / "a.kvc") as r:
        assert r.manifest["model"]["config_hash"] and r.manifest["has_token_ids"]
    with pytest.raises(InputError, match="cache of"):
        kvcodec.load(tmp_path / "a.kvc", model=b)
    other = prompt.clone()
    other[0, 3] += 1
    with pytest.raises(InputError, match="do not start with"):
        kvcodec.load(tmp_path / "a.kvc", model=a, input_ids=other)
    with pytest.raises(InputError, match="tokens"):
        kvcodec.save(output_cache(a(prompt, use_cache=True)), tmp_path / "x.kvc", "raw", input_ids=prompt[:, :5])
    with pytest.raises(InputError, match="at least 2 tokens"):
        kvcodec.load(tmp_path / "a.kvc", model=a, input_ids=prompt[:, :1])
    # without model= the file names no model: save warns, info says how to record one
    with torch.no_grad(), pytest.warns(UserWarning, match="no model= given"):
        kvcodec.save(output_cache(a(prompt, use_cache=True)), tmp_path / "anon.kvc", "raw")
    from kvcodec.cli import main

    assert main(["info", str(tmp_path / "anon.kvc")]) == 0
    assert "(unknown model: its writer recorded none; kvcodec.save(..., model=model) does)" in capsys.readouterr().out


def test_a_kvcache_saves_and_loads_too(tmp_path):
    c = kvcodec.KVCache.from_tensors([(torch.randn(6, 2, 8), torch.randn(6, 2, 8))] * 2)
    kvcodec.save(c, tmp_path / "k.kvc", "raw")
    dc = kvcodec.load(tmp_path / "k.kvc")
    assert tuple(dc.layers[0].keys.shape) == (1, 2, 6, 8) and torch.equal(dc.layers[1].values[0].transpose(0, 1), c.layers[1]["v"])
