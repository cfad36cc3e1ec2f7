"""CRC-32 arithmetic: the CRC of concatenated bytes from the CRCs of their parts.

A torch.save zip stores each member's CRC-32. When an output member is made of source pieces
whose CRCs were just verified, combining those CRCs (O(log length) each) replaces a second pass
over every output byte. Same polynomial and bit order as :func:`zlib.crc32`.
"""

from __future__ import annotations

__all__ = ["combine"]

_POLY = 0xEDB88320  # x^32 + x^26 + … + 1, bit-reflected as zlib stores it
_ONE = 1 << 31  # the polynomial 1 (x^0) in the reflected representation


def _multiply(a: int, b: int) -> int:
    """``a · b`` modulo the CRC polynomial, both reflected 32-bit polynomials."""
    product = 0
    bit = _ONE
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        bit >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


def _powers_of_two() -> list[int]:
    """``x^(2^k)`` for k in 0..63: squaring the previous one."""
    powers = [_ONE >> 1]  # x^1
    for _ in range(63):
        powers.append(_multiply(powers[-1], powers[-1]))
    return powers


_X_POW_2K = _powers_of_two()


def _x_to_the_bits(nbytes: int) -> int:
    """``x^(8·nbytes)`` modulo the polynomial: the shift appending ``nbytes`` zero bytes makes."""
    result, k = _ONE, 3  # 8·n = n·2^3
    while nbytes:
        if nbytes & 1:
            result = _multiply(_X_POW_2K[k], result)
        nbytes >>= 1
        k += 1
    return result


def combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """The CRC-32 of ``a + b`` given ``crc32(a)``, ``crc32(b)`` and ``len(b)``."""
    if length_b < 0:
        raise ValueError(f"length_b must be >= 0, not {length_b}")
    return _multiply(_x_to_the_bits(length_b), crc_a) ^ crc_b
