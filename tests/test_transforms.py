"""Transforms and the dead-zone quantizer: reference properties (fast, no model)."""

import numpy as np
import pytest

from kvcodec.errors import InputError
from kvcodec.quant.deadzone import (
    STEP_CODE_MAX,
    STEP_CODE_MIN,
    STEP_MANTISSA,
    deadzone_dequantize,
    deadzone_quantize,
    step_code,
    step_from_code,
)
from kvcodec.transforms import (
    channel_means,
    coding_gain_db,
    fwht,
    head_pca,
    head_rms,
    is_power_of_two,
    rate_for_distortion,
    reverse_waterfill,
    token_rms,
    waterlevel_for_rate,
    weighted_steps,
)


def _sylvester(d):
    h = np.array([[1.0]])
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(d)


# ---------------------------------------------------------------- dead-zone quantizer
def test_step_codes_are_exact_powers_and_round_trip():
    c = np.arange(STEP_CODE_MIN, STEP_CODE_MAX + 1)
    s = step_from_code(c)
    assert s.dtype == np.float32 and np.all(s > 0) and np.all(np.isfinite(s))
    # every 8 codes the step doubles exactly (ldexp), mantissas are the float32 of 2**(i/8)
    assert np.array_equal(s[8:], 2 * s[:-8])
    assert step_from_code(np.array([0, 8, -8, 3]))[[0, 1, 2]].tolist() == [1.0, 2.0, 0.5]
    assert step_from_code(np.array([3]))[0] == STEP_MANTISSA[3] == np.float32(2 ** (3 / 8))
    assert np.array_equal(step_code(s), c)
    # nearest code is within half a code (1/16 octave) of any step
    x = np.exp(np.random.default_rng(0).uniform(-20, 20, 1000))
    ratio = step_from_code(step_code(x)) / x
    assert np.all(np.abs(np.log2(ratio)) <= 1 / 16 + 1e-9)
    assert step_code(np.array([0.0, -1.0, 1e300])).tolist() == [STEP_CODE_MIN, STEP_CODE_MIN, STEP_CODE_MAX]
    with pytest.raises(InputError, match="log-step code outside"):
        step_from_code(np.array([STEP_CODE_MAX + 1]))


def test_deadzone_error_bounds_and_dead_zone():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 7)) * rng.uniform(0.1, 10, size=7)
    step = step_from_code(step_code(rng.uniform(0.05, 2, size=7)))
    q = deadzone_quantize(x, step, 0.5)
    err = np.abs(deadzone_dequantize(q, step) - x)
    assert np.all(err <= step / 2 * (1 + 1e-6))
    # rho < 1/2: zero bin |x| < (1 - rho) step, error below (1 - rho) step, codes never larger
    q3 = deadzone_quantize(x, step, 0.3)
    assert np.all((q3 == 0) == (np.abs(x) < 0.7 * step))
    assert np.all(np.abs(deadzone_dequantize(q3, step) - x) <= 0.7 * step * (1 + 1e-6))
    assert np.all(np.abs(q3) <= np.abs(q)) and (q3 == 0).sum() > (q == 0).sum()
    assert np.array_equal(deadzone_quantize(-x, step, 0.3), -q3)  # symmetric
    for bad in (0.0, 0.6, -0.1):
        with pytest.raises(InputError, match="rho"):
            deadzone_quantize(x, step, bad)


# ---------------------------------------------------------------- Hadamard
@pytest.mark.parametrize("d", [1, 2, 8, 64, 128, 256])
def test_fwht_matches_matrix_and_is_orthonormal(d):
    x = np.random.default_rng(d).normal(size=(5, 3, d)).astype(np.float32)
    y = fwht(x)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, x @ _sylvester(d).T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-5)
    np.testing.assert_allclose(fwht(y), x, atol=1e-5)
    assert np.array_equal(fwht(x), fwht(x))  # deterministic


@pytest.mark.parametrize("d", [0, 3, 24, 40, 17])
def test_fwht_rejects_other_widths(d):
    assert not is_power_of_two(d)
    with pytest.raises(InputError, match="power-of-two"):
        fwht(np.zeros((2, d), np.float32))


# ---------------------------------------------------------------- centring, PCA, allocation
def test_centring_statistics():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(300, 2, 5)) + np.array([100.0, -3.0, 0.0, 7.5, 1e6])
    m = channel_means(x)
    assert m.shape == (2, 5)
    assert np.array_equal(m, m.astype(np.float16).astype(np.float64))  # stored exactly as fp16
    assert m[0, 4] == 65504.0  # clamped into the float16 range
    np.testing.assert_allclose(m[:, :4], x.mean(0)[:, :4], atol=0.07)
    z = x[:, :, :4] - m[:, :4]
    np.testing.assert_allclose(head_rms(z), 1.0, atol=0.1)
    assert token_rms(z).shape == (300, 2)
    assert channel_means(np.zeros((0, 2, 3))).shape == (2, 3)
    assert head_rms(np.zeros((0, 2, 3))).tolist() == [0.0, 0.0]
    # float32 accumulation (kvc's for float16 caches): float64 results within 1e-5 relative
    z32 = (rng.laplace(size=(2000, 3, 64)) * 300).astype(np.float32)
    for f in (head_rms, token_rms):
        a, b = f(z32), f(z32, np.float32)
        assert a.dtype == b.dtype == np.float64
        np.testing.assert_allclose(b, a, rtol=1e-5)


def test_pca_basis_and_coding_gain():
    rng = np.random.default_rng(3)
    mix = rng.normal(size=(6, 6))
    z = rng.normal(size=(4000, 2, 6)) @ mix
    basis, var = head_pca(z)
    for h in range(2):
        np.testing.assert_allclose(basis[h].T @ basis[h], np.eye(6), atol=1e-10)
        assert np.all(np.diff(var[h]) <= 1e-12)
        np.testing.assert_allclose((z[:, h] @ basis[h]).var(0), var[h], rtol=0.05)
    assert coding_gain_db(z) > 1.0
    indep = rng.normal(size=(4000, 2, 6)) * np.arange(1, 7)
    assert abs(coding_gain_db(indep)) < 0.2


def test_reverse_waterfilling():
    var = np.array([16.0, 4.0, 1.0, 0.1, 0.0])
    rates, dist = reverse_waterfill(var, 1.0)
    assert rates.tolist() == [2.0, 1.0, 0.0, 0.0, 0.0]
    assert dist.tolist() == [1.0, 1.0, 1.0, 0.1, 0.0]
    for r in (0.1, 0.6, 2.5):
        lvl = waterlevel_for_rate(var, r)
        assert rate_for_distortion(var, lvl) == pytest.approx(r, abs=1e-6)
    with pytest.raises(InputError):
        reverse_waterfill(var, 0.0)
    w = np.array([1.0, 4.0, 0.0, 3.0])
    s = weighted_steps(2.0, w)
    # equal weighted distortion w * step^2 on positive weights; zero weight gets the largest step
    wd = (w * s**2)[w > 0]
    np.testing.assert_allclose(wd, wd[0])
    assert s[2] == s[w > 0].max()
