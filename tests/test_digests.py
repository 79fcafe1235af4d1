"""The digests behind request keys, text identities and the QA sample are the standard ones: a
key stored by an earlier version of lowtide (computed in DuckDB) is the key computed today."""

from __future__ import annotations

import hashlib

import duckdb
import polars as pl

from lowtide.digests import md5_fraction, md5_hex, sha256_hex, text_key

TEXTS = ["", "a", "héllo wörld ✓", "tab\there\nnewline", "x" * 200_000, "\x1f fingerprint"]


def test_sha256_and_md5_are_hashlibs_over_utf8_and_null_stays_null() -> None:
    values = pl.Series("material", [*TEXTS, None], dtype=pl.String)
    keys, ids = sha256_hex(values), md5_hex(values)
    assert keys.name == "material" and ids.name == "text_md5"
    assert keys.to_list() == [hashlib.sha256(t.encode()).hexdigest() for t in TEXTS] + [None]
    assert ids.to_list() == [hashlib.md5(t.encode()).hexdigest() for t in TEXTS] + [None]


def test_the_qa_fraction_is_the_one_duckdb_gave_before() -> None:
    """md5(seed:value)'s first 32 bits over 2^32, as the SQL lowtide ran before computed it: a
    rerun samples the same rows for QA."""
    values = pl.Series("unit_id", ["r1", "r2:c0", "ü", ""])
    expected = [
        row[0]
        for row in duckdb.sql(
            "SELECT ('0x' || substr(md5('42:' || v), 1, 8))::BIGINT / 4294967296.0 "
            "FROM (SELECT unnest($vs) AS v, generate_subscripts($vs, 1) AS i) ORDER BY i",
            params={"vs": values.to_list()},
        ).fetchall()
    ]
    got = md5_fraction(values, 42)
    assert got.to_list() == expected
    assert got.dtype == pl.Float64 and all(0 <= f < 1 for f in got)


def test_a_text_key_is_the_standard_xxh3_128_of_its_utf8() -> None:
    # values from the reference xxHash library (xxh3_128_intdigest, seed 0): a key remembered
    # under one version of polars-hash is found under the next
    keys = text_key(pl.Series(["abc", "é", None]))
    assert keys.name == "text_key"
    assert keys.to_list() == [
        "xxh3:8891052093862885505146213044715469136",
        "xxh3:191670584815468735495791302810358844595",
        None,
    ]
