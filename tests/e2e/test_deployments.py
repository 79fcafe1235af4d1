"""The schedules an operator relies on exist in Prefect after `prefect deploy --all`, and
`make serve` (deployments/serve.sh) brings the whole local setup up and takes it down cleanly.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.conftest import REPO
from tests.e2e.conftest import (
    BIN,
    PREFECT_FILE,
    WORK_POOL,
    Deployed,
    PrefectServer,
    clean_environ,
    free_port,
)
from tests.waiting import wait_until

pytestmark = pytest.mark.slow

EXPECTED = {
    # deployment: (entrypoint, cron, timezone)
    "enrich/nightly-support-intents": ("flows/enrich.py:enrich", "0 2 * * *", "UTC"),
    "collect/collect-in-flight": ("flows/collect.py:collect", "*/5 * * * *", "UTC"),
    "qa-report/morning-qa-report": ("flows/report.py:qa_report", "30 6 * * *", "UTC"),
}


def _deployments(server: PrefectServer) -> dict[str, dict[str, Any]]:
    flows = {f["id"]: f["name"] for f in server.api.post("/flows/filter", json={}).json()}
    return {
        f"{flows[d['flow_id']]}/{d['name']}": d
        for d in server.api.post("/deployments/filter", json={}).json()
    }


@pytest.mark.timeout(180)
def test_deploy_all_registers_the_schedules(deployed: Deployed) -> None:
    found = _deployments(deployed.server)
    assert set(EXPECTED) <= set(found), deployed.output
    for name, (entrypoint, cron, tz) in EXPECTED.items():
        d = found[name]
        assert d["entrypoint"] == entrypoint
        assert d["work_pool_name"] == WORK_POOL
        assert not d["paused"]
        crons = [(s["schedule"].get("cron"), s["schedule"].get("timezone")) for s in d["schedules"]]
        assert crons == [(cron, tz)], d["schedules"]
        assert all(s["active"] for s in d["schedules"])
        assert d["global_concurrency_limit"]["limit"] == 1
        # The worker runs the flow from the repository, where `prefect deploy` ran.
        assert d["pull_steps"] == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO)}}
        ]
    nightly = found["enrich/nightly-support-intents"]
    assert nightly["parameters"]["job_file"] == "data/jobs/support-intents.toml"
    assert (REPO / nightly["parameters"]["job_file"]).is_file()


@pytest.mark.timeout(60)
def test_prefect_yaml_matches_what_the_test_expects() -> None:
    """The file itself, read as YAML: each deployment names a flow file that exists."""
    spec = yaml.safe_load(PREFECT_FILE.read_text())
    entrypoints = {d["entrypoint"] for d in spec["deployments"]}
    assert entrypoints == {e for e, _, _ in EXPECTED.values()}
    for e in entrypoints:
        assert (REPO / e.split(":")[0]).is_file(), e


def _wait_line(log: Path, text: str, proc: subprocess.Popen[bytes]) -> None:
    wait_until(
        lambda: text in log.read_text(errors="replace"),
        f"{text!r} from serve.sh",
        still_going=lambda: proc.poll() is None,
        explain=lambda: log.read_text(errors="replace")[-4000:],
        recheck_s=0.3,
    )


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(240)
def test_make_serve_starts_everything_and_ctrl_c_stops_it(tmp_path: Path) -> None:
    prefect_port, emulator_port = free_port(), free_port()
    env = clean_environ(
        VENV_BIN=str(BIN),
        PREFECT_PORT=str(prefect_port),
        EMULATOR_PORT=str(emulator_port),
        PREFECT_HOME=str(tmp_path / "prefect"),
        SERVE_LOGS=str(tmp_path / "logs"),
        WORKER_NAME="e2e-serve",
        # the every-5-minutes collect may fire while this runs: keep it off the real store
        LOWTIDE_STATE=str(tmp_path / "state.duckdb"),
        LOWTIDE_DB=str(tmp_path / "lowtide.duckdb"),
        LOWTIDE_WORK_DIR=str(tmp_path / "work"),
    )
    log = tmp_path / "serve.out"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["bash", str(REPO / "deployments" / "serve.sh")],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            _wait_line(log, "Prefect UI:", proc)
            url = f"http://127.0.0.1:{prefect_port}"
            assert f"Prefect UI:  {url}" in log.read_text()
            api = httpx.Client(base_url=f"{url}/api", timeout=10)
            names = {d["name"] for d in api.post("/deployments/filter", json={}).json()}
            assert {"nightly-support-intents", "collect-in-flight"} <= names
            assert httpx.get(f"http://127.0.0.1:{emulator_port}/_emulator/clock").is_success
            # the worker registers itself with the pool within a few seconds
            wait_until(
                lambda: bool(api.post(f"/work_pools/{WORK_POOL}/workers/filter", json={}).json()),
                "the worker to register with its pool",
                still_going=lambda: proc.poll() is None,
                explain=lambda: log.read_text(errors="replace")[-3000:],
                recheck_s=0.5,
            )
            api.close()

            proc.send_signal(signal.SIGINT)  # Ctrl-C
            assert proc.wait(timeout=90) != 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            group_left = True
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                group_left = False
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    assert not group_left, "serve.sh left processes behind:\n" + log.read_text()[-3000:]
    assert "stopped." in log.read_text()
    assert not _port_open(prefect_port) and not _port_open(emulator_port)
