"""Bring a copy of the last published file up to the state file, writing only what changed.

A publish first tries a plain copy of the state file itself (`state_copy`); this is the way
when that copy cannot be taken (the state file changed while it was copied) or would be more
than a fifth free space.

Rebuilding the published file copied every table in full each night, so publishing cost grew
with the job's whole history. Instead, `publish` copies the previous file (a plain file copy)
and, per table, deletes the rows the state file no longer has and inserts the ones it gained,
both found by comparing a hash of every row on each side. A table whose columns changed, that
holds repeated rows (a hash then cannot say which copy went), or that changed in more than a
quarter of its rows is rewritten whole instead, which also compacts it; a patched file that ends
up more than a fifth free space is written afresh (`publish`). Views are dropped and made again
by `publish`, as for a fresh file.

A table whose rows are only ever added or removed, never changed in place (`added_to_only`: a
run's units, the requests, the input rows), has its rows compared by the columns that tell them
apart (a request's custom_id, derived from its content; an input row's key, a hash of its
values) instead of by hashing whole rows, texts and all: that hashing was most of a publish,
and grew with the job's history. Only while both files are at the same schema version: a
migration may rewrite rows in place.
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


def _patch_by_key(con: duckdb.DuckDBPyConnection, table: str, key: tuple[str, ...]) -> bool:
    """Delete the rows whose key (no columns named: the whole row) the state file no longer has
    and insert those it gained; False when the table must be rewritten (a key repeated on either
    side, or more than a quarter of the rows gone: deleting them would leave the file mostly
    holes). Rows added, however many, are appended: they leave no holes."""
    t = ident(table)
    whole_row = not key
    key = key or tuple(name for name, _ in _signature(con, "pub", table))
    columns = ", ".join(ident(c) for c in key)
    for side in (t, f"pub.{t}"):
        if con.execute(
            f"SELECT count(*) > 0 FROM (SELECT {columns} FROM {side} GROUP BY ALL "
            "HAVING count(*) > 1)"
        ).fetchall()[0][0]:
            return False
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE gone AS SELECT {columns} FROM pub.{t} "
        f"EXCEPT SELECT {columns} FROM {t}"
    )
    gone, had = con.execute(
        f"SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM pub.{t})"
    ).fetchall()[0]
    if gone > _REWRITE_ABOVE * max(had, 1):
        return False
    matched = " AND ".join(f"x.{ident(c)} IS NOT DISTINCT FROM g.{ident(c)}" for c in key)
    if gone:
        con.execute(f"DELETE FROM pub.{t} x USING gone g WHERE {matched}")
    if whole_row:
        con.execute(f"INSERT INTO pub.{t} SELECT * FROM {t} EXCEPT SELECT * FROM pub.{t}")
        return True
    # the new keys first, then their rows: an anti join would read every row's texts
    con.execute(
        f"CREATE OR REPLACE TEMP TABLE added AS SELECT {columns} FROM {t} "
        f"EXCEPT SELECT {columns} FROM pub.{t}"
    )
    con.execute(f"INSERT INTO pub.{t} SELECT x.* FROM {t} x SEMI JOIN added g ON {matched}")
    return True


def _version(con: duckdb.DuckDBPyConnection, database: str) -> object:
    """The schema version a state file (or the published copy of one) was migrated to."""
    try:
        return con.execute(f"SELECT max(version) FROM {database}.schema_version").fetchall()[0][0]
    except duckdb.Error:  # no such table: not a state file's copy
        return None


def refresh_tables(
    con: duckdb.DuckDBPyConnection,
    tables: list[str],
    added_to_only: dict[str, tuple[str, ...]] | None = None,
) -> None:
    """Make the attached `pub` hold exactly `tables` of the state file, as they are now, and
    no view (the caller makes them again). `added_to_only`: the tables whose rows are only ever
    added or removed, each with the columns that tell its rows apart (none: all of them)."""
    state = con.execute("SELECT current_database()").fetchall()[0][0]
    version = _version(con, ident(state))
    if version is None or version != _version(con, "pub"):
        added_to_only = None
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
            key = (added_to_only or {}).get(table)
            if key is not None:
                patched = same and _patch_by_key(con, table, key)
            else:
                patched = same and _patch(con, table)
            if not patched:
                _rewrite(con, table)
    finally:
        for temp in ("state_rows", "pub_rows", "gone", "added"):
            con.execute(f"DROP TABLE IF EXISTS temp.{temp}")
