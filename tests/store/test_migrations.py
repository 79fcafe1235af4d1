from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import duckdb
import polars as pl
import pytest

from lowtide.errors import StateLockedError, StateTooNewError
from lowtide.store import Store, migrations
from tests.sql import query, scalar

TABLES = {
    "schema_version",
    "jobs",
    "runs",
    "units",
    "requests",
    "batches",
    "batch_requests",
    "results",
    "failures",
    "qa_samples",
    "eval_scores",
    "costs",
    "metrics",
}


def test_empty_file_is_migrated_to_the_latest_schema(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    assert scalar(store, "SELECT max(version) FROM schema_version") == migrations.LATEST
    names = set(query(store, "SELECT table_name FROM duckdb_tables()")["table_name"].to_list())
    assert TABLES <= names
    cols = set(
        query(store, "SELECT column_name FROM duckdb_columns() WHERE table_name = 'results'")[
            "column_name"
        ]
    )
    assert {"custom_id", "outcome", "output", "error", "input_tokens", "attempts"} <= cols


def test_migrating_twice_changes_nothing(tmp_path: Path) -> None:
    con = duckdb.connect(str(tmp_path / "s.duckdb"))
    assert migrations.apply(con) == migrations.LATEST
    assert migrations.apply(con) == migrations.LATEST
    assert con.execute("SELECT count(*) FROM schema_version").fetchall()[0][0] == len(
        migrations.MIGRATIONS
    )


def test_a_newer_file_is_refused(tmp_path: Path) -> None:
    con = duckdb.connect(str(tmp_path / "s.duckdb"))
    migrations.apply(con)
    con.execute("INSERT INTO schema_version VALUES (999, 'future', now())")
    with pytest.raises(StateTooNewError, match="newer than this lowtide"):
        migrations.apply(con)


def test_a_held_state_file_is_waited_for_then_named(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    Store(path).list_runs()  # created and migrated
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import duckdb,time; c=duckdb.connect({str(path)!r}); print('held', flush=True); time.sleep(30)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StateLockedError, match=rf"state file {path} is locked by .*waited 1 s"):
            Store(path, lock_timeout_s=1.0).list_runs()
    finally:
        holder.kill()
        holder.wait()


def test_one_process_drives_a_run_and_a_dead_holder_frees_it(tmp_path: Path) -> None:

    store = Store(tmp_path / "s.duckdb")
    store.open_run(
        run_id="r",
        job="j",
        job_fingerprint="f",
        job_file="job.toml",
        backend="emulator",
        model="m",
        input_fingerprint="i",
    )
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    import socket

    here = socket.gethostname()
    assert store.claim_run("r", f"{here}:{os.getpid()}:a", 60) is None
    assert store.claim_run("r", f"{here}:{os.getpid()}:b", 60) == f"{here}:{os.getpid()}:a"
    store.release_run("r", f"{here}:{os.getpid()}:a")
    assert store.claim_run("r", f"{here}:{gone}:dead", 60) is None  # taken by a process...
    assert store.claim_run("r", f"{here}:{os.getpid()}:b", 60) is None  # ...that is gone: free
    assert store.claim_run("r", "elsewhere:1:x", 60) == f"{here}:{os.getpid()}:b"


def _file_just_before(path: Path, step_says: str) -> duckdb.DuckDBPyConnection:
    """A state file at `path` migrated up to the step whose description holds `step_says`,
    that step and those after it not applied; open, for the test to fill."""
    step = next(n for n, text, _ in migrations.MIGRATIONS if step_says in text)
    con = duckdb.connect(str(path))
    migrations.current_version(con)
    for number, description, sql in migrations.MIGRATIONS:
        if number < step:
            sql(con) if callable(sql) else con.execute(sql)
            con.execute("INSERT INTO schema_version VALUES (?, ?, now())", [number, description])
    return con


def test_results_from_before_engines_are_credited_to_their_runs_backend(tmp_path: Path) -> None:
    """The step that adds `results.engine` fills it for old answers from the run that received
    them: an emulator run's answers are the emulator's, a real backend's are `<backend>:<model>`."""
    path = tmp_path / "s.duckdb"
    con = _file_just_before(path, "which engine gave it")
    for run_id, backend, model in (("a", "emulator", "gpt-4o-mini"), ("b", "openai", "gpt-4o")):
        con.execute(
            "INSERT INTO runs (run_id, job, job_fingerprint, backend, model, status, started_at) "
            "VALUES (?, 'j', 'f', ?, ?, 'completed', now())",
            [run_id, backend, model],
        )
        con.execute(
            "INSERT INTO results (custom_id, run_id, outcome, attempts, received_at) "
            "VALUES (?, ?, 'ok', 1, now())",
            [f"lt1_{run_id}", run_id],
        )
    con.close()
    store = Store(path)
    engines = dict(query(store, "SELECT run_id, engine FROM results ORDER BY 1").iter_rows())
    assert engines == {"a": "emulator", "b": "openai:gpt-4o"}
    assert scalar(store, "SELECT max(version) FROM schema_version") == migrations.LATEST


@pytest.mark.parametrize(
    ("storage_version", "compressions"),
    [(None, {"ZSTD"}), ("v1.0.0", None)],  # None: DuckDB's own pick, whatever it is
)
def test_request_messages_are_zstd_where_the_file_format_allows_it(
    tmp_path: Path, storage_version: str | None, compressions: set[str] | None
) -> None:
    """A file in DuckDB's older storage format cannot be told a column's compression: it is
    migrated all the same, and keeps DuckDB's pick."""
    con = duckdb.connect()
    option = f" (STORAGE_VERSION '{storage_version}')" if storage_version else ""
    con.execute(f"ATTACH '{tmp_path / 'state.duckdb'}' AS state{option}")
    con.execute("USE state")
    assert migrations.apply(con) == migrations.LATEST
    con.execute(
        "INSERT INTO requests (custom_id, request_key, job, model, first_run_id, created_at, "
        "user_message) SELECT 'c' || i, 'k' || i, 'j', 'm', 'r', now(), "
        "repeat('a message of some length ', 8) || i FROM range(5000) t(i)"
    )
    con.execute("CHECKPOINT")
    used = {
        r[0]
        for r in con.execute(
            "SELECT compression FROM pragma_storage_info('requests') "
            "WHERE column_name = 'user_message' AND segment_type = 'VARCHAR'"
        ).fetchall()
    }
    assert used and (compressions is None or used == compressions)


def test_big_tables_lose_their_keys_and_keep_their_rows_and_compression(tmp_path: Path) -> None:
    """Migration 16 rebuilds `results`, `requests`, `batch_requests` and `units` without a
    primary key: every row, every NOT NULL and the messages' zstd are kept, and later writes
    still keep one row per key."""
    path = tmp_path / "s.duckdb"
    con = _file_just_before(path, "keeps one row per key")
    con.execute(
        "INSERT INTO results (custom_id, batch_id, run_id, outcome, attempts, received_at, "
        "engine) SELECT 'c' || i, 'b1', 'r', 'ok', 1, now(), 'emulator' FROM range(3) t(i)"
    )
    con.execute("INSERT INTO batch_requests SELECT 'b1', 'c' || i FROM range(3) t(i)")
    con.execute(
        "INSERT INTO requests (custom_id, request_key, job, model, first_run_id, created_at, "
        "user_message) SELECT 'c' || i, 'k' || i, 'j', 'm', 'r', now(), "
        "repeat('a message of some length ', 8) || i FROM range(5000) t(i)"
    )
    con.execute(
        "INSERT INTO units (run_id, unit_id, source_id, kind, chunk_index, n_chunks, custom_id, "
        "cache_hit) SELECT 'r', 'u' || i, 's' || i, 'row', 0, 1, 'c' || i, false "
        "FROM range(3) t(i)"
    )
    con.close()

    store = Store(path)
    assert scalar(store, "SELECT max(version) FROM schema_version") == migrations.LATEST
    kinds = query(
        store,
        "SELECT table_name, constraint_type, constraint_column_names[1] AS col "
        "FROM duckdb_constraints() WHERE database_name = current_database() "
        "AND table_name IN ('results', 'batch_requests', 'requests', 'units')",
    )
    assert "PRIMARY KEY" not in kinds["constraint_type"].to_list()
    required = set(
        kinds.filter(kinds["constraint_type"] == "NOT NULL")
        .select(pl.concat_str("table_name", pl.lit("."), "col"))
        .to_series()
        .to_list()
    )
    assert {
        "results.custom_id",
        "results.outcome",
        "results.received_at",
        "batch_requests.batch_id",
        "requests.request_key",
        "units.unit_id",
    } <= required
    counts = query(
        store,
        "SELECT (SELECT count(*) FROM batch_requests) AS members, "
        "(SELECT count(*) FROM results WHERE engine = 'emulator') AS results, "
        "(SELECT count(*) FROM requests) AS requests, (SELECT count(*) FROM units) AS units",
    )
    assert counts.rows() == [(3, 3, 5000, 3)]
    store._query("CHECKPOINT")
    used = query(
        store,
        "SELECT DISTINCT compression FROM pragma_storage_info('requests') "
        "WHERE column_name = 'user_message' AND segment_type = 'VARCHAR'",
    )
    assert used["compression"].to_list() == ["ZSTD"]

    # a failure of a later attempt leaves an answer alone; a new key is added once
    again = query(store, "SELECT * EXCLUDE (received_at) FROM results ORDER BY custom_id")
    again = again.with_columns(
        outcome=pl.lit("provider_error"), batch_id=pl.lit("b2"), error=pl.lit("boom")
    )
    fresh = again.head(1).with_columns(custom_id=pl.lit("c9"))
    store.upsert_results(pl.concat([again, fresh, fresh]))
    rows = query(store, "SELECT custom_id, outcome FROM results ORDER BY custom_id")
    assert rows.rows() == [("c0", "ok"), ("c1", "ok"), ("c2", "ok"), ("c9", "provider_error")]


def test_cuts_keyed_by_md5_keep_their_key_under_its_new_name(tmp_path: Path) -> None:
    path = tmp_path / "s.duckdb"
    con = _file_just_before(path, "remembered cuts are found by a key")
    con.execute("INSERT INTO chunk_cuts VALUES ('0123abcd', 'v1:budget', [0, 9], [9, 9], [3, 3])")
    con.close()
    store = Store(path)
    cuts = store.chunk_cuts("v1:budget", pl.Series(["0123abcd"]))
    assert cuts.to_dicts() == [
        {"text_key": "0123abcd", "starts": [0, 9], "lengths": [9, 9], "tokens": [3, 3]}
    ]
    assert store.has_md5_cuts("v1:budget") and not store.has_md5_cuts("v1:other")


def test_remembered_cuts_lose_their_key_and_stay_one_per_text_and_budget(
    tmp_path: Path,
) -> None:
    """Migration 19 rebuilds `chunk_cuts` without its primary key: the cuts and NOT NULLs stay,
    a cut remembered again is not stored twice, and a lookup gives one cut per text even where
    two processes both kept one."""
    path = tmp_path / "s.duckdb"
    con = _file_just_before(path, "remembered cuts without a primary key")
    con.execute("INSERT INTO chunk_cuts VALUES ('xxh3:1', 'v1:budget', [0, 9], [9, 9], [3, 3])")
    con.close()

    store = Store(path)
    kinds = query(
        store,
        "SELECT constraint_type, constraint_column_names[1] AS col FROM duckdb_constraints() "
        "WHERE database_name = current_database() AND table_name = 'chunk_cuts'",
    )
    assert "PRIMARY KEY" not in kinds["constraint_type"].to_list()
    assert {"text_key", "budget", "starts"} <= set(
        kinds.filter(kinds["constraint_type"] == "NOT NULL")["col"].to_list()
    )

    cut = pl.DataFrame(
        {"text_key": ["xxh3:1", "xxh3:2"], "starts": [[0, 9], [0]], "lengths": [[9, 9], [4]]}
    ).with_columns(pl.col("lengths").alias("tokens"))
    cut = cut.cast({c: pl.List(pl.Int32) for c in ("starts", "lengths", "tokens")})
    store.remember_chunk_cuts("v1:budget", cut, "v1")
    store.remember_chunk_cuts("v1:other", cut.head(1), "v1")  # another budget: its own cut
    assert scalar(store, "SELECT count(*) FROM chunk_cuts") == 3

    # a second process's copy of the same cut (no key refuses it) is read once
    store._query("INSERT INTO chunk_cuts VALUES ('xxh3:2', 'v1:budget', [0], [4], [4]) RETURNING 1")
    found = store.chunk_cuts("v1:budget", pl.Series(["xxh3:1", "xxh3:2", "xxh3:3"]))
    assert sorted(found["text_key"].to_list()) == ["xxh3:1", "xxh3:2"]
