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

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import duckdb

from lowtide.store._db import Database, insert_in_slices
from lowtide.store._sql import ident, literal

if TYPE_CHECKING:
    import polars as pl

MEMBERS = "run_sources"


def source_table(view: str) -> str:
    """The view of the input rows each run read: (run_id, source_id, the input's columns)."""
    return f"src_{view}"


def content_table(view: str) -> str:
    """The table holding each distinct input row of the job once."""
    return f"src_{view}-rows"


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
    with duckdb.connect() as con:  # its own: a failed query would abort the caller's transaction
        try:
            row = con.execute(
                f"SELECT typeof(x) FROM (SELECT NULL::{stored} AS x "  # noqa: S608 - type names
                f"UNION ALL SELECT NULL::{incoming}) LIMIT 1"
            ).fetchone()
        except duckdb.Error:
            return "VARCHAR"
    return str(row[0]) if row else "VARCHAR"


def sources_file_sql(path: Path, text_column: str, names: Iterable[str]) -> str:
    """The rows of a run's sources file (columns `names`) as the store keeps them: `text`
    under its input name, without `_priority`, which steers sending only (analysts never see
    it)."""
    picked = [
        f"text AS {ident(text_column)}" if name == "text" else ident(name)
        for name in names
        if name != "_priority"
    ]
    return f"SELECT {', '.join(picked)} FROM read_parquet({literal(str(path))})"  # noqa: S608


def _has_values(con: duckdb.DuckDBPyConnection, column: str) -> bool:
    return bool(con.execute(f"SELECT count({ident(column)}) FROM incoming").fetchall()[0][0])  # noqa: S608


class SourcesStore(Database):
    def save_sources(
        self, view: str, run_id: str, rows: pl.DataFrame | Path, text_column: str = "text"
    ) -> None:
        """Keep the run's input rows (typed) so the job view can show them next to outputs:
        the run's membership, and the rows no earlier run stored. `rows` is a frame of the
        rows as stored, or the run's sources file (`sources_file_sql`: its `text` is stored as
        `text_column`), which DuckDB streams a row group at a time."""
        content = ident(content_table(view))
        with self._transaction() as con:
            if isinstance(rows, Path):
                names = con.execute(
                    "SELECT column_name FROM "  # noqa: S608 - a quoted path
                    f"(DESCRIBE SELECT * FROM read_parquet({literal(str(rows))}))"
                ).fetchall()
                sql = sources_file_sql(rows, text_column, [n for (n,) in names])
                con.execute(f"CREATE OR REPLACE TEMP VIEW incoming AS {sql}")
            else:
                con.register("incoming", rows)
            types = dict(
                con.execute("SELECT column_name, column_type FROM (DESCRIBE incoming)").fetchall()
            )
            key = row_key_sql(types)
            con.execute(
                f"CREATE TABLE IF NOT EXISTS {content} AS "
                "SELECT 0::UBIGINT AS lowtide_row_key, * FROM incoming LIMIT 0"
            )
            # an input that gained columns since earlier runs: widen the table (old rows: NULL)
            stored = column_types(con, content_table(view))
            for column in types:
                c = ident(column)
                if column not in stored:
                    con.execute(f"ALTER TABLE {content} ADD COLUMN {c} {types[column]}")
                elif stored[column] != types[column] and _has_values(con, column):
                    # a column read as another type tonight (ints that gained a 4.5): widen it
                    # (one empty tonight, read as text, fits any column as it is)
                    wider = common_type(stored[column], types[column])
                    if con.execute(  # DuckDB's common type may not hold tonight's values
                        f"SELECT count(*) FROM incoming WHERE {c} IS NOT NULL "  # noqa: S608
                        f"AND TRY_CAST({c} AS {wider}) IS NULL"
                    ).fetchall()[0][0]:
                        wider = "VARCHAR"
                    if wider != stored[column]:
                        con.execute(f"ALTER TABLE {content} ALTER COLUMN {c} TYPE {wider}")
            con.execute(source_view_sql(view))
            con.execute(f"DELETE FROM {MEMBERS} WHERE view = ? AND run_id = ?", [view, run_id])
            con.execute(
                f"INSERT INTO {MEMBERS} SELECT ?, ?, source_id, {key} FROM incoming", [view, run_id]
            )
            insert = (
                f"INSERT INTO {content} BY NAME SELECT n.* FROM "
                f"(SELECT {key} AS lowtide_row_key, * FROM incoming) n "
                f"ANTI JOIN {content} s ON s.source_id = n.source_id "
                "AND s.lowtide_row_key = n.lowtide_row_key"
            )
            if isinstance(rows, Path):
                con.execute(insert)  # DuckDB reads the file a row group at a time
                con.execute("DROP VIEW incoming")
            else:
                # the texts themselves a slice at a time (ids are unique: slices never overlap)
                insert_in_slices(con, rows, insert)
