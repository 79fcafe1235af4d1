"""Ctrl-C on a waiting `lowtide run`: one line, exit 130, no process left behind, and the same
command afterwards resumes the run without sending anything twice.

The run is a real subprocess started as a terminal starts it (SIGINT at its default), on
Prefect's temporary server (the case where a child server could outlive it); SIGTERM to a run
in-process (no server) is reported the same way, and the process then ends by the signal. The emulator's
clock stands still, so the run is certainly waiting in its poll loop when the signal comes: the
test waits for the event (the run recorded as submitted), never for a time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from flows.enrich import enrich
from lowtide.emulator import Emulator, EmulatorConfig
from lowtide.store import Store
from tests.integration.conftest import start_lowtide_run, write_job
from tests.processes import wait_for_exit

pytestmark = [pytest.mark.usefixtures("prefect_harness"), pytest.mark.slow]


def _processes_of(state: str) -> list[int]:
    """Processes (other than this one) whose environment names this test's state file: the
    run and every child it started."""
    mark = f"LOWTIDE_STATE={state}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            env = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if mark in env:
            found.append(int(proc.name))
    return found


def _wait_until_submitted(store: Store, proc: subprocess.Popen[str]) -> str:
    """The run's id once the state file records it as submitted (a run that ends first fails
    the test; one that hangs, the test's timeout)."""
    while True:
        assert proc.poll() is None, proc.communicate()
        if Path(store.path).is_file():
            runs = store.list_runs()
            if runs.height and runs["status"][0] == "submitted":
                return str(runs["run_id"][0])
        time.sleep(0.5)


@pytest.mark.parametrize(
    ("sent", "prefect", "returncode"),
    [
        (signal.SIGINT, "temporary", 130),  # Ctrl-C, with Prefect's temporary server as a child
        (signal.SIGINT, "auto", 130),  # Ctrl-C, the run in-process
        (signal.SIGTERM, "auto", -signal.SIGTERM),  # a service manager's stop: ends by it
    ],
)
def test_an_interrupt_stops_a_waiting_run_in_one_line_and_the_rerun_resumes_it(
    tmp_path: Path, sent: signal.Signals, prefect: str, returncode: int
) -> None:
    job = write_job(tmp_path, rows=20, eval_rows=5)
    state = os.environ["LOWTIDE_STATE"]
    frozen = EmulatorConfig(time_scale=0.0, error_rate=0.0, validating_s=3600)
    with Emulator(frozen) as emu:
        env = {
            **os.environ,
            "LOWTIDE_EMULATOR_URL": emu.base_url,
            "LOWTIDE_PREFECT_SERVER": prefect,
        }
        env.pop("PREFECT_API_URL", None)  # no server configured
        proc = start_lowtide_run(job, env, tmp_path)
        try:
            run_id = _wait_until_submitted(Store(state), proc)
            proc.send_signal(sent)
            out, err = proc.communicate()
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == returncode, (out, err)
        assert "stopped: interrupted" in err and "Traceback" not in out + err, (out, err)
        wait_for_exit(_processes_of(state))  # anything the run started follows it out
        assert _processes_of(state) == []
        # the batch was accepted before the interrupt: the rerun waits for it, sends nothing
        emu.state.clock.set_time_scale(600.0)
        summary = enrich(job_file=str(job), emulator_url=emu.base_url)
        executed = emu.ledger.count_by_custom_id()
    assert summary["run_id"] == run_id and summary["status"] == "completed"
    assert summary["succeeded"] + summary["failed"] == 20
    assert executed and max(executed.values()) == 1
