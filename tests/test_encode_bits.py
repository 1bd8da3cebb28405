"""Bit helpers: widths by the issue's convention and word-straddling bit ranges."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ccprofd.encode.bits import (
    ceil_log2,
    get_bits,
    int_to_words,
    set_bits,
    word_ops,
    words_for_bits,
    words_to_int,
)


def test_ceil_log2_convention() -> None:
    # one alternative needs no bits; 7 alternatives (Figure 3's cyclic edges) need 3
    assert [ceil_log2(k) for k in (1, 2, 3, 4, 5, 7, 8, 9)] == [0, 1, 2, 2, 3, 3, 3, 4]
    with pytest.raises(ValueError):
        ceil_log2(0)


def test_words_for_bits() -> None:
    assert [words_for_bits(b) for b in (0, 1, 64, 65, 148)] == [0, 1, 1, 2, 3]


def test_straddling_range_by_hand() -> None:
    words = [0, 0]
    set_bits(words, 62, 66, 0b1011)  # bits 62,63 <- 1,1 ; bits 64,65 <- 0,1
    assert words == [0b11 << 62, 0b10]
    assert get_bits(words, 62, 66) == 0b1011
    assert word_ops(62, 66, 0b1011) == [(0, 0b11 << 62, 0b11 << 62), (1, 0b11, 0b10)]
    set_bits(words, 62, 66, 0)
    assert words == [0, 0]


def test_refuses_values_that_do_not_fit() -> None:
    with pytest.raises(OverflowError):
        set_bits([0], 0, 2, 4)
    with pytest.raises(OverflowError):
        int_to_words(1 << 64, 1)
    with pytest.raises(IndexError):
        get_bits([0], 60, 65)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.data())
def test_set_get_round_trip_against_integer_model(nwords: int, data: st.DataObject) -> None:
    total = 64 * nwords
    lo = data.draw(st.integers(0, total))
    hi = data.draw(st.integers(lo, total))
    start = data.draw(st.integers(0, (1 << total) - 1))
    value = data.draw(st.integers(0, (1 << (hi - lo)) - 1))
    words = list(int_to_words(start, nwords))
    set_bits(words, lo, hi, value)
    range_mask = ((1 << (hi - lo)) - 1) << lo
    assert words_to_int(words) == (start & ~range_mask) | (value << lo)
    assert get_bits(words, lo, hi) == value
