"""submit: one shard → one provider batch, write-ahead.

The manifest (requests and a `pending` batch row) is already committed. Each provider id is
committed the moment it returns. A batch that already has a provider id is never sent again; one
that was uploaded but has no batch id may have been created just before a crash, so the provider
is asked (by lowtide's metadata tag) before anything is created.
"""

from __future__ import annotations

from pathlib import Path

from lowtide import prepared_lines
from lowtide.backends.base import Backend, BatchStatus, TerminalBackendError
from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.errors import CredentialsError, InputFileGoneError
from lowtide.orchestration import retry_transient, task
from lowtide.runlog import stage_log
from lowtide.store import Store


def submit_batch(
    store: Store, backend: Backend, batch_id: str, work_dir: Path | None = None
) -> str:
    """Make sure `batch_id` exists at the provider exactly once; returns the provider batch id.
    With `work_dir`, the lines `prepared_lines.prepare` wrote there are sent, if complete."""
    row = store.batch(batch_id)
    if row["provider_batch_id"]:
        return row["provider_batch_id"]
    input_file_id = row["input_file_id"]
    if row["status"] == BatchStatus.UPLOADED.value:
        # the create call may have reached the provider just before a crash: ask first
        found = backend.find(
            batch_id,
            row["n_requests"],
            row["updated_at"].timestamp(),
            exclude=store.claimed_provider_ids(),
        )
        if found:
            store.record_created(batch_id, found)
            return found
    prepared = prepared_lines.read(work_dir, batch_id, row["n_requests"]) if work_dir else None
    lines = prepared if prepared is not None else store.batch_lines(batch_id)
    if row["status"] == BatchStatus.PENDING.value:
        input_file_id = backend.upload(batch_id, lines)
        # recorded even for providers without an upload step (None): from here on a create call
        # may have happened, so a restart must look for the batch before creating another
        store.record_uploaded(batch_id, input_file_id)
        crash_point("after_upload")
    try:
        provider_id = backend.create(batch_id, input_file_id, lines)
    except InputFileGoneError:
        # the create was refused, so nothing exists or was paid for: send the file again
        input_file_id = backend.upload(batch_id, lines)
        store.record_uploaded(batch_id, input_file_id)
        stage_log("submit", "%s: the input file was gone; uploaded again", batch_id)
        provider_id = backend.create(batch_id, input_file_id, lines)
    crash_point("after_create")
    store.record_created(batch_id, provider_id)
    if work_dir:
        prepared_lines.discard(work_dir, batch_id)
    return provider_id


@task(name="submit", task_run_name="submit-lines-{run_id}")
def prepare_lines_task(ctx: RunContext, run_id: str, batch_ids: list[str]) -> None:
    """The lines of every batch about to be sent, from one pass over the store
    (`prepared_lines`). Only a shortcut: without its files each send builds its own lines."""
    try:
        prepared_lines.prepare(ctx.store, ctx.work_dir(run_id), batch_ids)
    except OSError as e:  # a full disk, say: sending works without the files
        stage_log("submit", "request lines not prepared in %s: %s", ctx.work_dir(run_id), e)


@task(
    name="submit",
    task_run_name="submit-{batch_id}",
    retries=4,
    retry_delay_seconds=[1, 2, 4, 8],
    retry_jitter_factor=0.5,
    retry_condition_fn=retry_transient,
)
def submit_task(ctx: RunContext, batch_id: str, run_id: str) -> str | None:
    """Send one pending batch; returns its provider id. A batch the provider refuses for good
    ends failed with the reason (its requests become failed rows) and returns None. A missing
    or refused key is raised instead: it is not the batch's fault, so the batch stays unsent
    and the next run with a working key sends it."""
    store = ctx.store
    try:
        provider_id = submit_batch(store, ctx.batch_client(), batch_id, ctx.work_dir(run_id))
    except CredentialsError:
        raise
    except TerminalBackendError as e:
        store.fail_batch(batch_id, "rejected", str(e))
        stage_log("submit", "%s refused by %s: %s", batch_id, ctx.backend, e)
        return None
    stage_log("submit", "%s sent as %s", batch_id, provider_id)
    return provider_id
