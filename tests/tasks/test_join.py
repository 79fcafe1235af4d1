from __future__ import annotations

import polars as pl

from lowtide.backends.base import RESULT_SCHEMA
from tasks.join import join_results


def _returned(rows: list[dict]) -> pl.DataFrame:
    return pl.DataFrame(rows, schema=RESULT_SCHEMA)


def test_results_are_matched_by_custom_id_not_position() -> None:
    members = pl.DataFrame({"custom_id": ["a", "b", "c"]})
    returned = _returned(
        [
            {"custom_id": "c", "status": "answered", "raw_text": "C"},
            {"custom_id": "a", "status": "answered", "raw_text": "A"},
            {"custom_id": "b", "status": "provider_error", "error": "HTTP 500"},
        ]
    )
    out = join_results(members, returned, "lost")
    assert dict(zip(out["custom_id"], out["raw_text"], strict=True)) == {
        "a": "A",
        "b": None,
        "c": "C",
    }
    assert out.filter(pl.col("custom_id") == "b")["status"][0] == "provider_error"


def test_unanswered_requests_become_missing_with_the_reason_and_strangers_are_dropped() -> None:
    members = pl.DataFrame({"custom_id": ["a", "b"]})
    returned = _returned(
        [
            {"custom_id": "a", "status": "answered", "raw_text": "A"},
            {"custom_id": "a", "status": "answered", "raw_text": "again"},
            {"custom_id": "zzz", "status": "answered", "raw_text": "not ours"},
        ]
    )
    out = join_results(members, returned, "batch failed validation: line 2")
    assert out.height == 2
    b = out.filter(pl.col("custom_id") == "b").row(0, named=True)
    assert b["status"] == "missing" and b["error"] == "batch failed validation: line 2"
    assert out.filter(pl.col("custom_id") == "a")["raw_text"][0] == "A"
