"""A copy of the state file taken with a plain file copy: no row read, nothing compressed again.

Publishing by copying every table through DuckDB read, decompressed and compressed again every
text (~40 s of CPU at a million rows); copying the file itself costs the disk's time only, and
the copy is written past the page cache (`uncached_files`). The copy must be one state of the
file: taken right after a checkpoint (so the file holds every committed change), and checked
unchanged around the copy. The copy carries the file's free blocks as they are (rows since
deleted or replaced, tables dropped): what the published file showed before, or what only the
state keeps (chunk cut positions); never a secret, which never reaches the state file.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import duckdb

from lowtide.uncached_files import copy_uncached

log = logging.getLogger(__name__)

_HEADERS = 3 * 4096
"""A DuckDB file's leading bytes: its main header and the two database headers a checkpoint
flips between (the last thing a checkpoint writes)."""

_LOGS = (".wal", ".wal.checkpoint")
"""The logs DuckDB keeps beside a database file, holding changes the file may not have yet."""


def _logged(state: Path) -> bool:
    """Whether a log beside the state file holds anything."""
    for suffix in _LOGS:
        log_file = state.with_name(state.name + suffix)
        if log_file.exists() and log_file.stat().st_size > 0:
            return True
    return False


def _headers(path: Path) -> bytes:
    with path.open("rb") as f:
        return f.read(_HEADERS)


def _unlogged_stamp(state: Path) -> tuple[int, int, bytes] | None:
    """The state file's size, modification time and headers; None while a log beside it
    holds changes the file itself may not have yet. Equal before and after a copy (and the
    copy's headers equal to the file's): no checkpoint and no commit came in between, so the
    copy is one state of the file."""
    if _logged(state):
        return None
    with state.open("rb") as f:
        headers = f.read(_HEADERS)
        stat = os.fstat(f.fileno())
    return stat.st_size, stat.st_mtime_ns, headers


def copy_at_checkpoint(con: duckdb.DuckDBPyConnection, state: Path, to: Path) -> bool:
    """Checkpoint the state file through `con` (a connection that has it attached) and copy it
    to `to`. False when the copy may not be one state of the file (a log kept changes, it was
    written while being copied) or could not be made (a full disk): the caller discards
    whatever is at `to`."""
    state = state.resolve()  # as attached: its logs lie beside the file, not beside a link
    if not state.is_file():
        return False
    try:
        con.execute("CHECKPOINT")
    except duckdb.Error:  # refused while another transaction writes: it may write meanwhile
        return False
    try:
        before = _unlogged_stamp(state)
        if before is None:
            return False
        copy_uncached(state, to)
        return _unlogged_stamp(state) == before and _headers(to) == before[2]
    except OSError as e:
        log.info("%s: not copied (%s)", state, e)
        return False
