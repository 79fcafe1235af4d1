"""submit: one shard → one provider batch, write-ahead, when the provider's queue has room.

The manifest (requests and a `pending` batch row) is already committed. Each provider id is
committed the moment it returns. A batch that already has a provider id is never sent again; one
that was uploaded but has no batch id may have been created just before a crash, so the provider
is asked (by lowtide's metadata tag) before anything is created.

Batches go out only while the provider's queue has room for them (`lowtide/quota.py`, `admit`);
one larger than the queue is first cut to fit. A create the provider refuses for its queue or
create rate (a 429) made nothing: the batch waits for the provider's `retry-after` and goes again.
A batch the provider refused at validation for its token limit ran nothing either: `requeue`
puts it back, and the limit its refusal states is remembered for this night and the next.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path

import polars as pl

from lowtide import prepared_lines
from lowtide.backends.base import (
    Backend,
    BackendError,
    BatchStatus,
    ItemRole,
    ProviderItem,
    QuotaRefusal,
    TerminalBackendError,
)
from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.errors import CredentialsError, InputFileGoneError, ProviderQueueFullError
from lowtide.orchestration import retry_transient, task
from lowtide.quota import (
    ALL_MODELS,
    ENQUEUED_TOKENS,
    NOT_BEFORE,
    PLANNING_SHARE,
    QUEUED_REQUESTS,
    Batch,
    room_for,
)
from lowtide.runlog import stage_log
from lowtide.store import Store

QUEUE_WAIT_S = 30.0
"""How long to wait after a queue-full 429 that carried no `retry-after`."""

PIECES_PER_QUEUE = 3
"""A batch larger than a third of the queue is cut into pieces of at most a third, so that while
one ends and the next is created the queue still holds two, and pieces pack it closely."""


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
    except ProviderQueueFullError as e:
        wait_for_room(ctx, run_id, e)
        return None
    except TerminalBackendError as e:
        store.fail_batch(batch_id, "rejected", str(e))
        stage_log("submit", "%s refused by %s: %s", batch_id, ctx.backend, e)
        return None
    stage_log("submit", "%s sent as %s", batch_id, provider_id)
    return provider_id


# -- the provider's queue ------------------------------------------------------------------------
def _queue_model(ctx: RunContext) -> str:
    """The model key the provider's queue limit is kept under: Anthropic's is shared by all."""
    return ALL_MODELS if ctx.capabilities.queue == QUEUED_REQUESTS else ctx.job.model.name


def admit(ctx: RunContext, run_id: str) -> tuple[list[str], str | None]:
    """The run's unsent batches that may be created now, in sending order, and why the others
    wait (None when none do). A batch larger than a third of the queue's token limit is first
    cut into pieces of a third; one that does not fit the room left is passed over for a later,
    smaller one that does."""
    store = ctx.store
    unsent = store.unsent_batch_sizes(run_id)
    if unsent.is_empty():
        return [], None
    limits = ctx.queue_limits()
    cap = limits.enqueued_tokens
    if cap is not None and math.isfinite(cap):
        piece = int(cap * PLANNING_SHARE / PIECES_PER_QUEUE)
        too_big = unsent.filter((pl.col("est_tokens") > piece) & (pl.col("n_requests") > 1))
        for batch_id in too_big["batch_id"]:
            pieces = split(ctx, batch_id, piece)
            stage_log("submit", "%s cut in %d to fit the provider's queue", batch_id, len(pieces))
        if too_big.height:
            unsent = store.unsent_batch_sizes(run_id)
    usage = store.queue_usage(ctx.backend, ctx.job.model.name)
    probe = ctx.capabilities.queue == ENQUEUED_TOKENS
    admitted: list[str] = []
    first_why: str | None = None
    now = time.time()
    for batch_id, n_requests, tokens, wait_below in unsent.iter_rows():
        blocked = room_for(Batch(0, 0), limits, usage, now=now, probe=probe)
        if blocked is not None:
            # the provider's wait, its create rate or a batch awaiting admission: nothing goes
            return admitted, first_why or blocked
        why = room_for(Batch(tokens, n_requests), limits, usage, now=now, probe=probe)
        if why is None and wait_below is not None and usage.tokens >= wait_below:
            # refused before while the queue held this much: the provider counts it larger
            # than lowtide's estimate, so it waits until the queue holds less
            why = f"refused with {wait_below:,} tokens queued; waiting for less"
        if why is not None:
            first_why = first_why or why
            continue
        admitted.append(batch_id)
        usage = replace(
            usage,
            tokens=usage.tokens + tokens,
            requests=usage.requests + n_requests,
            unadmitted=usage.unadmitted + 1,
            creates_last_hour=usage.creates_last_hour + 1,
        )
    return admitted, first_why


def wait_for_room(ctx: RunContext, run_id: str, refusal: ProviderQueueFullError) -> None:
    """A create refused with a 429 (queue or create rate full): no batch is created before the
    provider's `retry-after`; for a request-count queue, the size its refusal states (else what
    it held when it refused) is remembered, so the next batch and the next night do not
    overfill it."""
    store, model = ctx.store, _queue_model(ctx)
    wait = refusal.retry_after_s if refusal.retry_after_s is not None else QUEUE_WAIT_S
    store.learn_limit(ctx.backend, model, NOT_BEFORE, time.time() + wait, "retry-after")
    stage_log("submit", "the provider's queue is full; waiting %.0f s (%s)", wait, refusal)
    if ctx.capabilities.queue != QUEUED_REQUESTS:
        return
    if refusal.limit is not None:
        store.learn_limit(ctx.backend, model, QUEUED_REQUESTS, refusal.limit, "429")
        return
    # what the queue held when it refused, as the provider sees it now: batches the store still
    # counts may have ended since they were last polled
    backend = ctx.batch_client()
    live = store.live_provider_batches(run_id)
    store.record_polls(
        [
            (b, backend.poll(p))
            for b, p in zip(live["batch_id"], live["provider_batch_id"], strict=True)
        ]
    )
    held = store.queue_usage(ctx.backend, ctx.job.model.name).requests
    if held:
        known = ctx.queue_limits().queued_requests
        if known is None or held < known:
            store.learn_limit(ctx.backend, model, QUEUED_REQUESTS, held, "429")


def requeue(ctx: RunContext, batch_id: str, refusal: QuotaRefusal) -> None:
    """A batch the provider refused at validation for its token limit ran nothing: it goes back
    to be created again, and the limit is remembered (the one the refusal states, else what the
    queue held besides it). Refused with nothing else queued, it is halved, since the provider
    counts it larger than lowtide's estimate does; a single request that does not fit fails."""
    store, model = ctx.store, _queue_model(ctx)
    tokens = int(store.batch(batch_id)["est_tokens"] or 0)
    others = store.queue_usage(ctx.backend, ctx.job.model.name).tokens - tokens
    limit = refusal.limit if refusal.limit is not None else (others if others > 0 else None)
    if limit is not None:
        store.learn_limit(ctx.backend, model, refusal.limit_name, limit, "refusal")
    store.requeue_refused(batch_id, ctx.backend, model, refusal.reason, max(others, 0))
    stage_log(
        "submit",
        "%s refused for the provider's queue limit: sent again when there is room",
        batch_id,
    )
    if others > 0:
        return
    if store.batch(batch_id)["n_requests"] > 1:
        split(ctx, batch_id, max(1, tokens // 2))
    else:
        store.fail_batch(
            batch_id,
            "queue_limit",
            f"the provider's queue cannot hold this request ({refusal.reason})",
        )


def split(ctx: RunContext, batch_id: str, max_tokens: int) -> list[str]:
    """Cut an unsent batch into pieces of at most `max_tokens` (`Store.split_batch`); the file
    it had uploaded for a refused create is needed no more and is deleted (a refused delete is
    left to `lowtide leftovers`)."""
    uploaded = ctx.store.batch(batch_id)["input_file_id"]
    pieces = ctx.store.split_batch(batch_id, max_tokens)
    if uploaded:
        item = ProviderItem(uploaded, ItemRole.INPUT, batch_id)
        try:
            ctx.batch_client().delete_item(item)
        except BackendError as e:
            stage_log("submit", "input file %s of %s not deleted: %s", uploaded, batch_id, e)
    return pieces
