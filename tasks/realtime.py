"""realtime: send a few requests as plain synchronous calls (stragglers, urgent rows, re-asks).

Bookkept like a batch: a `realtime` batch row and its members are committed before the first
call, results are stored with channel 'realtime' and priced at the realtime (list) price.
Realtime calls have no idempotency at the provider: a crash in the middle of this task can lose
answers that were already paid for; the batch path is the one that never pays twice.
"""

from __future__ import annotations

import secrets

import polars as pl

from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.errors import CredentialsError
from lowtide.orchestration import task
from lowtide.runlog import stage_log
from lowtide.store import Store
from lowtide.vocabulary import REALTIME_BACKEND, Channel
from tasks.parse import parse_results, store_parsed


def realtime_batch_rows(
    batch_id: str, custom_ids: pl.Series, n_bytes: int
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(batches, members) frames for a realtime batch, for a write-ahead manifest."""
    batches = pl.DataFrame(
        {
            "batch_id": [batch_id],
            "shard": [-1],
            "attempt": [0],
            "backend": [REALTIME_BACKEND],
            "n_requests": [custom_ids.len()],
            "n_bytes": [n_bytes],
        },
        schema_overrides={
            "shard": pl.Int32,
            "attempt": pl.Int32,
            "n_requests": pl.Int32,
            "n_bytes": pl.Int64,
        },
    )
    return batches, pl.DataFrame({"batch_id": batch_id, "custom_id": custom_ids})


def plan_realtime(store: Store, run_id: str, custom_ids: list[str], reason: str) -> str:
    """Commit a `pending` realtime batch for these stored requests; returns its batch_id."""
    batch_id = f"{run_id}-rt-{reason}-{secrets.token_hex(3)}"
    ids = pl.Series("custom_id", custom_ids, dtype=pl.String)
    batches, members = realtime_batch_rows(batch_id, ids, 0)
    empty = pl.DataFrame(
        schema={
            "custom_id": pl.String,
            "request_key": pl.String,
            "job": pl.String,
            "model": pl.String,
            "est_input_tokens": pl.Int64,
        }
    )
    store.write_manifest(run_id, empty, batches, members)
    return batch_id


@task(name="realtime", task_run_name="realtime-{batch_id}")
def realtime_task(ctx: RunContext, batch_id: str, run_id: str) -> dict:
    """Send a pending realtime batch's requests as synchronous calls and store the answers.

    The batch is marked in_progress before the first call: if the process dies during the calls,
    the next poll marks it failed (its answers, paid or not, are lost) rather than sending again.
    A key the provider refuses puts it back to pending and raises: the run stays resumable.
    """
    from lowtide.backends.realtime import run_realtime

    store = ctx.store
    client = ctx.realtime_client()
    lines = store.request_lines(store.batch_members(batch_id)["custom_id"].to_list())
    store.start_batch(batch_id)
    try:
        returned = run_realtime(
            lines["line"].to_list(),
            provider=ctx.entry.realtime_protocol(),
            client=client,
            concurrency=ctx.job.retry.realtime_concurrency,
            structured_output=ctx.capabilities.structured_output,
        )
    except CredentialsError:
        store.unstart_batch(batch_id)  # the key was refused, not the requests: send them later
        raise
    counts = store_parsed(
        store,
        parse_results(returned, ctx.job.output_schema),
        batch_id=batch_id,
        run_id=run_id,
        engine=ctx.answer_family,
        channel=Channel.REALTIME.value,
    )
    crash_point("in_realtime")
    store.complete_batch(batch_id)
    stage_log("realtime", "%s: %d requests, %s", batch_id, lines.height, counts)
    return counts


def deadline_passed(started_at, deadline_hours: float | None) -> bool:
    if deadline_hours is None or started_at is None:
        return False
    from datetime import UTC, datetime

    now = datetime.now(UTC).replace(tzinfo=None)
    return (now - started_at).total_seconds() > deadline_hours * 3600
