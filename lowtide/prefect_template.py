"""A new Prefect database starts as a copy of one already migrated.

Prefect's temporary server creates its SQLite database on first start and runs every migration
on it: measured on this 2-core box, 19-20 s until it answers and ~25 s of CPU, against 8 s and
~12 s when the database exists. The CLI keeps Prefect's files per directory (.lowtide/prefect),
so every new project, and every test or benchmark with a Prefect home of its own, paid that.

So once a server has migrated a new database, a copy of it is kept in lowtide's cache under
Prefect's version, taken before any flow ran and only while it holds nothing but what a server
writes at its first start (the migrations' bookkeeping, Prefect's block types:
`store.prefect_db`), and a later new database starts as that copy. Prefect still checks its
migrations at every start. The cache is only ever a shortcut: any failure to read or write it
leaves Prefect to create its database as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sqlite3
import uuid
from importlib import metadata
from pathlib import Path

from lowtide.settings import cache_dir
from lowtide.store.prefect_db import copy_if_unused, is_sound

log = logging.getLogger(__name__)

_CACHE_ERRORS = (OSError, RuntimeError, sqlite3.Error)
"""What the cache may raise: a folder that cannot be read or written, no home folder to put it
in (RuntimeError from `expanduser`), a damaged copy."""


def template_path() -> Path:
    """Where the migrated copy for the installed Prefect is kept."""
    return cache_dir() / f"prefect-{metadata.version('prefect')}.db"


def _scratch(beside: Path) -> Path:
    return beside.with_name(f".{beside.name}.{uuid.uuid4().hex[:8]}.tmp")


def _drop(path: Path) -> None:
    for leftover in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        with contextlib.suppress(OSError):
            leftover.unlink()


def seed_database(database: Path) -> bool:
    """Make `database` a copy of the template when it does not exist yet and a sound template
    does; whether it did. Never replaces a database that appeared meanwhile; a damaged template
    is removed (the next new database is kept in its place)."""
    if database.exists():
        return False
    tmp = _scratch(database)
    try:
        template = template_path()
        if not template.is_file():
            return False
        database.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, tmp)
        if not is_sound(tmp):
            log.warning("%s: not an intact SQLite database; removed", template)
            template.unlink(missing_ok=True)
            return False
        os.link(tmp, database)  # fails if another process made the database meanwhile
    except _CACHE_ERRORS as e:
        log.debug("Prefect's database not started from the cache: %s", e)
        return False
    finally:
        _drop(tmp)
    return True


def keep_template(database: Path) -> None:
    """After a server has migrated the new `database`: keep a copy as the template, unless one
    is kept already or the database holds more than a new server writes (another process
    sharing the Prefect home has used it)."""
    tmp: Path | None = None
    try:
        template = template_path()
        if template.exists() or not database.is_file():
            return
        template.parent.mkdir(parents=True, exist_ok=True)
        tmp = _scratch(template)
        if copy_if_unused(database, tmp):
            with open(tmp, "rb") as written:  # on disk before it is named: no cut-off template
                os.fsync(written.fileno())
            os.replace(tmp, template)
    except _CACHE_ERRORS as e:
        log.debug("no copy of Prefect's new database kept in the cache: %s", e)
    finally:
        if tmp is not None:
            _drop(tmp)
