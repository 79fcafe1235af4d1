"""poll: batches → terminal status, with exponential backoff; never the only copy of any fact.

Every poll round's observations are written to the store in one transaction at its end (a
round over many batches opens the state file once). A poller killed mid-round loses only that
round's observations, which the next round asks again: the provider ids were stored before any
poll, so the next run or a scheduled `collect` picks up from them.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from datetime import datetime

import polars as pl

from lowtide import progress
from lowtide.backends.base import Backend, BatchState, BatchStatus, QuotaRefusal
from lowtide.context import RunContext
from lowtide.crashpoints import crash_point
from lowtide.lease import LEASE_S, process_owner
from lowtide.orchestration import retry_transient, task
from lowtide.routing import is_due, seconds_left
from lowtide.runlog import stage_log
from lowtide.store import Store
from lowtide.vocabulary import REALTIME_BACKEND
from tasks.submit import requeue

INTERRUPTED = "realtime calls were interrupted before their answers were stored"


Refused = Callable[[str, QuotaRefusal], None]
"""What to do with a batch the provider refused for its queue limit (`tasks.submit.requeue`)."""


def poll_once(
    store: Store, backend: Backend | None, run_id: str, refused: Refused | None = None
) -> tuple[int, int]:
    """Refresh every live batch of the run once; returns (terminal, total) batch counts.
    `backend` is None for a backend without provider batches (nothing to ask). A batch the
    provider refused for its queue limit goes to `refused` (when given) instead of ending."""
    batches = store.open_batches(run_id)
    observed: list[tuple[str, BatchState]] = []
    try:
        terminal, done_requests, total_requests = _poll_round(
            store, backend, batches, observed, refused
        )
    except BaseException:
        # keep what was seen before the failing poll, but let the poll's own error (which
        # decides whether the task retries) be the one raised
        with contextlib.suppress(Exception):
            store.record_polls(observed)
        raise
    store.record_polls(observed)
    progress.report(
        "batches", done_requests, total_requests, f"{terminal}/{batches.height} batches ended"
    )
    return terminal, batches.height


def _poll_round(
    store: Store,
    backend: Backend | None,
    batches: pl.DataFrame,
    observed: list[tuple[str, BatchState]],
    refused: Refused | None = None,
) -> tuple[int, int, int]:
    """Ask the provider about each live batch once, appending to `observed`; returns
    (terminal batches, requests done, requests in all)."""
    terminal = 0
    done_requests = 0
    total_requests = 0
    for b in batches.iter_rows(named=True):
        total_requests += b["n_requests"]
        if BatchStatus(b["status"]).terminal:
            terminal += 1
            done_requests += b["n_requests"]
            continue
        if b["backend"] == REALTIME_BACKEND:
            # realtime calls run inside a task, never across a poll: one found in progress was
            # interrupted (its answers are lost), one still pending is sent by the next round
            if b["status"] == BatchStatus.IN_PROGRESS.value:
                store.fail_batch(b["batch_id"], "interrupted", INTERRUPTED)
                terminal += 1
            continue
        if not b["provider_batch_id"] or backend is None:
            continue
        state = backend.poll(b["provider_batch_id"])
        if state.refused is not None and refused is not None:
            refused(b["batch_id"], state.refused)  # not ended: it will be created again
            continue
        observed.append((b["batch_id"], state))
        if state.status.terminal:
            terminal += 1
            done_requests += b["n_requests"]
        else:
            done_requests += min(state.done or 0, b["n_requests"])
    return terminal, done_requests, total_requests


@task(
    name="poll",
    task_run_name="poll-{run_id}",
    retries=3,
    retry_delay_seconds=[2, 4, 8],
    retry_condition_fn=retry_transient,
)
def poll_task(
    ctx: RunContext,
    run_id: str,
    wait: bool = True,
    until: datetime | None = None,
    room: Callable[[], str | None] | None = None,
) -> bool:
    """Poll until every batch of the run ended (wait=True) or once; True when all ended. A
    waiting poll also stops at `until` (a route step's end, watched between polls), and, with
    `room` (batches wait for the provider's queue: why, or None once there is room), as soon as
    the next batch may go."""
    store = ctx.store
    backend = ctx.batch_client() if ctx.entry.mode == "batch" else None
    refused = functools.partial(requeue, ctx) if backend is not None else None
    interval = 0.2
    started = time.perf_counter()
    polls = 0
    while True:
        store.claim_run(run_id, process_owner(), LEASE_S)  # still driving: renew the lease
        terminal, total = poll_once(store, backend, run_id, refused)
        polls += 1
        why = room() if room is not None else ""
        if why is None or terminal == total or not wait or is_due(until):
            stage_log(
                "poll",
                "%d of %d batches ended after %d poll(s), %.1f s",
                terminal,
                total,
                polls,
                time.perf_counter() - started,
            )
            return terminal == total
        if why:
            progress.report("queue", terminal, total, f"waiting for room: {why}")
            crash_point("waiting_for_room")
        crash_point("during_poll")
        left = seconds_left(until)
        time.sleep(interval if left is None else min(interval, left))
        interval = min(interval * 1.5, ctx.poll_max_interval_s)
