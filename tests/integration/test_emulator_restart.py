"""The in-process emulator keeps its files and batches in `<work_dir>/emulator`: `lowtide run`
on the `emulator` backend killed right after the provider created its batch, then run again,
finds that batch at the restarted emulator and finishes it, as it would at a real provider."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest

from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.store import Store
from tests.integration.conftest import lowtide_cli, write_job

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]


def _lowtide_run(job: Path, cwd: Path, crash_at: str | None) -> subprocess.CompletedProcess[str]:
    # no LOWTIDE_EMULATOR_URL: the run starts its in-process emulator, not one of the test's
    assert "LOWTIDE_EMULATOR_URL" not in os.environ
    return lowtide_cli("run", str(job), cwd=cwd, env={"LOWTIDE_CRASH_AT": crash_at or ""})


def _emulator_memory() -> Emulator:
    """An emulator (never started) loaded from the folder the runs' emulators used."""
    folder = Path(os.environ["LOWTIDE_WORK_DIR"]) / "emulator"
    return Emulator(EmulatorConfig(time_scale=0, state_dir=str(folder)))


def test_a_run_killed_after_the_create_resumes_on_the_same_emulator_batch(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=60, eval_rows=10)

    crashed = _lowtide_run(job, tmp_path, crash_at="after_create")
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    store = Store(os.environ["LOWTIDE_STATE"])
    crashed_run = store.list_runs().row(0, named=True)
    assert crashed_run["status"] in ("running", "submitted")
    # the batch id never reached the store; the emulator's folder has the batch
    assert store.run_batches(crashed_run["run_id"])["provider_batch_id"].drop_nulls().is_empty()
    before = _emulator_memory()
    created = {b.id: b.metadata for b in before.state.batches.values()}
    before.stop()
    assert len(created) == 1, created

    rerun = _lowtide_run(job, tmp_path, crash_at=None)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr

    run = store.list_runs().row(0, named=True)
    assert run["run_id"] == crashed_run["run_id"]  # resumed, not started over
    assert run["status"] == "completed"
    assert run["rows"] == 60 == run["succeeded"]
    batches = store.run_batches(run["run_id"])
    first = batches.row(0, named=True)
    assert first["provider_batch_id"] in created  # found again at the provider, not recreated
    assert created[first["provider_batch_id"]] == {"lowtide_batch_id": first["batch_id"]}

    after = _emulator_memory()
    try:
        provider_ids = set(batches["provider_batch_id"].drop_nulls())
        assert set(after.state.batches) == provider_ids  # no second batch at the provider
        assert batches["provider_batch_id"].drop_nulls().n_unique() == len(provider_ids)
        counts = after.ledger.count_by_custom_id()
        assert set(counts.values()) == {1}  # every request executed once, across both processes
        assert len(counts) == store.list_runs().row(0, named=True)["unique_requests"]
    finally:
        after.stop()
