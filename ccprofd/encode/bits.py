"""Bit arithmetic shared by the encoders, the decoders and (later) the BPF code generator.

``acycID`` is a fixed array of 64-bit words (little-endian: bit ``i`` lives in word ``i // 64`` at
position ``i % 64``), and a code's bit range ``[lo, hi)`` may straddle a word boundary, so every
set/get goes through these helpers instead of ad-hoc shifts.
"""

from __future__ import annotations

from collections.abc import Sequence

WORD_BITS = 64
WORD_MASK = (1 << WORD_BITS) - 1


def ceil_log2(k: int) -> int:
    """Bits needed to choose one of ``k`` alternatives: ``ceil(log2 k)``, 0 when ``k == 1``."""
    if k < 1:
        raise ValueError(f"ceil_log2 of {k}: need at least one alternative")
    return (k - 1).bit_length()


def words_for_bits(bits: int) -> int:
    """64-bit words needed to hold ``bits`` bits (0 for 0 bits)."""
    if bits < 0:
        raise ValueError(f"negative bit count {bits}")
    return (bits + WORD_BITS - 1) // WORD_BITS


def mask(width: int) -> int:
    return (1 << width) - 1


def words_to_int(words: Sequence[int]) -> int:
    """The words as one non-negative integer (word 0 is the least significant)."""
    if len(words) == 1:  # the common case (one acycID word), once per decoded context
        return words[0] & WORD_MASK
    value = 0
    for i, w in enumerate(words):
        value |= (w & WORD_MASK) << (i * WORD_BITS)
    return value


def int_to_words(value: int, nwords: int) -> tuple[int, ...]:
    """Split ``value`` into ``nwords`` words; refuses values that do not fit (never truncates)."""
    if value < 0:
        raise ValueError("negative value cannot be stored in words")
    if value >> (nwords * WORD_BITS):
        need = words_for_bits(value.bit_length())
        raise OverflowError(f"value needs {need} words, only {nwords} available")
    return tuple((value >> (i * WORD_BITS)) & WORD_MASK for i in range(nwords))


def get_bits(words: Sequence[int], lo: int, hi: int) -> int:
    """Bits ``[lo, hi)`` of the word array, as an integer whose bit 0 is bit ``lo``."""
    if not 0 <= lo <= hi <= len(words) * WORD_BITS:
        raise IndexError(f"bit range [{lo}, {hi}) outside {len(words)} words")
    value = 0
    pos = lo
    while pos < hi:
        wi, off = divmod(pos, WORD_BITS)
        take = min(WORD_BITS - off, hi - pos)
        value |= ((words[wi] >> off) & mask(take)) << (pos - lo)
        pos += take
    return value


def set_bits(words: list[int], lo: int, hi: int, value: int) -> None:
    """Overwrite bits ``[lo, hi)`` of ``words`` in place with ``value`` (which must fit)."""
    if not 0 <= lo <= hi <= len(words) * WORD_BITS:
        raise IndexError(f"bit range [{lo}, {hi}) outside {len(words)} words")
    if value < 0 or value >> (hi - lo):
        raise OverflowError(f"value {value:#x} does not fit in {hi - lo} bits")
    for wi, m, v in word_ops(lo, hi, value):
        words[wi] = (words[wi] & ~m & WORD_MASK) | v


def word_ops(lo: int, hi: int, value: int) -> list[tuple[int, int, int]]:
    """``(word index, mask, bits)`` triples that set ``[lo, hi)`` to ``value``: what BPF executes.

    Setting is ``w = (w & ~mask) | bits`` per triple; resetting is ``w &= ~mask``.
    """
    ops: list[tuple[int, int, int]] = []
    pos = lo
    while pos < hi:
        wi, off = divmod(pos, WORD_BITS)
        take = min(WORD_BITS - off, hi - pos)
        part = (value >> (pos - lo)) & mask(take)
        ops.append((wi, mask(take) << off, part << off))
        pos += take
    return ops
