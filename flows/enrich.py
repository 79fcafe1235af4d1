"""enrich: one job end to end, in three phases of task calls.

    prepare  load → chunk → dedupe → assemble (the write-ahead manifest)
    advance  submit → poll → join → parse → retry round, looped until every request has its
             final outcome (or, with wait=False, until the batches are in flight)
    finish   qa → reconcile → finalize → publish

Tasks are per stage, and per batch where work is batched; never per row. Every fact lands in the
state file; task results are small (paths, ids, counts). A rerun of the same job content on the
same input resumes the unfinished run, so nothing accepted by a provider is sent again; the
scheduled `collect` flow reuses `advance` and `finish` for runs that stopped after submitting.
"""

from __future__ import annotations

import functools
import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, TypedDict

from lowtide import artifacts, progress
from lowtide.context import RunContext, run_context
from lowtide.crashpoints import crash_point
from lowtide.errors import RunFailedError, RunHeldError, WaitExpiredError
from lowtide.input_identity import input_digest, input_fingerprint, spec_digest
from lowtide.interrupts import raise_if_interrupt
from lowtide.jobspec import load_job
from lowtide.lease import driving
from lowtide.nightly import new_run_id, unchanged_summary
from lowtide.orchestration import flow
from lowtide.routing import is_due
from lowtide.runlog import stage_log
from lowtide.settings import Settings
from lowtide.vocabulary import RunStatus
from tasks.assemble import assemble_task
from tasks.chunk import chunk_task
from tasks.dedupe import dedupe_task
from tasks.finalize import finalize_task, publish_task
from tasks.join import join_task
from tasks.load import load_task
from tasks.parse import STORE_ROWS, parse_task, store_collected
from tasks.poll import poll_task
from tasks.qa import failed_share_gate, qa_task
from tasks.realtime import realtime_task
from tasks.reconcile import reconcile_task
from tasks.release import release_collected
from tasks.retry import retry_round_task
from tasks.stream import stream_task
from tasks.submit import admit, prepare_lines_task, submit_task


def _run_name() -> str:
    from prefect.runtime import flow_run  # called by Prefect only: it is imported by then

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
    """Run one job; returns the run's summary. Resumes the newest unfinished run of the same
    job content and input, so a rerun after a crash sends nothing already accepted. A run that
    ends held or with every row failed raises (`outcome`), so the flow run ends Failed."""
    settings = Settings().with_overrides(state=state, db=db)
    job = load_job(job_file, backend)
    if job.route is not None and backend is None:
        from flows.route import enrich_route  # route builds on this module's phases

        return outcome(enrich_route(settings, job, emulator_url, wait))
    unchanged = unchanged_summary(settings, job)
    if unchanged is not None:
        stage_log(
            "unchanged", "job and input as in run %s: nothing to ask", unchanged["unchanged_from"]
        )
        return unchanged
    with run_context(settings, job, emulator_url) as ctx:
        run_id = open_run(ctx)
        with driving(ctx.store, run_id), artifacts.progress_artifact(job.name) as progress_id:
            try:
                if not ctx.store.has_manifest(run_id):
                    prepare(ctx, run_id)
                    crash_point("after_manifest")
                # shard files are run by an Indexed Job, not by waiting here: stop once they
                # are planned (`lowtide shards export`, then `shards import` or `collect`)
                if advance(ctx, run_id, wait and not ctx.entry.shard_files):
                    finish(ctx, run_id)
            except Exception as e:
                record_failure(ctx, run_id, e)
                raise
            summary = run_summary(ctx, run_id)
            if summary["finished_at"] is not None:  # finished, or failed with every row
                artifacts.update_progress(progress_id, 1, 1)
                artifacts.publish_run_report(summary)
        return outcome(summary)


def outcome(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary of a run that may stand as the night's answer (finished and shown, or still
    in flight); a run a gate held raises `RunHeldError`, one whose every row failed
    `RunFailedError`, each carrying the summary, so the flow run that drove it ends Failed
    (Prefect's alerts fire) on either path, through Prefect or in-process."""
    run_id, status = summary["run_id"], summary["status"]
    if status == RunStatus.HELD.value:
        raise RunHeldError(
            f"run {run_id} held: {summary.get('gate_note')}. The job view still shows the last "
            f"published run; `lowtide publish {run_id}` releases this one",
            summary,
        )
    if status == RunStatus.FAILED.value:
        raise RunFailedError(
            f"run {run_id} failed: {summary.get('error')}; the job view still shows the last "
            "published run",
            summary,
        )
    return summary


def prepare(ctx: RunContext, run_id: str) -> None:
    """load → chunk → dedupe → assemble: the run's units and its write-ahead manifest."""
    progress.report("load")
    loaded = load_task(ctx, run_id)
    progress.report("chunk")
    chunked = chunk_task(ctx, run_id, loaded)
    progress.report("dedupe")
    deduped = dedupe_task(ctx, run_id, chunked)
    ctx.store.record_prepared(
        run_id,
        rows=loaded["rows"],
        units=deduped["row_units"],
        unique_requests=deduped["unique_requests"],
        cache_hits=deduped["cache_hits"],
        carried_from=chunked["carried_from"],
        rows_carried=chunked["rows_carried"],
        spec_digest=spec_digest(ctx.job),
        units_recipe=chunked["units_recipe"],
    )
    progress.report("assemble")
    plan = assemble_task(ctx, run_id, deduped)
    ctx.store.record_estimate(run_id, plan["estimate_usd"])


def advance(ctx: RunContext, run_id: str, wait: bool, until: datetime | None = None) -> bool:
    """submit → poll → join → parse → retry round, until every request has its final outcome
    (True) or, with wait=False, until what is left is in flight at the provider or waits for
    room there (False). With `until` (a route step's end) it also stops there (False): no
    round starts past it. Batches the provider's queue has no room for wait, polled, until an
    earlier batch ends (or the provider's `retry-after` passes), up to `[retry] deadline_hours`;
    past it they end expired and take the stragglers' path."""
    while True:
        waiting = send_pending(ctx, run_id)
        if waiting and past_deadline(ctx, run_id):
            stragglers_past_deadline(ctx, run_id)
            waiting = False
        room = functools.partial(next_batch_room, ctx, run_id) if waiting else None
        stop = until if not waiting else earliest(until, deadline(ctx, run_id))
        ended = poll_task(ctx, run_id, wait, stop, room)
        if waiting and wait and not is_due(until):
            # room opened: fill it before downloading what ended, so the queue is not left short
            # while results are joined and parsed
            send_pending(ctx, run_id)
        collect_ended(ctx, run_id)
        if waiting:
            if not wait or is_due(until):
                return False
            continue
        if not ended or is_due(until):
            return False
        if not retry_round_task(ctx, run_id):
            return True
        if not wait:
            send_pending(ctx, run_id)
            if ctx.store.open_batches(run_id).height:
                return False


def finish(ctx: RunContext, run_id: str) -> None:
    """qa → reconcile → finalize → publish, for a run whose requests all have final outcomes.
    It ends held when a gate gives reasons (eval drift or floor, an unanswered eval set, more
    failed rows than `[qa] max_failed_share`), failed when every row failed (`finish_run`);
    neither is shown in the job view."""
    progress.report("qa")
    # qa → reconcile → finalize are short SQL steps back to back (about twenty state-file opens);
    # publishing, the long one, is left unheld so other processes get in while it builds
    with ctx.store.held():
        qa = qa_task(ctx, run_id)
        cost = reconcile_task(ctx, run_id)
        counts = finalize_task(ctx, run_id)
        share = failed_share_gate(counts["rows"], counts["failed"], ctx.job.qa.max_failed_share)
        ctx.store.finish_run(
            run_id,
            hold_reasons=share + qa["hold"],
            succeeded=counts["succeeded"],
            failed=counts["failed"],
            eval_accuracy=qa["eval_accuracy"],
            cost_usd=cost["cost_usd"],
            realtime_cost_usd=cost["realtime_cost_usd"],
            naive_cost_usd=cost["naive_cost_usd"],
        )
        ctx.store.record_paid_twice(run_id)  # a route's step: what switching engines cost
    progress.report("publish")
    publish_task(ctx, run_id)
    # the run's messages are needed no more, but for requests still without an answer
    ctx.store.prune_messages()
    if not ctx.keep_work_dir:
        # everything the run needs is in the state file now; its parquet files only took space
        shutil.rmtree(ctx.work_dir(run_id), ignore_errors=True)


def send_pending(ctx: RunContext, run_id: str) -> bool:
    """Everything of the run not sent yet: realtime batches are answered now; provider batches
    are submitted as far as the provider's queue has room (True when some are left waiting for
    it); a streaming backend's shards run through its pool to the end."""
    store = ctx.store
    why: str | None = None  # why provider batches wait for the queue, if they do
    pending_realtime = store.pending_realtime_batches(run_id)
    for batch_id in pending_realtime:
        realtime_task(ctx, batch_id, run_id)
    if ctx.entry.mode == "stream":
        shards = store.uncollected_shards(run_id)
        if shards:
            store.mark_submitted(run_id)
        for batch_id in shards:
            stream_task(ctx, batch_id, run_id)
        sent = shards
    else:
        sent, why = admit(ctx, run_id)
        if len(sent) > 1:  # every batch's lines from one pass over the requests, not one each
            prepare_lines_task(ctx, run_id, sent)
        for i, batch_id in enumerate(sent):
            progress.report("submit", i, len(sent))
            submit_task(ctx, batch_id, run_id)
    waiting = ctx.entry.mode == "batch" and bool(store.unsent_provider_batches(run_id))
    if waiting and why is not None:
        stage_log("submit", "batches wait for room: %s", why)
    if pending_realtime or sent or waiting:
        # batches waiting for the provider's queue are handed over too: `collect` sends them
        store.fold_reasks()
        store.mark_submitted(run_id)
    return waiting


QUEUE_DEADLINE = (
    "the provider's queue had no room for this batch before the job's [retry] deadline_hours"
)


def stragglers_past_deadline(ctx: RunContext, run_id: str) -> None:
    """The run's deadline passed with batches still waiting for room in the provider's queue:
    they end expired and their requests go through the realtime path. A job without that path
    (`[retry] realtime_fallback = false`) stops resumable instead, to be run again later."""
    if not (ctx.job.retry.realtime_fallback and ctx.entry.has_realtime):
        waiting = len(ctx.store.unsent_provider_batches(run_id))
        raise WaitExpiredError(
            f"run {run_id}: {waiting} batch(es) still wait for room in the provider's queue past "
            "[retry] deadline_hours, and the job has no realtime fallback; the run is kept: run "
            "the job again (or let `lowtide collect` go on) when the queue has room"
        )
    expired = ctx.store.expire_unsent_batches(run_id, QUEUE_DEADLINE)
    stage_log("submit", "%d batch(es) never found room before the deadline", expired)


def next_batch_room(ctx: RunContext, run_id: str) -> str | None:
    """Why the run's next unsent batch must still wait for the provider's queue, or None."""
    admitted, why = admit(ctx, run_id)
    return None if admitted or not why else why


def deadline(ctx: RunContext, run_id: str) -> datetime | None:
    """When the run's `[retry] deadline_hours` ends (None without one)."""
    hours = ctx.job.retry.deadline_hours
    started = ctx.store.require_run(run_id).get("started_at")
    if hours is None or started is None:
        return None
    return started + timedelta(hours=hours)  # naive UTC, as the store and `until` keep time


def past_deadline(ctx: RunContext, run_id: str) -> bool:
    return is_due(deadline(ctx, run_id))


def earliest(*moments: datetime | None) -> datetime | None:
    known = [m for m in moments if m is not None]
    return min(known) if known else None


def collect_ended(ctx: RunContext, run_id: str) -> None:
    """Join and parse every ended, uncollected batch of the run. Parsed batches are stored
    together (`STORE_ROWS` results at a time, and at the end); a batch is collected once its
    results are stored. When a batch fails, those parsed before it are stored (`keep_parsed`)
    and the failure is raised. Then what the provider keeps of the collected batches is
    deleted (`release_collected`)."""
    ended = ctx.store.ended_uncollected_batches(run_id)
    waiting: list[dict] = []  # parsed, stored with a later batch (`STORE_ROWS`)
    try:
        for i, batch_id in enumerate(ended):
            progress.report("collect", 0, 0, batch_id)
            joined = join_task(ctx, batch_id)
            rows = sum(joined["counts"].values()) + sum(p["rows"] for p in waiting)
            store = i == len(ended) - 1 or rows >= STORE_ROWS
            parsed = parse_task(ctx, batch_id, joined, store=store, earlier=waiting)
            waiting = [] if store else [*waiting, parsed]
    except Exception:
        keep_parsed(ctx, waiting)
        raise
    if ended:
        ctx.store.fold_reasks()
    release_collected(ctx, run_id, ended)


def keep_parsed(ctx: RunContext, waiting: list[dict]) -> None:
    """After a batch of the collect pass failed: store the batches parsed before it, so a rerun
    downloads only what was not stored; the first failure is the one reported."""
    if not waiting:
        return
    try:
        store_collected(ctx, waiting)
    except Exception as e:  # noqa: BLE001 - reported beside the failure that is raised
        stage_log("parse", "%d parsed batch(es) not stored (%s)", len(waiting), e)


def open_run(ctx: RunContext) -> str:
    """The unfinished run of this job content and input on this backend to resume, or a new
    run (decided in one transaction, so two runs started together share one)."""
    job = ctx.job
    save_job(ctx)
    return ctx.store.open_or_resume_run(**run_fields(ctx, new_run_id(job.name)))


def save_job(ctx: RunContext) -> None:
    """The job's view name, id column, schema and reduce rules, for publishing."""
    job = ctx.job
    ctx.store.save_job(
        job.name,
        job.view_name,
        job.input.id_column,
        job.output_schema,
        job.source_path,
        job.reduce_rules(),
    )


class RunFields(TypedDict):
    run_id: str
    job: str
    job_fingerprint: str
    job_file: str
    backend: str
    model: str
    input_fingerprint: str
    input_digest: str | None
    spec_digest: str | None


def run_fields(ctx: RunContext, run_id: str) -> RunFields:
    """What a new run records about its job, backend and input."""
    job = ctx.job
    return {
        "run_id": run_id,
        "job": job.name,
        "job_fingerprint": job.prompt_fingerprint(),
        "job_file": job.source_path,
        "backend": ctx.backend,
        "model": job.model.name,
        "input_fingerprint": input_fingerprint(job),
        "input_digest": input_digest(job),
        "spec_digest": spec_digest(job),
    }


def run_summary(ctx: RunContext, run_id: str) -> dict[str, Any]:
    """The run's summary with where its files are (and, for a route's step, the route)."""
    with ctx.store.held():
        summary = {**ctx.store.run_summary(run_id), "db": ctx.db_path, "state": ctx.state_path}
        route = ctx.store.route_summary(run_id)
    if route is not None:
        summary["route"] = route
    return summary


def record_failure(ctx: RunContext, run_id: str, error: Exception) -> None:
    """Before the manifest exists nothing was sent, so the run ends failed; after, it stays
    resumable and keeps the error. A Ctrl-C that DuckDB reported as an error is no failure:
    it is raised as the interrupt it was."""
    raise_if_interrupt(error)
    if ctx.store.has_manifest(run_id):
        ctx.store.record_error(run_id, str(error))
    else:
        ctx.store.fail_run(run_id, str(error))
