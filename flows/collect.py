"""collect: finish every in-flight run in the store, once; meant to run on a schedule.

For each unfinished run that has batches: submit what is pending, poll once, collect ended
batches, start retries, and finish (score, price, publish) the runs whose requests all ended.
Holds no worker while providers work: each call is a few seconds, then it exits.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from prefect import flow

from flows.common import RunContext, drive_run, emulator_for, finish_run, price_for, summary
from lowtide import artifacts
from lowtide.jobspec import load_job
from lowtide.lease import LEASE_S, process_owner
from lowtide.settings import Settings
from lowtide.store.state import Store


def _run_name() -> str:
    return f"collect-{datetime.now(UTC):%Y-%m-%d-%H%M}"


@flow(name="collect", flow_run_name=_run_name, log_prints=False)
def collect(
    state: str | None = None, db: str | None = None, emulator_url: str | None = None
) -> list[dict[str, Any]]:
    """One pass over in-flight runs; returns a summary per run it touched."""
    settings = Settings().with_overrides(state=state, db=db)
    if not settings.state.is_file():
        return []
    store = Store(settings.state, settings.lock_timeout_s)
    runs = store.query(
        "SELECT run_id, job_file, backend FROM runs WHERE status IN ('submitted', 'running', "
        "'cancelling') AND run_id IN (SELECT run_id FROM batches) ORDER BY started_at"
    )
    touched = []
    problems: list[str] = []
    owner = process_owner()
    for run in runs.iter_rows(named=True):
        if store.claim_run(run["run_id"], owner, LEASE_S) is not None:
            continue  # a live enrich (or another collect) is driving it
        try:
            touched.append(_collect_one(run, settings, store, emulator_url))
        except Exception as e:  # noqa: BLE001 - recorded on the run, re-raised after the others
            store.update_run(run["run_id"], error=f"collect: {e}"[:2000])
            problems.append(f"{run['run_id']}: {e}")
        finally:
            store.release_run(run["run_id"], owner)
    if problems:
        # the other runs were collected; the flow run still fails so the schedule shows it
        raise RuntimeError("collect failed for " + "; ".join(problems))
    return touched


def _collect_one(run: dict, settings: Settings, store: Store, emulator_url: str | None) -> dict:
    job = load_job(run["job_file"], run["backend"])
    with emulator_for(run["backend"], emulator_url) as emu_url:
        ctx = RunContext(settings, store, run["backend"], emu_url, price_for(job, run["backend"]))
        finished = drive_run(job, ctx, run["run_id"], wait=False)
        if finished:
            finish_run(job, ctx, run["run_id"])
    result = summary(store, run["run_id"], settings)
    if finished:
        artifacts.publish_run_report(result)
    return result
