"""release: once a batch's results are stored, delete what the provider still keeps of it.

That is its input file and its output and error files (OpenAI), or the ended batch itself,
which holds its requests and results (Anthropic). Only collected batches are released: their
results are committed, so nothing there is needed again, and a batch still waiting to be
created (a quota refusal puts it back) keeps its input file. `[provider] keep_files` keeps
everything instead (recorded, not deleted).

A failed delete never fails the run: it is logged and recorded with its reason, and left for
`lowtide leftovers --delete` (OpenAI's expiry, `openai_storage.EXPIRES_AFTER_S`, is the last
backstop). A batch whose items could not even be looked up stays unreleased, so the next
collect pass of its run tries again; so does one whose release a crash cut short.
"""

from __future__ import annotations

import logging
from typing import Any

from lowtide.backends.base import Backend, BackendError, BatchRefs, ProviderItem
from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.orchestration import task
from lowtide.runlog import stage_log
from lowtide.store import Store


def release_batches(
    store: Store, backend: Backend, batches: list[BatchRefs], keep: bool
) -> dict[str, int]:
    """Delete (or, with `keep`, record as kept) what the provider keeps of each batch, and
    mark each batch released; returns counts of items `deleted`, `kept` and `failed`, and of
    batches `unreleased` (their items could not be looked up). What became of every item is
    recorded in one transaction at the end: a delete is safe to repeat, so a crash before that
    only makes the next pass find those items gone."""
    counts = {"deleted": 0, "kept": 0, "failed": 0, "unreleased": 0}
    outcomes: list[dict[str, Any]] = []
    released: list[str] = []
    for refs in batches:
        try:
            items = backend.kept_items(refs)
        except BackendError as e:
            counts["unreleased"] += 1
            stage_log(
                "release",
                "%s: not released, the provider was not reached: %s",
                refs.batch_id,
                e,
                level=logging.WARNING,
            )
            continue
        outcomes += [dispose(backend, item, keep) for item in items]
        released.append(refs.batch_id)
    store.record_items(outcomes, released=released)
    for outcome in outcomes:
        counts["kept" if outcome["kept"] else "deleted" if outcome["deleted"] else "failed"] += 1
    if counts["failed"]:
        stage_log(
            "release",
            "%d delete(s) failed; `lowtide leftovers JOB_FILE --delete` deletes them later",
            counts["failed"],
        )
    return counts


def dispose(backend: Backend, item: ProviderItem, keep: bool) -> dict[str, Any]:
    """Delete `item` unless `keep`; returns what became of it, as `Store.record_items` takes
    it. A failed delete is logged and returned with its reason, never raised."""
    outcome: dict[str, Any] = {
        "provider_id": item.provider_id,
        "batch_id": item.batch_id,
        "role": item.role,
        "bytes": item.bytes,
        "kept": keep,
        "deleted": False,
        "error": None,
    }
    if keep:
        return outcome
    try:
        backend.delete_item(item)
    except BackendError as e:
        stage_log(
            "release",
            "%s %s of %s not deleted: %s",
            item.kind,
            item.provider_id,
            item.batch_id,
            e,
            level=logging.WARNING,
        )
        outcome["error"] = str(e)
        return outcome
    outcome["deleted"] = True
    return outcome


def batch_refs(row: dict[str, Any]) -> BatchRefs:
    """A batch row's provider ids (the store's `unreleased_batches`, `job_batch_refs`)."""
    return BatchRefs(
        batch_id=row["batch_id"],
        provider_batch_id=row["provider_batch_id"],
        input_file_id=row["input_file_id"],
        output_file_id=row["output_file_id"],
        error_file_id=row["error_file_id"],
    )


def release_collected(ctx: RunContext, run_id: str, batch_ids: list[str]) -> None:
    """Release the run's collected batches not released yet, and `batch_ids` (other runs'
    batches its collect pass stored). Nothing to do costs one query, not a task run."""
    if ctx.entry.mode != "batch":  # a pool keeps nothing at a provider
        return
    pending = ctx.store.unreleased_batches(run_id, batch_ids)
    if pending.height:
        crash_point("before_release")
        release_task(ctx, run_id, [batch_refs(r) for r in pending.iter_rows(named=True)])


@task(name="release", task_run_name="release-{run_id}")
def release_task(ctx: RunContext, run_id: str, batches: list[BatchRefs]) -> dict[str, int]:
    """Delete what the provider keeps of these collected batches (or keep it, as the job
    says); never fails on a provider's refusal."""
    counts = release_batches(ctx.store, ctx.batch_client(), batches, ctx.job.provider.keep_files)
    stage_log(
        "release",
        "%d batch(es): %d item(s) deleted, %d kept, %d failed",
        len(batches) - counts["unreleased"],
        counts["deleted"],
        counts["kept"],
        counts["failed"],
    )
    return counts
