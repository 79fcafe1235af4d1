"""An operator's rerun: a deployment's flow run dies mid-flight (SIGKILL while it polls its batch),
the operator presses Retry, and the same flow run finishes the work without the provider
executing any request twice.

The crash is armed in the environment of a worker that serves only this test's work queue; the
process worker hands its environment to the flow runs it starts, so the first attempt kills
itself at `during_poll`. That worker is then stopped and a clean one takes its place on the same
queue, as when a broken machine is replaced, so the retried attempt runs unarmed. Retry is the
call the UI's Retry button makes: POST /flow_runs/{id}/set_state with a Scheduled
"AwaitingRetry" state.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.store import Store
from tests.e2e.conftest import NIGHTLY, Deployed, PrefectServer, run_env, stop_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

QUEUE = "e2e-retry"


def _retry_like_the_ui(server: PrefectServer, flow_run_id: str) -> None:
    r = server.api.post(
        f"/flow_runs/{flow_run_id}/set_state",
        json={
            "state": {"type": "SCHEDULED", "name": "AwaitingRetry", "message": "Retry from the UI"},
            "force": False,
        },
    )
    r.raise_for_status()
    assert r.json()["status"] == "ACCEPT", r.json()


def test_retry_after_a_crash_finishes_without_paying_twice(
    deployed: Deployed, small_job: Path, tmp_path: Path
) -> None:
    server = deployed.server
    server.ensure_queue(QUEUE)
    state_file = tmp_path / "state.duckdb"
    # A slow clock: the batch (about 22 simulated seconds) is still running at the first poll
    # even on a busy machine, so the crash at during_poll is reached.
    with Emulator(EmulatorConfig(time_scale=3.0, error_rate=0.0, seed=1)) as emu:
        env = run_env(tmp_path, emu.base_url)

        armed = server.start_worker(tmp_path, "e2e-crash", QUEUE, LOWTIDE_CRASH_AT="during_poll")
        try:
            flow_run_id = server.run_deployment(
                NIGHTLY, {"job_file": str(small_job)}, env, work_queue_name=QUEUE
            )
            crashed = server.wait_for_terminal(flow_run_id, explain=lambda: armed.tail(60))
        finally:
            stop_worker(armed)
        assert crashed["state"]["type"] == "CRASHED", crashed["state"]
        assert "SIGKILL" in (crashed["state"]["message"] or ""), crashed["state"]

        # Mid-flight: the batch was accepted by the provider before the process died.
        store = Store(state_file)
        before = store.list_runs().row(0, named=True)
        assert before["status"] in ("submitted", "running")
        batches = store.run_batches(before["run_id"])
        assert batches.height >= 1 and batches["provider_batch_id"].is_not_null().all()
        del store
        assert len(emu.state.batches) == batches.height

        clean = server.start_worker(tmp_path, "e2e-clean", QUEUE)
        try:
            _retry_like_the_ui(server, flow_run_id)
            done = server.wait_for_terminal(flow_run_id, explain=lambda: clean.tail(60))
        finally:
            stop_worker(clean)
        assert done["state"]["type"] == "COMPLETED", done["state"]
        assert done["id"] == flow_run_id and done["run_count"] == 2  # the same run, retried

        # The store resumed the crashed run instead of starting a new one ...
        store = Store(state_file)
        runs = store.list_runs()
        assert runs.height == 1
        after = runs.row(0, named=True)
        assert after["run_id"] == before["run_id"] and after["status"] == "completed"
        assert after["rows"] == 200 == after["succeeded"] + after["failed"]

        # ... and the provider executed every unique request exactly once.
        counts = emu.ledger.count_by_custom_id()
        assert counts and set(counts.values()) == {1}, "a request was executed twice"
        assert len(counts) == after["unique_requests"]
        final_batches = store.run_batches(after["run_id"])
        assert final_batches["provider_batch_id"].n_unique() == final_batches.height
        assert len(emu.state.batches) == final_batches.height  # no orphan batch at the provider
