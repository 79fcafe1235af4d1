"""DuckDB as a calculator: reading an input table, touching no state.

Kept in the store package because it is SQL; it never opens the state file.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl

from lowtide.errors import InputError
from lowtide.interrupts import kept_through_duckdb
from lowtide.store._sql import ident


def read_duckdb_table(
    database: str,
    table: str,
    where: str,
    cursor_column: str | None = None,
    after: object = None,
) -> pl.DataFrame:
    """Every row of `table` in the DuckDB file `database`, opened read-only. `where` names the
    input in error messages. With `cursor_column` and a mark `after`, only the rows whose cursor
    is greater than the mark or empty, filtered in the scan."""
    if not Path(database).is_file():
        raise InputError(f"{database}: DuckDB file not found")
    try:
        con = duckdb.connect(database, read_only=True)
    except duckdb.Error as e:
        raise InputError(f"{database}: cannot open DuckDB file: {e}") from e
    sql, params = f"SELECT * FROM {ident(table)}", []
    if cursor_column is not None and after is not None:
        column = ident(cursor_column)
        sql, params = f"{sql} WHERE {column} > ? OR {column} IS NULL", [after]
    try:
        with kept_through_duckdb():
            result = pl.from_arrow(con.sql(sql, params=params).to_arrow_table())
    except duckdb.CatalogException as e:
        raise InputError(f"{database}: no table {table!r} (from {where})") from e
    except duckdb.BinderException as e:
        raise InputError(
            f"{where}: [input] cursor_column {cursor_column!r} is not a column of {table!r}"
        ) from e
    except duckdb.ConversionException as e:
        raise InputError(
            f"{where}: [input] cursor_column {cursor_column!r} does not compare with the last "
            f"run's mark {after!r}: {' '.join(str(e).split())}"
        ) from e
    finally:
        con.close()
    return result if isinstance(result, pl.DataFrame) else result.to_frame()
