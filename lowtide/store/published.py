"""Reading the published file the way an analyst does: read-only, never blocking a run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb

from lowtide.errors import UserError
from lowtide.interrupts import kept_through_duckdb


def first_query(view: str, columns: list[str], limit: int = 5) -> str:
    """The first query the demo suggests on a job view."""
    return f"SELECT {', '.join(columns)} FROM {view} LIMIT {limit}"


def query_published(db: Path, sql: str, limit: int) -> tuple[list[str], list[tuple[Any, ...]]]:
    """(columns, at most `limit` rows) of a query against the published file; ([], []) for a
    statement without a result. UserError naming the file for a missing file or bad SQL."""
    if not db.is_file():
        raise UserError(f"{db}: no published file yet; run a job first (lowtide demo)")
    # read-only on the file, and no file access beyond it: `lowtide sql` cannot COPY … TO a
    # path or read other files (use DuckDB itself, or `lowtide export`, for that)
    con = duckdb.connect(str(db), read_only=True, config={"enable_external_access": False})
    try:
        with kept_through_duckdb():
            rel = con.sql(sql)
            if rel is None:
                return [], []
            return list(rel.columns), rel.limit(limit).fetchall()
    except duckdb.Error as e:
        raise UserError(f"{db}: {e}") from e
    finally:
        con.close()
