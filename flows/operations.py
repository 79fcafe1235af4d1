"""Operator actions on a run: cancel it, publish it. One implementation, two faces: the CLI
calls these functions directly (no Prefect server needed for a one-line action) and the
`cancel-run` / `publish-run` flows wrap them for the Prefect UI and deployments.
"""

from __future__ import annotations

from typing import Any

from lowtide.backends import Connection, backend_entry
from lowtide.backends.base import Backend
from lowtide.errors import (
    BackendError,
    JobFileError,
    PublishError,
    TerminalBackendError,
    UserError,
)
from lowtide.jobspec import load_job
from lowtide.orchestration import flow
from lowtide.settings import Settings
from lowtide.store import Store


def cancel_run(settings: Settings, run_id: str) -> dict[str, Any]:
    """Mark the run cancelling (so no new round starts), drop what was never sent, and ask the
    provider to cancel what is in flight (a batch that ended meanwhile is left as it is). Finished
    work is kept; `collect` records the rest as cancelled. Returns {run_id, cancelled_in_flight,
    dropped_unsent, already_ended}."""
    store = Store(settings.state, settings.lock_timeout_s)
    run = store.require_run(run_id)
    entry = backend_entry(run["backend"])
    if entry.shard_files:
        # the shards run in a Kubernetes Job lowtide does not own; refuse before marking
        # anything, so the run stays importable
        raise UserError(
            f"run {run_id} runs as `vllm run-batch` shards in a Job lowtide cannot stop: delete "
            "the Job (kubectl delete job ...), then `lowtide shards import` keeps what finished"
        )
    store.mark_cancelling(run_id)
    dropped = store.cancel_unsent_batches(run_id)
    live = store.live_provider_batches(run_id)
    ended = 0
    if live.height and entry.mode == "batch":
        try:
            connection = Connection(
                emulator_url=settings.emulator_url, api_key_block=_key_block(run)
            )
            backend = entry.batch_client(connection)
            ended = cancel_provider_batches(backend, live["provider_batch_id"].to_list())
        except BackendError as e:
            raise type(e)(
                f"{e} (the run is marked cancelling; run `lowtide cancel` again)",
                backend=e.backend,
                operation=e.operation,
            ) from e
    return {
        "run_id": run_id,
        "cancelled_in_flight": live.height - ended,
        "dropped_unsent": dropped,
        "already_ended": ended,
    }


def cancel_provider_batches(backend: Backend, provider_batch_ids: list[str]) -> int:
    """Ask the provider to cancel each batch; returns how many had already ended (their
    answers are kept like any finished work)."""
    ended = 0
    for provider_batch_id in provider_batch_ids:
        try:
            backend.cancel(provider_batch_id)
        except TerminalBackendError:
            # refused because it ended meanwhile (completed, expired): nothing to cancel
            if not backend.poll(provider_batch_id).status.terminal:
                raise
            ended += 1
    return ended


def _key_block(run: dict[str, Any]) -> str | None:
    """The run's `[model] api_key_block`, from its job file as `collect` reads it; None when
    that file is gone or no longer valid (the key's variable still works)."""
    try:
        return load_job(run["job_file"], run["backend"]).model.api_key_block
    except JobFileError:
        return None


def publish_run(settings: Settings, run_id: str) -> dict[str, Any]:
    """Make a finished run (e.g. one held by the eval gate) the one its job view shows and
    rebuild the published file. Returns {run_id, status, db}."""
    store = Store(settings.state, settings.lock_timeout_s)
    store.publishable(run_id)  # finished, or a clear error before anything is written
    try:
        path = store.publish(settings.db, showing=run_id)
    except PublishError as e:
        store.record_error(run_id, f"{e}. Fix the cause, then: lowtide publish {run_id}")
        raise
    status = store.publish_run(run_id)  # only now: the file shows it
    return {"run_id": run_id, "status": status.value, "db": str(path)}


@flow(name="cancel-run", flow_run_name="cancel-{run_id}", log_prints=False)
def cancel(run_id: str, state: str | None = None) -> dict[str, Any]:
    """Cancel a run's in-flight batches (the Prefect face of `lowtide cancel`)."""
    return cancel_run(Settings().with_overrides(state=state), run_id)


@flow(name="publish-run", flow_run_name="publish-{run_id}", log_prints=False)
def publish(run_id: str, state: str | None = None, db: str | None = None) -> dict[str, Any]:
    """Publish a finished run (the Prefect face of `lowtide publish`)."""
    return publish_run(Settings().with_overrides(state=state, db=db), run_id)
