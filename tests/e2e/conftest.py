"""End-to-end fixtures: a real Prefect server in a subprocess, lowtide's deployments registered
from deployments/prefect.yaml with the real CLI, and process workers that run them.

Everything here talks to Prefect the way an operator's tools do: the CLI for deploy and workers,
the REST API (plain httpx) for runs, states and artifacts. The test process never imports a
Prefect client, so it cannot pick up another session's settings (the integration tests'
harness) by accident.

Every process is started in its own session (process group) and stopped by the fixture that
started it, with bounded waits; flow-run processes a worker spawned die with their worker's
group.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import REPO
from tests.integration.conftest import write_job
from tests.waiting import wait_until

PREFECT_FILE = REPO / "deployments" / "prefect.yaml"
WORK_POOL = "lowtide"
NIGHTLY = "enrich/nightly-support-intents"
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_environ(**extra: str) -> dict[str, str]:
    """This process's environment without lowtide's or the providers' variables."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LOWTIDE_", "OPENAI_", "ANTHROPIC_", "PREFECT_"))
    }
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


class Proc:
    """A subprocess in its own process group, its output in a log file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path, cwd: Path):
        self.name = name
        self.log = log
        self._out = log.open("wb")
        self.popen = subprocess.Popen(
            args,
            env=env,
            cwd=cwd,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 40) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return f"--- {self.name} ({self.log}) ---\n" + "\n".join(text.splitlines()[-lines:])

    def stop(self, signals: tuple[int, ...] = (signal.SIGTERM,), grace_s: float = 15.0) -> None:
        """Send each signal in turn (waiting up to grace_s after each), then SIGKILL the group."""
        for sig in signals:
            if not self.alive():
                break
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # whatever it left behind in its group
        if self.alive():
            self.popen.kill()
        self.popen.wait(timeout=10)
        self._out.close()


class BusyRetryTransport(httpx.HTTPTransport):
    """A test server on a loaded 2-core machine answers 503 while its SQLite is busy: wait and
    ask again (a few times), as an operator's browser would."""

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for attempt in range(6):
            response = super().handle_request(request)
            if response.status_code != 503 or attempt == 5:
                return response
            response.close()
            time.sleep(0.5 * 2**attempt)
        return response


@dataclass
class PrefectServer:
    """A running server: its URLs, environment for CLI subprocesses, and an API client."""

    url: str
    api_url: str
    home: Path
    env: dict[str, str]
    api: httpx.Client
    proc: Proc

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(BIN / "prefect"), *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def deployment(self, name: str) -> dict[str, Any]:
        r = self.api.get(f"/deployments/name/{name}")
        r.raise_for_status()
        return r.json()

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        r = self.api.get(f"/flow_runs/{flow_run_id}")
        r.raise_for_status()
        return r.json()

    def run_deployment(
        self,
        name: str,
        parameters: dict[str, Any],
        env: dict[str, str],
        work_queue_name: str | None = None,
    ) -> str:
        """Create a flow run of a deployment (what `prefect deployment run` does); its id."""
        body: dict[str, Any] = {"parameters": parameters, "job_variables": {"env": env}}
        if work_queue_name:
            body["work_queue_name"] = work_queue_name
        r = self.api.post(f"/deployments/{self.deployment(name)['id']}/create_flow_run", json=body)
        r.raise_for_status()
        return str(r.json()["id"])

    def wait_for_terminal(
        self, flow_run_id: str, explain: Callable[[], str] = lambda: ""
    ) -> dict[str, Any]:
        """Poll the flow run until it is in a terminal state; its record. The test's timeout
        bounds the wait (a hang fails with `explain()` and the run's last state)."""
        last: dict[str, Any] = {}

        def ended() -> bool:
            last.update(self.flow_run(flow_run_id))
            return last["state"]["type"] in TERMINAL

        def why() -> str:
            state = last.get("state") or {}
            return f"flow run {flow_run_id} still {state.get('name')}\n" + explain()

        wait_until(ended, f"flow run {flow_run_id} to end", explain=why, recheck_s=0.5)
        return last

    def artifacts(self, flow_run_id: str) -> list[dict[str, Any]]:
        r = self.api.post(
            "/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
        )
        r.raise_for_status()
        return list(r.json())

    def ensure_queue(self, name: str) -> None:
        r = self.api.post(f"/work_pools/{WORK_POOL}/queues", json={"name": name})
        if r.status_code != 409:  # already there
            r.raise_for_status()

    def start_worker(self, tmp: Path, name: str, queue: str, **extra_env: str) -> Proc:
        """A process worker on one queue of the pool. Its environment reaches every flow run
        it starts (the process worker passes it on), so extra_env arms crash points."""
        env = {**self.env, "PREFECT_WORKER_QUERY_SECONDS": "1", **extra_env}
        return Proc(
            f"worker {name}",
            [
                str(BIN / "prefect"),
                "worker",
                "start",
                "--pool",
                WORK_POOL,
                "--work-queue",
                queue,
                "--type",
                "process",
                "--name",
                name,
            ],
            env,
            tmp / f"worker-{name}.log",
            REPO,
        )


def stop_worker(worker: Proc) -> None:
    """A process worker needs two signals: the first only asks it to stop taking work."""
    worker.stop(signals=(signal.SIGTERM, signal.SIGTERM), grace_s=8.0)


def _healthy(api: httpx.Client) -> bool:
    try:
        return api.get("/health").json() is True
    except httpx.HTTPError:  # not listening yet
        return False


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A Prefect server on a free loopback port with a temporary PREFECT_HOME (SQLite)."""
    home = tmp_path_factory.mktemp("prefect-home")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Flow runs that escape a test's own settings still land in a temp folder, never in the
    # developer's .lowtide/.
    safety = tmp_path_factory.mktemp("lowtide-default")
    env = clean_environ(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=f"{url}/api",
        PREFECT_UI_URL=url,
        DO_NOT_TRACK="1",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="INFO",
        # The scheduler would queue nightly and every-5-minutes runs that the workers would pick
        # up; the tests create their runs themselves.
        PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED="false",
        LOWTIDE_STATE=str(safety / "state.duckdb"),
        LOWTIDE_DB=str(safety / "lowtide.duckdb"),
        LOWTIDE_WORK_DIR=str(safety / "work"),
    )
    proc = Proc(
        "prefect server",
        [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env,
        home / "server.log",
        home,
    )
    api = httpx.Client(base_url=f"{url}/api", timeout=30, transport=BusyRetryTransport())
    try:
        wait_until(
            lambda: _healthy(api),
            "the Prefect server to answer /health",
            still_going=proc.alive,
            explain=lambda: "Prefect server log:\n" + proc.tail(),
            recheck_s=0.3,
        )
        yield PrefectServer(url, f"{url}/api", home, env, api, proc)
    finally:
        api.close()
        proc.stop(signals=(signal.SIGTERM,), grace_s=15.0)


@dataclass
class Deployed:
    output: str
    server: PrefectServer


@pytest.fixture(scope="session")
def deployed(prefect_server: PrefectServer) -> Deployed:
    """The process work pool and every deployment in deployments/prefect.yaml, registered with
    the real CLI exactly as `make serve` (deployments/serve.sh) does."""
    created = prefect_server.cli("work-pool", "create", WORK_POOL, "--type", "process")
    assert created.returncode == 0, created.stdout + created.stderr
    result = prefect_server.cli(
        "--no-prompt", "deploy", "--all", "--prefect-file", str(PREFECT_FILE)
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return Deployed(result.stdout, prefect_server)


@pytest.fixture(scope="session")
def default_worker(deployed: Deployed, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """One worker on the pool's default queue, shared by the tests that just run a deployment."""
    worker = deployed.server.start_worker(
        tmp_path_factory.mktemp("worker-default"), "e2e-default", "default"
    )
    try:
        yield worker
    finally:
        stop_worker(worker)


@pytest.fixture
def small_job(tmp_path: Path) -> Path:
    """The sample job on its first 200 messages, named like the sample so run names read well."""
    job = write_job(tmp_path, rows=200, eval_rows=20)
    return job.rename(tmp_path / "support-intents.toml")


def run_env(tmp_path: Path, emulator_url: str) -> dict[str, str]:
    """Where one test's flow runs keep their files and which emulator they talk to."""
    return {
        "LOWTIDE_STATE": str(tmp_path / "state.duckdb"),
        "LOWTIDE_DB": str(tmp_path / "lowtide.duckdb"),
        "LOWTIDE_WORK_DIR": str(tmp_path / "work"),
        "LOWTIDE_EMULATOR_URL": emulator_url,
    }


def chromium_executable() -> str:
    """Debian's chromium; the tests skip (saying why) only when it is not installed."""
    path = shutil.which("chromium") or (
        "/usr/bin/chromium" if Path("/usr/bin/chromium").exists() else None
    )
    if path is None:
        pytest.skip("Chromium not found (apt-get install -y chromium; .ci/run installs it)")
    return path
