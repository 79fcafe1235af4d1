"""Work on a big frame a slice of rows at a time, so the copies a step makes only to measure,
hash or cut its texts are held for one slice, never for a million rows at once."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import polars as pl

Part = TypeVar("Part", pl.DataFrame, pl.Series)


def by_slices(frame: pl.DataFrame, rows: int, make: Callable[[pl.DataFrame], Part]) -> Part:
    """`make` applied to each slice of `rows` rows of `frame`, the parts concatenated in order
    (`make(frame)` itself when it fits one slice, an empty frame included)."""
    if frame.height <= rows:
        return make(frame)
    return pl.concat([make(part) for part in frame.iter_slices(rows)])
