"""kvc's attention estimate in C (csrc/attention.c ``kvn_softmax_mean``) against its numpy
reference (:func:`kvcodec.codecs.kvc.calibration.softmax_mean`), bit for bit, and the reference
against the true softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec import native
from kvcodec.codecs.kvc import calibration as C
from kvcodec.codecs.kvc.calibration import QueryStats, attention_estimate, exp_neg, softmax_mean

needs_cc = pytest.mark.skipif(native.build._compiler() is None, reason="no C compiler on this machine")


def _cpu_has_avx2() -> bool | None:
    """Whether this CPU has AVX2 (None where /proc/cpuinfo does not say)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else "avx2" in flags.split()


def _logits(rng, b, r, t, scale, masked=0.0, dead_rows=0):
    x = (rng.normal(size=(b, r, t)) * scale).astype(np.float32)
    if masked:
        x[rng.random(size=x.shape) < masked] = -np.inf
    if dead_rows:  # rows that see no key
        x[0, :dead_rows] = -np.inf
    return x


def test_exp_neg_within_two_ulp_of_exp():
    d = np.concatenate([np.linspace(-86.0, 0.0, 200001, dtype=np.float32),
                        -np.random.default_rng(0).exponential(4.0, 100000).astype(np.float32).clip(0, 86)])
    got = exp_neg(d).astype(np.float64)
    true = np.exp(d.astype(np.float64))
    ulp = np.spacing(true.astype(np.float32)).astype(np.float64)
    assert (np.abs(got - true) <= 2 * ulp).all()
    assert exp_neg(np.array([-86.5, -np.inf, -1e30], np.float32)).tolist() == [0.0, 0.0, 0.0]
    assert exp_neg(np.array([0.0, -0.0], np.float32)).tolist() == [1.0, 1.0]


def test_softmax_mean_reference_is_the_mean_softmax():
    rng = np.random.default_rng(1)
    x = _logits(rng, 3, 40, 301, 4.0, masked=0.2, dead_rows=3)
    got = softmax_mean(x)
    p = torch.softmax(torch.from_numpy(x).double(), dim=-1).nan_to_num(0.0)
    np.testing.assert_allclose(got, p.mean(dim=1).T.numpy(), rtol=2e-6, atol=1e-12)
    np.testing.assert_allclose(got.sum(axis=0)[1:], 1.0, rtol=1e-5)  # heads without dead rows
    assert abs(got[:, 0].sum() - 37 / 40) < 1e-5  # three of its rows see nothing: they add 0
    sinks = rng.normal(size=(3, 40)).astype(np.float32)
    got = softmax_mean(x, sinks)
    cat = torch.cat([torch.from_numpy(x).double(), torch.from_numpy(sinks).double()[..., None]], dim=-1)
    want = torch.softmax(cat, dim=-1)[..., :-1].mean(dim=1).T.numpy()
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-12)
    assert softmax_mean(np.array([[[0.0, np.nan]]], np.float32)) is None
    assert softmax_mean(np.array([[[0.0, np.inf]]], np.float32)) is None


@needs_cc
@pytest.mark.parametrize("seed", range(6))
def test_native_softmax_mean_equals_reference_bit_for_bit(seed):
    from kvcodec.native.attention import softmax_mean as native_softmax_mean

    rng = np.random.default_rng(seed)
    for b, r, t in ((1, 1, 1), (2, 7, 5), (2, 33, 8), (3, 17, 67), (2, 64, 1536), (1, 9, 1029)):
        for scale in (0.01, 3.0, 60.0):  # flat, peaked, and logits 86 below the max (e = 0)
            x = _logits(rng, b, r, t, scale, masked=0.3 * (seed % 2), dead_rows=min(r, 2) * (seed % 3 == 2))
            sinks = rng.normal(size=(b, r)).astype(np.float32) * scale if seed >= 3 else None
            want = softmax_mean(x, sinks)
            for kernel in (0, 1, 2):
                try:
                    got = native_softmax_mean(x, sinks, kernel=kernel)
                except native.Unsupported:
                    assert kernel == 2 and _cpu_has_avx2() is not True  # a CPU without AVX2
                    continue
                assert got.dtype == np.float64 and got.shape == (t, b)
                np.testing.assert_array_equal(got, want, err_msg=f"{(b, r, t, scale, kernel)}")


@needs_cc
def test_native_softmax_mean_leaves_nan_and_inf_to_the_caller():
    from kvcodec.native.attention import softmax_mean as native_softmax_mean

    x = np.zeros((1, 2, 9), np.float32)
    for bad in (np.nan, np.inf):
        y = x.copy()
        y[0, 1, 8] = bad
        with pytest.raises(native.Unsupported, match="NaN"):
            native_softmax_mean(y)
        with pytest.raises(native.Unsupported, match="NaN"):
            native_softmax_mean(x, np.array([[0.0, bad]], np.float32))
    with pytest.raises(native.Unsupported):
        native_softmax_mean(np.zeros((1, 0, 4), np.float32))
    with pytest.raises(ValueError, match="sinks"):
        native_softmax_mean(x, np.zeros((2, 1), np.float32))


def _stats(rng, layers=2, hq=4, n=6, d=8):
    return QueryStats([None] * layers, [rng.normal(size=(hq, n, d)).astype(np.float32) for _ in range(layers)],
                      q_position=20, rope_theta=1e4)


def test_attention_estimate_same_without_native_and_from_kept_queries(monkeypatch):
    """The C pass, its reference (no native library) and a second call (queries turned once and
    kept) give the same estimate; another delta turns them anew."""
    rng = np.random.default_rng(3)
    st = _stats(rng)
    k = rng.normal(size=(50, 2, 8)).astype(np.float32)
    first = attention_estimate(st, 1, k)
    assert (1, float(50 - 20)) in st.__dict__["_turned"]
    np.testing.assert_array_equal(attention_estimate(st, 1, k), first)
    far = attention_estimate(st, 1, k, query_pos=400)
    assert not np.array_equal(far, first)
    from kvcodec.native import attention as NA

    def unavailable(*a, **kw):
        raise native.Unsupported("no native library")

    monkeypatch.setattr(NA, "softmax_mean", unavailable)
    np.testing.assert_array_equal(attention_estimate(_stats(np.random.default_rng(3)), 1, k), first)
    # a NaN key: torch's softmax, as before (NaN estimates, not an error)
    k[3, 0, 0] = np.nan
    assert np.isnan(attention_estimate(st, 1, k)[:, 0]).all()


def test_turned_queries_kept_are_bounded():
    st = _stats(np.random.default_rng(4))
    la = st.layer_attention(0)
    for delta in range(C._TURNED_KEPT + 10):
        C._turned_queries(st, 0, float(delta), la)
    kept = st.__dict__["_turned"]
    assert len(kept) == C._TURNED_KEPT and (0, 0.0) not in kept and (0, float(C._TURNED_KEPT + 9)) in kept
    np.testing.assert_array_equal(kept[(0, 5.0 + 10)].numpy(),
                                  C.rotate_queries(st.q_sample[0], 15.0, 1e4).astype(np.float32))
