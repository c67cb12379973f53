"""Anchor-based delta coding across tokens (CacheGen section 5.1): definition and exact inverse."""

import doctest

import pytest
import torch

import kvcodec.quant.delta as deltamod
from kvcodec.errors import ConfigError, InputError
from kvcodec.quant import delta_decode, delta_encode
from kvcodec.quant.delta import anchor_index


def test_doctests():
    assert doctest.testmod(deltamod).failed == 0


@pytest.mark.parametrize("t", [0, 1, 2, 9, 10, 11, 37, 100])
@pytest.mark.parametrize("n", [1, 3, 10])
def test_roundtrip_random_codes(t, n):
    g = torch.Generator().manual_seed(t * 100 + n)
    codes = torch.randint(0, 256, (t, 3, 5), generator=g, dtype=torch.int64).to(torch.uint8)
    d = delta_encode(codes, n)
    assert d.dtype == torch.int32 and d.shape == codes.shape
    assert torch.equal(delta_decode(d, n), codes.to(torch.int64))


def test_definition_differences_from_the_group_anchor():
    c = torch.tensor([[10], [12], [9], [20], [25], [18], [7]])
    d = delta_encode(c, 3).flatten().tolist()
    # anchors at t = 0, 3, 6; others minus their group's anchor (not the previous token)
    assert d == [10, 2, -1, 20, 5, -2, 7]
    assert anchor_index(7, 3).tolist() == [0, 0, 0, 3, 3, 3, 6]


def test_anchor_every_one_is_identity_and_large_n_single_anchor():
    c = torch.randint(-50, 50, (17, 2), generator=torch.Generator().manual_seed(0))
    assert torch.equal(delta_encode(c, 1).long(), c)
    d = delta_encode(c, 1000)
    assert torch.equal(d[0].long(), c[0]) and torch.equal(d[1:].long(), c[1:] - c[0])


def test_signed_and_wide_codes():
    c = torch.tensor([-(2**30), 2**30, 0], dtype=torch.int64)
    with pytest.raises(InputError, match="int32"):
        delta_encode(c, 3)  # 2^30 - (-2^30) = 2^31 does not fit
    c = torch.tensor([-5, 7, -3], dtype=torch.int16)
    assert torch.equal(delta_decode(delta_encode(c, 2), 2), c.long())


def test_bad_input():
    with pytest.raises(InputError, match="integer"):
        delta_encode(torch.zeros(3), 2)
    with pytest.raises(InputError, match="token axis"):
        delta_encode(torch.tensor(3), 2)
    for n in (0, -1, 2.0, True):
        with pytest.raises(ConfigError):
            delta_encode(torch.zeros(3, dtype=torch.int32), n)
    with pytest.raises(InputError):
        delta_decode(torch.zeros(3), 2)
