"""enrich: one job end to end — load → chunk → dedupe → assemble → submit → poll → join → parse
→ retries/re-asks → qa → reconcile → finalize → publish. Tasks are per stage, and per shard
where work is sharded; never per row. Every fact lands in the state file; task results are
small (paths, ids, counts). With wait=False the flow stops after submitting and the scheduled
`collect` flow finishes the run.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import polars as pl
from prefect import flow
from prefect.runtime import flow_run

from flows.common import (
    RunContext,
    drive_run,
    emulator_for,
    finish_run,
    now,
    price_for,
    submit_pending,
    summary,
)
from lowtide import artifacts, progress
from lowtide.backends import make_backend
from lowtide.crashpoints import crash_point
from lowtide.jobspec import JobSpec, load_job
from lowtide.lease import LEASE_S, RunBusyError, process_owner
from lowtide.settings import Settings
from lowtide.store.publish import source_table
from lowtide.store.state import Store
from tasks.assemble import assemble_task
from tasks.chunk import chunk_task
from tasks.dedupe import dedupe_task
from tasks.load import input_fingerprint, load_task


def _run_name() -> str:
    params = flow_run.parameters or {}
    stem = Path(str(params.get("job_file", "job"))).stem
    return f"{stem}-{datetime.now(UTC):%Y-%m-%d-%H%M}"


@flow(name="enrich", flow_run_name=_run_name, log_prints=False)
def enrich(
    job_file: str,
    backend: str | None = None,
    state: str | None = None,
    db: str | None = None,
    wait: bool = True,
    emulator_url: str | None = None,
) -> dict[str, Any]:
    """Run one job. Resumes the newest unfinished run of the same job content, so a rerun after
    a crash sends nothing already accepted by the provider."""
    settings = Settings().with_overrides(state=state, db=db)
    job = load_job(job_file, backend)
    store = Store(settings.state, settings.lock_timeout_s)
    price = price_for(job, job.model.backend)
    run_id = _open_run(job, store)
    owner = process_owner()
    holder = store.claim_run(run_id, owner, LEASE_S)
    if holder is not None:
        raise RunBusyError(
            f"run {run_id} is being driven by another lowtide process ({holder}), e.g. a "
            "scheduled collect; it will finish the run. `lowtide status` shows its progress."
        )
    progress_id = artifacts.start_progress(job.name)

    def batches_progress(stage: str, done: int, total: int, note: str) -> None:
        if stage == "batches":
            artifacts.update_progress(progress_id, done, total)

    progress.add_listener(batches_progress)
    try:
        with emulator_for(job.model.backend, emulator_url) as emu_url:
            ctx = RunContext(settings, store, job.model.backend, emu_url, price)
            try:
                if store.run_batches(run_id).is_empty():
                    _prepare(job, ctx, run_id)
                    crash_point("after_manifest")
                submit_pending(job, ctx, run_id)
                if drive_run(job, ctx, run_id, wait):
                    finish_run(job, ctx, run_id)
            except Exception as e:
                # After the manifest exists the run stays resumable; before it, nothing was sent.
                sent = store.run_batches(run_id).height > 0
                store.update_run(
                    run_id,
                    error=str(e)[:2000],
                    **({} if sent else {"status": "failed", "finished_at": now()}),
                )
                raise
        result = summary(store, run_id, settings)
        if result["status"] in ("completed", "cancelled", "held"):
            artifacts.update_progress(progress_id, 1, 1)
            artifacts.publish_run_report(result)
        return result
    finally:
        progress.remove_listener(batches_progress)
        store.release_run(run_id, owner)


def _open_run(job: JobSpec, store: Store) -> str:
    """The unfinished run of this job content to resume, or a new run."""
    fingerprint = job.prompt_fingerprint()
    inputs = input_fingerprint(job)
    run_id = store.resumable_run(job.name, fingerprint, inputs)
    if run_id is not None:
        return run_id
    run_id = f"{job.name}-{datetime.now(UTC):%Y%m%dT%H%M%S}-{secrets.token_hex(2)}"
    store.save_job(
        job.name,
        job.view_name,
        job.input.id_column,
        orjson.dumps(job.output_schema).decode(),
        job.source_path,
    )
    store.create_run(
        run_id=run_id,
        job=job.name,
        job_fingerprint=fingerprint,
        job_file=job.source_path,
        backend=job.model.backend,
        model=job.model.name,
        status="running",
        started_at=now(),
        input_fingerprint=inputs,
    )
    return run_id


def _prepare(job: JobSpec, ctx: RunContext, run_id: str) -> None:
    """load → chunk → dedupe → assemble: the run's units and its write-ahead manifest."""
    work_dir = ctx.work_dir(run_id)
    progress.report("load")
    loaded = load_task(job, work_dir)
    ctx.store.save_sources(
        source_table(job.view_name),
        run_id,
        pl.read_parquet(loaded["sources"]).rename({"text": job.input.text_column}),
    )
    progress.report("chunk")
    chunked = chunk_task(job, loaded, work_dir)
    progress.report("dedupe")
    deduped = dedupe_task(job, chunked, work_dir, ctx.state_path, run_id)
    # the counts are written before the manifest, so a crash after it leaves a countable run
    ctx.store.update_run(
        run_id,
        rows=loaded["rows"],
        units=deduped["row_units"],
        unique_requests=deduped["unique_requests"],
        cache_hits=deduped["cache_hits"],
        requests_sent=0,
    )
    caps = make_backend(ctx.backend_name, emulator_url=ctx.emulator_url).capabilities
    max_requests = min(caps.max_requests, ctx.settings.shard_max_requests or caps.max_requests)
    plan = assemble_task(
        job,
        deduped,
        run_id,
        ctx.state_path,
        ctx.backend_name,
        max_requests,
        caps.max_bytes,
        ctx.price.per_mtok(),
    )
    ctx.store.update_run(run_id, estimate_usd=plan["estimate_usd"])
