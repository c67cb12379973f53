"""kvc's per-(layer, head) steps from Fisher sensitivities in the calibration file."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.codecs.kvc import _sens_multipliers
from kvcodec.errors import ConfigError, FormatError, InputError
from kvcodec.harness.calibration import QueryStats, load_query_statistics, save_query_statistics


def _cache(layers=2, t=128, h=2, d=16, seed=0, same=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layers):
        if same and out:
            out.append(out[0])
            continue
        k = torch.randn(t, h, d, generator=g) * (0.5 + torch.rand(1, h, d, generator=g)) + 3 * torch.randn(1, h, d, generator=g)
        v = torch.randn(t, h, d, generator=g) * (0.5 + torch.rand(t, h, 1, generator=g))
        out.append((k.half(), v.half()))
    return kvcodec.KVCache.from_tensors(out)


def _stats(cache, k_sens=None, v_sens=None, seed=1) -> QueryStats:
    rng = np.random.default_rng(seed)
    h, d = cache.layers[0]["k"].shape[1:]
    energy = [np.ones((h, d), np.float32) for _ in cache.layers]
    sample = [rng.normal(size=(2 * h, 4, d)).astype(np.float32) for _ in cache.layers]
    return QueryStats(energy, sample, q_position=0, rope_theta=0.0, meta={"model": "test"},
                      k_sens=k_sens, v_sens=v_sens)


def test_multipliers_keep_the_geometric_mean_and_are_clipped():
    cache = _cache(layers=3, h=2, d=4)
    rng = np.random.default_rng(0)
    sens = [rng.uniform(0.01, 10.0, (2, 4)) for _ in range(3)]
    m = _sens_multipliers(sens, cache, "k", 1.0, 1e6)
    heads = np.concatenate([s.mean(1) for s in sens])
    flat = np.concatenate(m)
    assert abs(np.exp(np.log(flat).mean()) - 1.0) < 1e-12  # mean log-step unchanged
    np.testing.assert_allclose(flat ** -2 / heads, (flat ** -2 / heads)[0], rtol=1e-12)  # step**2 ∝ 1/sens
    clipped = np.concatenate(_sens_multipliers(sens, cache, "v", 1.0, 2.0, 1.5))
    assert clipped.min() >= 0.5 and clipped.max() <= 1.5
    assert np.all(np.concatenate(_sens_multipliers(sens, cache, "k", 0.0, 2.0)) == 1.0)
    # a layer whose shape is not the cache's (another model) gets nothing
    assert _sens_multipliers([np.ones((3, 4))] + sens[1:], cache, "k", 1.0, 2.0)[0] is None
    assert _sens_multipliers([None] * 3, cache, "k", 1.0, 2.0) == [None] * 3


def test_stats_file_keeps_sensitivities_and_rejects_bad_ones(tmp_path):
    from safetensors.numpy import save_file

    cache = _cache()
    ks = [np.full((2, 16), 2.0, np.float32), np.full((2, 16), 0.5, np.float32)]
    vs = [np.full((2, 16), 1.0, np.float32), None]
    p = tmp_path / "q.safetensors"
    save_query_statistics(_stats(cache, ks, vs), p)
    back = load_query_statistics(p)
    assert [a.tolist() for a in back.k_sens] == [a.tolist() for a in ks]
    assert back.v_sens[0].tolist() == vs[0].tolist() and back.v_sens[1] is None
    # a query-only file (format /1, written before sensitivities existed) still loads
    old = tmp_path / "old.safetensors"
    save_file({"layers.0.q_energy": np.ones((2, 16), np.float32)}, str(old),
              metadata={"format": "kvcodec.qstats/1", "num_layers": "1", "q_position": "0", "rope_theta": "0.0"})
    assert load_query_statistics(old).k_sens is None and load_query_statistics(old).sensitivity("v") == [None]
    bad = tmp_path / "bad.safetensors"
    save_file({"layers.0.k_sens": -np.ones((2, 16), np.float32)}, str(bad),
              metadata={"format": "kvcodec.qstats/2", "num_layers": "1", "q_position": "0", "rope_theta": "0.0"})
    with pytest.raises(FormatError, match="k_sens"):
        load_query_statistics(bad)


def test_a_16x_more_sensitive_layer_gets_4x_finer_steps_and_decodes_without_the_file(tmp_path):
    cache = _cache(layers=2, same=True)  # two identical layers: only the sensitivities differ
    sens = [np.full((2, 16), 16.0, np.float32), np.full((2, 16), 1.0, np.float32)]
    p = tmp_path / "q.safetensors"
    save_query_statistics(_stats(cache, sens, [a.copy() for a in sens]), p)
    base = {"id": "kvc", "k_step": 0.3, "v_step": 0.9, "sinks": 0, "sink_v_ratio": 0.0, "calibration": str(p),
            "k_attn": 0.0, "v_attn": 0.0, "sens_clip": 8.0, "sens_coarse": 8.0}
    blob = kvcodec.get_codec(base).encode(cache)
    flat = kvcodec.get_codec({**base, "sens": 0.0}).encode(cache)
    p.unlink()  # the decoder never needs the calibration file
    out, ref = kvcodec.decode(blob), kvcodec.decode(flat)

    def mse(c, i, r):
        return float((c.layers[i][r].double() - cache.layers[i][r].double()).pow(2).mean())

    for r in ("k", "v"):
        assert mse(ref, 0, r) == mse(ref, 1, r)  # same data, same steps without sensitivities
        ratio = mse(out, 1, r) / mse(out, 0, r)  # steps 2x coarser / 2x finer: error ratio ~16
        assert 10.0 < ratio < 24.0, (r, ratio)
    with pytest.raises(ConfigError):
        kvcodec.get_codec({"id": "kvc", "sens": -1.0})
    with pytest.raises(ConfigError):
        kvcodec.get_codec({"id": "kvc", "sens_coarse": 0.5})


def test_file_without_sensitivities_gives_the_same_bytes_whatever_sens(tmp_path):
    cache = _cache()
    p = tmp_path / "q.safetensors"
    save_query_statistics(_stats(cache), p)
    a = kvcodec.get_codec({"id": "kvc", "calibration": str(p), "sens": 0.0})
    b = kvcodec.get_codec({"id": "kvc", "calibration": str(p), "sens": 2.0})
    da, db = a.decode(a.encode(cache)), b.decode(b.encode(cache))
    assert all(torch.equal(x[r], y[r]) for x, y in zip(da.layers, db.layers) for r in ("k", "v"))


# ---------------------------------------------------------------- Fisher estimate on a tiny model
transformers = pytest.importorskip("transformers")


def _tiny_llama(vocab=16):
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _exact_fisher(model, ids, cont):
    """sum over scored positions and every vocabulary token y of p(y) * grad(log p(y))**2."""
    from kvcodec.harness.capture import capture
    from kvcodec.integrations.transformers import cache_kwargs

    ref = capture(model, None, token_ids=ids, dtype=torch.float32)
    acc = [{r: torch.zeros(layer[r].shape, dtype=torch.float64) for r in ("k", "v")} for layer in ref.layers]
    vocab = model.config.vocab_size
    for pos in range(cont.numel()):
        for y in range(vocab):
            leaves = [{r: layer[r].clone().requires_grad_(True) for r in ("k", "v")} for layer in ref.layers]
            dc = transformers.DynamicCache()
            for i, lv in enumerate(leaves):
                dc.update(lv["k"].transpose(0, 1)[None], lv["v"].transpose(0, 1)[None], i)
            logp = torch.log_softmax(model(cont[None], use_cache=True, **cache_kwargs(model, dc)).logits[0].float(), -1)
            logp[pos, y].backward()
            w = float(logp[pos, y].detach().exp())
            for a, lv in zip(acc, leaves):
                for r in ("k", "v"):
                    a[r] += w * lv[r].grad.double().pow(2)
    return [{r: a[r] / cont.numel() for r in a} for a in acc]


@pytest.fixture
def one_thread():
    """Tiny-model passes are overhead-bound: one thread is ~4x faster than two on a busy machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_sampled_fisher_matches_the_exact_one_on_a_tiny_model(one_thread):
    from kvcodec.harness.calibration import fisher_diagonal, fisher_sensitivity

    model = _tiny_llama()
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 16, (10,), generator=g)
    cont = torch.randint(0, 16, (3,), generator=g)
    ref, est = fisher_diagonal(model, ids, cont, samples=200, seed=1)
    exact = _exact_fisher(model, ids, cont)
    for e, x in zip(est, exact):
        for r in ("k", "v"):
            assert e[r].shape == x[r].shape == ref.layers[0][r].shape
            # per-head sums over tokens and channels (what kvc's steps use): the sampled estimate is
            # unbiased; 200 draws x 3 positions put it within a few percent of the exact value
            se, sx = e[r].sum(dim=(0, 2)), x[r].sum(dim=(0, 2))
            rel = ((se - sx).abs() / sx).max()
            assert rel < 0.15, (r, float(rel))
            assert float(sx.sum()) > 0
    # the seed makes it reproducible, and the sensitivities are these diagonals in kvc's units
    k_sens, v_sens = fisher_sensitivity(model, ids, cont, samples=3, seed=2)
    _, f3 = fisher_diagonal(model, ids, cont, samples=3, seed=2)
    k1, v1 = ref.layers[1]["k"][1:].double(), ref.layers[1]["v"][1:].double()
    uk = (k1 - k1.mean(0)).pow(2).mean(dim=(0, 2))
    np.testing.assert_allclose(k_sens[1], (f3[1]["k"][1:].mean(0) * uk[:, None]).numpy(), rtol=1e-5)
    uv = v1.pow(2).mean(2)
    np.testing.assert_allclose(v_sens[1], (f3[1]["v"][1:] * uv[:, :, None]).mean(0).numpy(), rtol=1e-5)
    assert any(p.requires_grad for p in model.parameters())  # parameter flags restored


def test_fisher_kl_predicts_the_kl_of_a_small_perturbation(one_thread):
    import dataclasses

    from kvcodec.harness.calibration import fisher_diagonal, fisher_kl
    from kvcodec.integrations.transformers import cache_kwargs, to_dynamic_cache
    from kvcodec.metrics import next_token_metrics

    model = _tiny_llama()
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 16, (24,), generator=g)
    cont = torch.randint(0, 16, (8,), generator=g)
    ref, fisher = fisher_diagonal(model, ids, cont, exact=True)
    # the same Fisher from a cache the caller holds (the search passes its first window's)
    ref2, fisher2 = fisher_diagonal(model, ids, cont, exact=True, reference=ref.to(torch.float16))
    assert ref2.layers[0]["k"].dtype == torch.float32
    assert torch.allclose(fisher2[1]["k"], fisher[1]["k"], rtol=0.05, atol=1e-9)
    with pytest.raises(InputError):
        fisher_diagonal(model, ids[:-1], cont, exact=True, reference=ref)

    def logits(cache):
        dc = to_dynamic_cache(cache, dtype=torch.float32)
        with torch.no_grad():
            return model(cont[None], use_cache=True, **cache_kwargs(model, dc)).logits[0]

    base = logits(ref)
    # independent errors: the diagonal is exact in expectation (the off-diagonal terms average
    # out). This model's 8 positions x 15 free probabilities make each draw scatter (0.4-2x), so
    # compare the mean over 48 draws; a model's millions of cache elements do that within one.
    measured, predicted = [], []
    for _ in range(48):
        noisy = dataclasses.replace(ref, layers=[
            {r: t + 0.03 * t.std() * torch.randn(t.shape, generator=g) for r, t in layer.items()}
            for layer in ref.layers])
        measured.append(next_token_metrics(base, logits(noisy))["kl_mean"])
        predicted.append(fisher_kl(fisher, ref, noisy))
    ratio = sum(predicted) / sum(measured)
    assert 0.8 < ratio < 1.25, ratio
    assert fisher_kl(fisher, ref, ref) == 0.0


# ---------------------------------------------------------------- recency ramp (no calibration)
def test_recency_factor_is_a_clipped_ramp():
    from kvcodec.codecs.kvc import recency_factor

    m = recency_factor(300, np.ones(300, bool), 64, 4.0)
    assert m.shape == (300,) and np.all(np.diff(m) <= 0)  # older tokens never get finer steps
    assert m[-1] == 0.25 and m[0] == 1.0 and m[-64] == 1.0 and m[-63] < 1.0
    coded = np.ones(300, bool)
    coded[[0, 299]] = False  # protected tokens keep their place: distances count from the last token
    assert recency_factor(300, coded, 64, 4.0).tolist() == m[1:299].tolist()
    assert recency_factor(300, coded, 0, 4.0) is None and recency_factor(300, coded, 64, 1.0) is None
    with pytest.raises(ConfigError):
        kvcodec.get_codec({"id": "kvc", "recent_fine": 0.5})


def test_recency_ramp_refines_the_latest_tokens_of_k_and_v():
    cache = _cache(layers=1, t=256)
    plain = kvcodec.get_codec({"id": "kvc", "sink_v_ratio": 0.0})
    ramp = kvcodec.get_codec({"id": "kvc", "sink_v_ratio": 0.0, "recent_ramp": 64, "recent_fine": 4.0})
    a, b = kvcodec.decode(plain.encode(cache)), kvcodec.decode(ramp.encode(cache))
    for r in ("k", "v"):
        ea = (a.layers[0][r].double() - cache.layers[0][r].double()).pow(2).mean(dim=(1, 2))
        eb = (b.layers[0][r].double() - cache.layers[0][r].double()).pow(2).mean(dim=(1, 2))
        assert torch.equal(ea[:192], eb[:192])  # older than the ramp: the same steps, the same values
        assert float(eb[-16:].mean()) < 0.15 * float(ea[-16:].mean())  # 4x finer steps: ~1/16 the error
