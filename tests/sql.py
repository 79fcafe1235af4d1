"""Tests read the state file with plain SQL, as an analyst would; the product keeps its SQL in
`lowtide.store`, tests may look anywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import polars as pl


def _path(where: Any) -> str:
    if hasattr(where, "list_runs"):  # a Store: make sure its file exists and is migrated
        where.list_runs()
        return str(where.path)
    return str(Path(where))


def query(where: Any, sql: str, params: list[Any] | None = None) -> pl.DataFrame:
    """A query against a store's file (or a path), as a polars frame."""
    con = duckdb.connect(_path(where))
    try:
        result = pl.from_arrow(con.sql(sql, params=params or None).to_arrow_table())
    finally:
        con.close()
    assert isinstance(result, pl.DataFrame)
    return result


def scalar(where: Any, sql: str, params: list[Any] | None = None) -> Any:
    con = duckdb.connect(_path(where))
    try:
        rows = con.execute(sql, params or []).fetchall()
    finally:
        con.close()
    return rows[0][0] if rows else None
