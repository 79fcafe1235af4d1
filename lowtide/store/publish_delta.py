"""Bring a copy of the last published file up to the state file, writing only what changed.

Rebuilding the published file copied every table in full each night, so publishing cost grew
with the job's whole history. Instead, `publish` copies the previous file (a plain file copy)
and, per table, deletes the rows the state file no longer has and inserts the ones it gained,
both found by comparing a hash of every row on each side. A table whose columns changed, that
holds repeated rows (a hash then cannot say which copy went), or that changed in more than a
quarter of its rows is rewritten whole instead, which also compacts it; a patched file that ends
up more than a fifth free space is written afresh (`publish`). Views are dropped and made again
by `publish`, as for a fresh file.
"""

from __future__ import annotations

import duckdb

from lowtide.store._sql import ident

_REWRITE_ABOVE = 0.25
"""The share of a table's rows that changed above which it is rewritten rather than patched."""

FREE_AT_MOST = 0.2
"""The share of free space in a patched file above which it is written afresh instead: rows a
patch deletes, and row groups it rewrites, leave blocks behind that a copy carries forward."""

_ROW = ident("lowtide row")
"""The alias a row is hashed under: a column of the same name would shadow a plainer one."""


def _signature(con: duckdb.DuckDBPyConnection, database: str, table: str) -> list[tuple]:
    return con.execute(
        "SELECT column_name, data_type FROM duckdb_columns() WHERE database_name = ? "
        "AND schema_name = 'main' AND table_name = ? ORDER BY column_index",
        [database, table],
    ).fetchall()


def _rewrite(con: duckdb.DuckDBPyConnection, table: str) -> None:
    con.execute(f"DROP TABLE IF EXISTS pub.{ident(table)}")
    con.execute(f"CREATE TABLE pub.{ident(table)} AS SELECT * FROM {ident(table)}")


def _patch(con: duckdb.DuckDBPyConnection, table: str) -> bool:
    """Delete and insert the rows that differ; False when the table must be rewritten."""
    t = ident(table)
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE state_rows AS SELECT hash({_ROW}) AS h FROM {t} {_ROW}"
    )
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE pub_rows AS SELECT hash({_ROW}) AS h FROM pub.{t} {_ROW}"
    )
    counts = con.execute(
        "SELECT (SELECT count(*) - count(DISTINCT h) FROM state_rows), "
        "(SELECT count(*) - count(DISTINCT h) FROM pub_rows), (SELECT count(*) FROM state_rows)"
    ).fetchall()[0]
    if counts[0] or counts[1]:
        return False
    con.execute(
        "CREATE OR REPLACE TEMP TABLE gone AS SELECT h FROM pub_rows EXCEPT SELECT h FROM state_rows"
    )
    con.execute(
        "CREATE OR REPLACE TEMP TABLE added AS SELECT h FROM state_rows EXCEPT SELECT h FROM pub_rows"
    )
    changed = con.execute(
        "SELECT (SELECT count(*) FROM gone) + (SELECT count(*) FROM added)"
    ).fetchall()[0][0]
    if changed > _REWRITE_ABOVE * max(counts[2], 1):
        return False
    if changed:
        con.execute(f"DELETE FROM pub.{t} {_ROW} WHERE hash({_ROW}) IN (SELECT h FROM gone)")
        con.execute(
            f"INSERT INTO pub.{t} SELECT * FROM {t} {_ROW} "
            f"WHERE hash({_ROW}) IN (SELECT h FROM added)"
        )
    return True


def refresh_tables(con: duckdb.DuckDBPyConnection, tables: list[str]) -> None:
    """Make the attached `pub` hold exactly `tables` of the state file, as they are now, and
    no view (the caller makes them again)."""
    state = con.execute("SELECT current_database()").fetchall()[0][0]
    for (view,) in con.execute(
        "SELECT view_name FROM duckdb_views() WHERE database_name = 'pub' AND NOT internal"
    ).fetchall():
        con.execute(f"DROP VIEW pub.{ident(view)}")
    for (table,) in con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = 'pub'"
    ).fetchall():
        if table not in tables:
            con.execute(f"DROP TABLE pub.{ident(table)}")
    try:
        for table in tables:
            same = _signature(con, state, table) == _signature(con, "pub", table)
            if not (same and _patch(con, table)):
                _rewrite(con, table)
    finally:
        for temp in ("state_rows", "pub_rows", "gone", "added"):
            con.execute(f"DROP TABLE IF EXISTS temp.{temp}")
