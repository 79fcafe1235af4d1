"""Prefect's own SQLite database, as `lowtide.prefect_template` copies it: the only SQL here that
reads a database lowtide does not own. Imports no polars or DuckDB (the CLI's start-up path)."""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

SETUP_TABLES = frozenset(
    {
        "alembic_version",  # the migrations' bookkeeping
        "block_type",  # Prefect's block types, registered at every start
        "block_schema",
        "block_schema_reference",
        "sqlite_sequence",
        "sqlite_stat1",
    }
)
"""The tables a server fills on its first start, before anything uses it."""


def copy_if_unused(database: Path, copy_to: Path) -> bool:
    """Copy `database` (while a server may write it) to `copy_to` as one self-contained file,
    when no table but `SETUP_TABLES` holds a row: nothing of any run, block, variable or
    deployment is copied. False when something is (`copy_to` is then left for the caller to
    remove)."""
    with (
        contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as source,
        contextlib.closing(sqlite3.connect(copy_to)) as copy,
    ):
        source.backup(copy)  # a consistent snapshot, the -wal's pages included
        tables = [
            name
            for (name,) in copy.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
            if name not in SETUP_TABLES
        ]
        for name in tables:
            quoted = '"' + name.replace('"', '""') + '"'
            if copy.execute(f"SELECT 1 FROM {quoted} LIMIT 1").fetchone():  # noqa: S608
                return False
        copy.execute("PRAGMA journal_mode = DELETE")  # whole without a -wal beside it
    return True


def is_sound(path: Path) -> bool:
    """Whether `path` reads as an intact SQLite database (a cut-off copy does not)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as con:
            return con.execute("PRAGMA quick_check").fetchone() == ("ok",)
    except sqlite3.Error:
        return False
