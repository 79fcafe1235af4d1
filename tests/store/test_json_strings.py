"""Messages escaped by polars for the lines of a messages file are byte for byte what the store's
SQL (`to_json`) writes, so a request's line is the same whichever path builds it."""

from __future__ import annotations

import duckdb
import polars as pl

from lowtide.store.lines import json_strings

TEXTS = [
    'He said "hi"\n\tthen left 🙂',
    "back\\slash and a/slash",
    "\x00\x01\x08\x0b\x0c\x0e\x1a\x1f\x7f controls",  # hex escapes: polars writes them lower case
    # each alone: short escapes (\b, \f, \r) both write alike, hex ones only DuckDB's way
    "a\x08b",
    "a\x0cb",
    "a\rb",
    "a\x1bb",
    "a\x7fb",
    "a\u0085b\ufeff",
    "the text \\u001f itself, not an escape",
    "\u2028\u2029 line separators, Zoë, €, 漢字",
    "",
    None,
]


def test_escaped_as_the_store_escapes() -> None:
    texts = pl.Series("user", TEXTS * 3, dtype=pl.String)
    with duckdb.connect() as con:
        ours = json_strings(con, texts)
        con.register("t", texts.to_frame())
        theirs = con.sql("SELECT to_json(user) AS j FROM t").pl()["j"]
    assert ours.name == "user"
    assert ours.to_list() == theirs.to_list()
    # a missing message stays missing: its line is refused, not sent with "null"
    assert ours[TEXTS.index(None)] is None
