"""Metric unit tests against hand-computed cases (identity -> 0, known perturbations -> known values)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvcodec.errors import InputError
from kvcodec.metrics import (
    attention_errors,
    attention_reference,
    next_token_kl,
    next_token_metrics,
    reconstruction_errors,
    rel_l2,
    summarize,
    visibility_mask,
)


def _qkv(tq=5, hq=4, hkv=2, t=7, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tq, hq, d, generator=g), torch.randn(t, hkv, d, generator=g),
            torch.randn(t, hkv, d, generator=g))


def test_identity_gives_zero_error():
    q, k, v = _qkv()
    e = attention_errors(q, k, v, k.clone(), v.clone())
    assert e["out_rel_l2"].tolist() == [0.0] * 4
    assert e["attn_kl"].tolist() == [0.0] * 4
    assert e["k_logit_rmse"].tolist() == [0.0] * 4
    torch.testing.assert_close(e["out_cosine"], torch.ones(4, dtype=torch.float64), rtol=0, atol=1e-12)
    r = reconstruction_errors(k, v, k.clone(), v.clone())
    assert r["k_rel_l2"].tolist() == [0.0, 0.0] and r["v_rel_l2"].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("a", [0.1, -0.25])
def test_scaled_values_give_exact_relative_error(a):
    # Attention output is linear in V: O' = (1+a) O, so the error is |a|, the cosine 1 (for a > -1)
    # and the probabilities do not move.
    q, k, v = _qkv(seed=1)
    e = attention_errors(q, k, v, k, v * (1 + a), dtype=torch.float64)
    torch.testing.assert_close(e["out_rel_l2"], torch.full((4,), abs(a), dtype=torch.float64))
    torch.testing.assert_close(e["out_cosine"], torch.ones(4, dtype=torch.float64))
    assert e["attn_kl"].abs().max() < 1e-12 and e["k_logit_rmse"].max() == 0
    r = reconstruction_errors(k, v, k, v * (1 + a))
    torch.testing.assert_close(r["v_rel_l2"], torch.full((2,), abs(a), dtype=torch.float64))


def test_key_shift_moves_logits_but_not_softmax():
    # Adding one vector to every key adds s·q·δ to all of a query's logits: softmax invariant,
    # so KL and output error are 0, but the logit error is exactly |s·q·δ| (RMS over queries).
    q, k, v = (x.double() for x in _qkv(tq=3, hq=2, hkv=1, t=4, d=3, seed=2))
    delta = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    e = attention_errors(q, k, v, k + delta, v, scaling=0.5, dtype=torch.float64)
    assert e["attn_kl"].abs().max() < 1e-12 and e["out_rel_l2"].max() < 1e-12
    expected = ((0.5 * (q.double() @ delta.double())) ** 2).mean(0).sqrt()  # per query head
    torch.testing.assert_close(e["k_logit_rmse"], expected)


def test_two_key_case_by_hand():
    # q = 1, keys 0 and 0 -> P = (1/2, 1/2); test keys 0 and ln 3 -> P' = (1/4, 3/4).
    f64 = torch.float64
    q = torch.ones(1, 1, 1, dtype=f64)
    k = torch.zeros(2, 1, 1, dtype=f64)
    kt = torch.tensor([0.0, math.log(3)], dtype=f64).reshape(2, 1, 1)
    v = torch.tensor([1.0, 3.0], dtype=f64).reshape(2, 1, 1)
    e = attention_errors(q, k, v, kt, v, scaling=1.0, dtype=torch.float64)
    assert e["attn_kl"].item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-12)
    # O = 2, O' = 1/4 + 9/4 = 2.5: relative error 1/4, same direction.
    assert e["out_rel_l2"].item() == pytest.approx(0.25, rel=1e-12)
    assert e["out_cosine"].item() == pytest.approx(1.0, rel=1e-12)
    assert e["k_logit_rmse"].item() == pytest.approx(math.log(3) / math.sqrt(2), rel=1e-12)
    assert reconstruction_errors(k, v, kt, v)["k_rel_l2"].item() == math.inf  # reference K is 0
    # Opposite V direction: cosine -1.
    e2 = attention_errors(q, k, v, k, -v, scaling=1.0, dtype=torch.float64)
    assert e2["out_cosine"].item() == pytest.approx(-1.0) and e2["out_rel_l2"].item() == pytest.approx(2.0)


def test_gqa_head_mapping():
    # 4 query heads over 2 KV heads: heads 0,1 read KV head 0 and heads 2,3 read KV head 1.
    q, k, v = _qkv(hq=4, hkv=2, seed=3)
    v2 = v.clone()
    v2[:, 1] *= 1.5
    e = attention_errors(q, k, v, k, v2, dtype=torch.float64)
    assert e["out_rel_l2"][:2].tolist() == [0.0, 0.0]
    torch.testing.assert_close(e["out_rel_l2"][2:], torch.full((2,), 0.5, dtype=torch.float64))


def test_causal_and_sliding_window_masks():
    assert visibility_mask(torch.tensor([1, 3]), torch.arange(4)).int().tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert visibility_mask(torch.tensor([3]), torch.arange(4), window=2).int().tolist() == [[0, 0, 1, 1]]
    q, k, v = _qkv(tq=2, hq=2, hkv=1, t=6, seed=4)
    # Queries at positions 6 and 7 with window 3 see keys 4..5 and 5 only: a change to key 0
    # is invisible, a change to key 5 is not.
    pos = torch.tensor([6, 7])
    k0 = k.clone()
    k0[0] += 10
    e = attention_errors(q, k, v, k0, v, q_positions=pos, window=3)
    assert e["attn_kl"].max() == 0 and e["k_logit_rmse"].max() == 0
    k5 = k.clone()
    k5[5] += 1
    assert attention_errors(q, k, v, k5, v, q_positions=pos, window=3)["attn_kl"].min() > 0
    # Queries that see no key at all (window 1, keys before them) give NaN, not a fake 0.
    e = attention_errors(q, k, v, k, v, q_positions=torch.tensor([10, 11]), window=1)
    assert torch.isnan(e["out_rel_l2"]).all()
    # Causality: a query at position 2 ignores keys 3..5.
    k3 = k.clone()
    k3[3:] += 5
    e = attention_errors(q[:1], k, v, k3, v * 1.0, q_positions=torch.tensor([2]))
    assert e["attn_kl"].max() == 0


def test_precomputed_reference_matches_and_float32_is_close():
    q, k, v = _qkv(tq=9, hq=6, hkv=3, t=40, d=16, seed=5)
    kt, vt = k + 0.05 * torch.randn_like(k), v + 0.05 * torch.randn_like(v)
    ref = attention_reference(q, k, v, q_positions=torch.arange(30, 39))
    a = attention_errors(q, k, v, kt, vt, q_positions=torch.arange(30, 39), reference=ref)
    b = attention_errors(q, k, v, kt, vt, q_positions=torch.arange(30, 39))
    c = attention_errors(q, k, v, kt, vt, q_positions=torch.arange(30, 39), dtype=torch.float64)
    for name in a:
        assert torch.equal(a[name], b[name])
        torch.testing.assert_close(a[name], c[name], rtol=1e-4, atol=1e-6)


def test_shape_errors():
    q, k, v = _qkv()
    with pytest.raises(InputError):
        attention_errors(q, k, v, k[:3], v)
    with pytest.raises(InputError):
        attention_errors(q[:, :3], k, v, k, v)  # 3 query heads over 2 KV heads
    with pytest.raises(InputError):
        next_token_metrics(torch.zeros(2, 3), torch.zeros(2, 4))
    with pytest.raises(InputError):
        next_token_metrics(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([0]))


def test_next_token_metrics_by_hand():
    f64 = torch.float64
    ref = torch.tensor([[0.0, 0.0, math.log(2)]], dtype=f64)          # P = (1/4, 1/4, 1/2)
    test = torch.tensor([[0.0, math.log(2), math.log(2)]], dtype=f64)  # P' = (1/5, 2/5, 2/5)
    m = next_token_metrics(ref, test, torch.tensor([1]))
    kl = 0.25 * math.log(0.25 / 0.2) + 0.25 * math.log(0.25 / 0.4) + 0.5 * math.log(0.5 / 0.4)
    assert m["kl_mean"] == pytest.approx(kl, rel=1e-12) and m["kl_max"] == pytest.approx(kl, rel=1e-12)
    assert m["top1_agreement"] == 0.0  # reference argmax 2; test ties 1 and 2, argmax takes 1
    assert m["ppl_ref"] == pytest.approx(4.0) and m["ppl_test"] == pytest.approx(2.5)
    assert m["delta_ppl"] == pytest.approx(-1.5)


@pytest.mark.parametrize("noise", [1e-4, 1e-2, 0.3, 3.0])
def test_next_token_kl_equals_the_float64_kl(noise):
    # the closed loop's fast KL: the same numbers as next_token_metrics on a large vocabulary of
    # 30-nat logits, from tiny to large differences, with and without cached probabilities
    g = torch.Generator().manual_seed(11)
    ref = 8 * torch.randn(64, 50_000, generator=g)
    test = ref + noise * torch.randn(64, 50_000, generator=g)
    lr, lt = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    exact = (lr.exp() * (lr - lt)).sum(-1)
    for probs in (None, torch.softmax(ref, -1)):
        kl = next_token_kl(ref, test, probs)
        assert kl.dtype == torch.float64 and kl.shape == (64,)
        # atol 1e-8 nats: near-one-hot rows have KLs of 1e-7, where float32 sums differ by a few
        # 1e-9 from CPU to CPU (seen on AMX/AVX-512 Xeons)
        assert torch.allclose(kl, exact, rtol=1e-3, atol=1e-8), float((kl - exact).abs().max())
    assert float(next_token_kl(ref, test).mean()) == pytest.approx(next_token_metrics(ref, test)["kl_mean"], rel=1e-3)


def test_next_token_kl_wide_rows_and_bad_shapes():
    ref = torch.zeros(3, 5)
    test = ref.clone()
    test[1, 2] = 60.0  # expm1 would overflow float32: that row is computed in float64
    lr, lt = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    exact = (lr.exp() * (lr - lt)).sum(-1)
    kl = next_token_kl(ref, test)
    assert torch.isfinite(kl).all() and torch.allclose(kl, exact, rtol=1e-9, atol=1e-12)
    assert kl[0] == 0 and kl[2] == 0
    with pytest.raises(InputError):
        next_token_kl(torch.zeros(2, 3), torch.zeros(2, 4))


def test_next_token_identity_and_quantiles():
    g = torch.Generator().manual_seed(6)
    ref = torch.randn(200, 50, generator=g)
    m = next_token_metrics(ref, ref.clone(), torch.randint(0, 50, (200,), generator=g))
    assert m["kl_mean"] == 0 and m["kl_p99"] == 0 and m["delta_ppl"] == 0 and m["top1_agreement"] == 1
    test = ref + 0.3 * torch.randn(200, 50, generator=g)
    m = next_token_metrics(ref, test)
    lr, lt = torch.log_softmax(ref.double(), -1), torch.log_softmax(test.double(), -1)
    per = (lr.exp() * (lr - lt)).sum(-1).numpy()
    assert m["kl_mean"] == pytest.approx(per.mean(), rel=1e-12)
    assert m["kl_p99"] == pytest.approx(np.percentile(per, 99), rel=1e-9)
    assert m["top1_agreement"] == pytest.approx(float((ref.argmax(-1) == test.argmax(-1)).double().mean()))
    assert "ppl_ref" not in m


def test_rel_l2_and_summarize():
    assert float(rel_l2(torch.tensor([3.0, 4.0]), torch.tensor([0.0, 0.0]))) == 1.0
    assert float(rel_l2(torch.zeros(2), torch.zeros(2))) == 0.0
    assert summarize({"a": [1.0, float("nan"), 3.0]}) == {"a": 2.0}
