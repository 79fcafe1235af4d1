"""A `lowtide run` killed with SIGKILL leaves no Prefect server behind.

Without PREFECT_API_URL the CLI starts Prefect's temporary server as its child; the kernel is
told to stop that child when its parent dies, so nothing outlives the killed run."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from lowtide.emulator import Emulator, EmulatorConfig
from tests.integration.conftest import lowtide_cli, write_job

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
            "PREFECT_API_URL": "",  # no server: the CLI starts Prefect's temporary one
            "PREFECT_HOME": str(home),
            "LOWTIDE_EMULATOR_URL": emu.base_url,
            "LOWTIDE_CRASH_AT": "after_create",
        }
        crashed = lowtide_cli("run", str(job), cwd=tmp_path, env=env)
    assert crashed.returncode == -signal.SIGKILL, crashed.stdout + crashed.stderr
    # the kernel delivers SIGTERM at once; give uvicorn its graceful shutdown (bounded wait
    # on an event, not a speed threshold)
    deadline = time.monotonic() + 60
    while _servers_with_home(home) and time.monotonic() < deadline:
        time.sleep(0.2)
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
        "run", str(job), cwd=tmp_path, env={"PREFECT_API_URL": "", "PREFECT_HOME": str(home)}
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert str(home / "prefect.db") in lines[0] and "move it away" in lines[0]
    assert not _servers_with_home(home)
