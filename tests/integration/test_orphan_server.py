"""A `lowtide run` killed with SIGKILL leaves no Prefect server behind.

Without PREFECT_API_URL the CLI starts Prefect's temporary server as its child; the kernel is
told to stop that child when its parent dies, so nothing outlives the killed run."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from lowtide import prefect_server
from lowtide.emulator import Emulator, EmulatorConfig
from tests.integration.conftest import lowtide_cli, write_job
from tests.processes import wait_for_exit

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux"),
]


def _servers_with_home(home: Path) -> list[int]:
    """Pids of Prefect API servers started with this PREFECT_HOME (read from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if b"prefect.server.api.server:create_app" in cmdline and (
            f"PREFECT_HOME={home}".encode() in environ.split(b"\0")
        ):
            found.append(int(entry.name))
    return found


def test_a_killed_run_leaves_no_prefect_server(tmp_path: Path) -> None:
    job = write_job(tmp_path, rows=20, eval_rows=4)
    home = tmp_path / "prefect-home"
    with Emulator(EmulatorConfig(time_scale=30.0, error_rate=0.0, validating_s=5.0)) as emu:
        env = {
            "PREFECT_API_URL": "",  # no server configured, and the temporary one asked for
            "LOWTIDE_PREFECT_SERVER": "temporary",
            "PREFECT_HOME": str(home),
            "LOWTIDE_EMULATOR_URL": emu.base_url,
            "LOWTIDE_CRASH_AT": "after_create",
        }
        crashed = lowtide_cli("run", str(job), cwd=tmp_path, env=env)
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    # the kernel delivers SIGTERM at once; uvicorn shuts down gracefully: wait for its exit
    # (a server that never exits fails the test by its timeout and is killed then)
    wait_for_exit(_servers_with_home(home))
    left = _servers_with_home(home)
    for pid in left:  # do not leak it into the rest of the suite
        os.kill(pid, signal.SIGKILL)
    assert not left, f"Prefect server(s) {left} outlived the killed run"


def test_a_damaged_prefect_database_is_one_line_at_once(tmp_path: Path) -> None:
    """A prefect.db that is not a database made the temporary server time out after minutes and
    print a traceback; it is named in one line before the server is started."""
    home = tmp_path / "prefect-home"
    home.mkdir()
    (home / "prefect.db").write_bytes(os.urandom(50_000))
    job = write_job(tmp_path, rows=5, eval_rows=2)
    result = lowtide_cli(
        "run",
        str(job),
        cwd=tmp_path,
        env={
            "PREFECT_API_URL": "",
            "PREFECT_HOME": str(home),
            "LOWTIDE_PREFECT_SERVER": "temporary",
        },
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert str(home / "prefect.db") in lines[0] and "move it away" in lines[0]
    assert not _servers_with_home(home)


_START_BESIDE_IMPORTS = """
import sys
import lowtide.prefect_server as ps

taken = iter([int(sys.argv[1])])
free = ps._free_port
ps._free_port = lambda: next(taken, None) or free()  # the first port tried is held elsewhere
ps.start_tied_server(lambda: __import__("prefect.client.orchestration"))
from prefect.client.orchestration import get_client
from prefect.settings import PREFECT_API_URL

with get_client(sync_client=True) as client:
    print(client.api_healthcheck())
print(PREFECT_API_URL.value())
print("prefect.server.api.server" in sys.modules)
"""


def test_the_temporary_server_boots_beside_the_flow_imports_and_moves_off_a_taken_port(
    tmp_path: Path,
) -> None:
    """The CLI starts Prefect's temporary server before Prefect is imported and points Prefect
    at it, so its own process never loads Prefect's server code; a port another process took
    meanwhile moves the server to another, and Prefect follows it. The server stops at exit."""
    home = tmp_path / "prefect-home"
    holder = socket.socket()
    holder.bind(("127.0.0.1", prefect_server._free_port()))
    holder.listen()
    taken = holder.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    try:
        result = subprocess.run(
            [sys.executable, "-c", _START_BESIDE_IMPORTS, str(taken)],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,  # a bound, not a speed threshold: it boots the server twice
        )
    finally:
        holder.close()
    assert result.returncode == 0, result.stderr
    health, url, server_code_loaded = result.stdout.splitlines()[-3:]
    assert health == "None"  # Prefect's client reached a healthy API
    assert url.startswith("http://127.0.0.1:") and f":{taken}/" not in url
    assert server_code_loaded == "False"
    assert not _servers_with_home(home)  # stopped at exit, not left to the parent-death signal
