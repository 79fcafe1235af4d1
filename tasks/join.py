"""join: provider results (any order) → one row per submitted request, by custom_id only.

Requests the provider never answered for (a batch that failed validation, a lost line) become
`missing` with the provider's reason, so nothing silently disappears.
"""

from __future__ import annotations

import orjson
import polars as pl

from lowtide.backends.base import RESULT_SCHEMA, BatchState, BatchStatus, RequestStatus
from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.orchestration import retry_transient, task
from lowtide.runlog import stage_log
from lowtide.slices import WORK_FILE_COMPRESSION
from lowtide.vocabulary import REALTIME_BACKEND


def join_results(
    members: pl.DataFrame,
    returned: pl.DataFrame,
    missing_reason: str,
    unmatched: RequestStatus = RequestStatus.MISSING,
) -> pl.DataFrame:
    """Match results to the batch's requests by custom_id; unmatched requests get `unmatched`
    (missing, or cancelled / expired when the whole batch was) and `missing_reason`.

    Results for ids that were not in the batch are dropped; a repeated id keeps its first line.
    """
    returned = returned.unique(subset="custom_id", keep="first", maintain_order=True)
    joined = members.join(returned, on="custom_id", how="left")
    return joined.with_columns(
        pl.col("status").fill_null(pl.lit(unmatched.value)),
        pl.when(pl.col("status").is_null())
        .then(pl.lit(missing_reason))
        .otherwise(pl.col("error"))
        .alias("error"),
    ).select(list(RESULT_SCHEMA))


_UNMATCHED = {
    BatchStatus.CANCELLED.value: (
        RequestStatus.CANCELLED,
        "the batch was cancelled before this request ran",
    ),
    BatchStatus.EXPIRED.value: (
        RequestStatus.EXPIRED,
        "the batch expired before this request ran",
    ),
}
"""A request a cancelled or expired batch never ran ended that way, not lost: it is reported
(and retried, where retrying applies) as cancelled / expired."""


def _missing_reason(batch: dict) -> str:
    if batch["status"] in _UNMATCHED and not batch["errors"]:
        return _UNMATCHED[batch["status"]][1]
    if batch["errors"]:
        errors = orjson.loads(batch["errors"])
        shown = "; ".join(
            (f"line {e['line']}: " if e.get("line") is not None else "")
            + (f"{e['code']}: " if e.get("code") else "")
            + str(e.get("message"))
            for e in errors[:3]
        )
        if batch["backend"] == REALTIME_BACKEND or batch["status"] == BatchStatus.CANCELLED.value:
            return shown
        return f"batch failed validation at the provider: {shown}"
    return f"no result returned by the provider for batch {batch['provider_batch_id']}"


@task(
    name="join",
    task_run_name="join-{batch_id}",
    retries=3,
    retry_delay_seconds=[2, 4, 8],
    retry_condition_fn=retry_transient,
)
def join_task(ctx: RunContext, batch_id: str) -> dict:
    """Download an ended batch's results and write them, joined, to a parquet file."""
    store = ctx.store
    batch = store.batch(batch_id)
    state = BatchState(
        status=BatchStatus(batch["status"]),
        provider_status=batch["provider_status"] or "",
        output_file_id=batch["output_file_id"],
        error_file_id=batch["error_file_id"],
        result_ref=batch["result_ref"],
        provider_batch_id=batch["provider_batch_id"],
    )
    returned = ctx.batch_client().results(state) if state.has_results else None
    if returned is None:
        returned = pl.DataFrame(schema=RESULT_SCHEMA)
    crash_point("during_download")
    unmatched = _UNMATCHED.get(batch["status"], (RequestStatus.MISSING, ""))[0]
    joined = join_results(
        store.batch_members(batch_id), returned, _missing_reason(batch), unmatched
    )
    path = ctx.work_dir(batch["run_id"]) / f"results-{batch_id}.parquet"
    joined.write_parquet(path, compression=WORK_FILE_COMPRESSION)
    counts = joined["status"].value_counts()
    answered = int((joined["status"] == RequestStatus.ANSWERED.value).sum())
    stage_log("join", "%s: %d of %d requests answered", batch_id, answered, joined.height)
    return {
        "batch_id": batch_id,
        "run_id": batch["run_id"],
        "results": str(path),
        "counts": dict(zip(counts["status"].to_list(), counts["count"].to_list(), strict=True)),
        "answered": answered,
    }
