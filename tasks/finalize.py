"""finalize: units → one outcome per input row, failures with reasons, the run's counts; publish.

A row succeeded when every one of its units has a validated answer. Every other row is a failure
with the first failing unit's reason, so `rows = succeeded + failed` holds by construction.
"""

from __future__ import annotations

import polars as pl
from prefect import task

from lowtide.store.publish import publish
from lowtide.store.state import ANSWERED, Store


def row_outcomes(outcomes: pl.DataFrame) -> pl.DataFrame:
    """(source_id, kind, succeeded, unit_id, reason, detail) per source row."""
    units = outcomes.with_columns(
        pl.col("outcome").is_in(ANSWERED).fill_null(False).alias("ok"),
        pl.when(pl.col("custom_id") == "")
        .then(pl.lit("empty_text"))
        .otherwise(pl.col("outcome").fill_null("missing"))
        .alias("reason"),
        pl.when(pl.col("custom_id") == "")
        .then(pl.lit("the row's text is empty; nothing to ask"))
        .otherwise(pl.col("error"))
        .alias("detail"),
    )
    first_bad = (
        units.filter(~pl.col("ok"))
        .sort("chunk_index")
        .group_by("source_id", "kind", maintain_order=True)
        .first()
        .select("source_id", "kind", "unit_id", "reason", "detail")
    )
    rows = units.group_by("source_id", "kind", maintain_order=True).agg(
        pl.col("ok").all().alias("succeeded")
    )
    return rows.join(first_bad, on=["source_id", "kind"], how="left")


@task(name="finalize", task_run_name="finalize-{run_id}")
def finalize_task(run_id: str, state_path: str) -> dict:
    store = Store(state_path)
    per_row = row_outcomes(store.run_unit_outcomes(run_id))
    failures = per_row.filter(~pl.col("succeeded")).select(
        "source_id", "kind", "unit_id", "reason", "detail"
    )
    store.replace_rows("failures", run_id, failures)
    rows = per_row.filter(pl.col("kind") == "row")
    succeeded = int(rows["succeeded"].sum())
    counts = {"rows": rows.height, "succeeded": succeeded, "failed": rows.height - succeeded}
    reasons = failures.filter(pl.col("kind") == "row")["reason"].value_counts()
    counts["failures_by_reason"] = dict(
        zip(reasons["reason"].to_list(), reasons["count"].to_list(), strict=True)
    )
    return counts


@task(name="publish", task_run_name="publish-{run_id}")
def publish_task(
    run_id: str, state_path: str, db_path: str, views: list[dict], mark: bool = True
) -> str:
    """Rebuild the analysts' file atomically; with `mark`, the run becomes the one job views show
    (a run held by the eval gate is rebuilt into the tables but not shown in the view)."""
    store = Store(state_path)
    if mark:
        store.update_run(run_id, published_at=_now())
    return str(publish(store, db_path, views))


def _now():
    from datetime import UTC, datetime

    return datetime.now(UTC).replace(tzinfo=None)
