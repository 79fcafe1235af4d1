"""A row asked in several chunks is one row of the job view: each output field combined by its
`[output] reduce` rule; the chunks' own answers stay in `<view>_chunks`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import duckdb
import orjson
import polars as pl
import pytest

from lowtide.store import Store
from tests.store.runs import finish

SCHEMA = {
    "type": "object",
    "properties": {
        "intent": {"type": "string", "enum": ["billing", "complaint", "other"]},
        "urgency": {"type": "string", "enum": ["low", "normal", "urgent"]},
        "summary": {"type": "string"},
        "refund": {"type": "boolean"},
        "amount": {"type": "number"},
        "items": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
}


def _answer(**fields: Any) -> str:
    return orjson.dumps(fields).decode()


# (source_id, chunk, outcome, answer) — row "a": 4 chunks all answered; row "b": 3 chunks, the
# second one failed; row "c": one chunk, failed; row "d": a tie in intent (1 vote each)
CHUNKS = [
    ("a", 0, "ok", _answer(intent="complaint", urgency="low", summary="one", refund=False,
                           amount=10.0, items=1, tags=["x"])),
    ("a", 1, "ok", _answer(intent="billing", urgency="urgent", summary="two", refund=True,
                           amount=20.0, items=3, tags=["y", "x"])),
    ("a", 2, "ok", _answer(intent="complaint", urgency="normal", summary="three", refund=False,
                           amount=30.0, items=2, tags=[])),
    ("a", 3, "repaired", _answer(intent="billing", urgency="low", summary="four", refund=False,
                                 amount=40.0, items=0, tags=["z"])),
    ("b", 0, "ok", _answer(intent="other", urgency="low", summary="b0", refund=False,
                           amount=1.0, items=1, tags=[])),
    ("b", 1, "provider_error", None),
    ("b", 2, "ok", _answer(intent="other", urgency="normal", summary="b2", refund=False,
                           amount=3.0, items=1, tags=[])),
    ("c", 0, "expired", None),
    ("d", 0, "ok", _answer(intent="other", urgency="low", summary="d0", refund=False,
                           amount=1.0, items=1, tags=[])),
    ("d", 1, "ok", _answer(intent="billing", urgency="low", summary="d1", refund=False,
                           amount=1.0, items=1, tags=[])),
]  # fmt: skip


def _publish(tmp_path: Path, reduce: dict[str, str]) -> duckdb.DuckDBPyConnection:
    store = Store(tmp_path / "state.duckdb")
    store.save_job("tickets", "tickets", "ticket_id", SCHEMA, "job.toml", reduce)
    store.open_run(
        run_id="r1",
        job="tickets",
        job_fingerprint="f",
        job_file="job.toml",
        backend="emulator",
        model="m",
        input_fingerprint="i",
    )
    ids = sorted({c[0] for c in CHUNKS})
    store.save_sources("tickets", "r1", pl.DataFrame({"source_id": ids, "body": ids}))
    n_chunks = {i: sum(1 for c in CHUNKS if c[0] == i) for i in ids}
    store.save_units(
        "r1",
        pl.DataFrame(
            {
                "unit_id": [f"{s}#{k}" for s, k, _, _ in CHUNKS],
                "source_id": [s for s, _, _, _ in CHUNKS],
                "kind": ["row"] * len(CHUNKS),
                "chunk_index": [k for _, k, _, _ in CHUNKS],
                "n_chunks": [n_chunks[s] for s, _, _, _ in CHUNKS],
                "unit_tokens": [10] * len(CHUNKS),
                "custom_id": [f"c-{s}-{k}" for s, k, _, _ in CHUNKS],
                "cache_hit": [False] * len(CHUNKS),
            },
            schema_overrides={"chunk_index": pl.Int32, "n_chunks": pl.Int32},
        ),
    )
    store.upsert_results(
        pl.DataFrame(
            {
                "custom_id": [f"c-{s}-{k}" for s, k, _, _ in CHUNKS],
                "batch_id": ["b"] * len(CHUNKS),
                "run_id": ["r1"] * len(CHUNKS),
                "outcome": [o for _, _, o, _ in CHUNKS],
                "output": [a for _, _, _, a in CHUNKS],
                "error": [None if a else "the provider said no" for _, _, _, a in CHUNKS],
                "attempts": [1] * len(CHUNKS),
            }
        )
    )
    finish(store, "r1", succeeded=2, failed=2)
    db = store.publish(tmp_path / "pub.duckdb", showing="r1")
    store.mark_published("r1")
    return duckdb.connect(str(db), read_only=True)


def _row(con: duckdb.DuckDBPyConnection, ticket: str) -> dict[str, Any]:
    cur = con.execute("SELECT * FROM tickets WHERE ticket_id = ?", [ticket])
    names = [d[0] for d in cur.description]
    return dict(zip(names, cur.fetchall()[0], strict=True))


def test_the_view_has_one_row_per_input_row_and_the_chunks_stay_queryable(
    tmp_path: Path,
) -> None:
    con = _publish(tmp_path, {})
    assert con.execute("SELECT count(*), count(DISTINCT ticket_id) FROM tickets").fetchall() == [
        (4, 4)
    ]
    chunks = con.execute(
        "SELECT ticket_id, chunk_index, intent FROM tickets_chunks WHERE ticket_id = 'a' "
        "ORDER BY chunk_index"
    ).fetchall()
    assert chunks == [("a", 0, "complaint"), ("a", 1, "billing"), ("a", 2, "complaint"),
                      ("a", 3, "billing")]  # fmt: skip


def test_default_rules_per_json_type(tmp_path: Path) -> None:
    a = _row(_publish(tmp_path, {}), "a")
    assert a["status"] == "succeeded" and a["failure_reason"] is None
    assert (a["chunks_answered"], a["n_chunks"]) == (4, 4)
    assert a["intent"] == "complaint"  # majority: a 2-2 tie goes to the earlier chunk's value
    assert a["urgency"] == "low"  # enum: majority too (low twice)
    assert a["summary"] == "one two three four"  # free text: joined in chunk order
    assert a["refund"] is True  # boolean: any
    assert a["amount"] == 25.0  # number: mean
    assert a["items"] == 3  # integer: max
    assert a["tags"] == ["x", "y", "z"]  # array: union


def test_rules_from_the_job_file(tmp_path: Path) -> None:
    con = _publish(
        tmp_path,
        {"urgency": "max", "intent": "first", "refund": "all", "amount": "min", "items": "min"},
    )
    a = _row(con, "a")
    assert a["urgency"] == "urgent"  # max in the enum's order, not alphabetical
    assert a["intent"] == "complaint"
    assert a["refund"] is False
    assert a["amount"] == 10.0
    assert a["items"] == 0
    assert _row(con, "d")["intent"] == "other"  # first


def test_a_partly_failed_row_says_how_many_chunks_were_answered(tmp_path: Path) -> None:
    con = _publish(tmp_path, {})
    b = _row(con, "b")
    assert b["status"] == "failed"
    assert (b["chunks_answered"], b["n_chunks"]) == (2, 3)
    assert b["failure_reason"] == (
        "provider_error: the provider said no (chunk 2 of 3; 2 answered)"
    )
    assert b["summary"] == "b0 b2"  # the answered chunks still combine
    c = _row(con, "c")
    assert c["status"] == "failed" and c["failure_reason"] == "expired: the provider said no"
    assert c["intent"] is None and c["chunks_answered"] == 0


def test_enum_fields_are_enum_columns_and_order_by_the_schema(tmp_path: Path) -> None:
    con = _publish(tmp_path, {})
    types = dict(
        con.execute(
            "SELECT column_name, data_type FROM duckdb_columns() WHERE table_name = 'tickets'"
        ).fetchall()
    )
    assert types["urgency"] == "ENUM('low', 'normal', 'urgent')"
    assert types["tags"] == "VARCHAR[]"
    assert con.execute("SELECT max(urgency) FROM tickets_chunks").fetchall() == [("urgent",)]


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_export_has_the_view_rows(tmp_path: Path, fmt: str) -> None:
    _publish(tmp_path, {"urgency": "max"})
    store = Store(tmp_path / "state.duckdb")
    target = tmp_path / f"out.{fmt}"
    assert store.export_run("r1", target, fmt) == 4
    frame = pl.read_csv(target) if fmt == "csv" else pl.read_parquet(target)
    assert frame.filter(pl.col("ticket_id") == "a")["urgency"].to_list() == ["urgent"]
