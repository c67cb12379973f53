"""Fixed-width bit packing of integer codes (1 to 16 bits each).

Layout: the codes are flattened in C order and written as one continuous **LSB-first** bit
stream: bit ``j`` of code ``i`` is bit ``i*bits + j`` of the stream, and stream bit ``k`` is bit
``k % 8`` (value ``1 << (k % 8)``) of byte ``k // 8``. The last byte is padded with zero bits, so
``n`` codes take exactly ``ceil(n * bits / 8)`` bytes. For ``bits`` in {1, 2, 4, 8} no code
straddles a byte (for 4 bits: element ``2i`` in the low nibble, like NVFP4); for other widths
codes straddle byte boundaries.

Example:
    >>> import numpy as np
    >>> packed = pack_bits(np.array([1, 2, 3, 0, 5]), 3)
    >>> packed.tolist(), unpack_bits(packed, 3, 5).tolist()
    ([209, 80], [1, 2, 3, 0, 5])
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError, FormatError, InputError


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes taken by ``count`` codes of ``bits`` bits: ``ceil(count * bits / 8)``."""
    return (count * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or isinstance(bits, bool) or not 1 <= bits <= 16:
        raise ConfigError(f"bit width must be an integer in 1..16, got {bits!r}")


def pack_bits(codes: np.ndarray | torch.Tensor, bits: int) -> np.ndarray:
    """Pack non-negative integer codes into a ``uint8`` array (see the module layout).

    Args:
        codes: integer codes of any shape, each in ``[0, 2**bits)``.
        bits: width of each code, 1..16.

    Returns:
        1-D ``uint8`` numpy array of ``ceil(codes.size * bits / 8)`` bytes.

    Raises:
        InputError: a code is negative or does not fit in ``bits`` bits, or codes are not integers.
        ConfigError: ``bits`` is out of range.
    """
    _check_bits(bits)
    a = codes.detach().cpu().numpy() if isinstance(codes, torch.Tensor) else np.asarray(codes)
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise InputError(f"pack_bits needs integer codes, got dtype {a.dtype}")
    a = a.reshape(-1).astype(np.int64, copy=False)
    if a.size and (a.min() < 0 or a.max() >= (1 << bits)):
        raise InputError(f"codes must lie in [0, {1 << bits}) for {bits}-bit packing")
    if bits == 8:
        return a.astype(np.uint8)
    if 8 % bits == 0:
        # 1, 2, 4 bits: whole codes per byte, code j of a byte at bits j*bits.. (same layout)
        per = 8 // bits
        a = np.pad(a.astype(np.uint8), (0, (-a.size) % per)).reshape(-1, per)
        out = a[:, 0].copy()
        for j in range(1, per):
            out |= a[:, j] << np.uint8(j * bits)
        return out
    # bit matrix [n, bits], LSB first, then numpy packs 8 stream bits per byte, LSB first
    bitmat = ((a[:, None] >> np.arange(bits)) & 1).astype(np.uint8)
    return np.packbits(bitmat.reshape(-1), bitorder="little")


def unpack_bits(packed: np.ndarray | torch.Tensor | bytes, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: read ``count`` codes of ``bits`` bits.

    Returns:
        1-D numpy array of ``count`` codes: ``uint8`` when ``bits <= 8``, else ``int32``.

    Raises:
        FormatError: ``packed`` does not hold exactly ``ceil(count * bits / 8)`` bytes, or its
            padding bits are not zero.
    """
    _check_bits(bits)
    if isinstance(packed, torch.Tensor):
        buf = packed.detach().cpu().numpy()
    elif isinstance(packed, (bytes, bytearray, memoryview)):
        buf = np.frombuffer(bytes(packed), dtype=np.uint8)
    else:
        buf = np.asarray(packed)
    if buf.dtype != np.uint8:
        raise FormatError(f"packed codes must be uint8, got {buf.dtype}")
    buf = buf.reshape(-1)
    if count < 0 or buf.size != packed_nbytes(count, bits):
        raise FormatError(
            f"packed plane holds {buf.size} bytes; {count} codes of {bits} bits need "
            f"{packed_nbytes(count, bits) if count >= 0 else '?'}"
        )
    out_dtype = np.uint8 if bits <= 8 else np.int32
    if bits == 8:
        return buf.copy()
    if 8 % bits == 0:
        per = 8 // bits
        shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
        codes = ((buf[:, None] >> shifts) & np.uint8((1 << bits) - 1)).reshape(-1)
        if codes[count:].any():
            raise FormatError("non-zero padding bits after the last packed code")
        return codes[:count].copy()
    allbits = np.unpackbits(buf, bitorder="little")
    if allbits[count * bits:].any():
        raise FormatError("non-zero padding bits after the last packed code")
    bitmat = allbits[: count * bits].reshape(count, bits).astype(np.int32)
    return (bitmat << np.arange(bits, dtype=np.int32)).sum(axis=1).astype(out_dtype)


def pack_bits_loop(codes: list[int], bits: int) -> bytes:
    """Plain-Python pack_bits (one bit at a time): the executable definition tests compare to."""
    out = bytearray(packed_nbytes(len(codes), bits))
    k = 0
    for c in codes:
        for j in range(bits):
            if (c >> j) & 1:
                out[k // 8] |= 1 << (k % 8)
            k += 1
    return bytes(out)


__all__ = ["pack_bits", "pack_bits_loop", "packed_nbytes", "unpack_bits"]
