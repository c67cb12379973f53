"""kvc calibration on every attention variant transformers ships, against brute force.

Tiny randomly initialised models (eager attention, fixed seeds) of Llama, Qwen2, Qwen3 (QK-norm),
Gemma 2 (logit softcap, query_pre_attn_scalar, alternating sliding windows), Gemma 3 (QK-norm,
head_dim 256, MQA, a different RoPE base on local and global layers), Mistral and Starcoder2
(a sliding window smaller than the context), Phi-3 and GPT-NeoX (partial rotary), Cohere
(interleaved rotary), OLMo 2, GPT-2 (no RoPE) and DeepSeek-V3 (MLA: rotary part last); SmolLM3
(NoPE every fourth layer), EXAONE 4 (QK-norm, sliding layers with RoPE and a global one without),
OLMo 3 (sliding and full layers), Granite (attention scaled by a multiplier), GPT-J (interleaved
partial rotary from a sine table, no ``inv_freq`` buffer), GLM-4 (interleaved partial rotary),
Falcon (parallel attention), StableLM (per-head QK layer norm, a quarter rotated), OPT
(learned positions), GPT-OSS (learned attention sinks, sliding and full layers) and Llama 4
(chunked attention on its RoPE layers, a NoPE layer); and hybrids whose other layers keep a fixed-size state (kept as it is):
Qwen3.5 (linear attention, a quarter rotated), LFM2 (short convolutions), Granite 4.0-H and
Jamba (Mamba layers), Nemotron-H (Mamba and MLP-only layers) and Falcon-H1 (attention and Mamba
side by side in every layer); Gemma 3n (its last layers read the KV of earlier ones).

What each test holds the library to:

1. The recorded queries are the model's: ``softmax(q_sample k^T [softcap] + mask)``, with the
   cached keys, the window and softcap calibration recorded, reproduces the probabilities the
   model returns with ``output_attentions=True``; ``q_energy`` is their mean square with the
   RoPE pairs the model really turns (per family, written out here) averaged.
2. ``attention_estimate`` models the next ``N`` queries as the ``N`` sampled ones moved to just
   after the cache. Moving is exact: the brute force runs the calibration text with every
   position shifted by ``delta`` (with RoPE this leaves every hidden state as it was), takes the
   model's own queries at ``T .. T+N-1`` and their softmax over the cached keys each may see
   (window, softcap). GPT-2's learned positions cannot be moved: the estimate uses its queries as
   recorded, and so does the reference.
3. ``fisher_diagonal(exact=True)`` equals a one-backward-per-(position, token) enumeration with
   a hand-built cache, every layer of every family gets gradient, tokens outside every scored
   query's window get exactly none, and the sampled estimate converges to the exact one.
4. The whole closed loop (``build_profile``: statistics, sensitivities, step search, K/V
   balance, held-out windows) runs on every family and writes a profile whose level an encode
   then codes with exactly, and which decodes to the cache's shape.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from kvcodec.codecs.kvc.calibration import LayerAttention, QueryStats  # noqa: E402
from kvcodec.harness.calibration import (  # noqa: E402
    attention_estimate,
    fisher_diagonal,
    load_query_statistics,
    query_statistics,
    save_query_statistics,
)

V = 96
W = 8  # every sliding window here
_COMMON = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=0, pad_token_id=0)


def _spec(rot="half", frac=1.0, offset="first", theta=(10000.0,), window=(), softcap=0.0, nope=(), sinks=False,
          chunked=()):
    """What the family does, written out by hand: rotary style, rotary fraction of the head,
    first/last channels, RoPE base per layer (cycled), sliding layers, softcap, layers without
    RoPE (NoPE) in a rotary model, learned attention sinks (each attention module's ``sinks``),
    layers with chunked attention (chunks of C positions)."""
    return dict(rot=rot, frac=frac, offset=offset, theta=theta, window=window, softcap=softcap, nope=nope,
                sinks=sinks, chunked=chunked)


C = 16  # the chunk of Llama 4's chunked layers here


def _llama4():
    """Llama 4's text model: chunked attention on its RoPE layer (interleaved pairs, QK-norm), a
    NoPE layer with full attention (temperature tuning off: with it, the NoPE queries' scale
    moves with the position and calibration marks the layer "unknown")."""
    return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(
        **_COMMON, head_dim=16, intermediate_size_mlp=96, num_local_experts=2, num_experts_per_tok=1,
        attention_chunk_size=C, no_rope_layers=[1, 0], attn_temperature_tuning=False, use_qk_norm=True,
        interleave_moe_layer_step=1))


def _gpt_oss():
    """GPT-OSS: alternating sliding and full layers, and learned attention sinks (made large here,
    so that leaving them out would show)."""
    m = transformers.GptOssForCausalLM(transformers.GptOssConfig(
        **_COMMON, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=W,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 150000.0}))
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return m


def _sink_logits(model, spec, i):
    """Layer ``i``'s sink logits ``[Hq]`` (float64), read from the model, or None."""
    if not spec["sinks"]:
        return None
    return model.model.layers[i].self_attn.sinks.detach().double()


def _softmax(logits, sinks):
    """softmax over the last axis of ``logits [Hq, Nq, T]``, with each head's sink logit taking
    part and its share dropped (as GPT-OSS's attention does)."""
    if sinks is None:
        return torch.softmax(logits, -1)
    s = sinks[:, None, None].expand(logits.shape[0], logits.shape[1], 1)
    return torch.softmax(torch.cat([logits, s], -1), -1)[..., :-1]


FAMILIES = {
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_COMMON, head_dim=16)), _spec()),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_COMMON)), _spec()),
    "qwen3": (lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_COMMON, head_dim=32)), _spec()),
    "gemma2": (lambda: transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        **_COMMON, head_dim=32, sliding_window=W, attn_logit_softcapping=5.0, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention"])), _spec(window=(0,), softcap=5.0)),
    "gemma3": (lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        **{**_COMMON, "num_hidden_layers": 3, "num_key_value_heads": 1}, head_dim=256, sliding_window=W,
        query_pre_attn_scalar=48, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
        _spec(theta=(10000.0, 1000000.0), window=(0, 2))),
    "mistral": (lambda: transformers.MistralForCausalLM(transformers.MistralConfig(
        **_COMMON, head_dim=16, sliding_window=W)), _spec(window=(0, 1))),
    "starcoder2": (lambda: transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(
        **_COMMON, sliding_window=W)), _spec(window=(0, 1))),
    "phi3": (lambda: transformers.Phi3ForCausalLM(transformers.Phi3Config(**_COMMON, partial_rotary_factor=0.5)),
             _spec(frac=0.5)),
    "gpt_neox": (lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        **{k: v for k, v in _COMMON.items() if k != "num_key_value_heads"}, rotary_pct=0.25)), _spec(frac=0.25)),
    "cohere": (lambda: transformers.CohereForCausalLM(transformers.CohereConfig(**_COMMON)),
               _spec(rot="interleaved", theta=(500000.0,))),
    "olmo2": (lambda: transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**_COMMON)), _spec()),
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=512, bos_token_id=1, eos_token_id=0)),
        _spec(rot=None)),
    # NoPE every fourth layer
    "smollm3": (lambda: transformers.SmolLM3ForCausalLM(transformers.SmolLM3Config(
        **{**_COMMON, "num_hidden_layers": 4}, head_dim=16, no_rope_layers=[1, 1, 1, 0],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})), _spec(nope=(3,))),
    # QK-norm, three sliding layers with RoPE, then a global one without
    "exaone4": (lambda: transformers.Exaone4ForCausalLM(transformers.Exaone4Config(
        **{**_COMMON, "num_hidden_layers": 4}, head_dim=16, sliding_window=W, sliding_window_pattern=4)),
        _spec(window=(0, 1, 2), nope=(3,))),
    "olmo3": (lambda: transformers.Olmo3ForCausalLM(transformers.Olmo3Config(
        **_COMMON, sliding_window=W, layer_types=["sliding_attention", "full_attention"])),
        _spec(theta=(500000.0,), window=(0,))),
    # attention scaled by a multiplier, not 1/sqrt(d)
    "granite": (lambda: transformers.GraniteForCausalLM(transformers.GraniteConfig(**_COMMON, attention_multiplier=0.05)),
                _spec()),
    # interleaved partial rotary from a sine table (no inv_freq buffer: the config's, tested)
    "gptj": (lambda: transformers.GPTJForCausalLM(transformers.GPTJConfig(
        vocab_size=V, n_embd=64, n_layer=2, n_head=4, rotary_dim=8, n_positions=512, bos_token_id=1, eos_token_id=0)),
        _spec(rot="interleaved", frac=0.5)),
    "glm4": (lambda: transformers.Glm4ForCausalLM(transformers.Glm4Config(**_COMMON, head_dim=16)),
             _spec(rot="interleaved", frac=0.5)),
    # parallel attention and MLP, GQA
    "falcon": (lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2,
        new_decoder_architecture=True, bos_token_id=1, eos_token_id=0)), _spec()),
    # per-head QK layer norm, a quarter of the head rotated
    "stablelm": (lambda: transformers.StableLmForCausalLM(transformers.StableLmConfig(
        **_COMMON, partial_rotary_factor=0.25, qk_layernorm=True)), _spec(frac=0.25)),
    # learned absolute positions
    "opt": (lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, ffn_dim=96, num_attention_heads=4,
        max_position_embeddings=512, word_embed_proj_dim=64, bos_token_id=1, eos_token_id=0, pad_token_id=0)),
        _spec(rot=None)),
    # hybrids: linear attention (gated delta rule) or short convolutions beside attention layers,
    # whose fixed-size states the harness keeps as they are
    "qwen3_5": (lambda: transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
        **{**_COMMON, "num_hidden_layers": 4}, head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)),
        _spec(frac=0.25)),
    "lfm2": (lambda: transformers.Lfm2ForCausalLM(transformers.Lfm2Config(
        **{**_COMMON, "num_hidden_layers": 4}, layer_types=["conv", "full_attention", "conv", "full_attention"])),
        _spec(theta=(1000000.0,))),
    # Mamba layers (transformers' cache: linear_attention) beside attention; Nemotron-H also MLP-only layers
    "granitemoehybrid": (lambda: transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(
        **{**_COMMON, "num_hidden_layers": 4}, layer_types=["mamba", "attention", "mamba", "attention"],
        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, num_local_experts=2,
        num_experts_per_tok=1, position_embedding_type="rope")), _spec()),
    "jamba": (lambda: transformers.JambaForCausalLM(transformers.JambaConfig(
        **{**_COMMON, "num_hidden_layers": 4}, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, num_experts=2, num_experts_per_tok=1, expert_layer_period=2,
        expert_layer_offset=1, use_mamba_kernels=False)), _spec(rot=None)),
    "nemotron_h": (lambda: transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
        **{**_COMMON, "num_hidden_layers": 4}, hybrid_override_pattern="M*-*", mamba_num_heads=4, mamba_head_dim=16,
        ssm_state_size=16, n_groups=1)), _spec(rot=None)),
    # attention and Mamba side by side in every layer (one transformers cache layer holds both)
    "falcon_h1": (lambda: transformers.FalconH1ForCausalLM(transformers.FalconH1Config(
        **{**_COMMON, "num_hidden_layers": 2}, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
        mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4)), _spec()),
    # the last layers read the KV of earlier ones (KV sharing): the cache is the owners' layers
    "gemma3n": (lambda: transformers.Gemma3nForCausalLM(transformers.Gemma3nTextConfig(
        **{**_COMMON, "num_hidden_layers": 4}, head_dim=16, num_kv_shared_layers=2, sliding_window=W,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        vocab_size_per_layer_input=V, hidden_size_per_layer_input=16, laurel_rank=8, altup_num_inputs=2,
        activation_sparsity_pattern=[0.0] * 4)), _spec(theta=(10000.0, 1000000.0), window=(0,))),
    # MLA: q = [q_nope (16), q_pe (8)], the rotary part last (de-interleaved: rotate-half there)
    "gpt_oss": (_gpt_oss, _spec(theta=(150000.0,), window=(0,), sinks=True)),
    "llama4": (_llama4, _spec(rot="interleaved", theta=(500000.0,), nope=(1,), chunked=(0,))),
    "deepseek_v3": (lambda: transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**_COMMON, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=2, moe_intermediate_size=32)), _spec(frac=8 / 24, offset="last")),
}

_MODELS: dict[str, object] = {}


def _model(name):
    if name not in _MODELS:
        torch.manual_seed(0)
        m = FAMILIES[name][0]()
        m.config._attn_implementation = "eager"
        _MODELS[name] = m.eval()
    return _MODELS[name]


class _Tok:
    """Token ids written as decimal numbers (no BOS: the ids are used as given)."""

    bos_token_id = None

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [int(x) for x in text.split()]}


def _ids(n, seed):
    return torch.randint(2, V, (n,), generator=torch.Generator().manual_seed(seed))


def _text(ids):
    return " ".join(str(int(x)) for x in ids)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _is_sliding(spec, i):
    return i in spec["window"]


def _expected_rotation(spec, i, d):
    """(first channel, R, style, base) the family really uses on layer ``i`` (None: no RoPE)."""
    if spec["rot"] is None or i in spec["nope"]:
        return None
    r = int(round(d * spec["frac"]))
    off = 0 if spec["offset"] == "first" else d - r
    return off, r, spec["rot"], spec["theta"][i % len(spec["theta"])]


def _pairs(off, r, style):
    c = np.arange(r // 2)
    return (off + c, off + r // 2 + c) if style == "half" else (off + 2 * c, off + 2 * c + 1)


def _full_cache_k(model, ids):
    from kvcodec.harness.capture import capture

    return capture(model, None, token_ids=ids, dtype=torch.float32)


# ------------------------------------------------------------------------------------ 1. queries
@pytest.mark.parametrize("name", list(FAMILIES))
def test_recorded_queries_reproduce_the_models_attention(name):
    model, spec = _model(name), FAMILIES[name][1]
    c = 40
    ids = _ids(c, 1)
    st = query_statistics(model, _Tok(), _text(ids), context=c, samples=c)
    assert st.q_position == 0 and st.attention is not None
    with torch.no_grad():
        att = model(ids[None], output_attentions=True, use_cache=False).attentions
    cache = _full_cache_k(model, ids)
    pos = torch.arange(c)
    for i in range(st.num_layers):
        la = st.attention[i]
        win = W if _is_sliding(spec, i) else 0
        assert la.window == win and la.softcap == spec["softcap"], (i, la)
        if name == "deepseek_v3":  # the cache holds MLA latents: no statistics, rotation still found
            assert st.q_sample[i] is None and st.q_energy[i] is None
            assert (la.rope, la.offset, la.style, 2 * la.inv_freq.shape[0]) == ("rotary", 16, "half", 8)
            continue
        q = torch.from_numpy(st.q_sample[i]).double()  # [Hq, T, D], times the scaling
        k = cache.layers[i]["k"].double().transpose(0, 1)  # [Hkv, T, D]
        hq, hkv, d = q.shape[0], k.shape[0], q.shape[2]
        logits = q @ k.repeat_interleave(hq // hkv, 0).transpose(1, 2)
        if spec["softcap"]:
            logits = spec["softcap"] * torch.tanh(logits / spec["softcap"])
        vis = pos[:, None] >= pos[None, :]
        if win:
            vis &= pos[:, None] - pos[None, :] < win
        if i in spec["chunked"]:
            vis &= pos[:, None] // C == pos[None, :] // C
        assert la.chunk == (C if i in spec["chunked"] else 0), (i, la)
        p = _softmax(logits.masked_fill(~vis, float("-inf")), _sink_logits(model, spec, i))
        torch.testing.assert_close(p, att[i][0].double(), atol=2e-5, rtol=0)
        assert (la.sinks is not None) == spec["sinks"]
        # the rotation calibration found is the family's, with its per-layer base
        exp = _expected_rotation(spec, i, d)
        if exp is None:
            assert la.rope == "none"
            pairs = (np.zeros(0, int), np.zeros(0, int))
        else:
            off, r, style, base = exp
            assert (la.rope, la.offset, la.style, 2 * la.inv_freq.shape[0]) == ("rotary", off, style, r), (i, la)
            np.testing.assert_allclose(la.inv_freq, base ** (-np.arange(0, r, 2) / r), rtol=1e-6)
            pairs = _pairs(off, r, style)
        # q_energy: mean square over tokens 1.., query heads of each KV head, RoPE pairs averaged
        e = q[:, 1:].pow(2).mean(1).reshape(hkv, hq // hkv, d).mean(1).numpy()
        a, b = pairs
        m = 0.5 * (e[:, a] + e[:, b])
        e[:, a], e[:, b] = m, m
        np.testing.assert_allclose(st.q_energy[i], e, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- 2. the estimate
@pytest.mark.parametrize("name", list(FAMILIES))
def test_attention_estimate_equals_the_models_own_future_queries(name, tmp_path):
    from kvcodec.harness.evaluate import record_queries

    model, spec = _model(name), FAMILIES[name][1]
    t0, n, t = 24, 8, 37
    cal = _ids(t0 + n, 2)
    st = query_statistics(model, _Tok(), _text(cal), context=t0 + n, samples=n)
    assert st.q_position == t0
    save_query_statistics(st, tmp_path / "q.safetensors")  # the estimate from the file
    st = load_query_statistics(tmp_path / "q.safetensors")
    cache = _full_cache_k(model, _ids(t, 3))
    delta = t - t0 if spec["rot"] is not None else 0
    with torch.no_grad(), record_queries(model) as rec:
        model(cal[None], position_ids=torch.arange(delta, delta + t0 + n)[None], use_cache=False)
    qpos = torch.arange(t, t + n)
    kpos = torch.arange(t)
    if name == "deepseek_v3":  # MLA latents: no estimate, and a calibrated encode still works
        import kvcodec

        assert all(attention_estimate(st, i, layer["k"].numpy()) is None for i, layer in enumerate(cache.layers))
        codec = kvcodec.get_codec({**kvcodec.get_codec("kvc-near-cal").get_config(),
                                   "calibration": str(tmp_path / "q.safetensors")})
        assert kvcodec.decode(codec.encode(cache.to(torch.float16))).layers[0]["k"].shape == cache.layers[0]["k"].shape
        return
    for i in range(st.num_layers):
        q = rec[i]["q"][-n:].double().transpose(0, 1) * rec[i]["scaling"]  # [Hq, N, D] at t..t+N-1
        k = cache.layers[i]["k"].double().transpose(0, 1)
        hq, hkv = q.shape[0], k.shape[0]
        logits = q @ k.repeat_interleave(hq // hkv, 0).transpose(1, 2)  # [Hq, N, T]
        if spec["softcap"]:
            logits = spec["softcap"] * torch.tanh(logits / spec["softcap"])
        if _is_sliding(spec, i):
            logits = logits.masked_fill(qpos[:, None] - kpos[None, :] >= W, float("-inf"))
        if i in spec["chunked"]:
            logits = logits.masked_fill(qpos[:, None] // C != kpos[None, :] // C, float("-inf"))
        p = torch.nan_to_num(_softmax(logits, _sink_logits(model, spec, i)), nan=0.0)
        ref = p.reshape(hkv, hq // hkv * n, t).mean(1).transpose(0, 1).numpy()
        est = attention_estimate(st, i, cache.layers[i]["k"].numpy())
        np.testing.assert_allclose(est, ref, atol=2e-6, rtol=1e-4)
        if _is_sliding(spec, i):
            assert np.all(est[: t - W + 1] == 0) and np.all(est[t - W + 1:].sum(0) > 0)
        if i in spec["chunked"]:  # the queries' chunk starts at 32: earlier tokens get nothing
            assert np.all(est[: t // C * C] == 0) and np.all(est[t // C * C:] > 0)


def test_estimate_is_none_for_mla_latents_and_unknown_rotations():
    rng = np.random.default_rng(0)
    st = QueryStats([np.ones((2, 16), np.float32)] * 2, [rng.normal(size=(4, 3, 16)).astype(np.float32)] * 2,
                    q_position=5, attention=[LayerAttention("unknown"), LayerAttention("none")])
    k = rng.normal(size=(9, 2, 16)).astype(np.float32)
    assert attention_estimate(st, 0, k) is None  # cannot be turned: no estimate
    assert attention_estimate(st, 1, k).shape == (9, 2)
    assert attention_estimate(st, 1, rng.normal(size=(9, 1, 40)).astype(np.float32)) is None  # a latent


def test_chunked_estimate_places_the_cache_just_before_the_queries():
    """With chunks of 4 and a cache of 10 tokens read by queries at 13 and 14 (``query_pos``), the
    cache holds positions 3..12: only its last token shares the queries' chunk (12..15)."""
    rng = np.random.default_rng(0)
    st = QueryStats([np.ones((1, 8), np.float32)], [rng.normal(size=(2, 2, 8)).astype(np.float32)],
                    q_position=5, attention=[LayerAttention("none", chunk=4)])
    k = rng.normal(size=(10, 1, 8)).astype(np.float32)
    est = attention_estimate(st, 0, k, query_pos=13)
    assert np.array_equal(est[:9], np.zeros((9, 1))) and np.allclose(est[9], 1.0)
    est = attention_estimate(st, 0, k)  # queries at 10, 11: the cache's 8, 9 share their chunk
    assert np.all(est[:8] == 0) and np.isclose(est[8:].sum(), 1.0) and np.all(est[8:] > 0)


# ------------------------------------------------------------------------------- 3. sensitivity
def _hand_cache(model, own, leaves):
    """A transformers cache built by hand around ``leaves`` (per attention layer K and V
    ``[T, H, D]``): plain layers for an attention-only model; for a hybrid, the model's own
    cache ``own`` of the prefill with the leaves in place of its KV, every other state copied
    (new states stored as new tensors, not written over those autograd keeps)."""
    import copy

    from transformers.cache_utils import DynamicLayer

    if own is None:
        dc, at = transformers.DynamicCache(), list(range(len(leaves)))
    else:
        dc = transformers.DynamicCache(config=model.config)
        at = [i for i, layer in enumerate(own.layers) if getattr(layer, "keys", None) is not None]
        for i, layer in enumerate(own.layers):
            if not hasattr(layer, "update_recurrent_state"):
                dc.layers[i] = DynamicLayer()
                continue
            c = copy.deepcopy(layer)
            c.keys = c.values = None
            c.is_initialized = False
            c.activate_past_recording(0)
            c.update_recurrent_state = lambda s, state_idx=0, _c=c, **k: _c.recurrent_states.__setitem__(
                state_idx, s if isinstance(s, torch.Tensor) else s[-1]) or _c.recurrent_states[state_idx]
            dc.layers[i] = c
    for lv, i in zip(leaves, at):
        dc.update(lv["k"].transpose(0, 1)[None], lv["v"].transpose(0, 1)[None], i)
    return dc


def _brute_fisher(model, ids, cont):
    """Every (scored position, token y): p(y) * grad(log p(y))**2, one backward each, with a
    cache built by hand (:func:`_hand_cache`); p from one forward over ids + cont without any cache."""
    from kvcodec.integrations.transformers import cache_kwargs, kv_layer_map

    cache = _full_cache_k(model, ids)
    with torch.no_grad():
        full = torch.log_softmax(model(torch.cat([ids, cont])[None], use_cache=False).logits[0].float(), -1)
        own = model(ids[None], use_cache=True).past_key_values if kv_layer_map(model) is not None else None
    acc = [{r: torch.zeros(layer[r].shape, dtype=torch.float64) for r in ("k", "v")} for layer in cache.layers]
    for pos in range(cont.numel()):
        for y in range(V):
            leaves = [{r: layer[r].clone().requires_grad_(True) for r in ("k", "v")} for layer in cache.layers]
            dc = _hand_cache(model, own, leaves)
            logp = torch.log_softmax(model(cont[None], use_cache=True, **cache_kwargs(model, dc)).logits[0].float(), -1)
            # the injected cache continues exactly like the uncached pass
            torch.testing.assert_close(logp, full[ids.numel():], atol=2e-5, rtol=0)
            logp[pos, y].backward()
            w = float(full[ids.numel() + pos, y].exp())
            for a, lv in zip(acc, leaves):
                for r in ("k", "v"):
                    a[r] += w * lv[r].grad.double().pow(2)
    return [{r: a[r] / cont.numel() for r in a} for a in acc]


@pytest.mark.parametrize("name", ["llama", "gemma2", "mistral", "phi3", "gpt2"])
def test_exact_fisher_equals_enumeration(name):
    model = _model(name)
    ids, cont = _ids(12, 4), _ids(2, 5)
    _, exact = fisher_diagonal(model, ids, cont, exact=True)
    brute = _brute_fisher(model, ids, cont)
    for e, b in zip(exact, brute):
        for r in ("k", "v"):
            torch.testing.assert_close(e[r], b[r], rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_gradients_reach_every_layer_and_only_tokens_in_the_window(name):
    model, spec = _model(name), FAMILIES[name][1]
    ids, cont = _ids(12, 4), _ids(2, 5)
    _, f = fisher_diagonal(model, ids, cont, exact=True)
    for i, layer in enumerate(f):
        for r in ("k", "v"):
            per_token = layer[r].sum(dim=(1, 2))
            if _is_sliding(spec, i):
                # scored queries at 12 and 13 see keys j > 12 - W only
                assert torch.all(per_token[: 12 - W + 1] == 0), (i, r)
                assert torch.all(per_token[12 - W + 1:] > 0), (i, r)
            else:
                assert torch.all(per_token > 0), (i, r)


def test_sampled_fisher_converges_to_the_exact_one_with_softcap_and_windows():
    model = _model("gemma2")
    ids, cont = _ids(12, 4), _ids(3, 6)
    _, exact = fisher_diagonal(model, ids, cont, exact=True)
    _, est = fisher_diagonal(model, ids, cont, samples=150, seed=1)
    for e, x in zip(est, exact):
        for r in ("k", "v"):
            se, sx = e[r].sum(dim=(0, 2)), x[r].sum(dim=(0, 2))  # per head, as kvc uses them
            assert float(((se - sx).abs() / sx).max()) < 0.2, r


def test_attention_metadata_round_trips_and_is_parsed_strictly(tmp_path):
    import json

    from safetensors.numpy import load_file, save_file

    from kvcodec.codecs.kvc.calibration import default_inv_freq
    from kvcodec.errors import FormatError
    from kvcodec.format import safetensors_io as sio

    rng = np.random.default_rng(1)
    att = [LayerAttention("rotary", default_inv_freq(8, 1e4)[:2], offset=4, style="interleaved", window=5, softcap=3.0),
           LayerAttention("none", sinks=np.array([0.5, -1.5], np.float32)), LayerAttention("unknown", chunk=16)]
    st = QueryStats([np.ones((2, 8), np.float32)] * 3, [rng.normal(size=(2, 3, 8)).astype(np.float32)] * 3,
                    q_position=4, attention=att)
    p = tmp_path / "q.safetensors"
    save_query_statistics(st, p)
    back = load_query_statistics(p)
    assert back.attention == att and np.array_equal(back.attention[0].inv_freq, att[0].inv_freq)
    assert np.array_equal(back.attention[1].sinks, att[1].sinks) and back.attention[0].sinks is None
    assert [la.chunk for la in back.attention] == [0, 0, 16]
    tensors = load_file(str(p))
    meta = sio.read_raw_header(sio.as_source(p.read_bytes())).metadata
    items = json.loads(meta["attention"])

    def bad(meta_patch=None, drop=None, extra=None, entry=None):
        m = {**meta, **(meta_patch or {})}
        if entry is not None:
            m["attention"] = json.dumps([entry] + items[1:])
        t = {k: v for k, v in tensors.items() if k != drop}
        t.update(extra or {})
        save_file(t, str(tmp_path / "bad.safetensors"), metadata=m)
        with pytest.raises(FormatError):
            load_query_statistics(tmp_path / "bad.safetensors")

    bad(meta_patch={"format": "kvcodec.qstats/3"})  # the new facts need /4
    bad(meta_patch={"attention": "[1, 2"})
    bad(meta_patch={"attention": json.dumps(items[:2])})  # one layer short
    bad(entry={**items[0], "window": -1})
    bad(entry={**items[0], "window": True})
    bad(entry={**items[0], "softcap": float("inf")})
    bad(entry={**items[0], "style": "spiral"})
    bad(entry={**items[0], "offset": 6})  # 6 + 4 rotary channels > 8
    bad(entry={**items[0], "extra": 1})
    bad(entry={"rope": "bogus", "window": 0, "softcap": 0.0})
    bad(drop="layers.0.rope_inv_freq")  # rotary without its frequencies
    bad(extra={"layers.1.rope_inv_freq": np.ones(2, np.float32)})  # frequencies on a "none" layer
    bad(extra={"layers.0.rope_inv_freq": np.full(2, np.nan, np.float32)})
    bad(meta_patch={"format": "kvcodec.qstats/4"})  # sinks need /5
    bad(drop="layers.1.attn_sinks")  # "sinks": true without its values
    bad(extra={"layers.2.attn_sinks": np.ones(2, np.float32)})  # values on a layer without the key
    bad(extra={"layers.1.attn_sinks": np.ones(3, np.float32)})  # 3 sinks for 2 query heads
    bad(extra={"layers.1.attn_sinks": np.full(2, np.inf, np.float32)})
    bad(entry={**items[0], "chunk": 0})
    bad(entry={**items[0], "chunk": 2.5})
    bad(entry={**items[0], "chunk": True})
    m4 = {**meta, "format": "kvcodec.qstats/4", "attention": json.dumps([items[0], {k: v for k, v in items[1].items()
                                                                                    if k != "sinks"},
                                                                          {k: v for k, v in items[2].items()
                                                                           if k != "chunk"}])}
    save_file({k: v for k, v in tensors.items() if k != "layers.1.attn_sinks"}, str(tmp_path / "v4.safetensors"),
              metadata=m4)
    assert load_query_statistics(tmp_path / "v4.safetensors").attention[1].sinks is None  # /4 files still read
    save_file({k: v for k, v in tensors.items() if k != "layers.1.attn_sinks"}, str(tmp_path / "v4c.safetensors"),
              metadata={**m4, "attention": json.dumps([items[0], {k: v for k, v in items[1].items() if k != "sinks"},
                                                       items[2]])})
    with pytest.raises(FormatError):  # chunked attention needs /5
        load_query_statistics(tmp_path / "v4c.safetensors")


# 4. The whole closed loop on every family: build_profile (query statistics, sensitivities, the
#    step search, the K/V balance, the held-out windows) runs end to end, writes a profile the
#    encoder accepts, and an encode through it codes the level's own steps and decodes to the
#    cache. The held-out model of issue 20 is of an architecture neither real model here has.
def _word_tokenizer():
    pytest.importorskip("tokenizers")
    from kvc_tools import word_tokenizer

    tok, words = word_tokenizer(80)  # ids < V
    rng = np.random.default_rng(0)
    return tok, {d: " ".join(words[i] for i in rng.integers(0, 60, 300)) for d in ("prose", "code")}


def cache_layers(model) -> int:
    """Cache layers after the first (each gets a predictor; a hybrid's attention layers only)."""
    from kvcodec.integrations.transformers import kv_layer_map

    kv = kv_layer_map(model)
    return (int(model.config.num_hidden_layers) if kv is None else len(kv)) - 1


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_whole_calibration_runs_on_every_family(name, tmp_path):
    import json

    import kvcodec
    from kvcodec.codecs.kvc.calibration import save_query_statistics
    from kvcodec.codecs.kvc.profile import parse_profile
    from kvcodec import open as open_kvc
    from kvcodec.harness import profile as hp
    from kvcodec.harness.capture import capture

    model = _model(name)
    tok, texts = _word_tokenizer()
    levels = {"a": 0.01, "b": 0.05}
    st = hp.build_profile(model, tok, texts, context=64, continuation=16, samples=16, sensitivity_samples=1,
                          levels=levels, max_windows=2, max_held=1)
    p = parse_profile(json.loads(json.dumps(st.profile)), name)
    assert {lv["name"] for lv in st.profile["levels"]} == set(levels)
    for lv in st.profile["levels"]:
        assert np.isfinite([lv["k_step"], lv["v_step"], lv["kl_search"], lv["kl_holdout"]]).all()
        assert lv["k_step"] > 0 and lv["v_step"] > 0 and lv["kl_holdout"] >= 0
    assert p.points and st.profile["model"]  # measured points, and the model's identity
    # cross-layer predictors fitted for every layer after the first, and the search coded with them
    assert st.profile["settings"]["xpred"] == 1 and st.xpred[0] is None
    assert all(x is not None for x in st.xpred[1:]) and st.profile["xpred"]["layers"] == cache_layers(model)
    f = tmp_path / f"{name}.safetensors"
    save_query_statistics(st, f)
    cache = capture(model, tok, texts["prose"], context=48, dtype=torch.float16)
    a = next(lv for lv in st.profile["levels"] if lv["name"] == "a")
    blob = kvcodec.get_codec({"id": "kvc", "target_kl": 0.01, "calibration": str(f)}).encode(cache)
    with open_kvc(blob) as r:
        cfg = dict(r.manifest["codec"])
    assert cfg["k_step"] == a["k_step"] and cfg["v_step"] == a["v_step"] and cfg["xpred"] == 1
    with open_kvc(blob) as r:
        flags = {c["params"].get("xp") for layer in r.manifest["layers"][1:] for t in layer["tensors"].values()
                 for c in t["chunks"]}
    assert flags == {1}
    dec = kvcodec.decode(blob)
    assert dec.num_layers == cache.num_layers
    for got, want in zip(dec.layers, cache.layers):
        assert got.keys() == want.keys()
        for role in want:
            assert got[role].shape == want[role].shape and bool(torch.isfinite(got[role].float()).all())


def test_calibration_leaves_out_predictors_too_wide_to_decode(tmp_path, monkeypatch):
    """Past XPRED_MAX_WEIGHTS a profile is made without cross-layer predictors, and says why;
    files coded with it decode without it."""
    import kvcodec
    from kvcodec.codecs.kvc.calibration import save_query_statistics
    from kvcodec.harness import profile as hp
    from kvcodec.harness.capture import capture

    model = _model("llama")
    tok, texts = _word_tokenizer()
    monkeypatch.setattr(hp, "XPRED_MAX_WEIGHTS", 4)
    st = hp.build_profile(model, tok, texts, context=64, continuation=16, samples=16, sensitivity_samples=1,
                          levels={"a": 0.05}, max_windows=2, max_held=1)
    assert st.xpred is None and st.profile["settings"]["xpred"] == 0 and "off" in st.profile["xpred"]
    f = tmp_path / "p.safetensors"
    save_query_statistics(st, f)
    blob = kvcodec.get_codec({"id": "kvc", "target_kl": 0.05, "calibration": str(f)}).encode(
        capture(model, tok, texts["prose"], context=48, dtype=torch.float16))
    f.unlink()  # no profile needed to decode
    assert kvcodec.decode(blob).num_layers == model.config.num_hidden_layers


# ----------------------------------------------------------------------------- hybrid models
def test_a_hybrid_models_cache_is_its_attention_layers_and_continues_exactly():
    """capture keeps a hybrid model's recurrent layers as they are (HybridState) and gives its
    attention layers' KV; the model continues on the two exactly as on one uncached pass, so
    an uncompressed cache scores KL 0 and kvc's closed loop measures the real model."""
    from kvcodec.harness.capture import capture_with_state
    from kvcodec.harness.evaluate import Evaluator

    for name, kv_layers in (("qwen3_5", [1, 3]), ("lfm2", [1, 3])):
        model = _model(name)
        ids = _ids(56, 7)
        kv, state = capture_with_state(model, None, token_ids=ids[:40])
        assert state.kv_layers == kv_layers and sorted(state.recurrent) == [0, 2]
        assert kv.num_layers == 2 and all(layer["k"].shape == (40, 2, 16) for layer in kv.layers)
        with torch.no_grad():
            own = model(ids[None, :40], use_cache=True).past_key_values  # the model's own cache
            full = model(ids[None], use_cache=False).logits[0, 40:56].float()
        for j, m in enumerate(kv_layers):
            torch.testing.assert_close(kv.layers[j]["k"], own.layers[m].keys[0].transpose(0, 1))
            torch.testing.assert_close(kv.layers[j]["v"], own.layers[m].values[0].transpose(0, 1))
        ev = Evaluator(model, _Tok(), "", 40, 15, cache_dtype=torch.float32, token_ids=ids)
        torch.testing.assert_close(ev.ref_logits, full[:15], atol=2e-4, rtol=0)
        assert ev.evaluate("raw")["next_token"]["kl_mean"] == 0.0
        r = ev.evaluate("kvc-near")
        assert r["error"] is None and 0 < r["next_token"]["kl_mean"] < 0.05


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2", "falcon_h1"])
def test_exact_fisher_of_a_hybrid_equals_enumeration(name):
    """The brute force builds the hybrid's cache by hand: the model's own recurrent layers after
    the prefill, and the attention layers' K and V as the leaves."""
    model = _model(name)
    ids, cont = _ids(12, 4), _ids(2, 5)
    _, exact = fisher_diagonal(model, ids, cont, exact=True)
    for e, b in zip(exact, _brute_fisher(model, ids, cont)):
        for r in ("k", "v"):
            torch.testing.assert_close(e[r], b[r], rtol=1e-4, atol=1e-12)


def test_a_model_with_one_attention_layer_calibrates_without_predictors():
    """Nemotron-H with one attention layer among Mamba and MLP layers: a one-layer cache, so no
    cross-layer predictors (there is no layer before to predict from), every level still met."""
    from kvcodec.harness import profile as hp

    torch.manual_seed(0)
    model = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
        **{**_COMMON, "num_hidden_layers": 4}, hybrid_override_pattern="M*M-", mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, n_groups=1)).eval()
    model.config._attn_implementation = "eager"
    tok, texts = _word_tokenizer()
    msgs: list[str] = []
    st = hp.build_profile(model, tok, texts, context=64, continuation=16, samples=16, sensitivity_samples=1,
                          levels={"a": 0.01}, max_windows=2, max_held=1, progress=msgs.append)
    assert st.num_layers == 1 and st.profile["settings"]["xpred"] == 0 and st.profile["xpred"] == {"off": "one cache layer"}
    assert "cross-layer predictors: off (the cache has one layer)" in msgs
    assert [lv["name"] for lv in st.profile["levels"]] == ["a"]


def test_unsupported_layer_kinds_are_refused_with_a_clear_error_before_they_run(monkeypatch):
    """Sparse indexed attention (an indexer's cache beside the KV) and Mamba state that a config
    declares without transformers' layer_types: refused before the model runs."""
    from types import SimpleNamespace

    from kvcodec.errors import InputError
    from kvcodec.harness.capture import capture
    from kvcodec.integrations.transformers import require_kv_layers

    model = _model("llama")
    calls = []
    monkeypatch.setattr(model.config, "layer_types", ["indexed_attention", "full_attention"], raising=False)
    monkeypatch.setattr(model, "forward", lambda *a, **k: calls.append(1))
    with pytest.raises(InputError, match=r"llama: layers of type indexed_attention; .*sparse attention"):
        capture(model, None, token_ids=_ids(24, 5))
    assert calls == []  # refused before the model ran
    monkeypatch.undo()
    with pytest.raises(InputError, match="recurrent .Mamba/SSM or convolution. state"):
        require_kv_layers(SimpleNamespace(model_type="x", mamba_d_state=16, num_hidden_layers=2))
    for name in ("llama", "gemma3", "exaone4", "deepseek_v3", "qwen3_5", "lfm2", "jamba", "nemotron_h", "falcon_h1"):
        require_kv_layers(_model(name))  # these pass


@pytest.mark.parametrize("name, reason", [
    ("lfm2", "cache layer 0 is a .*LinearAttention.*hybrid"),  # recurrent states would be lost
    ("gemma3n", "cache layer 2 holds no KV of its own .*Gemma 3n"),  # a layer reading another's KV
])
def test_a_cache_that_is_not_all_kv_is_refused_by_save_with_the_reason(name, reason, tmp_path):
    """A KVC file holds each layer's own KV only: save refuses the model's own cache and says why."""
    import kvcodec.integrations.transformers as kt
    from kvcodec.errors import InputError

    model = _model(name)
    with torch.no_grad():
        out = model(_ids(12, 6)[None], use_cache=True)
    with pytest.raises(InputError, match=reason):
        kt.save(out.past_key_values, tmp_path / "x.kvc", "fp8-e4m3")
    assert not (tmp_path / "x.kvc").exists()
