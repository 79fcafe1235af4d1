"""A publish patches a copy of the previous published file with what changed; the result is the
same as writing it whole."""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import duckdb
import pytest

from lowtide.store import Store, state_copy
from lowtide.store.publish_delta import refresh_tables
from tests.store.test_publish import _seed


def _written_during_every_copy(
    store: Store, monkeypatch: pytest.MonkeyPatch, checkpointed: bool = False
) -> None:
    """Another thread commits while each copy of the state file is taken (and, `checkpointed`,
    checkpoints it too, emptying the log): no copy can be trusted to be one state of it, so
    publishing falls back to patching the previous file."""
    real_copy = state_copy.copy_uncached
    commits = itertools.count(1)

    def copy_while_another_thread_commits(src: Path, dst: Path) -> None:
        real_copy(src, dst)  # (a commit that changes nothing writes nothing: a new value each)
        store.set_metrics("elsewhere", {"written_during_the_copy": float(next(commits))})
        if checkpointed:
            with store._connect() as con:
                con.execute("CHECKPOINT")

    monkeypatch.setattr(state_copy, "copy_uncached", copy_while_another_thread_commits)


def _pair(tmp_path: Path) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect(str(tmp_path / "state.duckdb"))
    con.execute(
        "CREATE TABLE results AS SELECT i AS id, 'answer ' || i AS output FROM range(100) t(i)"
    )
    con.execute("CREATE TABLE runs AS SELECT 'r1' AS run_id, 'completed' AS status")
    con.execute(f"ATTACH '{tmp_path / 'pub.duckdb'}' AS pub")
    refresh_tables(con, ["results", "runs"])  # an empty file: every table written
    con.execute("CREATE VIEW pub.my_view AS SELECT * FROM pub.results")
    con.execute("CREATE TABLE pub.old_table AS SELECT 1 AS x")
    return con


def _same(con: duckdb.DuckDBPyConnection, table: str) -> bool:
    return not con.execute(
        f"(SELECT * FROM {table} EXCEPT ALL SELECT * FROM pub.{table}) UNION ALL "
        f"(SELECT * FROM pub.{table} EXCEPT ALL SELECT * FROM {table})"
    ).fetchall()


def _rowid(con: duckdb.DuckDBPyConnection, id_: int) -> int:
    return con.execute("SELECT rowid FROM pub.results WHERE id = ?", [id_]).fetchall()[0][0]


def test_a_few_changed_rows_are_patched_in_place(tmp_path: Path) -> None:
    con = _pair(tmp_path)
    kept = _rowid(con, 50)
    con.execute("UPDATE results SET output = 'changed' WHERE id IN (3, 7)")
    con.execute("DELETE FROM results WHERE id = 0")
    con.execute("INSERT INTO results SELECT i, 'new ' || i FROM range(100, 103) t(i)")
    con.execute("UPDATE runs SET status = 'held'")  # one row of one: rewritten whole
    refresh_tables(con, ["results", "runs"])
    assert _same(con, "results") and _same(con, "runs")
    assert _rowid(con, 50) == kept  # untouched rows stay where they were: patched, not copied
    left = con.execute(
        "SELECT table_name FROM duckdb_tables() WHERE database_name = 'pub' ORDER BY 1"
    ).fetchall()
    assert left == [("results",), ("runs",)]  # a table the state file no longer has is gone
    assert not con.execute("SELECT * FROM duckdb_views() WHERE database_name = 'pub'").fetchall()


def test_columns_named_like_a_row_alias_are_patched_by_whole_rows(tmp_path: Path) -> None:
    """An input's columns reach the published file's tables: columns named `p` or `s` must not
    be taken for the row they are in when rows are matched."""
    con = duckdb.connect(str(tmp_path / "state.duckdb"))
    con.execute(
        "CREATE TABLE src AS SELECT i AS p, i % 3 AS s, 'text ' || i AS t FROM range(40) t(i)"
    )
    con.execute(f"ATTACH '{tmp_path / 'pub.duckdb'}' AS pub")
    refresh_tables(con, ["src"])
    con.execute("UPDATE src SET t = 'changed' WHERE p IN (3, 7)")
    con.execute("INSERT INTO src VALUES (40, 1, 'new')")
    refresh_tables(con, ["src"])
    assert _same(con, "src")


def test_new_columns_and_repeated_rows_rewrite_the_table(tmp_path: Path) -> None:
    con = _pair(tmp_path)
    con.execute("ALTER TABLE results ADD COLUMN lang VARCHAR DEFAULT 'en'")
    con.execute("INSERT INTO runs VALUES ('r1', 'completed')")  # a repeat: hashes cannot tell
    refresh_tables(con, ["results", "runs"])
    assert _same(con, "results") and _same(con, "runs")
    assert con.execute("SELECT count(*) FROM pub.runs").fetchall()[0][0] == 2


def test_a_damaged_previous_file_is_replaced_by_a_whole_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO, logger="lowtide.store.publish")
    store = Store(tmp_path / "state.duckdb")
    _written_during_every_copy(store, monkeypatch)
    _seed(store, "run1", "first")
    db = tmp_path / "pub.duckdb"
    db.write_bytes(b"not a database" * 1000)
    store.publish(db)
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT label FROM my_job").fetchall() == [("first",)]
    assert any("not patched" in r.getMessage() for r in caplog.records)


def test_each_publish_shows_the_newest_run_and_equals_the_state_file(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    db = tmp_path / "pub.duckdb"
    for n in range(1, 4):
        _seed(store, f"run{n}", f"label{n}")
        store.publish(db)
    con = duckdb.connect(str(tmp_path / "state.duckdb"), read_only=True)
    con.execute(f"ATTACH '{db}' AS pub (READ_ONLY)")
    tables = [
        r[0]
        for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = 'pub'"
        ).fetchall()
    ]
    assert {"runs", "results", "units", "run_sources", "src_my_job-rows"} <= set(tables)
    assert all(_same(con, f'"{t}"') for t in tables)
    assert con.execute("SELECT label, run_id FROM pub.my_job").fetchall() == [("label3", "run3")]


def test_patching_night_after_night_stays_near_the_size_of_a_fresh_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thirty nights, each adding 1% new answers and changing a few, with the state file never
    still while it is copied: the file is patched, and its free space never grows past what a
    rewrite would reclaim."""
    state = tmp_path / "state.duckdb"
    store = Store(state)
    store.list_runs()  # created and migrated
    _written_during_every_copy(store, monkeypatch)
    answers = (
        "INSERT INTO results (custom_id, run_id, outcome, output, attempts, received_at) "
        "SELECT 'c' || i, 'r', 'ok', repeat('an answer ', 30) || i, 1, now() "
        "FROM range({start}, {stop}) t(i)"
    )
    with duckdb.connect(str(state)) as con:
        con.execute(answers.format(start=0, stop=5000))
    db = tmp_path / "pub.duckdb"
    store.publish(db)
    caplog.set_level(logging.INFO, logger="lowtide.store.publish")
    for night in range(30):
        with duckdb.connect(str(state)) as con:
            con.execute(answers.format(start=5000 + 50 * night, stop=5050 + 50 * night))
            con.execute(
                "UPDATE results SET outcome = 'repaired' WHERE custom_id IN (SELECT 'c' || i "
                f"FROM range({night}, 5000, 997) t(i))"
            )
        store.publish(db)
    patched = [r for r in caplog.records if r.getMessage().endswith(": patched")]
    assert len(patched) >= 15  # most nights patch the previous file
    fresh = store.publish(tmp_path / "fresh.duckdb")
    assert db.stat().st_size <= 1.25 * fresh.stat().st_size


def test_a_log_left_beside_the_previous_file_is_not_left_beside_the_new_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = Store(tmp_path / "state.duckdb")
    _seed(store, "run1", "first")
    db = store.publish(tmp_path / "pub.duckdb")
    wal = db.with_name(db.name + ".wal")
    wal.write_bytes(b"someone wrote to the published file")
    _seed(store, "run2", "second")
    store.publish(db)
    assert not wal.exists()
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT label FROM my_job").fetchall() == [("second",)]


def _keyed_pair(tmp_path: Path, state_version: int, pub_version: int) -> duckdb.DuckDBPyConnection:
    """A state file with a units-like table (rows only added or removed) published once."""
    con = duckdb.connect(str(tmp_path / "state.duckdb"))
    con.execute(
        "CREATE TABLE units AS SELECT 'r1' AS run_id, 'u' || i AS unit_id, 'text ' || i AS t "
        "FROM range(100) t(i)"
    )
    con.execute(f"CREATE TABLE schema_version AS SELECT {pub_version} AS version")
    con.execute(f"ATTACH '{tmp_path / 'pub.duckdb'}' AS pub")
    refresh_tables(con, ["schema_version", "units"])
    con.execute(f"UPDATE schema_version SET version = {state_version}")
    return con


def test_a_table_only_added_to_is_patched_by_its_key(tmp_path: Path) -> None:
    con = _keyed_pair(tmp_path, state_version=15, pub_version=15)
    kept = con.execute(
        "SELECT rowid FROM pub.units WHERE run_id = 'r1' AND unit_id = 'u50'"
    ).fetchall()
    con.execute("INSERT INTO units SELECT 'r2', 'u' || i, 'text ' || i FROM range(100) t(i)")
    con.execute("DELETE FROM units WHERE run_id = 'r1' AND unit_id IN ('u3', 'u7')")
    refresh_tables(con, ["schema_version", "units"], {"units": ("run_id", "unit_id")})
    assert _same(con, "units")
    assert con.execute("SELECT count(*) FROM pub.units").fetchall()[0][0] == 198
    # patched in place, not rewritten: an untouched row keeps its place
    assert (
        con.execute(
            "SELECT rowid FROM pub.units WHERE run_id = 'r1' AND unit_id = 'u50'"
        ).fetchall()
        == kept
    )


def test_after_a_migration_keyed_tables_are_compared_by_whole_rows(tmp_path: Path) -> None:
    """A migration may rewrite rows in place, which comparing keys cannot see."""
    con = _keyed_pair(tmp_path, state_version=16, pub_version=15)
    con.execute("UPDATE units SET t = 'migrated' WHERE unit_id = 'u3'")
    refresh_tables(con, ["schema_version", "units"], {"units": ("run_id", "unit_id")})
    assert _same(con, "units") and _same(con, "schema_version")
    assert con.execute("SELECT t FROM pub.units WHERE unit_id = 'u3'").fetchall() == [("migrated",)]


def test_a_key_repeated_in_a_keyed_table_rewrites_it(tmp_path: Path) -> None:
    con = _keyed_pair(tmp_path, state_version=15, pub_version=15)
    con.execute("INSERT INTO units VALUES ('r1', 'u3', 'a second text')")
    refresh_tables(con, ["schema_version", "units"], {"units": ("run_id", "unit_id")})
    assert _same(con, "units")


def test_a_row_put_back_under_its_key_with_other_values_is_replaced(tmp_path: Path) -> None:
    """A resumed run re-inserts its units under the same keys; a state file made anew holds the
    same requests from other runs: every compared column counts, not the key alone."""
    con = _keyed_pair(tmp_path, state_version=15, pub_version=15)
    con.execute("DELETE FROM units WHERE unit_id = 'u3'")
    con.execute("INSERT INTO units VALUES ('r1', 'u3', 'prepared again')")
    refresh_tables(con, ["schema_version", "units"], {"units": ()})
    assert _same(con, "units")
    assert con.execute("SELECT t FROM pub.units WHERE unit_id = 'u3'").fetchall() == [
        ("prepared again",)
    ]


def test_a_first_publish_is_a_copy_of_the_state_file_without_its_own_tables(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="lowtide.store.publish")
    state = tmp_path / "state.duckdb"
    store = Store(state)
    _seed(store, "run1", "first")
    with duckdb.connect(str(state)) as con:  # what only the state keeps, and a view of its own
        con.execute("INSERT INTO chunk_cuts VALUES ('md5', 'budget', [0], [5], [1])")
        con.execute("CREATE VIEW private_view AS SELECT 1 AS x")
    db = store.publish(tmp_path / "pub.duckdb")
    assert any(r.getMessage().endswith(": copied from the state file") for r in caplog.records)
    con = duckdb.connect(str(state), read_only=True)
    con.execute(f"ATTACH '{db}' AS pub (READ_ONLY)")
    tables = {
        r[0]
        for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = 'pub'"
        ).fetchall()
    }
    assert "chunk_cuts" not in tables and {"results", "requests", "src_my_job-rows"} <= tables
    assert all(_same(con, f'"{t}"') for t in tables)
    views = {
        r[0]
        for r in con.execute(
            "SELECT view_name FROM duckdb_views() WHERE database_name = 'pub' AND NOT internal"
        ).fetchall()
    }
    assert "private_view" not in views and "my_job" in views
    assert con.execute("SELECT label FROM pub.my_job").fetchall() == [("first",)]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_state_file_written_while_it_is_copied_is_published_whole(
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    checkpointed: bool,
) -> None:
    """Another thread's commit lands in the middle of the copy (and, `checkpointed`, reaches
    the file itself, leaving no log behind): the copy may hold half of it, so it is thrown away
    and (no previous file to patch) the file written from the tables."""
    caplog.set_level(logging.INFO, logger="lowtide.store.publish")
    state = tmp_path / "state.duckdb"
    store = Store(state)
    _seed(store, "run1", "first")
    _written_during_every_copy(store, monkeypatch, checkpointed)
    db = store.publish(tmp_path / "pub.duckdb")
    messages = [r.getMessage() for r in caplog.records]
    assert not any(m.endswith(": copied from the state file") for m in messages)
    assert any(m.endswith(": written whole") for m in messages)
    assert not list(tmp_path.glob(".pub.duckdb.*"))  # the discarded copy is gone
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute(  # the commit that spoiled the copy is in the file written instead
        "SELECT value FROM metrics WHERE name = 'written_during_the_copy'"
    ).fetchall() == [(1.0,)]
    assert con.execute("SELECT label FROM my_job").fetchall() == [("first",)]


def test_a_copy_that_fails_falls_back_to_writing_the_file_whole(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills while the state file is copied: the half copy goes, and the file is
    written from the tables (smaller than the state file: it may still fit)."""
    caplog.set_level(logging.INFO, logger="lowtide.store.publish")
    store = Store(tmp_path / "state.duckdb")
    _seed(store, "run1", "first")

    def disk_full(src: Path, dst: Path) -> None:
        Path(dst).write_bytes(b"half a copy")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(state_copy, "copy_uncached", disk_full)
    db = store.publish(tmp_path / "pub.duckdb")
    assert any(r.getMessage().endswith(": written whole") for r in caplog.records)
    assert not list(tmp_path.glob(".pub.duckdb.*"))
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT label FROM my_job").fetchall() == [("first",)]


def test_a_state_file_reached_through_a_link_is_copied(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Its logs lie beside the file the link names, which is what is checked and copied."""
    caplog.set_level(logging.INFO, logger="lowtide.store.publish")
    (tmp_path / "data").mkdir()
    (tmp_path / "state.duckdb").symlink_to(tmp_path / "data" / "state.duckdb")
    store = Store(tmp_path / "state.duckdb")
    _seed(store, "run1", "first")
    db = store.publish(tmp_path / "pub.duckdb")
    assert any(r.getMessage().endswith(": copied from the state file") for r in caplog.records)
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT label FROM my_job").fetchall() == [("first",)]


def test_every_night_is_a_copy_of_the_state_file_while_it_stands_still(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A later night copies the state file again rather than patching the previous file (whose
    indexes a patch would have to load and extend): it costs what the first night's did."""
    caplog.set_level(logging.INFO, logger="lowtide.store.publish")
    state = tmp_path / "state.duckdb"
    store = Store(state)
    db = tmp_path / "pub.duckdb"
    for n in range(1, 4):
        _seed(store, f"run{n}", f"label{n}")
        store.publish(db)
    copied = [r for r in caplog.records if r.getMessage().endswith(": copied from the state file")]
    assert len(copied) == 3
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT label, run_id FROM my_job").fetchall() == [("label3", "run3")]
