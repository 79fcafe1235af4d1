"""Whether tonight's run has anything to do, decided before reading a single row.

`record_if_unchanged` is called first by the `enrich` flow and, when no Prefect server is
configured, by the CLI before it starts Prefect's temporary server: an unchanged night then
costs the state file's lookups, not a server start and a pass over every row.
"""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from lowtide.input_identity import input_fingerprint, same_input, spec_digest
from lowtide.jobspec import JobSpec
from lowtide.settings import Settings
from lowtide.store import Store
from lowtide.vocabulary import RunStatus


def new_run_id(job: str) -> str:
    return f"{job}-{datetime.now(UTC):%Y%m%dT%H%M%S}-{secrets.token_hex(2)}"


def record_if_unchanged(
    store: Store, job: JobSpec, backend: str, db_path: str | Path
) -> str | None:
    """The id of a new run recorded as unchanged from the run the job's view shows, or None when
    tonight needs a real run: the job spec, backend or model changed, the input's bytes changed,
    the shown run left rows to ask again, an unfinished run of the same input waits to be
    resumed, or the eval set is to be asked afresh (`[qa] eval_every_run`)."""
    if job.qa.eval_set and job.qa.eval_every_run:
        return None
    shown = store.shown_run(job.name)
    if (
        shown is None
        or shown["status"] != RunStatus.COMPLETED.value
        or shown["backend"] != backend
        or shown["model"] != job.model.name
        or shown["job_fingerprint"] != job.prompt_fingerprint()
        or shown["spec_digest"] != spec_digest(job)
    ):
        return None
    fingerprint = input_fingerprint(job)
    if store.resumable_run(job.name, shown["job_fingerprint"], fingerprint, backend):
        return None
    if shown["input_fingerprint"] != fingerprint and not same_input(shown["input_digest"], job):
        return None
    if store.row_units_left_to_ask(shown["rows_run"]):
        return None
    run_id = new_run_id(job.name)
    store.record_unchanged(
        run_id=run_id, shown=shown, job_file=job.source_path, input_fingerprint=fingerprint
    )
    if not store.add_run_to_published(db_path, run_id):
        store.publish(db_path)
    return run_id


def unchanged_summary(settings: Settings, job: JobSpec) -> dict[str, Any] | None:
    """The summary of a run recorded as unchanged (nothing read, nothing asked), or None when
    tonight needs a real run (or there is no state file yet)."""
    if not settings.state.is_file():
        return None
    from lowtide.backends import backend_entry

    store = Store(settings.state, settings.lock_timeout_s)
    run_id = record_if_unchanged(store, job, backend_entry(job.model.backend).name, settings.db)
    if run_id is None:
        return None
    return {**store.run_summary(run_id), "db": str(settings.db), "state": str(settings.state)}
