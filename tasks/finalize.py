"""finalize: units → one outcome per input row, failures with reasons, the run's counts; publish.

A row succeeded when every one of its units has a validated answer. Every other row is a failure
with the first failing unit's reason, so `rows = succeeded + failed` holds by construction.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.errors import PublishError
from lowtide.orchestration import task
from lowtide.runlog import stage_log
from lowtide.vocabulary import RunStatus

EMPTY_TEXT_DETAIL = "the row's text is empty or only whitespace; nothing to ask"


@task(name="finalize", task_run_name="finalize-{run_id}")
def finalize_task(ctx: RunContext, run_id: str) -> dict:
    """One outcome per input row: the run's failures with reasons, and its counts."""
    store = ctx.store
    failures, rows_by_kind = store.run_row_failures(run_id, EMPTY_TEXT_DETAIL)
    store.replace_rows("failures", run_id, failures)
    rows = rows_by_kind.get("row", 0)
    row_failures = failures.filter(pl.col("kind") == "row")
    failed = row_failures.height
    counts: dict[str, Any] = {"rows": rows, "succeeded": rows - failed, "failed": failed}
    reasons = row_failures["reason"].value_counts()
    counts["failures_by_reason"] = dict(
        zip(reasons["reason"].to_list(), reasons["count"].to_list(), strict=True)
    )
    stage_log("finalize", "%d rows: %d succeeded, %d failed", rows, rows - failed, failed)
    return counts


@task(name="publish", task_run_name="publish-{run_id}")
def publish_task(ctx: RunContext, run_id: str) -> str:
    """Rebuild the analysts' file atomically. The job view shows each job's latest published
    run, so a held or cancelled run is in the tables but not in its view. A completed run is
    marked published only once its file is in place: a crash or a failed write before that
    leaves it completed and unpublished, and a rerun of the job publishes it (sending nothing)."""
    store = ctx.store
    completed = store.run_status(run_id) is RunStatus.COMPLETED
    try:
        path = store.publish(ctx.db_path, showing=run_id if completed else None)
    except PublishError as e:
        message = f"{e}. Fix the cause, then: lowtide publish {run_id}"
        store.record_error(run_id, message)
        raise PublishError(message) from e
    crash_point("mid_publish")
    if completed:
        store.mark_published(run_id)
    stage_log("publish", "%s written for run %s", path, run_id)
    return str(path)
