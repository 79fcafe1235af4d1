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


@task(name="realtime", task_run_name="realtime-{run_id}-{reason}")
def realtime_task(
    run_id: str,
    custom_ids: list[str],
    reason: str,
    state_path: str,
    backend_name: str,
    emulator_url: str | None,
    schema: dict,
    concurrency: int,
) -> dict:
    from lowtide.backends.realtime import run_realtime

    store = Store(state_path)
    lines = store.request_lines(custom_ids)
    batch_id = f"{run_id}-rt-{reason}-{secrets.token_hex(3)}"
    store.write_manifest(
        run_id,
        lines.head(0).with_columns(pl.lit("").alias("job"), pl.lit("").alias("model")),
        pl.DataFrame(
            {
                "batch_id": [batch_id],
                "shard": [-1],
                "attempt": [0],
                "backend": ["realtime"],
                "n_requests": [lines.height],
                "n_bytes": [int(lines["line"].str.len_bytes().sum())],
            }
        ),
        lines.select(pl.lit(batch_id).alias("batch_id"), "custom_id"),
    )
    store.update_batch(batch_id, status=BatchStatus.IN_PROGRESS.value)
    provider, client = realtime_client(backend_name, emulator_url)
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
