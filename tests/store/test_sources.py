"""A job's input rows are stored once however many runs read them; `src_<view>` still shows
one row per run and input row."""

from __future__ import annotations

from datetime import date
from pathlib import Path

import duckdb
import polars as pl
import pytest

from lowtide.store import Store, migrations
from tests.sql import query, scalar


def _rows(store: Store, run_id: str) -> list[tuple]:
    return query(
        store,
        "SELECT source_id, body, lang FROM src_x WHERE run_id = ? ORDER BY source_id",
        [run_id],
    ).rows()


def test_runs_reading_the_same_rows_store_each_row_once(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    first = pl.DataFrame(
        {"source_id": ["a", "b", "c"], "body": ["one", "two", "three"], "lang": ["en"] * 3}
    )
    store.save_sources("x", "r1", first)
    store.save_sources("x", "r2", first.select("lang", "body", "source_id"))  # columns moved
    assert scalar(store, 'SELECT count(*) FROM "src_x-rows"') == 3

    changed = pl.DataFrame(
        {"source_id": ["a", "b", "d"], "body": ["one", "TWO", "four"], "lang": ["en"] * 3}
    )
    store.save_sources("x", "r3", changed)
    assert scalar(store, 'SELECT count(*) FROM "src_x-rows"') == 5  # + b's new text, + d

    assert _rows(store, "r1") == [("a", "one", "en"), ("b", "two", "en"), ("c", "three", "en")]
    assert _rows(store, "r2") == _rows(store, "r1")
    assert _rows(store, "r3") == [("a", "one", "en"), ("b", "TWO", "en"), ("d", "four", "en")]

    store.save_sources("x", "r3", changed.head(1))  # a resumed run saving again replaces its own
    assert _rows(store, "r3") == [("a", "one", "en")]
    assert _rows(store, "r1")[1] == ("b", "two", "en")


def test_a_state_file_from_before_keeps_every_runs_rows(tmp_path: Path) -> None:
    """Migration 14 turns the per-run copies into distinct rows and membership."""
    path = tmp_path / "state.duckdb"
    con = duckdb.connect(str(path))
    migrations.current_version(con)
    for number, description, sql in migrations.MIGRATIONS:
        if number < 14:
            sql(con) if callable(sql) else con.execute(sql)
            con.execute("INSERT INTO schema_version VALUES (?, ?, now())", [number, description])
    con.execute(
        "CREATE TABLE src_x (run_id VARCHAR, source_id VARCHAR, body VARCHAR, lang VARCHAR)"
    )
    con.execute(
        "INSERT INTO src_x VALUES ('r1', 'a', 'one', NULL), ('r1', 'b', 'two', NULL), "
        "('r2', 'a', 'one', NULL), ('r2', 'b', 'TWO', 'en')"
    )
    con.close()

    store = Store(path)
    assert _rows(store, "r1") == [("a", "one", None), ("b", "two", None)]
    assert _rows(store, "r2") == [("a", "one", None), ("b", "TWO", "en")]
    assert scalar(store, 'SELECT count(*) FROM "src_x-rows"') == 3
    assert scalar(store, "SELECT max(version) FROM schema_version") == migrations.LATEST

    # the next run of the same rows adds no content
    store.save_sources(
        "x",
        "r3",
        pl.DataFrame(
            {"source_id": ["a"], "body": ["one"], "lang": pl.Series([None], dtype=pl.String)}
        ),
    )
    assert scalar(store, 'SELECT count(*) FROM "src_x-rows"') == 3


def test_a_column_read_as_another_type_is_widened_not_truncated(tmp_path: Path) -> None:
    """A number column whose new rows gain a fraction, a date column that gains times, an id
    column that gains letters: the stored column takes a type that holds old and new values
    (inserting as-is stored 4.5 in a BIGINT column as 4, and 'x' stopped the load)."""
    store = Store(tmp_path / "state.duckdb")
    store.save_sources(
        "x",
        "r1",
        pl.DataFrame({"source_id": ["a"], "rating": [4], "code": [7], "body": ["one"]}),
    )
    store.save_sources(
        "x",
        "r2",
        pl.DataFrame(
            {
                "source_id": ["a", "b"],
                "rating": [4.0, 4.5],
                "code": ["7", "x7"],
                "body": ["one", "two"],
            }
        ),
    )
    assert query(
        store, "SELECT source_id, rating, code FROM src_x WHERE run_id = 'r2' ORDER BY source_id"
    ).rows() == [("a", 4.0, "7"), ("b", 4.5, "x7")]
    assert query(store, "SELECT rating, code FROM src_x WHERE run_id = 'r1'").rows() == [(4.0, "7")]


def test_a_column_empty_tonight_keeps_its_type_and_one_duckdb_cannot_widen_becomes_text(
    tmp_path: Path,
) -> None:
    """An optional column empty tonight is read as text; it fits the stored column as it is (it
    does not turn every earlier run's numbers into text). DATE and BIGINT have DuckDB's common
    type DATE, which cannot hold 7: the column becomes text instead of stopping the load."""
    store = Store(tmp_path / "state.duckdb")
    first = pl.DataFrame({"source_id": ["a"], "rating": [4], "seen": [date(2026, 1, 2)]})
    store.save_sources("x", "r1", first)
    empty = pl.DataFrame(
        {"source_id": ["b"], "rating": [None], "seen": [date(2026, 1, 3)]},
        schema_overrides={"rating": pl.String},
    )
    store.save_sources("x", "r2", empty)
    types = dict(
        query(
            store,
            "SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = 'src_x-rows'",
        ).rows()
    )
    assert types["rating"] == "BIGINT"
    store.save_sources("x", "r3", pl.DataFrame({"source_id": ["c"], "rating": [5], "seen": [7]}))
    assert query(store, "SELECT rating, seen FROM src_x ORDER BY run_id").rows() == [
        (4, "2026-01-02"),
        (None, "2026-01-03"),
        (5, "7"),
    ]


def test_a_runs_sources_file_stores_as_its_frame_would_a_slice_at_a_time(
    tmp_path: Path, monkeypatch
) -> None:
    """load hands the store its sources file (`text`, `_priority`); the rows are stored under
    the input's names, slice by slice, with the keys a frame of the same rows gets, whatever
    the column types (so unchanged rows are still found unchanged)."""
    from datetime import datetime, timedelta

    from lowtide.store import sources

    monkeypatch.setattr(sources, "INSERT_SLICE_ROWS", 3)
    n = 8
    rows = pl.DataFrame(
        {
            "source_id": [f"r{i}" for i in range(n)],
            "body": [f"text {i}" for i in range(n)],
            "seen": pl.Series([datetime(2026, 1, 1 + i) for i in range(n)]).cast(pl.Datetime("ms")),
            "took": [timedelta(seconds=i) for i in range(n)],
            "score": [i if i != 6 else None for i in range(n)],
        }
    )
    file = tmp_path / "sources.parquet"
    flagged = rows.rename({"body": "text"}).with_columns(pl.lit(True).alias("_priority"))
    flagged.write_parquet(file, row_group_size=2)

    store = Store(tmp_path / "state.duckdb")
    store.save_sources("x", "r1", rows)
    store.save_sources("x", "r2", file, text_column="body")
    assert scalar(store, 'SELECT count(*) FROM "src_x-rows"') == n  # the same rows, once
    stored = query(store, "SELECT * EXCLUDE (run_id, took) FROM src_x WHERE run_id = 'r2'")
    assert stored.sort("source_id").equals(rows.drop("took"))  # (polars reads no INTERVAL)

    # a later night of floats where the rows held integers: the column widens slice by slice
    wider = rows.with_columns(pl.col("score").cast(pl.Float64) + 0.5).rename({"body": "text"})
    wider.write_parquet(file)
    store.save_sources("x", "r3", file, text_column="body")
    scores = query(store, "SELECT score FROM src_x WHERE run_id = 'r3' ORDER BY source_id")
    assert scores["score"].to_list() == [0.5, 1.5, 2.5, 3.5, 4.5, 5.5, None, 7.5]


def test_a_save_failing_on_a_later_slice_takes_the_runs_membership_back(
    tmp_path: Path, monkeypatch
) -> None:
    """Each slice commits on its own (one transaction held the whole night in memory), so a
    slice that fails after others went in leaves no half membership of the run: its rows are
    not shown as read by it, and the runs before keep theirs. Saving again stores each row
    once."""
    from lowtide.store import sources

    monkeypatch.setattr(sources, "INSERT_SLICE_ROWS", 2)
    rows = pl.DataFrame({"source_id": ["a", "b", "c", "d"], "body": ["1", "2", "3", "4"]})
    store = Store(tmp_path / "state.duckdb")
    store.save_sources("x", "r1", rows)
    broken = rows.with_columns(source_id=pl.Series(["a", "b", None, "d"]))  # fails slice 2
    with pytest.raises(duckdb.ConstraintException):
        store.save_sources("x", "r2", broken)
    assert scalar(store, "SELECT count(*) FROM src_x WHERE run_id = 'r2'") == 0
    assert scalar(store, "SELECT count(*) FROM src_x WHERE run_id = 'r1'") == 4

    store.save_sources("x", "r2", rows)
    assert scalar(store, "SELECT count(*) FROM src_x WHERE run_id = 'r2'") == 4
    assert scalar(store, 'SELECT count(*) FROM "src_x-rows"') == 4


def test_a_first_save_failing_midway_then_saved_again_stores_each_row_once(
    tmp_path: Path, monkeypatch
) -> None:
    """A view's first save that fails midway leaves its first slices stored; saving again
    finds them and stores each row once."""
    from lowtide.store import sources

    monkeypatch.setattr(sources, "INSERT_SLICE_ROWS", 2)
    rows = pl.DataFrame({"source_id": ["a", "b", "c", "d", "e"], "body": ["1", "2", "3", "4", "5"]})
    store = Store(tmp_path / "state.duckdb")
    broken = rows.with_columns(source_id=pl.Series(["a", "b", None, "d", "e"]))  # fails slice 2
    with pytest.raises(duckdb.ConstraintException):
        store.save_sources("x", "r1", broken)
    assert scalar(store, 'SELECT count(*) FROM "src_x-rows"') == 2  # slice 1 stayed

    store.save_sources("x", "r1", rows)
    assert scalar(store, 'SELECT count(*) FROM "src_x-rows"') == 5
    assert query(store, "SELECT source_id FROM src_x WHERE run_id = 'r1' ORDER BY 1")[
        "source_id"
    ].to_list() == ["a", "b", "c", "d", "e"]
