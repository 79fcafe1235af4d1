"""Big inserts reach DuckDB a slice at a time (to bound memory at a million rows): the stored
rows are those of a single insert. Inside one transaction a slice that fails leaves nothing of
the earlier ones; where each slice commits on its own (requests whose messages come from a
file), a failure leaves no manifest, and writing it again stores each request once."""

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


def test_a_failing_message_slice_leaves_no_manifest_and_a_rewrite_completes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lowtide.store import manifest

    monkeypatch.setattr(manifest, "INSERT_SLICE_ROWS", 2)
    store = Store(tmp_path / "state.duckdb")
    requests = _requests(5)
    messages = tmp_path / "to_send.parquet"
    requests.select("custom_id", pl.col("user_message").alias("user")).write_parquet(messages)
    sized = requests.drop("user_message")
    too_big = sized.with_columns(  # the third slice's request cannot be stored (INTEGER column)
        pl.when(pl.col("custom_id") == "c4")
        .then(2**40)
        .otherwise("est_input_tokens")
        .alias("est_input_tokens")
    )
    batches = pl.DataFrame(
        {"batch_id": ["r1-s0000-a1"], "shard": [0], "attempt": [1], "backend": ["openai"]}
    ).with_columns(n_requests=pl.lit(5), n_bytes=pl.lit(100))
    members = requests.select(pl.lit("r1-s0000-a1").alias("batch_id"), "custom_id")
    with pytest.raises(duckdb.ConversionException):
        store.write_manifest("r1", too_big, batches, members, messages=messages)
    assert not store.has_manifest("r1")  # nothing is sent for it
    assert scalar(store, "SELECT count(*) FROM batch_requests") == 0

    store.write_manifest("r1", sized, batches, members, messages=messages)  # the resumed run
    assert scalar(store, "SELECT count(*) FROM requests") == 5
    store.save_template("t", "H", "M", "T")
    lines = list(store.batch_lines("r1-s0000-a1"))
    assert lines == [f'H"c{i}"M"message {i}"T' for i in range(5)]  # from the kept file
    assert store.has_manifest("r1")
    assert scalar(store, "SELECT count(*) FROM batch_requests") == 5
