"""Several batches' results stored in one transaction end as one upsert per batch, in turn,
would leave them: an answer is never replaced by another attempt's failure, a failure is
replaced by a later answer, and a repeated download changes nothing."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from lowtide.store import Store


def _results(batch_id: str, outcomes: dict[str, str]) -> pl.DataFrame:
    return pl.DataFrame(
        {
            "custom_id": list(outcomes),
            "batch_id": [batch_id] * len(outcomes),
            "run_id": ["r1"] * len(outcomes),
            "outcome": list(outcomes.values()),
            "output": [f"{batch_id}:{c}" if o == "ok" else None for c, o in outcomes.items()],
            "error": [None if o == "ok" else "the provider said no" for o in outcomes.values()],
            "attempts": [1] * len(outcomes),
        }
    )


# x answered first, then failed in a later attempt; y failed first, then answered; z answered
# twice (two attempts' answers: the first one stays); w downloaded twice from the same batch
PARTS = [
    _results("b1", {"x": "ok", "y": "provider_error", "z": "ok", "w": "provider_error"}),
    _results("b2", {"x": "provider_error", "y": "ok", "z": "ok"}),
    _results("b1", {"w": "provider_error"}),
]


def _stored(store: Store) -> list[tuple[str, str, str, str | None]]:
    return (
        store.results_for(pl.Series(["x", "y", "z", "w"]))
        .sort("custom_id")
        .select("custom_id", "batch_id", "outcome", "output")
        .rows()
    )


def test_batches_stored_together_end_as_one_upsert_each_would_leave_them(
    tmp_path: Path,
) -> None:
    together = Store(tmp_path / "together.duckdb")
    together.upsert_results_in_order(PARTS)
    one_by_one = Store(tmp_path / "one_by_one.duckdb")
    for part in PARTS:
        one_by_one.upsert_results(part)

    assert (
        _stored(together)
        == _stored(one_by_one)
        == [
            ("w", "b1", "provider_error", None),
            ("x", "b1", "ok", "b1:x"),  # the answer stays; the later failure does not replace it
            ("y", "b2", "ok", "b2:y"),  # the failure is replaced by the later answer
            ("z", "b1", "ok", "b1:z"),
        ]
    )
    # every row of the stretch was committed at once: one transaction, one timestamp
    received = together.results_for(pl.Series(["x", "y", "z", "w"]))["received_at"]
    assert received.n_unique() == 1


def _sent(store: Store, batch_id: str, custom_ids: list[str]) -> None:
    """`custom_ids` sent in the batch `batch_id` (the manifest of a run of that name)."""
    n = len(custom_ids)
    requests = pl.DataFrame(
        {
            "custom_id": custom_ids,
            "request_key": custom_ids,
            "job": ["j"] * n,
            "model": ["m"] * n,
            "est_input_tokens": [1] * n,
            "user_message": custom_ids,
            "template_id": ["t"] * n,
        }
    )
    batches = pl.DataFrame(
        {
            "batch_id": [batch_id],
            "shard": [0],
            "attempt": [1],
            "backend": ["openai"],
            "n_requests": [n],
            "n_bytes": [100],
        }
    )
    members = pl.DataFrame({"batch_id": [batch_id] * n, "custom_id": custom_ids})
    store.write_manifest(batch_id, requests, batches, members)


def test_attempts_count_each_batch_once_however_often_a_request_is_named(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state.duckdb")
    _sent(store, "b1", ["x", "y"])
    _sent(store, "b2", ["x"])  # x tried again
    # several batches' results stored together name x once per batch it came back in
    counts = store.attempt_counts(pl.Series(["x", "y", "x"])).sort("custom_id")
    assert counts.rows() == [("x", 2), ("y", 1)]


def test_a_retry_round_reads_only_the_requests_whose_outcome_it_may_act_on(
    tmp_path: Path,
) -> None:
    from tasks.retry import ACTED_ON

    store = Store(tmp_path / "state.duckdb")
    _sent(store, "r1", ["x", "y", "z", "w"])
    store.upsert_results(
        _results("r1", {"x": "ok", "y": "provider_error", "z": "parse_failed", "w": "missing"})
    )
    every = store.run_request_outcomes("r1").sort("custom_id")
    assert every["custom_id"].to_list() == ["w", "x", "y", "z"]
    acted = store.run_request_outcomes("r1", ACTED_ON).sort("custom_id")
    assert acted.select("custom_id", "outcome", "batch_attempts").rows() == [
        ("y", "provider_error", 1),
        ("z", "parse_failed", 1),
    ]
    # the rows it reads are those of the full read
    assert acted.equals(every.filter(pl.col("custom_id").is_in(["y", "z"])))
