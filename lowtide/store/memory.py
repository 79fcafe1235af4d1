"""How much memory DuckDB may keep for the state file while it is attached.

Left to itself DuckDB keeps every block it reads or writes cached up to 80% of RAM: a first
night of 300,000 rows peaked 420 MB higher for it, and a million rows' state is ~5 GB. A cap
lets it drop cached blocks and spill big sorts and joins beside the state file. What a cap must
leave room for is the PRIMARY KEY indexes (ART): inserting into one loads most of it, and it
cannot spill (measured with DuckDB 2.0.1: 1 GiB held three tables of 3M 32-character keys each
while 1M more went in; a fourth million failed: ~80 bytes a key). So the cap grows with the
keyed rows the file holds (DuckDB's own table statistics) and with the rows a big insert is
about to add, and never exceeds DuckDB's default.
"""

from __future__ import annotations

import threading

import duckdb

BASE_MB = 384
"""Room for one step's work besides the indexes: joins, sorts and aggregates spill past it
beside the state file (a first night of 1M rows ran under 512 MiB + its indexes at 2 threads,
measured, with 64 MiB a thread) ..."""

PER_THREAD_MB = 128
"""... plus this for each of DuckDB's threads: sorts and aggregates need room per thread
(DuckDB asks for at least 125 MB a thread)."""

BYTES_PER_KEYED_ROW = 120
"""Room per row of a table with a primary key: ~1.5x the index's measured cost per key."""

RECOUNT_GROWTH = 1.2
"""Keyed rows are counted again once the file has grown by this factor since the last count
(a file is attached a few hundred times a run; a count costs ~1 ms, a size check nothing)."""

_KEYED_ROWS_SQL = (
    "SELECT coalesce(sum(estimated_size), 0) FROM duckdb_tables() "
    "WHERE database_name = ? AND has_primary_key"
)


def sized_mb(keyed_rows: int, threads: int) -> int:
    """The cap in MiB for a state holding `keyed_rows` rows in tables with a primary key."""
    return BASE_MB + PER_THREAD_MB * threads + keyed_rows * BYTES_PER_KEYED_ROW // 2**20


class MemoryCap:
    """The cap of one state file's DuckDB instance, kept up to date as the file grows.
    `override_mb` is the user's (LOWTIDE_STATE_MEMORY_MB): a fixed cap, or 0 for DuckDB's
    default; None sizes it."""

    def __init__(self, override_mb: int | None, instance: duckdb.DuckDBPyConnection) -> None:
        self.override_mb = override_mb
        self._threads = int(_setting(instance, "threads"))
        self._default_mb = _mib(_setting(instance, "memory_limit"))
        self._keyed = 0
        self._counted_at_bytes = -1
        self._lock = threading.Lock()  # inserts on several threads make room together
        self.said = "DuckDB's default"  # the cap as an error names it
        if override_mb:
            _set(instance, override_mb)
            self.said = f"{override_mb} MiB, from LOWTIDE_STATE_MEMORY_MB"

    def apply(self, con: duckdb.DuckDBPyConnection, alias: str, file_bytes: int) -> None:
        """At an attach: set the cap for the file attached as `alias` (`file_bytes` on disk)."""
        if self.override_mb is not None:
            return
        if 0 <= self._counted_at_bytes and file_bytes <= self._counted_at_bytes * RECOUNT_GROWTH:
            return
        rows = con.execute(_KEYED_ROWS_SQL, [alias]).fetchall()
        self._keyed = int(rows[0][0]) if rows else 0
        self._counted_at_bytes = max(file_bytes, 1)
        self._size(con, self._keyed)

    def make_room(self, con: duckdb.DuckDBPyConnection, rows: int) -> None:
        """Before inserting `rows` rows into keyed tables: their index entries need room too
        (a first night's manifest goes into an empty state)."""
        if self.override_mb is None and rows:
            with self._lock:
                # an upper bound (replaced rows count again) until the next count
                self._keyed += rows
                self._size(con, self._keyed)

    def _size(self, con: duckdb.DuckDBPyConnection, keyed: int) -> None:
        mb = min(sized_mb(keyed, self._threads), self._default_mb)
        _set(con, mb)
        self.said = f"{mb} MiB, sized for {keyed:,} keyed rows"


def _setting(con: duckdb.DuckDBPyConnection, name: str) -> str:
    return str(con.execute(f"SELECT current_setting('{name}')").fetchall()[0][0])


_UNITS_MIB = {"bytes": 2**-20, "KiB": 2**-10, "MiB": 1, "GiB": 2**10, "TiB": 2**20, "PiB": 2**30}


def _mib(shown: str) -> int:
    """A memory setting as DuckDB shows it ('18.8 GiB') in MiB; an unknown form counts as no
    bound (the sized cap then applies alone)."""
    number, _, unit = shown.partition(" ")
    try:
        return int(float(number) * _UNITS_MIB[unit])
    except (KeyError, ValueError):
        return 2**40


def _set(con: duckdb.DuckDBPyConnection, mb: int) -> None:
    con.execute(f"SET memory_limit = '{mb}MiB'")
