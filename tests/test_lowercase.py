"""Lowercasing through Arrow gives polars' own strings, character for character."""

from __future__ import annotations

import polars as pl
import pytest
from pyarrow import compute as pc

from lowtide import lowercase as lc

TRICKY = [
    "ΟΔΥΣΣΕΥΣ",  # capital sigmas, the last one ending the word (ς in Rust)
    "ΑΣ ΣΑ Σ",
    "İstanbul İİ",  # one character becomes two in Rust
    "Refund  PLEASE",
    "ünï 数据 ÅNGSTRÖM",
    "",
    None,
    "\ua7dd\ua7e2\uab6c\uab6d \U0001df40\U0001df7e",
    "ǅ ǈ ǋ Ϊ ẞ",
]


def _every_code_point(prefix: str) -> pl.Series:
    return pl.Series(
        [prefix + chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF], dtype=pl.String
    )


@pytest.mark.parametrize("prefix", ["", "a", "ΑΒ"])
def test_every_code_point_lowercases_as_polars_does(prefix: str) -> None:
    texts = _every_code_point(prefix)
    assert texts.len() >= lc.FAST_FROM_ROWS  # the Arrow way
    assert lc.lowercase(texts).equals(texts.str.to_lowercase())


def test_tricky_texts_in_a_long_column_lowercase_as_polars_does() -> None:
    texts = pl.Series("user", TRICKY * (lc.FAST_FROM_ROWS // len(TRICKY) + 1), dtype=pl.String)
    lowered = lc.lowercase(texts)
    assert lowered.name == "user"
    assert lowered.equals(texts.str.to_lowercase())
    assert lowered[0] == "οδυσσευς"


def test_every_disagreeing_character_is_found_by_its_first_bytes() -> None:
    """Found independently: each code point alone and after a letter, one text each."""
    starts = lc.disagreeing_starts()
    for prefix in ("", "a"):
        texts = _every_code_point(prefix)
        arrow = pl.Series(pc.utf8_lower(texts.to_arrow(compat_level=pl.CompatLevel.oldest())))
        for text in texts.filter(arrow != texts.str.to_lowercase()).to_list():
            assert any(s in text.encode() for s in starts), ascii(text)
