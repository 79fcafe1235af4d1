"""Big inserts reach DuckDB a slice at a time (to bound memory at a million rows) inside one
transaction: the stored rows are those of a single insert, and a slice that fails leaves
nothing of the earlier ones."""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl
import pytest

from lowtide.store import Store, _db
from tests.sql import query, scalar


def _requests(n: int) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "custom_id": [f"c{i}" for i in range(n)],
            "request_key": [f"k{i}" for i in range(n)],
            "job": ["j"] * n,
            "model": ["m"] * n,
            "est_input_tokens": list(range(n)),
            "user_message": [f"message {i}" for i in range(n)],
            "template_id": ["t"] * n,
        }
    )


def _manifest(store: Store, run_id: str, requests: pl.DataFrame) -> None:
    batches = pl.DataFrame(
        {
            "batch_id": [f"{run_id}-s0000-a1"],
            "shard": [0],
            "attempt": [1],
            "backend": ["openai"],
            "n_requests": [requests.height],
            "n_bytes": [100],
        }
    )
    members = requests.select(pl.lit(f"{run_id}-s0000-a1").alias("batch_id"), "custom_id")
    store.write_manifest(run_id, requests, batches, members)


def test_sliced_inserts_store_what_one_insert_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_db, "INSERT_SLICE_ROWS", 2)
    store = Store(tmp_path / "state.duckdb")
    _manifest(store, "r1", _requests(7))
    stored = query(store, "SELECT custom_id, user_message FROM requests ORDER BY custom_id")
    assert stored["custom_id"].to_list() == sorted(f"c{i}" for i in range(7))
    assert stored["user_message"].to_list() == [f"message {c[1:]}" for c in stored["custom_id"]]

    rows = pl.DataFrame({"source_id": [f"s{i}" for i in range(5)], "body": list("abcde")})
    store.save_sources("x", "r1", rows)
    store.save_sources("x", "r2", rows.with_columns(pl.lit("z").alias("body")).head(3))
    assert scalar(store, 'SELECT count(*) FROM "src_x-rows"') == 8  # 5 + 3 changed texts
    r2 = query(store, "SELECT source_id, body FROM src_x WHERE run_id = 'r2' ORDER BY 1")
    assert r2.rows() == [("s0", "z"), ("s1", "z"), ("s2", "z")]
    r1 = query(store, "SELECT source_id, body FROM src_x WHERE run_id = 'r1' ORDER BY 1")
    assert r1.rows() == list(zip(rows["source_id"], rows["body"], strict=True))


def test_a_failing_slice_leaves_nothing_of_the_manifest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_db, "INSERT_SLICE_ROWS", 2)
    store = Store(tmp_path / "state.duckdb")
    bad = _requests(5).with_columns(  # the last slice has a request without an id
        pl.when(pl.col("custom_id") == "c4").then(None).otherwise("custom_id").alias("custom_id")
    )
    with pytest.raises(duckdb.ConstraintException):
        _manifest(store, "r1", bad)
    assert scalar(store, "SELECT count(*) FROM requests") == 0
    assert scalar(store, "SELECT count(*) FROM batches") == 0
