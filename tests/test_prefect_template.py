"""A new Prefect database starts as a copy of one a server already migrated (kept in lowtide's
cache), instead of every migration running again in each new Prefect home."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from lowtide.prefect_template import keep_template, seed_database, template_path

# a fresh process (Prefect not imported yet, as in the CLI): start the tied server, run a flow
_START_AND_RUN_A_FLOW = """
from lowtide.prefect_server import start_tied_server
start_tied_server()
from prefect import flow

@flow
def hello() -> int:
    return 1

assert hello() == 1
"""


def _start(home: Path, cache: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env |= {"PREFECT_HOME": str(home), "LOWTIDE_CACHE_DIR": str(cache)}
    done = subprocess.run(
        [sys.executable, "-c", _START_AND_RUN_A_FLOW], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _rows(db: Path, table: str) -> int:
    with contextlib.closing(sqlite3.connect(db)) as con:
        return con.execute(f"SELECT count(*) FROM {table}").fetchone()[0]  # noqa: S608


def test_a_new_prefect_home_starts_from_the_copy_the_first_one_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("LOWTIDE_CACHE_DIR", str(cache))
    _start(tmp_path / "first", cache)
    template = template_path()
    assert template.is_file()
    # migrated, with Prefect's block types, and nothing of the flow that ran after the copy
    assert _rows(template, "alembic_version") == 1
    assert _rows(template, "block_type") > 0
    assert _rows(template, "flow_run") == 0
    assert _rows(tmp_path / "first" / "prefect.db", "flow_run") == 1

    with contextlib.closing(sqlite3.connect(template)) as con:  # mark it to see it reach the next
        con.execute("CREATE TABLE lowtide_marker (x INTEGER)")
    _start(tmp_path / "second", cache)
    second = tmp_path / "second" / "prefect.db"
    assert _rows(second, "lowtide_marker") == 0  # the table is there: started from the copy
    assert _rows(second, "flow_run") == 1  # and Prefect ran a flow on it


def _database(path: Path, flow_runs: int) -> Path:
    with contextlib.closing(sqlite3.connect(path)) as con:
        con.execute("CREATE TABLE flow_run (id INTEGER)")
        con.executemany("INSERT INTO flow_run VALUES (?)", [(i,) for i in range(flow_runs)])
        con.commit()
    return path


def test_a_database_holding_anything_of_a_run_or_a_secret_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process sharing the Prefect home may have used it before the copy."""
    monkeypatch.setenv("LOWTIDE_CACHE_DIR", str(tmp_path / "cache"))
    keep_template(_database(tmp_path / "used.db", flow_runs=1))
    assert not template_path().exists()
    with_a_secret = _database(tmp_path / "secret.db", flow_runs=0)
    with contextlib.closing(sqlite3.connect(with_a_secret)) as con:
        con.execute("CREATE TABLE block_document (name VARCHAR, value VARCHAR)")
        con.execute("INSERT INTO block_document VALUES ('openai-key', 'sk-not-for-the-cache')")
        con.commit()
    keep_template(with_a_secret)
    assert not template_path().exists()
    keep_template(_database(tmp_path / "new.db", flow_runs=0))
    assert template_path().is_file()
    assert not [p for p in template_path().parent.iterdir() if p != template_path()]


def test_a_cache_that_cannot_be_used_leaves_prefect_to_make_its_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("LOWTIDE_CACHE_DIR", str(blocked / "cache"))
    keep_template(_database(tmp_path / "new.db", flow_runs=0))  # nothing raised
    assert not seed_database(tmp_path / "home" / "prefect.db")
    monkeypatch.setenv("LOWTIDE_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache").mkdir()
    template_path().write_bytes(b"cut off")  # a damaged copy is dropped, not used
    assert not seed_database(tmp_path / "home" / "prefect.db")
    assert not template_path().exists()
    assert not (tmp_path / "home" / "prefect.db").exists()


def test_an_existing_database_is_never_replaced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOWTIDE_CACHE_DIR", str(tmp_path / "cache"))
    database = tmp_path / "home" / "prefect.db"
    assert not seed_database(database)  # no copy kept yet: Prefect makes its own
    assert not database.exists()
    keep_template(_database(tmp_path / "new.db", flow_runs=0))
    _database(tmp_path / "mine.db", flow_runs=3).rename(tmp_path / "home.db")
    assert not seed_database(tmp_path / "home.db")
    assert _rows(tmp_path / "home.db", "flow_run") == 3
    assert seed_database(database)
    assert _rows(database, "flow_run") == 0
    assert sorted(p.name for p in database.parent.iterdir()) == ["prefect.db"]
