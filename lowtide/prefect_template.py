"""A new Prefect database starts as a copy of one already migrated.

Prefect's temporary server creates its SQLite database on first start and runs every migration
on it: measured on this 2-core box, 19-20 s until it answers and ~25 s of CPU, against 8 s and
~12 s when the database exists. The CLI keeps Prefect's files per directory (.lowtide/prefect),
so every new project, and every test or benchmark with a Prefect home of its own, paid that.

So once a server has migrated a new database, a copy of it taken before any flow ran is kept in
lowtide's cache under Prefect's version (it holds the migrations' bookkeeping and Prefect's block
types, nothing of any run), and a later new database starts as that copy. Prefect still checks
its migrations at every start. The cache is only ever a shortcut: any failure to read or write
it leaves Prefect to create its database as before.
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

log = logging.getLogger(__name__)


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
    """Make `database` a copy of the template when it does not exist yet and a template does;
    whether it did. Never replaces a database that appeared meanwhile."""
    template = template_path()
    if database.exists() or not template.is_file():
        return False
    tmp = _scratch(database)
    try:
        database.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(template, tmp)
        os.link(tmp, database)  # fails if another process made the database meanwhile
    except OSError as e:
        log.debug("Prefect's database not started from %s: %s", template, e)
        return False
    finally:
        _drop(tmp)
    return True


def keep_template(database: Path) -> None:
    """After a server has migrated the new `database`: keep a copy as the template, unless one
    is kept already or a flow has run in it (another process sharing the Prefect home)."""
    template = template_path()
    if template.exists() or not database.is_file():
        return
    tmp = _scratch(template)
    try:
        template.parent.mkdir(parents=True, exist_ok=True)
        with (
            contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as source,
            contextlib.closing(sqlite3.connect(tmp)) as copy,
        ):
            source.backup(copy)  # a consistent snapshot while the server writes
            if copy.execute("SELECT count(*) FROM flow_run").fetchone()[0]:
                return
            copy.execute("PRAGMA journal_mode = DELETE")  # one file, whole without a -wal beside it
        os.replace(tmp, template)
    except (OSError, sqlite3.Error) as e:
        log.debug("no copy of Prefect's new database kept in %s: %s", template, e)
    finally:
        _drop(tmp)
