"""route: a job with `[route]`, one run per step, each on the next engine (`lowtide/routing.py`).

    step k   prepare → advance until the step's time is up (watched between polls)
    switch   cancel the step's in-flight batches, keep what already ended, → next step
    step k+1 prepare again: units any engine of the route answered are reused, the rest sent

`enrich` calls `enrich_route` for a routed job (no `--backend`); `collect` calls
`collect_route_step` for the current step of a route, so a scheduled collect switches too.
A switched step keeps its batches until the provider ends them; their answers are collected
(and, where the next step asked the same rows again, reported as `paid_twice`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from flows.enrich import (
    advance,
    collect_ended,
    finish,
    prepare,
    record_failure,
    run_fields,
    run_summary,
    save_job,
)
from flows.operations import cancel_provider_batches
from lowtide import artifacts, routing
from lowtide.backends.base import Backend
from lowtide.context import RunContext, run_context
from lowtide.errors import BackendError, RunBusyError, UserError
from lowtide.input_identity import input_fingerprint
from lowtide.jobspec import JobSpec, load_job
from lowtide.lease import driving
from lowtide.nightly import new_run_id
from lowtide.runlog import stage_log
from lowtide.settings import Settings
from lowtide.store import Store
from lowtide.vocabulary import BatchStatus, RunStatus
from tasks.poll import poll_once

Route = tuple[str, datetime]
"""(route_id, when the route started)."""


def enrich_route(
    settings: Settings, job: JobSpec, emulator_url: str | None, wait: bool
) -> dict[str, Any]:
    """Run `job` (loaded without a backend: its first engine) along its route, resuming the
    route of the same job content and input where it stands. Returns the summary of the step it
    stopped in: the last one when it finished, the current one with wait=False. `enrich`
    raises for a held or failed last step (`flows.enrich.outcome`), `collect` for its steps."""
    store = Store(settings.state, settings.lock_timeout_s)
    found = store.route_position(job.name, job.prompt_fingerprint(), input_fingerprint(job))
    if found is None:
        return _drive(settings, job, emulator_url, wait, step=0)
    route = (found["route_id"], found["route_started"])
    if found["switched_at"] is not None:  # switched, the next step never opened: open it
        _settle(settings, job, found["run_id"], found["backend"], emulator_url)
        step = _next_step(job, found["route_step"], found["switched_at"], route)
        return _drive(settings, job, emulator_url, wait, step=step, route=route)
    if found["status"] == RunStatus.FAILED.value:  # refused, or every row failed: open it again
        return _drive(settings, job, emulator_url, wait, step=found["route_step"], route=route)
    return _drive(
        settings, job, emulator_url, wait, step=found["route_step"], route=route,
        resume=(found["run_id"], found["backend"]),
    )  # fmt: skip


def collect_route_step(
    settings: Settings, run: dict[str, Any], emulator_url: str | None
) -> dict[str, Any]:
    """One `collect` pass over a step of a route. The current step: poll it, finish it, or
    switch it (and open the next step) when its time is up. A switched step: cancel again what
    is still running, collect what ended, and open the next step if a crash left it unopened."""
    job = _routed_job(run["job_file"], run["run_id"])
    route = (run["route_id"], run["route_started"])
    if run["switched_at"] is None:
        return _drive(
            settings, job, emulator_url, False, step=run["route_step"], route=route,
            resume=(run["run_id"], run["backend"]),
        )  # fmt: skip
    summary = _settle(settings, job, run["run_id"], run["backend"], emulator_url)
    store = Store(settings.state, settings.lock_timeout_s)
    if not store.has_later_step(run["route_id"], run["route_step"]):
        step = _next_step(job, run["route_step"], run["switched_at"], route)
        return _drive(settings, job, emulator_url, False, step=step, route=route)
    return summary


def _routed_job(job_file: str, run_id: str) -> JobSpec:
    job = load_job(job_file)
    if job.route is None:
        raise UserError(
            f"run {run_id} is a step of a [route], but {job_file} has no [route] any more: put "
            f"it back to finish the route, or stop it with `lowtide cancel {run_id}`"
        )
    return job


def _next_step(job: JobSpec, step: int, at: datetime, route: Route) -> int:
    assert job.route is not None
    return job.route.next_step(step, at, route[1])


def _drive(
    settings: Settings,
    job: JobSpec,
    emulator_url: str | None,
    wait: bool,
    *,
    step: int,
    route: Route | None = None,
    resume: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """Drive the route from `step` (resuming `resume` = (run id, its backend), or opening the
    step) until it ends, or (wait=False) until the current step is in flight. A step whose time
    is already up when it would open is not opened."""
    assert job.route is not None
    last = len(job.route.engines) - 1
    while True:
        if resume is None and step < last:
            now = routing.clock()
            ends_at = job.route.step_ends_at(step, now, route[1] if route else now)
            if ends_at is not None and ends_at <= now:
                step = job.route.next_step(step, now, route[1] if route else now)
                continue
        # a resumed step keeps the engine it was opened on, whatever the job file says now
        engine = resume[1] if resume else job.route.engines[step]
        with run_context(settings, load_job(job.source_path, engine), emulator_url) as ctx:
            if resume is None:
                run_id, route = _open_step(ctx, job, step, route)
            else:
                run_id = resume[0]
            assert route is not None
            switched_at = _drive_step(ctx, run_id, wait)
            if switched_at is None:
                _settle_earlier_steps(settings, job, route[0], run_id, emulator_url)
                summary = run_summary(ctx, run_id)
                if summary["finished_at"] is not None:  # finished, or failed with every row
                    artifacts.publish_run_report(summary)
                return summary
        step, resume = _next_step(job, step, switched_at, route), None


def _open_step(ctx: RunContext, job: JobSpec, step: int, route: Route | None) -> tuple[str, Route]:
    """The run for `step` (one another process opened meanwhile, or a new one); its end is
    fixed now, from the route's start and its own."""
    assert job.route is not None
    started = routing.clock()
    new_id = new_run_id(ctx.job.name)
    route = route if route is not None else (new_id, started)
    ends_at = job.route.step_ends_at(step, started, route[1])
    save_job(ctx)
    run_id = ctx.store.open_route_step(
        run_fields(ctx, new_id), route_id=route[0], step=step, step_ends_at=ends_at
    )
    if step == 0 and run_id != new_id:  # another start opened the route first
        route = (run_id, ctx.store.require_run(run_id)["started_at"])
    stage_log(
        "route", "step %d on %s: run %s, gives way at %s", step, ctx.backend, run_id,
        ends_at.isoformat(timespec="seconds") if ends_at else "its end (last step)",
    )  # fmt: skip
    return run_id, route


def _drive_step(ctx: RunContext, run_id: str, wait: bool) -> datetime | None:
    """Advance one step; returns when it was switched away from, or None (finished, or in
    flight with wait=False)."""
    store = ctx.store
    with driving(store, run_id), artifacts.progress_artifact(ctx.job.name):
        run = store.require_run(run_id)  # read again under the lease
        if run["switched_at"] is not None:  # another process switched it meanwhile
            return run["switched_at"]
        ends_at = run["step_ends_at"]
        try:
            if routing.is_due(ends_at):  # its time is up: send nothing more on this engine
                return switch(ctx, run_id)
            if not store.has_manifest(run_id):
                prepare(ctx, run_id)
            if advance(ctx, run_id, wait, until=ends_at):
                finish(ctx, run_id)
                return None
            if not routing.is_due(ends_at):
                return None
            return switch(ctx, run_id)
        except BackendError as e:
            if not routing.is_due(ends_at) or not store.has_manifest(run_id):
                record_failure(ctx, run_id, e)
                raise
            # the engine fails and the step's time is up: an outage falls over to the next
            stage_log("route", "run %s on %s failed (%s); its time is up", run_id, ctx.backend, e)
            return switch(ctx, run_id)
        except Exception as e:
            record_failure(ctx, run_id, e)
            raise


def switch(ctx: RunContext, run_id: str) -> datetime:
    """The step's time is up: no new round on its engine, nothing unsent sent, its in-flight
    batches cancelled; what already ended is collected now, what ends later by `collect`."""
    store = ctx.store
    store.mark_switched(run_id)
    if not store.has_manifest(run_id):
        store.skip_step(run_id)
        return store.require_run(run_id)["switched_at"]
    # a batch whose create may have reached the provider is looked up, then cancelled
    dropped = store.cancel_unsent_batches(run_id, keep_uploaded=True)
    try:
        client = ctx.batch_client() if ctx.entry.mode == "batch" else None
        cancelled = _cancel_live(store, client, run_id)
        terminal, total = poll_once(store, client, run_id)
        collect_ended(ctx, run_id)
        if terminal == total:
            finish(ctx, run_id)
    except BackendError as e:
        # the engine is down: the switch goes on; `collect` cancels and settles it later
        cancelled = 0
        store.record_error(run_id, f"switched; settling its batches failed: {e}")
    stage_log(
        "route", "run %s on %s switched: %d batch(es) cancelled, %d unsent dropped",
        run_id, ctx.backend, cancelled, dropped,
    )  # fmt: skip
    return store.require_run(run_id)["switched_at"]


def _cancel_live(store: Store, client: Backend | None, run_id: str) -> int:
    """Cancel the switched step's batches at the provider: those with a create call that may
    have reached it are looked up first (as a resumed submit does); one that fails to cancel
    does not stop the others (the next `collect` tries again). Returns how many were asked."""
    if client is None:
        return 0
    for batch_id in store.unsent_provider_batches(run_id):
        row = store.batch(batch_id)
        if row["status"] != BatchStatus.UPLOADED.value:
            continue  # never uploaded: nothing can exist at the provider
        found = client.find(
            batch_id, row["n_requests"], row["updated_at"].timestamp(),
            exclude=store.claimed_provider_ids(),
        )  # fmt: skip
        if found:
            store.record_created(batch_id, found)
    store.cancel_unsent_batches(run_id)
    live = store.live_provider_batches(run_id)
    asked = 0
    for row in live.iter_rows(named=True):
        if row["status"] == BatchStatus.CANCELLING.value:
            continue  # already asked; the provider is draining it
        try:
            cancel_provider_batches(client, [row["provider_batch_id"]])
            asked += 1
        except BackendError as e:
            stage_log("route", "cancelling %s failed (%s); collect tries again", row["batch_id"], e)
    return asked


def _settle(
    settings: Settings, job: JobSpec, run_id: str, backend: str, emulator_url: str | None
) -> dict[str, Any]:
    """A switched step: cancel again what still runs, collect what ended, finish it (it ends
    `cancelled`) once every batch ended."""
    step_job = load_job(job.source_path, backend)
    with run_context(settings, step_job, emulator_url) as ctx, driving(ctx.store, run_id):
        status = ctx.store.run_status(run_id)
        if status is not None and status.in_flight and ctx.store.has_manifest(run_id):
            client = ctx.batch_client() if ctx.entry.mode == "batch" else None
            _cancel_live(ctx.store, client, run_id)
            if advance(ctx, run_id, wait=False):
                finish(ctx, run_id)
        return run_summary(ctx, run_id)


def _settle_earlier_steps(
    settings: Settings, job: JobSpec, route_id: str, current: str, emulator_url: str | None
) -> None:
    """Settle once the switched steps whose cancelled batches had not ended. One that is busy
    (driven by a `collect`) or whose engine is down is left to the next `collect`."""
    store = Store(settings.state, settings.lock_timeout_s)
    for run_id in store.unfinished_earlier_steps(route_id, current):
        backend = store.require_run(run_id)["backend"]
        try:
            _settle(settings, job, run_id, backend, emulator_url)
        except (RunBusyError, BackendError) as e:
            stage_log("route", "switched run %s not settled yet (%s); collect will", run_id, e)
