"""A job's input rows, stored once however many runs read them.

`src_<view>-rows` holds each distinct input row (its `source_id` and values) once, under
`lowtide_row_key`, a hash of its values and column names. `run_sources` says which of those
rows each run read. The view `src_<view>` joins the two back into one row per run and input
row: what the job view, QA and exports read, and what analysts query. A night that changed 1%
of its input adds the membership of every row (three short columns) and the content of the 1%
only; before, each run stored a full copy of its input.

The hyphen in `src_<view>-rows` is a character no view name can hold (job names become view
names with `-` turned into `_`), so no job's tables can collide with another's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path

import duckdb
import polars as pl

from lowtide.crashpoints import crash_point
from lowtide.interrupts import kept_through_duckdb
from lowtide.slices import as_arrow, file_slices
from lowtide.store._db import INSERT_SLICE_ROWS, Database
from lowtide.store._sql import ident, literal

MEMBERS = "run_sources"


def source_table(view: str) -> str:
    """The view of the input rows each run read: (run_id, source_id, the input's columns)."""
    return f"src_{view}"


def content_table(view: str) -> str:
    """The table holding each distinct input row of the job once."""
    return f"src_{view}-rows"


KEY_COLUMN = "lowtide_row_key"
"""The content tables' column holding each row's key (`row_key_sql`)."""


def row_key_sql(columns: Iterable[str]) -> str:
    """A row's key: DuckDB's hash of its values and column names, in sorted column order (so an
    input whose columns move keeps its keys). Keys are compared together with `source_id`, so
    only two versions of one row could ever collide."""
    names = sorted(columns)
    values = ", ".join(ident(c) for c in names)
    return f"hash({values}, {literal(chr(31).join(names))})"


def source_view_sql(view: str) -> str:
    return (
        f"CREATE OR REPLACE VIEW {ident(source_table(view))} AS "
        f"SELECT m.run_id, s.* EXCLUDE (lowtide_row_key) FROM {MEMBERS} m "
        f"JOIN {ident(content_table(view))} s USING (source_id, lowtide_row_key) "
        f"WHERE m.view = {literal(view)}"
    )


def column_types(con: duckdb.DuckDBPyConnection, table: str) -> dict[str, str]:
    """The columns of a table or view of the state file and their types, in order (empty when
    it is absent)."""
    return dict(
        con.execute(
            "SELECT column_name, data_type FROM duckdb_columns() "
            "WHERE database_name = current_database() AND schema_name = 'main' "
            "AND table_name = ? ORDER BY column_index",
            [table],
        ).fetchall()
    )


def table_columns(con: duckdb.DuckDBPyConnection, table: str) -> list[str]:
    """The columns of a table or view of the state file, in order (empty when it is absent)."""
    return list(column_types(con, table))


def split_copied_sources(con: duckdb.DuckDBPyConnection) -> None:
    """Migration 14: turn each per-run copy `src_<view>` (run_id, source_id, ...) into distinct
    rows, their membership and the view of the same name."""
    con.execute(
        f"CREATE TABLE {MEMBERS} (view VARCHAR NOT NULL, run_id VARCHAR NOT NULL, "
        "source_id VARCHAR NOT NULL, lowtide_row_key UBIGINT NOT NULL)"
    )
    tables = con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
        "AND schema_name = 'main' AND starts_with(table_name, 'src_')"
    ).fetchall()
    for (table,) in tables:
        columns = table_columns(con, table)
        if "run_id" not in columns or "source_id" not in columns:
            continue
        view = table.removeprefix("src_")
        kept = [c for c in columns if c != "run_id"]
        key = row_key_sql(kept)
        con.execute(
            f"INSERT INTO {MEMBERS} SELECT {literal(view)}, run_id, source_id, {key} "
            f"FROM {ident(table)}"
        )
        listed = ", ".join(ident(c) for c in kept)
        con.execute(
            f"CREATE TABLE {ident(content_table(view))} AS SELECT DISTINCT ON (source_id, lowtide_row_key) "
            f"* FROM (SELECT {key} AS lowtide_row_key, {listed} FROM {ident(table)})"
        )
        con.execute(f"DROP TABLE {ident(table)}")
        con.execute(source_view_sql(view))


def common_type(stored: str, incoming: str) -> str:
    """The type a content column takes when a night reads it as another type: one that holds
    both without loss (BIGINT and DOUBLE: DOUBLE; DATE and TIMESTAMP: TIMESTAMP), text when one
    side is text or DuckDB knows none. Inserting as-is cast 4.5 into a BIGINT column as 4."""
    if "VARCHAR" in (stored, incoming):
        return "VARCHAR"
    # its own: a failed query would abort the caller's transaction
    with duckdb.connect() as con, kept_through_duckdb():
        try:
            row = con.execute(
                f"SELECT typeof(x) FROM (SELECT NULL::{stored} AS x "  # noqa: S608 - type names
                f"UNION ALL SELECT NULL::{incoming}) LIMIT 1"
            ).fetchone()
        except duckdb.Error:
            return "VARCHAR"
    return str(row[0]) if row else "VARCHAR"


def stored_parts(rows: pl.DataFrame | Path, text_column: str) -> Iterator[pl.DataFrame]:
    """The rows to store a slice at a time (at least one, perhaps empty): a frame as it is, or
    the run's sources file with its `text` named `text_column` again and without `_priority`,
    which steers sending only (analysts never see it). Each slice reaches DuckDB as a polars
    frame, so row keys hash the same types whichever way the rows came."""
    if isinstance(rows, pl.DataFrame):
        yield from rows.iter_slices(INSERT_SLICE_ROWS) if rows.height else [rows]
        return
    for part in file_slices(rows, INSERT_SLICE_ROWS):
        yield part.drop("_priority", strict=False).rename({"text": text_column})


def _widen(con: duckdb.DuckDBPyConnection, view: str) -> None:
    """Make room in the job's content table for the slice registered as `incoming`: columns
    the input gained since earlier runs are added (old rows: NULL), and a column read as
    another type tonight (ints that gained a 4.5) takes a type that holds both (one empty
    tonight, read as text, fits any column as it is). Slice by slice this ends where the
    whole night at once would: the widest type any slice needs."""
    content = ident(content_table(view))
    stored = column_types(con, content_table(view))
    types = dict(con.execute("SELECT column_name, column_type FROM (DESCRIBE incoming)").fetchall())
    for column, incoming in types.items():
        c = ident(column)
        if column not in stored:
            con.execute(f"ALTER TABLE {content} ADD COLUMN {c} {incoming}")
        elif stored[column] != incoming and _has_values(con, column):
            wider = common_type(stored[column], incoming)
            if con.execute(  # DuckDB's common type may not hold tonight's values
                f"SELECT count(*) FROM incoming WHERE {c} IS NOT NULL "  # noqa: S608
                f"AND TRY_CAST({c} AS {wider}) IS NULL"
            ).fetchall()[0][0]:
                wider = "VARCHAR"
            if wider != stored[column]:
                con.execute(f"ALTER TABLE {content} ALTER COLUMN {c} TYPE {wider}")


def _has_values(con: duckdb.DuckDBPyConnection, column: str) -> bool:
    return bool(con.execute(f"SELECT count({ident(column)}) FROM incoming").fetchall()[0][0])  # noqa: S608


class SourcesStore(Database):
    def save_sources(
        self, view: str, run_id: str, rows: pl.DataFrame | Path, text_column: str = "text"
    ) -> None:
        """Keep the run's input rows (typed) so the job view can show them next to outputs:
        the run's membership, and the rows no earlier run stored. `rows` is a frame of the
        rows as stored, or the run's sources file (`stored_parts`), read a slice at a time:
        handing 300,000 long texts to DuckDB in one statement raised the process's peak by ~2x
        their size (measured), and one join of a night's file against every stored row may
        hash the night's texts. Each slice commits on its own: DuckDB keeps a transaction's new
        rows in memory until it ends (a night of 1M rows peaked at 1.95 GB in one transaction,
        0.90 GB a slice at a time), with the file held across them (detached after each, its
        checkpoints took 19.9 s of CPU instead of 10.3; one transaction 7.1). Stored rows are
        keyed by their content, so a slice stored twice is stored once; if storing fails, the
        run's membership is taken back (rows and widened column types already committed stay:
        later nights find them as they would any earlier night's)."""
        content = ident(content_table(view))
        with self._transaction() as con:
            con.execute(f"DELETE FROM {MEMBERS} WHERE view = ? AND run_id = ?", [view, run_id])
        try:
            with self.held():
                for part in stored_parts(rows, text_column):
                    with self._transaction() as con:
                        self._store_slice(con, view, run_id, content, part)
                    crash_point("mid_sources")
                with self._transaction() as con:
                    con.execute(source_view_sql(view))
        except Exception:  # an interrupted run resumes, and resuming starts with the DELETE
            with contextlib.suppress(Exception), self._transaction() as con:
                con.execute(f"DELETE FROM {MEMBERS} WHERE view = ? AND run_id = ?", [view, run_id])
            raise

    @staticmethod
    def _store_slice(
        con: duckdb.DuckDBPyConnection, view: str, run_id: str, content: str, part: pl.DataFrame
    ) -> None:
        # each row's key hashed once, for the membership and the content rows both (hashing
        # a night's texts twice cost ~0.5 s of CPU at a million rows); the slice converted to
        # Arrow once (registering a polars frame copies its texts at each registration)
        rows = as_arrow(part)
        con.register("incoming", rows)
        keys = con.sql(f"SELECT {row_key_sql(part.columns)} FROM incoming").to_arrow_table()
        con.register("incoming", rows.add_column(0, KEY_COLUMN, keys.column(0)))
        con.execute(f"CREATE TABLE IF NOT EXISTS {content} AS SELECT * FROM incoming LIMIT 0")
        _widen(con, view)
        con.execute(
            f"INSERT INTO {MEMBERS} SELECT ?, ?, source_id, {KEY_COLUMN} FROM incoming",
            [view, run_id],
        )
        # ids are unique, so slices never overlap. On a view's first night nothing stored can
        # match, yet a plain INSERT there was worse, not better: 1M rows took 4.9-7.2 s of CPU
        # against 4.4-6.6, with ~90k more fresh pages, and twice in three left the file
        # 2.17 GB, not 1.59 (2026-12-07, alternating)
        con.execute(
            f"INSERT INTO {content} BY NAME SELECT n.* FROM incoming n "
            f"ANTI JOIN {content} s ON s.source_id = n.source_id "
            f"AND s.{KEY_COLUMN} = n.{KEY_COLUMN}"
        )
