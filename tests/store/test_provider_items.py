"""What batches left at their provider (migration 21): which batches are released, what is
counted as left, and how what lowtide learns of an item is kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb

from lowtide.store import Store
from tests.sql import query
from tests.store.runs import RUN


def _batch(path: Path, batch_id: str, run_id: str, **fields: Any) -> None:
    row = {
        "batch_id": batch_id,
        "run_id": run_id,
        "shard": 0,
        "attempt": 1,
        "backend": "openai",
        "status": "completed",
        "n_requests": 1,
        "n_bytes": 1,
        "collected": True,
        **fields,
    }
    con = duckdb.connect(str(path))
    try:
        con.execute(
            f"INSERT INTO batches ({', '.join(row)}, created_at, updated_at) "
            f"VALUES ({', '.join('?' for _ in row)}, now(), now())",
            list(row.values()),
        )
    finally:
        con.close()


def _store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "s.duckdb")
    for run_id in ("r1", "r2"):
        store.open_or_resume_run(run_id=run_id, **{**RUN, "input_fingerprint": run_id})
    return store


def test_an_empty_file_gets_the_table_and_the_release_mark(tmp_path: Path) -> None:
    store = Store(tmp_path / "s.duckdb")
    columns = query(
        store,
        "SELECT table_name, column_name FROM duckdb_columns() "
        "WHERE table_name IN ('provider_items', 'batches')",
    )
    names = set(zip(columns["table_name"], columns["column_name"], strict=True))
    assert {("provider_items", c) for c in ("provider_id", "bytes", "deleted_at")} <= names
    assert ("batches", "released_at") in names


def test_only_collected_provider_batches_are_released_and_a_shared_file_is_held_back(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path)
    _batch(store.path, "a", "r1", input_file_id="f-shared", output_file_id="f-out")
    _batch(store.path, "b", "r1", collected=False, status="pending", input_file_id="f-shared")
    _batch(store.path, "rt", "r1", backend="realtime")  # answered by realtime calls
    _batch(store.path, "pool", "r1", backend="vllm")  # no provider id: a pool's shard
    _batch(store.path, "other", "r2", provider_batch_id="msgbatch_1")
    pending = store.unreleased_batches("r1")
    assert pending["batch_id"].to_list() == ["a"]
    # "b" still needs the input file: it is not handed out with "a"
    assert pending.row(0, named=True)["input_file_id"] is None
    assert pending.row(0, named=True)["output_file_id"] == "f-out"
    # another run's batch only when this run's collect pass stored it
    assert store.unreleased_batches("r1", ["other"])["batch_id"].to_list() == ["a", "other"]
    store.record_items([], released=["a"])
    assert store.unreleased_batches("r1").is_empty()


def test_left_counts_what_is_neither_deleted_nor_gone(tmp_path: Path) -> None:
    store = _store(tmp_path)
    _batch(store.path, "a", "r1")
    _batch(store.path, "c", "r2")

    def item(provider_id: str, batch_id: str, **fields: Any) -> dict[str, Any]:
        return {"provider_id": provider_id, "batch_id": batch_id, "role": "input", **fields}

    store.record_items(
        [
            item("f1", "a", bytes=100, error="delete: Error code: 500"),
            item("f2", "a", bytes=20, kept=True),
            item("f3", "a", bytes=7, deleted=True),
            item("m1", "c", role="batch"),  # an Anthropic batch: no size
        ]
    )
    assert store.left_at_provider() == {
        "r1": {"count": 2, "bytes": 120},
        "r2": {"count": 1, "bytes": 0},
    }
    # f1 deleted later (no size this time), m1 found gone: the size stays, the error clears
    store.record_items([item("f1", "a", deleted=True), item("m1", "c", role="batch", gone=True)])
    assert store.left_at_provider("r1") == {"r1": {"count": 1, "bytes": 20}}
    assert store.left_at_provider("r2") == {}
    f1 = query(store, "SELECT * FROM provider_items WHERE provider_id = 'f1'").row(0, named=True)
    assert f1["bytes"] == 100 and f1["delete_error"] is None and f1["deleted_at"] is not None
    assert store.recorded_items(["a", "c"])["provider_id"].to_list() == ["f2"]
    status = store.status_records("r1", ("run_id",))
    assert status[0]["left_at_provider"] == {"count": 1, "bytes": 20}
