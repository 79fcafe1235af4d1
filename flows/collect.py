"""collect: finish every in-flight run in the store, once; meant to run on a schedule.

For each unfinished run that has batches: `advance` it without waiting (submit what is pending,
poll once, collect ended batches, start retries) and `finish` the runs whose requests all ended.
A run whose batches are `vllm run-batch` shards first imports whatever output shards exist
(`flows/shards.py`). Holds no worker while providers work: each call is a few seconds, then it
exits.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from flows.enrich import advance, finish, outcome, run_summary
from flows.route import collect_route_step
from flows.shards import import_shards, pending_requests
from lowtide import artifacts
from lowtide.context import run_context
from lowtide.errors import CollectError, RunBusyError, RunOutcomeError
from lowtide.interrupts import raise_if_interrupt
from lowtide.jobspec import load_job
from lowtide.lease import driving
from lowtide.orchestration import flow
from lowtide.settings import Settings
from lowtide.store import Store


def _run_name() -> str:
    return f"collect-{datetime.now(UTC):%Y-%m-%d-%H%M}"


@flow(name="collect", flow_run_name=_run_name, log_prints=False)
def collect(
    state: str | None = None,
    db: str | None = None,
    emulator_url: str | None = None,
    run_id: str | None = None,
) -> list[dict[str, Any]]:
    """One pass over in-flight runs (or only `run_id`); returns a summary per run it touched.
    A run another live process drives is reported as `driven` (with `driven_by`) and left to
    it. A run that fails keeps its error and the others still go; the flow run then fails with
    every failure, each with its type (one run's own error when only that run was asked for).
    So does a run this pass finished held or with every row failed (`RunOutcomeError`): a
    night is never green in Prefect because `collect` finished it."""
    settings = Settings().with_overrides(state=state, db=db)
    if not settings.state.is_file():
        return []
    store = Store(settings.state, settings.lock_timeout_s)
    touched = []
    problems: list[Exception] = []
    runs = [r for r in store.in_flight_runs() if run_id is None or r["run_id"] == run_id]
    for run in runs:
        try:
            touched.append(_collect_one(run, settings, emulator_url))
        except RunBusyError as e:  # a live enrich (or another collect) drives it: left to it
            touched.append({"run_id": run["run_id"], "status": "driven", "driven_by": e.holder})
        except Exception as e:  # noqa: BLE001 - recorded on the run, raised after the others
            raise_if_interrupt(e)  # a Ctrl-C DuckDB reported as an error stops the collect
            store.record_error(run["run_id"], f"collect: {type(e).__name__}: {e}")
            e.add_note(f"while collecting run {run['run_id']}")
            problems.append(e)
    ended_badly = _bad_outcomes(touched)
    if (problems or ended_badly) and run_id is not None:
        raise (problems or ended_badly)[0]
    if problems or ended_badly:
        # the other runs were collected; the flow run still fails so the schedule shows it
        said = [f"failed for {len(problems)} run(s)"] if problems else []
        said += [f"{len(ended_badly)} run(s) ended held or failed"] if ended_badly else []
        raise CollectError(f"collect: {'; '.join(said)}", problems + ended_badly, touched)
    return touched


def _bad_outcomes(touched: list[dict[str, Any]]) -> list[Exception]:
    """The runs this pass finished held or with every row failed, as their errors."""
    found: list[Exception] = []
    for summary in touched:
        try:
            outcome(summary)
        except RunOutcomeError as e:
            found.append(e)
    return found


def _collect_one(run: dict[str, Any], settings: Settings, emulator_url: str | None) -> dict:
    cancelled_by_hand = run["status"] == "cancelling" and run["switched_at"] is None
    if run["route_step"] is not None and not cancelled_by_hand:
        # a route's step: its time may be up (then the next step opens), or it was switched
        # and its cancelled batches are still ending
        return collect_route_step(settings, run, emulator_url)
    job = load_job(run["job_file"], run["backend"])
    with run_context(settings, job, emulator_url) as ctx, driving(ctx.store, run["run_id"]):
        shards = import_shards(ctx, run["run_id"]) if ctx.entry.shard_files else None
        finished = advance(ctx, run["run_id"], wait=False)
        if finished:
            finish(ctx, run["run_id"])
        summary = run_summary(ctx, run["run_id"])
        if shards is not None:
            summary["shards"] = shards
            summary["pending"] = pending_requests(ctx, run["run_id"])
    if finished:
        artifacts.publish_run_report(summary)
    return summary
