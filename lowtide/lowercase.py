"""Lowercase a column of texts exactly as polars does (Rust's `str::to_lowercase`), faster.

Keying folds the case of every message. polars lowercases each text into a string of its own:
~0.5 s of CPU per 200,000 real texts here. Arrow's `utf8_lower` does the same in ~0.15 s. The two
differ on a few characters only: Rust lowercases a capital sigma that ends a word to ς and İ to
two characters, and the two libraries' Unicode tables are of different versions (22 code points
with polars 2.1 and pyarrow 26). Which characters differ is found once per process, by
lowercasing every code point after a letter with both (~0.2 s); a text holding any of them is
lowercased by polars. So the result is byte for byte polars' own, whichever versions are
installed, and a request's key never changes with this shortcut.
"""

from __future__ import annotations

import sys
from array import array
from functools import cache
from itertools import chain

import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

FAST_FROM_ROWS = 10_000
"""Columns shorter than this are lowercased by polars alone: finding the characters the two
libraries disagree on costs more than Arrow saves on them."""


@cache
def disagreeing_starts() -> tuple[bytes, ...]:
    """UTF-8 byte strings that start every character Arrow lowercases otherwise than polars
    (for a character of three or four bytes, all but its last byte: a few more texts go the
    slow way, and a few searches find them all)."""
    # every code point but the surrogates and "\n", each after an "a" (where a final sigma
    # shows) and before a "\n", in one string that each library lowercases once
    codes = array("I", chain(range(0x0B, 0xD800), range(0xE000, 0x110000)))
    probe = array("I", [ord("a"), 0, ord("\n")]) * len(codes)
    probe[1::3] = codes
    text = probe.tobytes().decode(f"utf-32-{'le' if sys.byteorder == 'little' else 'be'}")
    ours = pl.Series([text]).str.to_lowercase()
    theirs = pl.Series(pc.utf8_lower(pa.array([text], pa.large_string())))
    lines = [s.str.split("\n").explode().head(len(codes)) for s in (ours, theirs)]
    starts = set()
    for i in (lines[0] != lines[1]).arg_true().to_list():
        encoded = chr(codes[i]).encode()
        starts.add(encoded if len(encoded) <= 2 else encoded[:-1])
    return tuple(sorted(starts))


def lowercase(texts: pl.Series) -> pl.Series:
    """`texts.str.to_lowercase()`, the same strings (nulls stay null), through Arrow where
    that gives the same."""
    if texts.len() < FAST_FROM_ROWS:
        return texts.str.to_lowercase()
    fast = pl.Series(
        texts.name, pc.utf8_lower(texts.to_arrow(compat_level=pl.CompatLevel.oldest()))
    )
    starts = disagreeing_starts()
    if not starts:
        return fast
    raw = texts.cast(pl.Binary)
    unsure = pl.select(pl.any_horizontal([pl.lit(raw).bin.contains(s) for s in starts]))
    unsure_rows = unsure.to_series().fill_null(False)
    if not unsure_rows.any():
        return fast
    return pl.select(
        pl.when(unsure_rows).then(texts.str.to_lowercase()).otherwise(fast).alias(texts.name)
    ).to_series()
