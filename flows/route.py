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
from lowtide.context import RunContext, run_context
from lowtide.errors import BackendError
from lowtide.input_identity import input_fingerprint
from lowtide.jobspec import JobSpec, load_job
from lowtide.lease import driving
from lowtide.nightly import new_run_id
from lowtide.runlog import stage_log
from lowtide.settings import Settings
from lowtide.store import Store
from lowtide.vocabulary import RunStatus
from tasks.poll import poll_once


def enrich_route(
    settings: Settings, job: JobSpec, emulator_url: str | None, wait: bool
) -> dict[str, Any]:
    """Run `job` (loaded without a backend: its first engine) along its route, resuming the
    route of the same job content and input where it stands. Returns the summary of the step it
    stopped in: the last one when it finished, the current one with wait=False."""
    store = Store(settings.state, settings.lock_timeout_s)
    found = store.route_position(job.name, job.prompt_fingerprint(), input_fingerprint(job))
    if found is None:
        return _drive(settings, job, emulator_url, wait, step=0, run_id=None, route=None)
    route = (found["route_id"], found["route_started"])
    if found["switched_at"] is not None:  # switched, the next step never opened: open it
        step = _next_step(job, found["route_step"], found["switched_at"], found["route_started"])
        return _drive(settings, job, emulator_url, wait, step=step, run_id=None, route=route)
    return _drive(
        settings, job, emulator_url, wait, step=found["route_step"], run_id=found["run_id"],
        route=route,
    )  # fmt: skip


def collect_route_step(
    settings: Settings, run: dict[str, Any], emulator_url: str | None
) -> dict[str, Any]:
    """One `collect` pass over the current step of a route: poll it, finish it, or switch it
    (and open the next step) when its time is up."""
    job = load_job(run["job_file"])
    route = (run["route_id"], run["route_started"])
    return _drive(
        settings, job, emulator_url, False, step=run["route_step"], run_id=run["run_id"],
        route=route,
    )  # fmt: skip


def _next_step(job: JobSpec, step: int, at: datetime, route_started: datetime) -> int:
    assert job.route is not None
    return job.route.next_step(step, at, route_started)


def _drive(
    settings: Settings,
    job: JobSpec,
    emulator_url: str | None,
    wait: bool,
    *,
    step: int,
    run_id: str | None,
    route: tuple[str, datetime] | None,
) -> dict[str, Any]:
    """Drive the route from `step` (resuming `run_id`, or opening the step) until it ends, or
    (wait=False) until the current step is in flight."""
    assert job.route is not None
    while True:
        step_job = load_job(job.source_path, job.route.engines[step])
        with run_context(settings, step_job, emulator_url) as ctx:
            if run_id is None:
                run_id = _open_step(ctx, job, step, route)
            if route is None:
                route = (run_id, routing.clock())
            switched_at = _drive_step(ctx, run_id, wait)
            if switched_at is None:
                _settle_earlier_steps(settings, job, route[0], run_id, emulator_url)
                summary = run_summary(ctx, run_id)
                if RunStatus(summary["status"]).finished:
                    artifacts.publish_run_report(summary)
                return summary
        step, run_id = _next_step(job, step, switched_at, route[1]), None


def _open_step(ctx: RunContext, job: JobSpec, step: int, route: tuple[str, datetime] | None) -> str:
    """A new run for `step`; its end is fixed now, from the route's start and its own."""
    assert job.route is not None
    run_id = new_run_id(ctx.job.name)
    started = routing.clock()
    route_id, route_started = route if route is not None else (run_id, started)
    ends_at = job.route.step_ends_at(step, started, route_started)
    save_job(ctx)
    ctx.store.open_route_step(
        run_fields(ctx, run_id), route_id=route_id, step=step, step_ends_at=ends_at
    )
    stage_log(
        "route", "step %d on %s: run %s, gives way at %s", step, ctx.backend, run_id,
        ends_at.isoformat(timespec="seconds") if ends_at else "its end (last step)",
    )  # fmt: skip
    return run_id


def _drive_step(ctx: RunContext, run_id: str, wait: bool) -> datetime | None:
    """Advance one step; returns when it was switched away from, or None (finished, or in
    flight with wait=False)."""
    store = ctx.store
    ends_at = store.require_run(run_id)["step_ends_at"]
    with driving(store, run_id), artifacts.progress_artifact(ctx.job.name):
        try:
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
    dropped = store.cancel_unsent_batches(run_id)
    live = store.live_provider_batches(run_id)
    try:
        if live.height and ctx.entry.mode == "batch":
            cancel_provider_batches(ctx.batch_client(), live["provider_batch_id"].to_list())
        client = ctx.batch_client() if ctx.entry.mode == "batch" else None
        terminal, total = poll_once(store, client, run_id)
        collect_ended(ctx, run_id)
        if terminal == total:
            finish(ctx, run_id)
    except BackendError as e:
        # the engine is down: the switch goes on; `collect` settles its batches later
        store.record_error(run_id, f"switched; settling its batches failed: {e}")
    stage_log(
        "route", "run %s on %s switched: %d batch(es) cancelled, %d unsent dropped",
        run_id, ctx.backend, live.height, dropped,
    )  # fmt: skip
    return store.require_run(run_id)["switched_at"]


def _settle_earlier_steps(
    settings: Settings, job: JobSpec, route_id: str, current: str, emulator_url: str | None
) -> None:
    """Poll once the switched steps whose cancelled batches had not ended; finish those that
    have (each ends `cancelled`). Whatever is still in flight is left to `collect`."""
    store = Store(settings.state, settings.lock_timeout_s)
    for run_id in store.unfinished_earlier_steps(route_id, current):
        backend = store.require_run(run_id)["backend"]
        step_job = load_job(job.source_path, backend)
        with run_context(settings, step_job, emulator_url) as ctx, driving(ctx.store, run_id):
            if advance(ctx, run_id, wait=False):
                finish(ctx, run_id)
