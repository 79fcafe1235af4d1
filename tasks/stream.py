"""stream: one shard through a pool of self-hosted servers (a `stream` backend), checkpointed.

The shard's batch row and members are committed before the first request (write-ahead, as for
provider batches). Results are parsed and committed in small groups as they arrive, so a killed
run resumes with only the requests that have no stored answer. The pool is priced by GPU time:
the shard's wall time × [pool] gpu_hour_usd × gpus, shared among its requests by tokens.
"""

from __future__ import annotations

import polars as pl

from lowtide import progress
from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.lease import LEASE_S, process_owner
from lowtide.orchestration import task
from lowtide.runlog import stage_log
from lowtide.vocabulary import Channel
from tasks.parse import parse_results, store_parsed


@task(name="stream", task_run_name="stream-{batch_id}")
def stream_task(ctx: RunContext, batch_id: str, run_id: str) -> dict:
    """Send the shard's unanswered requests to the pool and store every answer as it comes."""
    from lowtide.backends.vllm_pool import run_pool

    job, store = ctx.job, ctx.store
    members = store.batch_members(batch_id)["custom_id"]
    done = store.answered_among(members)
    todo = members.filter(~members.is_in(done.implode()))
    lines = store.request_lines(todo.to_list()).select("custom_id", "line", "est_input_tokens")
    store.start_batch(batch_id)
    total = members.len()
    stored = [done.len()]

    def checkpoint(frame: pl.DataFrame) -> None:
        store_parsed(
            store,
            parse_results(frame, job.output_schema),
            batch_id=batch_id,
            run_id=run_id,
            engine=ctx.answer_family,
            channel=Channel.POOL.value,
        )
        stored[0] += frame.height
        store.claim_run(run_id, process_owner(), LEASE_S)  # still driving: renew the lease
        progress.report("batches", stored[0], total, "answers stored")
        crash_point("during_stream")

    stats = run_pool(lines, ctx.pool, checkpoint) if lines.height else None
    if stats is not None and job.pool.gpu_hour_usd:
        store.share_batch_cost(batch_id, stats.gpu_cost_usd(job.pool.gpu_hour_usd, job.pool.gpus))
    store.complete_batch(batch_id)
    stage_log("stream", "%s: %d of %d requests sent to the pool", batch_id, lines.height, total)
    return stats.summary() if stats is not None else {"requests": 0}
