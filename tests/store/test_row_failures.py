"""A run's failed input rows, reckoned in the state file: each row with its first failing unit
(by chunk index) and why, and how many rows of each kind the run has."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from lowtide.store import Store
from tasks.finalize import EMPTY_TEXT_DETAIL

# (source_id, kind, chunk, custom_id, outcome or None when no result came back)
UNITS = [
    ("a", "row", 0, "c-a0", "ok"),  # every chunk answered: succeeded
    ("a", "row", 1, "c-a1", "repaired"),
    ("b", "row", 0, "c-b0", "ok"),  # chunks 1 and 2 failed: chunk 1 names the failure
    ("b", "row", 2, "c-b2", "expired"),
    ("b", "row", 1, "c-b1", "provider_error"),
    ("c", "row", 0, "", None),  # nothing to ask
    ("d", "row", 0, "c-d0", None),  # asked, never answered
    ("e", "row", 0, "c-shared", "reasked"),  # two rows sharing one answered request
    ("f", "row", 0, "c-shared", "reasked"),
    ("a", "eval", 0, "c-ea", "parse_failed"),  # an eval row of the same source id
]


def _store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "state.duckdb")
    store.save_units(
        "r1",
        pl.DataFrame(
            {
                "unit_id": [f"{s}#{k}" for s, _, k, _, _ in UNITS],
                "source_id": [s for s, _, _, _, _ in UNITS],
                "kind": [kind for _, kind, _, _, _ in UNITS],
                "chunk_index": [k for _, _, k, _, _ in UNITS],
                "n_chunks": [1] * len(UNITS),
                "unit_tokens": [10] * len(UNITS),
                "custom_id": [c for _, _, _, c, _ in UNITS],
                "cache_hit": [False] * len(UNITS),
            },
            schema_overrides={"chunk_index": pl.Int32, "n_chunks": pl.Int32},
        ),
    )
    answered = {c: o for _, _, _, c, o in UNITS if o is not None}
    store.upsert_results(
        pl.DataFrame(
            {
                "custom_id": list(answered),
                "batch_id": ["b"] * len(answered),
                "run_id": ["r1"] * len(answered),
                "outcome": list(answered.values()),
                "error": [None if o in ("ok", "repaired", "reasked") else f"why {c}"
                          for c, o in answered.items()],
                "attempts": [1] * len(answered),
            }
        )
    )  # fmt: skip
    return store


def test_each_failed_row_names_its_first_failing_unit(tmp_path: Path) -> None:
    failures, rows = _store(tmp_path).run_row_failures("r1", EMPTY_TEXT_DETAIL)
    assert rows == {"row": 6, "eval": 1}
    assert failures.rows() == [
        ("a", "eval", "a#0", "parse_failed", "why c-ea"),
        ("b", "row", "b#1", "provider_error", "why c-b1"),
        ("c", "row", "c#0", "empty_text", EMPTY_TEXT_DETAIL),
        ("d", "row", "d#0", "missing", None),
    ]
    assert failures.columns == ["source_id", "kind", "unit_id", "reason", "detail"]


def test_a_run_with_no_failure_has_an_empty_table_of_them(tmp_path: Path) -> None:
    store = _store(tmp_path)
    failures, rows = store.run_row_failures("another run", EMPTY_TEXT_DETAIL)
    assert failures.height == 0 and rows == {}
    assert failures.columns == ["source_id", "kind", "unit_id", "reason", "detail"]
