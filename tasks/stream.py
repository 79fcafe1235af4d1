"""stream: one shard through a pool of self-hosted servers (backend `vllm`), checkpointed.

The shard's batch row and members are committed before the first request (write-ahead, as for
provider batches). Results are parsed and committed in small groups as they arrive, so a killed
run resumes with only the requests that have no stored answer. The pool is priced by GPU time:
the shard's wall time × [pool] gpu_hour_usd × gpus, shared among its requests by tokens.
"""

from __future__ import annotations

import os

import polars as pl
from prefect import task

from lowtide import progress
from lowtide.backends.base import BatchStatus
from lowtide.crashpoints import crash_point
from lowtide.jobspec import JobSpec
from lowtide.lease import LEASE_S, process_owner
from lowtide.store.state import ANSWERED, Store
from tasks.parse import parse_results, store_parsed


def _pool_config(job: JobSpec):  # noqa: ANN202 - PoolConfig, imported lazily
    from lowtide.backends.vllm_pool import PoolConfig

    return PoolConfig.from_spec(
        job.pool,
        env_urls=os.environ.get("LOWTIDE_VLLM_URLS"),
        env_api_key=os.environ.get("LOWTIDE_VLLM_API_KEY"),
    )


@task(name="stream", task_run_name="stream-{batch_id}")
def stream_task(job: JobSpec, batch_id: str, run_id: str, state_path: str) -> dict:
    """Send the batch's unanswered requests to the pool and store every answer as it comes."""
    from lowtide.backends.vllm_pool import run_pool

    store = Store(state_path)
    members = store.batch_members(batch_id)["custom_id"]
    done = store.results_for(members).filter(pl.col("outcome").is_in(ANSWERED))["custom_id"]
    todo = members.filter(~members.is_in(done.implode()))
    lines = store.request_lines(todo.to_list()).select("custom_id", "line", "est_input_tokens")
    store.update_batch(batch_id, status=BatchStatus.IN_PROGRESS.value)
    total = members.len()
    stored = [done.len()]

    def checkpoint(frame: pl.DataFrame) -> None:
        store_parsed(
            store,
            parse_results(frame, job.output_schema),
            batch_id=batch_id,
            run_id=run_id,
            channel="pool",
        )
        stored[0] += frame.height
        store.claim_run(run_id, process_owner(), LEASE_S)  # still driving: renew the lease
        progress.report("batches", stored[0], total, "answers stored")
        crash_point("during_stream")

    stats = run_pool(lines, _pool_config(job), checkpoint) if lines.height else None
    if stats is not None and job.pool.gpu_hour_usd:
        _share_gpu_cost(store, batch_id, stats.gpu_cost_usd(job.pool.gpu_hour_usd, job.pool.gpus))
    store.update_batch(batch_id, status=BatchStatus.COMPLETED.value, collected=True)
    return stats.summary() if stats is not None else {"requests": 0}


def _share_gpu_cost(store: Store, batch_id: str, usd: float) -> None:
    """Spread the shard's GPU cost over its answers in proportion to their tokens."""
    with store.transaction() as con:
        con.execute(
            """
            UPDATE results SET cost_usd = ? * (coalesce(input_tokens, 0) + coalesce(output_tokens, 0))
                / nullif((SELECT sum(coalesce(input_tokens, 0) + coalesce(output_tokens, 0))
                          FROM results WHERE batch_id = ?), 0)
            WHERE batch_id = ?
            """,
            [usd, batch_id, batch_id],
        )
