"""Connections to the state file: short transactions, a bounded wait for another process.

DuckDB lets one process hold a file for writing and locks every other process out, even readers.
So each store method opens, works and closes; a second lowtide process (a scheduled `collect`
beside a `run`) retries with a backoff until `lock_timeout_s`, then gets `StateLockedError`
naming the file and the holder. Everything row-level moves through Arrow, never row by row.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from lowtide.errors import LowtideError, StateLockedError
from lowtide.store import migrations
from lowtide.store._sql import ident

if TYPE_CHECKING:
    import polars as pl


def frame(
    con: duckdb.DuckDBPyConnection, sql: str, params: list[Any] | dict[str, Any] | None = None
) -> pl.DataFrame:
    """Run a query and return its result as a polars frame (through Arrow, no row loop)."""
    import polars as pl  # here, not at the top: `collect`'s quick check never loads it

    result = pl.from_arrow(con.sql(sql, params=params or None).to_arrow_table())
    if not isinstance(result, pl.DataFrame):  # a one-column result can come back as a Series
        result = result.to_frame()
    return result


class UnknownColumnError(LowtideError):
    """A store method was asked to write a column its table does not have (a programming error
    caught before any SQL is built from the name)."""


class Database:
    """The state file's connection handling, shared by every part of the store."""

    def __init__(self, path: str | Path, lock_timeout_s: float = 30.0):
        self.path = Path(path)
        self.lock_timeout_s = lock_timeout_s
        self._migrated = False
        self._columns: dict[str, frozenset[str]] = {}
        self._holds = 0
        self._holds_lock = threading.Lock()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Keep the state file open across a stretch of back-to-back calls. Each call opens its
        own connection, and opening the file when no connection to it is open in the process
        starts DuckDB afresh (measured: ~45 ms of CPU, building its catalog of functions); while
        one is held, opening costs ~1 ms. Other processes wait while the file is held, so hold
        it around short store work only, never around a wait on a provider or a long
        computation. One thread per stretch: a thread that joins another's stretch runs unheld
        once that one ends (slower, never wrong)."""
        with self._holds_lock:
            self._holds += 1
            first = self._holds == 1
        try:
            if first:
                # DuckDB shares one open instance per file within a process: this connection
                # keeps it open, so every other call's connect is cheap
                with self._connect():
                    yield
            else:
                yield
        finally:
            with self._holds_lock:
                self._holds -= 1

    @contextmanager
    def _connect(self) -> Iterator[duckdb.DuckDBPyConnection]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.lock_timeout_s
        delay = 0.05
        while True:
            try:
                con = duckdb.connect(str(self.path))
                break
            except duckdb.IOException as e:
                if "lock" not in str(e).lower():
                    raise
                if time.monotonic() >= deadline:
                    raise StateLockedError(self.path, self.lock_timeout_s, str(e)) from e
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        try:
            # Every timestamp in the state is UTC: DuckDB's now() would otherwise be the host's
            # local time beside Python's UTC stamps.
            con.execute("SET TimeZone = 'UTC'")
            if not self._migrated:
                migrations.apply(con)
                self._migrated = True
            yield con
        finally:
            con.close()

    @contextmanager
    def _transaction(self) -> Iterator[duckdb.DuckDBPyConnection]:
        with self._connect() as con:
            con.execute("BEGIN")
            try:
                yield con
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")

    def _query(self, sql: str, params: list[Any] | dict[str, Any] | None = None) -> pl.DataFrame:
        with self._connect() as con:
            return frame(con, sql, params)

    def _scalar(self, sql: str, params: list[Any] | None = None) -> Any:
        with self._connect() as con:
            rows = con.execute(sql, params or []).fetchall()
            return rows[0][0] if rows else None

    def _table_columns(self, table: str) -> frozenset[str]:
        if table not in self._columns:
            names = self._query(
                "SELECT column_name FROM duckdb_columns() WHERE table_name = ?", [table]
            )["column_name"]
            self._columns[table] = frozenset(names.to_list())
        return self._columns[table]

    def _set_clause(self, table: str, fields: dict[str, Any]) -> str:
        """`a = ?, b = ?` for known columns of `table` only."""
        unknown = sorted(set(fields) - self._table_columns(table))
        if unknown or not fields:
            raise UnknownColumnError(f"table {table} has no column(s) {unknown or '(none given)'}")
        return ", ".join(f"{ident(k)} = ?" for k in fields)

    def _update(self, table: str, key: str, key_value: Any, **fields: Any) -> None:
        """Update checked columns of one row of `table` by its key column."""
        sets = self._set_clause(table, fields)
        with self._transaction() as con:
            con.execute(
                f"UPDATE {ident(table)} SET {sets} WHERE {ident(key)} = ?",
                [*fields.values(), key_value],
            )
