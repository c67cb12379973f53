"""Fixed-width LSB-first bit packing: layout against a bit-by-bit loop, round trips, bad input."""

import doctest

import numpy as np
import pytest
import torch

import kvcodec.quant.packing as packmod
from kvcodec.errors import ConfigError, FormatError, InputError
from kvcodec.quant import pack_bits, packed_nbytes, unpack_bits
from kvcodec.quant.packing import pack_bits_loop


def test_doctests():
    assert doctest.testmod(packmod).failed == 0


@pytest.mark.parametrize("bits", range(1, 17))
def test_matches_bit_by_bit_definition_and_roundtrips(bits):
    rng = np.random.default_rng(bits)
    for n in (0, 1, 2, 7, 8, 9, 31, 257):
        codes = rng.integers(0, 1 << bits, size=n)
        packed = pack_bits(codes, bits)
        assert packed.dtype == np.uint8 and packed.size == packed_nbytes(n, bits) == (n * bits + 7) // 8
        assert packed.tobytes() == pack_bits_loop(codes.tolist(), bits), (bits, n)
        out = unpack_bits(packed, bits, n)
        assert out.dtype == (np.uint8 if bits <= 8 else np.int32)
        assert out.tolist() == codes.tolist()


def test_known_layouts():
    # 4 bits: element 2i in the low nibble (same order as NVFP4)
    assert pack_bits(np.array([0x1, 0xF, 0x7]), 4).tolist() == [0xF1, 0x07]
    # 2 bits: element i at bits 2i..2i+1
    assert pack_bits(np.array([1, 2, 3, 0]), 2).tolist() == [0b00111001]
    # 1 bit: element i is bit i (LSB first)
    assert pack_bits(np.array([1, 0, 0, 0, 0, 0, 0, 0, 1]), 1).tolist() == [1, 1]
    # 3 bits straddle bytes: code 7 at elements 2 -> stream bits 6..8
    assert pack_bits(np.array([0, 0, 7]), 3).tolist() == [0b11000000, 0b1]


def test_accepts_torch_and_any_shape():
    x = torch.randint(0, 8, (3, 4, 5), dtype=torch.uint8)
    packed = pack_bits(x, 3)
    assert torch.equal(torch.from_numpy(unpack_bits(packed, 3, 60)).reshape(3, 4, 5), x)
    assert unpack_bits(torch.from_numpy(packed), 3, 60).tolist() == x.flatten().tolist()
    assert unpack_bits(packed.tobytes(), 3, 60).tolist() == x.flatten().tolist()


def test_bad_input():
    with pytest.raises(InputError, match=r"\[0, 4\)"):
        pack_bits(np.array([4]), 2)
    with pytest.raises(InputError):
        pack_bits(np.array([-1]), 2)
    with pytest.raises(InputError, match="integer"):
        pack_bits(np.array([0.5]), 2)
    for bits in (0, 17, 2.0):
        with pytest.raises(ConfigError):
            pack_bits(np.array([0]), bits)
    with pytest.raises(FormatError, match="need"):
        unpack_bits(np.zeros(2, np.uint8), 3, 10)  # needs 4 bytes
    with pytest.raises(FormatError, match="padding"):
        unpack_bits(np.array([0xFF], np.uint8), 3, 2)  # bits 6, 7 are padding
    with pytest.raises(FormatError, match="uint8"):
        unpack_bits(np.zeros(2, np.int16), 4, 1)
