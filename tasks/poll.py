"""poll: batches → terminal status, with exponential backoff; never the only copy of any fact.

Every observation is written to the store, so a killed poller loses nothing: the next run or a
scheduled `collect` picks up from the stored provider ids.
"""

from __future__ import annotations

import time

import orjson
from prefect import task

from lowtide import progress
from lowtide.backends import make_backend
from lowtide.backends.base import Backend, BatchStatus
from lowtide.crashpoints import crash_point
from lowtide.lease import LEASE_S, process_owner
from lowtide.store.state import Store
from tasks.submit import _transient

INTERRUPTED = "realtime calls were interrupted before their answers were stored"


def poll_once(store: Store, backend: Backend, run_id: str) -> tuple[int, int]:
    """Refresh every live batch of the run once; returns (terminal, total) batch counts."""
    batches = store.open_batches(run_id)
    terminal = 0
    done_requests = 0
    total_requests = 0
    for b in batches.iter_rows(named=True):
        total_requests += b["n_requests"]
        if BatchStatus(b["status"]).terminal:
            terminal += 1
            done_requests += b["n_requests"]
            continue
        if b["backend"] == "realtime":
            # realtime calls run inside a task, never across a poll: one found in progress was
            # interrupted (its answers are lost), one still pending is sent by submit_pending
            if b["status"] == BatchStatus.IN_PROGRESS.value:
                store.update_batch(
                    b["batch_id"],
                    status=BatchStatus.FAILED.value,
                    errors=orjson.dumps([{"code": "interrupted", "message": INTERRUPTED}]).decode(),
                )
                terminal += 1
            continue
        if not b["provider_batch_id"]:
            continue
        state = backend.poll(b["provider_batch_id"])
        store.update_batch(
            b["batch_id"],
            status=state.status.value,
            provider_status=state.provider_status,
            output_file_id=state.output_file_id,
            error_file_id=state.error_file_id,
            request_counts=orjson.dumps(state.counts).decode(),
            errors=orjson.dumps(state.errors).decode() if state.errors else None,
            usage=orjson.dumps(state.usage).decode() if state.usage else None,
        )
        if state.status.terminal:
            terminal += 1
            done_requests += b["n_requests"]
        else:
            done_requests += _finished(state.counts, b["n_requests"])
    progress.report(
        "batches", done_requests, total_requests, f"{terminal}/{batches.height} batches ended"
    )
    return terminal, batches.height


def _finished(counts: dict[str, int], n_requests: int) -> int:
    """Requests finished so far: OpenAI counts completed/failed as they go; Anthropic only
    moves `processing` until the batch ends."""
    if "processing" in counts:
        return max(0, n_requests - int(counts["processing"]))
    return int(counts.get("completed", 0)) + int(counts.get("failed", 0))


@task(
    name="poll",
    task_run_name="poll-{run_id}",
    retries=3,
    retry_delay_seconds=[2, 4, 8],
    retry_condition_fn=_transient,
)
def poll_task(
    run_id: str,
    state_path: str,
    backend_name: str,
    emulator_url: str | None,
    wait: bool = True,
    max_interval_s: float = 30.0,
) -> bool:
    """Poll until every batch of the run ended (wait=True) or once; True when all ended."""
    store = Store(state_path)
    backend = make_backend(backend_name, emulator_url=emulator_url)
    interval = 0.2
    while True:
        store.claim_run(run_id, process_owner(), LEASE_S)  # still driving: renew the lease
        terminal, total = poll_once(store, backend, run_id)
        if terminal == total:
            return True
        if not wait:
            return False
        crash_point("during_poll")
        time.sleep(interval)
        interval = min(interval * 1.5, max_interval_s)
