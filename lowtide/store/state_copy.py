"""A copy of the state file taken with a plain file copy: no row read, nothing compressed again.

Publishing a first night by copying every table through DuckDB read, decompressed and compressed
again every text (~40 s of CPU at a million rows); copying the file itself costs the disk's
time only. The copy must be one state of the file: taken right after a checkpoint (so the file
holds every committed change), and checked unchanged around the copy.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import duckdb

_HEADERS = 3 * 4096
"""A DuckDB file's leading bytes: its main header and the two database headers a checkpoint
flips between (the last thing a checkpoint writes)."""


def _wal(path: Path) -> Path:
    return path.with_name(path.name + ".wal")


def _unlogged_stamp(state: Path) -> tuple[int, int, bytes] | None:
    """The state file's size, modification time and headers; None while its write-ahead log
    holds changes the file itself does not have yet. Equal before and after a copy: no
    checkpoint and no commit came in between, so the copy is one state of the file."""
    wal = _wal(state)
    if wal.exists() and wal.stat().st_size > 0:
        return None
    with state.open("rb") as f:
        headers = f.read(_HEADERS)
        stat = os.fstat(f.fileno())
    return stat.st_size, stat.st_mtime_ns, headers


def copy_at_checkpoint(con: duckdb.DuckDBPyConnection, state: Path, to: Path) -> bool:
    """Checkpoint the state file through `con` (a connection that has it attached) and copy it
    to `to`. False when the copy may not be one state of the file (its log kept changes, or it
    was written while being copied): the caller discards what is at `to`."""
    try:
        con.execute("CHECKPOINT")
    except duckdb.Error:  # refused while another transaction writes: it may write meanwhile
        return False
    before = _unlogged_stamp(state)
    if before is None:
        return False
    shutil.copyfile(state, to)
    return _unlogged_stamp(state) == before
