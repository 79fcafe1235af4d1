"""Connections to the state file: short transactions, a bounded wait for another process.

DuckDB lets one process hold a file for writing and locks every other process out, even readers.
So each store method opens, works and closes; a second lowtide process (a scheduled `collect`
beside a `run`) retries with a backoff until `lock_timeout_s`, then gets `StateLockedError`
naming the file and the holder. Everything row-level moves through Arrow, never row by row.

Opening a DuckDB file starts a database instance afresh (its catalog of built-in functions:
~30 ms of CPU here), and a run opens the state file a few hundred times. So the file is attached
to an in-memory instance kept for the process instead (~4 ms), detached when its last user is
done: the file lock is held exactly as long as a connection of its own would hold it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import duckdb

from lowtide.errors import LowtideError, StateLockedError, StateMemoryError
from lowtide.interrupts import kept_through_duckdb
from lowtide.settings import state_memory_mb
from lowtide.store import memory, migrations
from lowtide.store._sql import ident, literal

log = logging.getLogger(__name__)

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


INSERT_SLICE_ROWS = 122_880
"""Rows handed to DuckDB per statement (`insert_in_slices`) and per transaction (the manifest's
messages, a run's input rows): one of DuckDB's row groups. A slice that ends mid row group
leaves it to be compressed again when the next slice fills it: 480,000 requests with ~1.1 KB
zstd messages took 9.7 s of CPU in slices of 50,000 and 8.0 s in slices of a row group (the
mean of three runs each, this machine), the peak the same."""


def insert_in_slices(
    con: duckdb.DuckDBPyConnection,
    rows: pl.DataFrame,
    sql: str,
    params: list[Any] | None = None,
) -> None:
    """Run `sql`, which reads the view `incoming`, once per slice of `rows`, inside the
    caller's transaction. Handing 300,000 long texts to DuckDB in one statement raised the
    process's peak by ~2x their size more than slices of them do (measured)."""
    for part in rows.iter_slices(INSERT_SLICE_ROWS):
        # each register replaces the last slice's view (an aborted transaction refuses even
        # an unregister, which would hide the error that aborted it)
        con.register("incoming", part)
        con.execute(sql, params or [])


class UnknownColumnError(LowtideError):
    """A store method was asked to write a column its table does not have (a programming error
    caught before any SQL is built from the name)."""


class Database:
    """The state file's connection handling, shared by every part of the store."""

    def __init__(self, path: str | Path, lock_timeout_s: float = 30.0):
        self.path = Path(path)
        self.lock_timeout_s = lock_timeout_s
        self._migrated = False
        self._migrate_lock = threading.Lock()
        self._columns: dict[str, frozenset[str]] = {}
        self._holds = 0
        self._holds_lock = threading.Lock()

    @contextmanager
    def held(self) -> Iterator[None]:
        """Keep the state file attached across a stretch of back-to-back calls. Each call gets
        its own cursor, and when nobody in the process uses the file, the call attaches it and
        detaches it again (a checkpoint each time); while one is held, a call costs ~1 ms more
        than its SQL. Other processes wait while the file is held, so hold
        it around short store work only, never around a wait on a provider or a long
        computation. One thread per stretch: a thread that joins another's stretch runs unheld
        once that one ends (slower, never wrong)."""
        with self._holds_lock:
            self._holds += 1
            first = self._holds == 1
        try:
            if first:
                # this use keeps the file attached, so every other call's open is cheap; the
                # calls inside name their own errors (anything else may run in the stretch)
                with self._connect(own_errors_only=True):
                    yield
            else:
                yield
        finally:
            with self._holds_lock:
                self._holds -= 1

    @contextmanager
    def _connect(self, own_errors_only: bool = False) -> Iterator[duckdb.DuckDBPyConnection]:
        # Ctrl-C in a query stays Ctrl-C, not a failed query
        with kept_through_duckdb(), self._connected(own_errors_only) as con:
            yield con

    @contextmanager
    def _connected(self, own_errors_only: bool) -> Iterator[duckdb.DuckDBPyConnection]:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        attached = _attached_file(self.path)
        with _naming_memory_errors(self.path, attached):  # attaching replays the file's log
            attached.acquire(self.lock_timeout_s)
        try:
            con = attached.cursor()
            try:
                with _naming_memory_errors(self.path, attached):
                    # Every timestamp in the state is UTC: DuckDB's now() would otherwise be the
                    # host's local time beside Python's UTC stamps (a setting of this cursor).
                    con.execute("SET TimeZone = 'UTC'")
                    if not self._migrated:
                        with self._migrate_lock:  # threads opening it together migrate once
                            if not self._migrated:
                                migrations.apply(con)
                                self._migrated = True
                if own_errors_only:
                    yield con
                else:
                    with _naming_memory_errors(self.path, attached):
                        yield con
            finally:
                con.close()
        finally:
            attached.release()

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

    def _make_room(self, con: duckdb.DuckDBPyConnection, keyed_rows: int) -> None:
        """Before inserting `keyed_rows` rows into tables with a primary key (their index
        entries need memory the cap must leave them)."""
        cap = _memory_cap(self.path)
        if cap is not None:
            cap.make_room(con, keyed_rows)

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
                "SELECT column_name FROM duckdb_columns() "
                "WHERE database_name = current_database() AND table_name = ?",
                [table],
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


STATE_ALIAS = "lowtide_state"
"""The name the state file is attached under (what `current_database()` says inside the store)."""


@contextmanager
def _naming_memory_errors(path: Path, attached: _AttachedFile) -> Iterator[None]:
    """DuckDB running out of the state file's cap becomes an error naming the cap's setting."""
    try:
        yield
    except duckdb.OutOfMemoryException as e:
        said = attached.memory.said if attached.memory is not None else "DuckDB's default"
        raise StateMemoryError(path, said, str(e)) from e


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class _AttachedFile:
    """One state file attached to an in-memory DuckDB instance of this process while anyone
    uses it. Each user gets a cursor of its own (one connection shared across threads fails with
    "connection is busy"); the first user attaches the file, waiting for another process's lock
    up to the caller's bound, and the last one detaches it, which checkpoints and lets go of the
    file's lock. While the file is attached, DuckDB refuses a second copy of it in the process
    ("Unique file handle conflict"): nothing else here opens the state file directly."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()  # held for moments only, never across a wait
        self._users = 0
        self._pending = 0  # handed out, not acquired yet (guarded by `_files_lock`)
        self._instance: duckdb.DuckDBPyConnection | None = None
        self.memory: memory.MemoryCap | None = None  # with the instance

    def acquire(self, lock_timeout_s: float) -> None:
        """Become a user, attaching the file if nobody in the process uses it; while another
        process holds it, retry with a backoff until `lock_timeout_s` (each thread waits once,
        and never blocks the process's other files meanwhile)."""
        deadline = time.monotonic() + lock_timeout_s
        delay = 0.05
        try:
            while True:
                with self._lock:
                    try:
                        if self._users == 0:
                            self._attach()
                        self._users += 1
                        return
                    except duckdb.IOException as e:
                        if "lock" not in str(e).lower():
                            raise
                        if time.monotonic() >= deadline:
                            raise StateLockedError(self.path, lock_timeout_s, str(e)) from e
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        finally:
            with _files_lock:
                self._pending -= 1

    def cursor(self) -> duckdb.DuckDBPyConnection:
        assert self._instance is not None, "cursor() outside acquire()/release()"
        con = self._instance.cursor()
        con.execute(f"USE {STATE_ALIAS}")
        return con

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0 and self._instance is not None:
                try:
                    self._instance.execute(f"DETACH {STATE_ALIAS}")
                except duckdb.Error as e:
                    # The work is committed (in the WAL, which the next open replays); only the
                    # checkpoint failed (a full disk, say). Reporting the committed call as
                    # failed would invite doing it again, so say it here and start afresh.
                    log.warning(
                        "%s: checkpoint on release failed (kept in its WAL): %s", self.path, e
                    )
                    self._drop_instance()

    def _attach(self) -> None:
        if self._instance is None:
            override = state_memory_mb()  # before the instance: a bad value leaves nothing
            # spills of big sorts and joins go beside the state file, as a file of its own would
            # put them, never into the working directory
            instance = duckdb.connect(config={"temp_directory": f"{self.path}.tmp"})
            try:
                self.memory = memory.MemoryCap(override, instance)
            except BaseException:
                instance.close()
                raise
            self._instance = instance
        assert self.memory is not None
        self._instance.execute(f"ATTACH {literal(str(self.path))} AS {STATE_ALIAS}")
        try:
            # the cap follows the file's keyed rows, which every night adds to
            self.memory.apply(self._instance, STATE_ALIAS, _size(self.path))
        except BaseException:
            # attached with no user would hold the file (and its lock) for good
            with contextlib.suppress(duckdb.Error):
                self._instance.execute(f"DETACH {STATE_ALIAS}")
            raise

    def _drop_instance(self) -> None:
        instance, self._instance = self._instance, None
        if instance is not None:
            with contextlib.suppress(duckdb.Error):
                instance.close()  # closing it lets go of the file whatever state it is in

    def close_if_unused(self) -> bool:
        """Close the instance when nobody uses or is about to use the file and no one is
        attaching it right now; True when closed. Called with `_files_lock` held."""
        if self._pending or not self._lock.acquire(blocking=False):
            return False
        try:
            if self._users:
                return False
            self._drop_instance()
            return True
        finally:
            self._lock.release()


_KEPT_FILES = 4
"""State files whose instance is kept between uses; a process that works on more (a test
session) closes the least recently used idle ones, so their memory does not add up."""

_files_lock = threading.Lock()
_files: dict[Path, _AttachedFile] = {}  # least recently used first


def _memory_cap(path: Path) -> memory.MemoryCap | None:
    """The memory cap of `path`'s instance (None before its first attach)."""
    with _files_lock:
        attached = _files.get(path.resolve())
    return attached.memory if attached is not None else None


def _attached_file(path: Path) -> _AttachedFile:
    """The process's one `_AttachedFile` of `path` (every Store of one file shares it); the
    caller must `acquire` it next."""
    key = path.resolve()
    with _files_lock:
        attached = _files.pop(key, None) or _AttachedFile(key)
        _files[key] = attached
        attached._pending += 1  # never closed between here and its acquire()
        for old_key, old in list(_files.items())[: max(0, len(_files) - _KEPT_FILES)]:
            if old.close_if_unused():
                del _files[old_key]
        return attached
