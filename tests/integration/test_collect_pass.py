"""A collect pass stores parsed batches together and keeps them when a later batch fails.

Each batch is parsed as it is downloaded, and the parsed batches are stored in one commit once
enough results wait (`STORE_ROWS`, lowered here) or the pass ends. When a later batch cannot be
downloaded, the batches parsed before it are still stored and marked collected; the failed one
is not, and the next pass downloads only it. Nothing is sent twice.
"""

from __future__ import annotations

import os
from pathlib import Path

import polars as pl
import pytest

import flows.enrich
from flows.collect import collect
from flows.enrich import enrich
from lowtide.backends import make_backend
from lowtide.backends.base import TerminalBackendError
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.emulator.config import FaultRule
from lowtide.store import Store
from tasks.poll import poll_once
from tests.integration.conftest import advance_clock, write_job
from tests.leftovers import assert_nothing_left, left_at_emulator

pytestmark = pytest.mark.usefixtures("prefect_harness")


def _results_of(store: Store, batch_id: str) -> pl.DataFrame:
    return store.results_for(store.batch_members(batch_id)["custom_id"])


def test_parsed_batches_are_stored_together_and_kept_when_a_later_one_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOWTIDE_SHARD_MAX_REQUESTS", "10")
    # the first three 10-request batches are stored together (30 results >= 25)
    monkeypatch.setattr(flows.enrich, "STORE_ROWS", 25)
    job = write_job(tmp_path, rows=60, eval_rows=5)
    config = EmulatorConfig(time_scale=0.0, error_rate=0.0)  # batches move with the test's clock
    with Emulator(config) as emu:
        run_id = enrich(job_file=str(job), emulator_url=emu.base_url, wait=False)["run_id"]
        store = Store(os.environ["LOWTIDE_STATE"])
        advance_clock(emu, 24 * 3600)
        poll_once(store, make_backend("emulator", emulator_url=emu.base_url), run_id)
        ended = store.ended_uncollected_batches(run_id)
        assert len(ended) >= 6, "the test needs a pass over at least six ended batches"
        # the fifth batch's answers can no longer be downloaded (a refusal, not retried)
        refused = store.batch(ended[4])["output_file_id"]
        emu.state.faults.replace([FaultRule("403", "GET", f"/v1/files/{refused}/content", None)])
        with pytest.raises(TerminalBackendError, match="download: .*Error code: 403"):
            collect(emulator_url=emu.base_url, run_id=run_id)

        collected = dict(store.run_batches(run_id).select("batch_id", "collected").iter_rows())
        assert [collected[b] for b in ended[:5]] == [True, True, True, True, False]
        stored = [_results_of(store, b) for b in ended[:5]]
        assert [s.height for s in stored[:4]] == [
            store.batch(b)["n_requests"] for b in ended[:4]
        ], "a batch parsed before the failure lost results"
        assert stored[4].is_empty(), "the refused batch has results it was never able to download"
        # the first three went in one commit, the fourth (kept after the failure) in another
        first_three = pl.concat(stored[:3])["received_at"]
        assert first_three.n_unique() == 1
        assert stored[3]["received_at"].n_unique() == 1
        assert stored[3]["received_at"][0] != first_three[0]
        # the refused batch's results are not stored: its files stay at the provider
        assert refused in left_at_emulator(emu.base_url, store, run_id)

        emu.state.faults.replace([])
        done = collect(emulator_url=emu.base_url, run_id=run_id)[0]
        assert_nothing_left(emu.base_url, store, run_id)
    assert done["status"] == "completed"
    assert done["rows"] == 60 == done["succeeded"] + done["failed"]
    assert set(emu.ledger.count_by_custom_id().values()) == {1}, "a request was paid twice"
