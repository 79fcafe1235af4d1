"""A poll round that fails part-way keeps what it saw before the failure.

A round asks the provider about each live batch in turn and writes its observations in one
transaction at the end. When one batch's poll fails (here the provider answers 500 for that
batch alone, on every try), the batches polled before it keep their new status, the poll's own
error is the one raised (Prefect's retry decides on it), and a later round finishes the run with
every row accounted for and nothing paid twice.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from flows.collect import collect
from flows.enrich import enrich
from lowtide.backends import make_backend
from lowtide.backends.base import TransientBackendError
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.emulator.config import FaultRule
from lowtide.store import Store
from tasks.poll import poll_once
from tests.integration.conftest import advance_clock, write_job

pytestmark = pytest.mark.usefixtures("prefect_harness")


def test_a_round_that_fails_part_way_keeps_the_polls_before_the_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOWTIDE_SHARD_MAX_REQUESTS", "10")
    job = write_job(tmp_path, rows=30, eval_rows=5)
    # a frozen clock (batches move only when the test advances it) and batches that stay in
    # progress for 1000 s per request once validated
    config = EmulatorConfig(
        time_scale=0.0, error_rate=0.0, validating_s=1, batch_seconds_per_request=1000.0
    )
    with Emulator(config) as emu:
        submitted = enrich(job_file=str(job), emulator_url=emu.base_url, wait=False)
        run_id = submitted["run_id"]
        store = Store(os.environ["LOWTIDE_STATE"])
        before = store.open_batches(run_id)
        assert before.height >= 3, "the test needs a round over at least three batches"
        assert set(before["status"]) == {"validating"}
        first, second, third = before["batch_id"][:3]

        advance_clock(emu, 2)  # past validation: the provider now says in_progress for each
        failing = before.filter(before["batch_id"] == second)["provider_batch_id"][0]
        emu.state.faults.replace([FaultRule("500", "GET", f"/v1/batches/{failing}", None)])
        backend = make_backend("emulator", emulator_url=emu.base_url)
        with pytest.raises(TransientBackendError, match="poll"):
            poll_once(store, backend, run_id)

        status = dict(store.open_batches(run_id).select("batch_id", "status").iter_rows())
        assert status[first] == "in_progress", "the poll before the failure was lost"
        assert status[second] == "validating" and status[third] == "validating"

        emu.state.faults.replace([])
        advance_clock(emu, 24 * 3600)
        done = collect(emulator_url=emu.base_url)[0]
    assert done["status"] == "completed"
    assert done["rows"] == 30 == done["succeeded"] + done["failed"]
    assert set(emu.ledger.count_by_custom_id().values()) == {1}, "a request was paid twice"
