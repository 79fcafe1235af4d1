"""Kill the run with SIGKILL at each step boundary of submit, resume it, and check the bill.

The emulator's ledger is the provider's view: every unique request must have been executed
exactly once, whatever the crash point, and the store must account for every row.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from flows.enrich import enrich
from lowtide.crashpoints import POINTS
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.store import Store
from tests.integration.conftest import write_job
from tests.leftovers import assert_nothing_left

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]


@pytest.mark.parametrize("point", POINTS)
def test_crash_then_resume_pays_once(point: str, tmp_path: Path) -> None:
    from prefect.settings import PREFECT_API_URL

    job = write_job(tmp_path, rows=60, eval_rows=10)
    # during_poll needs a poll that finds the batch still running: the emulator's clock stands
    # still until the crash (an event, not a race with a busy machine), then runs for the resume
    frozen = point == "during_poll"
    config = EmulatorConfig(time_scale=0.0 if frozen else 30.0, error_rate=0.0, seed=1)
    with Emulator(config) as emu:
        env = {
            **os.environ,
            "LOWTIDE_EMULATOR_URL": emu.base_url,
            "LOWTIDE_CRASH_AT": point,
            "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        }
        crashed = subprocess.run(
            [sys.executable, "-m", "lowtide.cli", "run", str(job)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr

        store = Store(os.environ["LOWTIDE_STATE"])
        crashed_run = store.list_runs().row(0, named=True)
        assert crashed_run["status"] in ("running", "submitted")

        emu.state.clock.set_time_scale(30.0)
        summary = enrich(job_file=str(job), emulator_url=emu.base_url)
        assert summary["run_id"] == crashed_run["run_id"]  # resumed, not started over
        assert summary["status"] == "completed"
        assert summary["rows"] == 60 == summary["succeeded"] + summary["failed"]

        counts = emu.ledger.count_by_custom_id()
        assert set(counts.values()) == {1}, f"paid twice after a crash at {point}"
        assert len(counts) == summary["unique_requests"]
        batches = store.run_batches(summary["run_id"])
        assert batches["provider_batch_id"].n_unique() == batches.height
        assert len(emu.state.batches) == batches.height  # no orphan batch at the provider
        assert_nothing_left(emu.base_url, store, summary["run_id"])


def test_an_input_file_gone_before_the_create_is_uploaded_again(tmp_path: Path) -> None:
    """Crash after the upload; the provider then loses the file (deleted, past retention, or a
    restarted emulator). The resumed create is refused, nothing was created or paid, so lowtide
    uploads again and creates: every row answered, every request executed once."""
    from prefect.settings import PREFECT_API_URL

    job = write_job(tmp_path, rows=40, eval_rows=5)
    config = EmulatorConfig(time_scale=30.0, error_rate=0.0, seed=1, validating_s=5.0)
    with Emulator(config) as emu:
        env = {
            **os.environ,
            "LOWTIDE_EMULATOR_URL": emu.base_url,
            "LOWTIDE_CRASH_AT": "after_upload",
            "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        }
        crashed = subprocess.run(
            [sys.executable, "-m", "lowtide.cli", "run", str(job)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
        store = Store(os.environ["LOWTIDE_STATE"])
        uploaded = store.run_batches(store.list_runs()["run_id"][0])["input_file_id"].to_list()
        import openai

        client = openai.OpenAI(base_url=f"{emu.base_url}/v1", api_key="sk-test")
        for file_id in uploaded:
            if file_id:
                client.files.delete(file_id)

        summary = enrich(job_file=str(job), emulator_url=emu.base_url)
        assert summary["status"] == "completed"
        assert summary["succeeded"] == 40 and summary["failed"] == 0
        counts = emu.ledger.count_by_custom_id()
        assert set(counts.values()) == {1}
        after = store.run_batches(summary["run_id"])["input_file_id"].to_list()
        assert not set(after) & set(uploaded)  # sent again under new file ids
