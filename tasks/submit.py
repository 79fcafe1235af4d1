"""submit: one shard → one provider batch, write-ahead.

The manifest (requests and a `pending` batch row) is already committed. Each provider id is
committed the moment it returns. A batch that already has a provider id is never sent again; one
that was uploaded but has no batch id may have been created just before a crash, so the provider
is asked (by lowtide's metadata tag) before anything is created.
"""

from __future__ import annotations

from prefect import task

from lowtide.backends import make_backend
from lowtide.backends.base import Backend, BatchStatus, TransientBackendError
from lowtide.crashpoints import crash_point
from lowtide.store.state import Store


def submit_batch(store: Store, backend: Backend, batch_id: str) -> str:
    """Make sure `batch_id` exists at the provider exactly once; returns the provider batch id."""
    row = store.query("SELECT * FROM batches WHERE batch_id = ?", [batch_id]).row(0, named=True)
    if row["provider_batch_id"]:
        return row["provider_batch_id"]
    input_file_id = row["input_file_id"]
    if row["status"] == BatchStatus.UPLOADED.value:
        # the create call may have reached the provider just before a crash: ask first
        claimed = store.query(
            "SELECT provider_batch_id FROM batches WHERE provider_batch_id IS NOT NULL"
        )["provider_batch_id"].to_list()
        found = backend.find(
            batch_id, row["n_requests"], row["updated_at"].timestamp(), exclude=tuple(claimed)
        )
        if found:
            store.update_batch(
                batch_id, provider_batch_id=found, status=BatchStatus.VALIDATING.value
            )
            return found
    lines = store.batch_lines(batch_id)
    if row["status"] == BatchStatus.PENDING.value:
        input_file_id = backend.upload(batch_id, lines)
        # recorded even for providers without an upload step (None): from here on a create call
        # may have happened, so a restart must look for the batch before creating another
        store.update_batch(batch_id, input_file_id=input_file_id, status=BatchStatus.UPLOADED.value)
        crash_point("after_upload")
    provider_id = backend.create(batch_id, input_file_id, lines)
    crash_point("after_create")
    store.update_batch(batch_id, provider_batch_id=provider_id, status=BatchStatus.VALIDATING.value)
    return provider_id


def _transient(task, task_run, state) -> bool:  # noqa: ANN001 - Prefect's callback signature
    try:
        state.result()
    except TransientBackendError:
        return True
    except Exception:  # noqa: BLE001 - any other failure is terminal for this task
        return False
    return False


@task(
    name="submit",
    task_run_name="submit-{batch_id}",
    retries=4,
    retry_delay_seconds=[1, 2, 4, 8],
    retry_jitter_factor=0.5,
    retry_condition_fn=_transient,
)
def submit_task(batch_id: str, state_path: str, backend_name: str, emulator_url: str | None) -> str:
    store = Store(state_path)
    return submit_batch(store, make_backend(backend_name, emulator_url=emulator_url), batch_id)
