from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import orjson
import polars as pl
import pytest

from lowtide.store import Store, publish
from lowtide.store.state_copy import copy_at_checkpoint
from tests.sql import query
from tests.store.runs import finish

SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string"},
        "score": {"type": "integer"},
        "ok": {"type": "boolean"},
        "tags": {"type": "array"},
    },
}


def _seed(store: Store, run_id: str, label: str) -> None:
    store.save_job("my-job", "my_job", "doc_id", SCHEMA, "job.toml")
    store.open_run(
        run_id=run_id,
        job="my-job",
        job_fingerprint="f",
        job_file="job.toml",
        backend="emulator",
        model="m",
        input_fingerprint="i",
    )
    store.save_sources(
        "my_job",
        run_id,
        pl.DataFrame({"source_id": ["d1"], "body": ["hello"], "lang": ["en"]}),
    )
    store.save_units(
        run_id,
        pl.DataFrame(
            {
                "unit_id": ["d1#0"],
                "source_id": ["d1"],
                "kind": ["row"],
                "chunk_index": [0],
                "n_chunks": [1],
                "unit_tokens": [None],
                "custom_id": [f"c-{label}"],
                "cache_hit": [False],
            },
            schema_overrides={"unit_tokens": pl.Int32},
        ),
    )
    store.upsert_results(
        pl.DataFrame(
            {
                "custom_id": [f"c-{label}"],
                "batch_id": ["b"],
                "run_id": [run_id],
                "outcome": ["ok"],
                "output": [
                    orjson.dumps({"label": label, "score": 3, "ok": True, "tags": ["a"]}).decode()
                ],
                "raw_text": [""],
                "finish_reason": ["stop"],
                "error": [None],
                "input_tokens": [1],
                "cached_tokens": [0],
                "output_tokens": [1],
                "attempts": [1],
            }
        )
    )
    assert finish(store, run_id) == "completed"
    store.mark_published(run_id)  # as publish_task does once the file is written


def test_job_view_has_source_columns_and_typed_outputs(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    _seed(store, "run1", "first")
    db = store.publish(tmp_path / "pub.duckdb")
    con = duckdb.connect(str(db), read_only=True)
    rows = con.execute("SELECT doc_id, body, lang, status, label, score, ok FROM my_job").fetchall()
    assert rows == [("d1", "hello", "en", "succeeded", "first", 3, True)]
    types = dict(
        con.execute(
            "SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = 'my_job'"
        ).fetchall()
    )
    assert types["score"] == "BIGINT" and types["ok"] == "BOOLEAN" and types["label"] == "VARCHAR"
    assert {"runs", "results", "costs", "failures"} <= {
        r[0] for r in con.execute("SHOW TABLES").fetchall()
    }


def test_publishing_swaps_the_file_while_a_reader_holds_the_old_one(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    _seed(store, "run1", "first")
    db = store.publish(tmp_path / "pub.duckdb")
    reader = duckdb.connect(str(db), read_only=True)
    assert reader.execute("SELECT label FROM my_job").fetchall() == [("first",)]
    _seed(store, "run2", "second")
    store.publish(db)  # must not be blocked by the open reader
    assert reader.execute("SELECT label FROM my_job").fetchall() == [("first",)]  # old snapshot
    reader.close()
    fresh = duckdb.connect(str(db), read_only=True)
    assert fresh.execute("SELECT label, run_id FROM my_job").fetchall() == [("second", "run2")]
    assert not list(tmp_path.glob(".pub.duckdb.*"))  # no temp file left behind


def test_sources_table_widens_when_the_input_gains_a_column(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.duckdb")
    store.save_sources("x", "r1", pl.DataFrame({"source_id": ["a"], "body": ["hi"]}))
    store.save_sources(
        "x", "r2", pl.DataFrame({"source_id": ["a"], "body": ["hi"], "lang": ["en"]})
    )
    rows = query(store, "SELECT run_id, lang FROM src_x ORDER BY run_id").rows()
    assert rows == [("r1", None), ("r2", "en")]


def test_the_views_show_the_runs_in_the_copy_even_when_a_run_ends_after_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publishing copies the state file, then makes the views in the copy. A run that ends
    between the two (another job's, in a shared state file) is not in the copy: the views must
    show the runs the copy holds, whose rows and answers it has."""
    store = Store(tmp_path / "state.duckdb")
    _seed(store, "run1", "first")

    def copy_then_another_run_ends(*args: Any, **kwargs: Any) -> bool:
        copied = copy_at_checkpoint(*args, **kwargs)
        _seed(store, "run2", "second")  # committed to the state file after the copy
        return copied

    monkeypatch.setattr(publish, "copy_at_checkpoint", copy_then_another_run_ends)
    db = store.publish(tmp_path / "pub.duckdb")
    con = duckdb.connect(str(db), read_only=True)
    assert con.execute("SELECT label, run_id FROM my_job").fetchall() == [("first", "run1")]
    con.close()
    monkeypatch.undo()
    fresh = duckdb.connect(str(store.publish(db)), read_only=True)  # the next publish has it
    assert fresh.execute("SELECT label, run_id FROM my_job").fetchall() == [("second", "run2")]
