"""realtime: send a few requests as plain synchronous calls (stragglers, urgent rows, re-asks).

Bookkept like a batch: a `realtime` batch row and its members are committed before the first
call, results are stored with channel 'realtime' and priced at the realtime (list) price.
Realtime calls have no idempotency at the provider: a crash in the middle of this task can lose
answers that were already paid for; the batch path is the one that never pays twice.
"""

from __future__ import annotations

import secrets

import polars as pl
from prefect import task

from lowtide.backends.base import BatchStatus
from lowtide.store.state import Store
from tasks.parse import parse_results, store_parsed


def realtime_client(backend_name: str, emulator_url: str | None):
    """(provider, SDK client) for the realtime path of a backend."""
    from lowtide.backends import realtime

    if backend_name == "emulator":
        return "openai", realtime.openai_client_for_base_url(f"{emulator_url}/v1")
    if backend_name == "anthropic":
        return "anthropic", realtime.anthropic_client_from_env()
    if backend_name == "openai":
        return "openai", realtime.openai_client_from_env()
    raise ValueError(f"backend {backend_name!r} has no realtime path")


def realtime_batch_rows(
    batch_id: str, custom_ids: pl.Series, n_bytes: int
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(batches, members) frames for a realtime batch, for a write-ahead manifest."""
    batches = pl.DataFrame(
        {
            "batch_id": [batch_id],
            "shard": [-1],
            "attempt": [0],
            "backend": ["realtime"],
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
def realtime_task(
    batch_id: str,
    run_id: str,
    state_path: str,
    backend_name: str,
    emulator_url: str | None,
    schema: dict,
    concurrency: int,
) -> dict:
    """Send a pending realtime batch's requests as synchronous calls and store the answers.

    The batch is marked in_progress before the first call: if the process dies during the calls,
    the next poll marks it failed (its answers, paid or not, are lost) rather than sending again.
    """
    from lowtide.backends.realtime import run_realtime

    store = Store(state_path)
    provider, client = realtime_client(backend_name, emulator_url)
    lines = store.request_lines(store.batch_members(batch_id)["custom_id"].to_list())
    store.update_batch(batch_id, status=BatchStatus.IN_PROGRESS.value)
    returned = run_realtime(
        lines["line"].to_list(), provider=provider, client=client, concurrency=concurrency
    )
    counts = store_parsed(
        store, parse_results(returned, schema), batch_id=batch_id, run_id=run_id, channel="realtime"
    )
    store.update_batch(batch_id, status=BatchStatus.COMPLETED.value, collected=True)
    return counts


def deadline_passed(started_at, deadline_hours: float | None) -> bool:
    if deadline_hours is None or started_at is None:
        return False
    from datetime import UTC, datetime

    now = datetime.now(UTC).replace(tzinfo=None)
    return (now - started_at).total_seconds() > deadline_hours * 3600
