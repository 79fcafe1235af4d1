"""Prefect's temporary server, tied to the lowtide process that needs it.

Without PREFECT_API_URL, Prefect starts a temporary API server as a child process the first time
a flow runs, and stops it at exit. A SIGKILL skips that, and the server lived on (measured: an
orphaned uvicorn for more than 20 minutes). On Linux the child is started here instead, from the
main thread, with the kernel told to send it SIGTERM when its parent dies, and Prefect's clients
are pointed at it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib.util
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowtide.errors import PrefectServerError
from lowtide.prefect_template import keep_template, seed_database
from lowtide.settings import (
    point_prefect_at,
    prefect_database_path,
    prefect_server_configured,
    prefect_startup_timeout_s,
    temporary_server_environment,
)

_PR_SET_PDEATHSIG = 1
_MOVED: list[Any] = []
"""Prefect settings entered for good when the server had to move to another port."""
_STARTED_THROUGH_PREFECT: list[bool] = []
"""Set once Prefect's own start-up made this process's server (its clients then find it)."""


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM it when the parent exits."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_tied_server(
    while_starting: Callable[[], object] | None = None,
    warm_ups: Sequence[Callable[[], object]] = (),
) -> None:
    """Start Prefect's temporary server now, tied to this process, and run `while_starting`
    (the flow's imports) while it boots; return once it answers. A no-op but for
    `while_starting` with a configured server, or off Linux. Call from the main thread: the tie
    is to the thread that forks.

    `warm_ups` (imports the run needs later: its backend's SDK, the tokenizer, the charts) are
    run one by one only while the server is still booting, on a core that would otherwise wait
    for it (measured: ~4 s of waiting after the flow's imports, at 2 cores).

    Before Prefect is imported, the server is started here and Prefect is pointed at it through
    PREFECT_API_URL, so this process never imports Prefect's server code (measured: 6.3 s of
    import) and boots it in parallel with its own imports instead of before them."""
    if not sys.platform.startswith("linux") or prefect_server_configured(Path(".")):
        _call(while_starting)
        return
    if "prefect" in sys.modules:  # too late to point Prefect elsewhere: tie the server it starts
        _start_through_prefect()
        _call(while_starting)
        return
    database = prefect_database_path()
    new = _prepare_database(database)
    server = _spawn()
    point_prefect_at(server.api_url)
    atexit.register(server.stop)  # before Prefect's own exit handlers, so it runs after them
    _call(while_starting)
    server.wait_until_healthy(database, list(warm_ups))
    if new and database is not None:
        keep_template(database)


def _call(while_starting: Callable[[], object] | None) -> None:
    if while_starting is not None:
        while_starting()


@dataclass
class _Server:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def wait_until_healthy(
        self, database: Path | None, warm_ups: list[Callable[[], object]] | None = None
    ) -> None:
        """Return once the server answers; run `warm_ups` (in order) instead of sleeping until
        then, and drop the rest."""
        warm_ups = warm_ups or []
        limit = prefect_startup_timeout_s()
        deadline = time.monotonic() + limit
        restarts = 0
        while True:  # health is checked once more after the last wait or warm-up
            code = self.process.poll()
            if code == 3 and restarts < 3:  # uvicorn's start-up failure: the port was taken
                restarts += 1
                self._restart_on_another_port()
                continue
            if code is not None:
                raise _did_not_start(f"it exited with code {code}", database)
            try:
                with urllib.request.urlopen(f"{self.api_url}/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:  # not listening yet (URLError and timeouts are OSErrors)
                pass
            if time.monotonic() >= deadline:
                break
            if warm_ups:
                with contextlib.suppress(Exception):  # the real import, later, says what failed
                    warm_ups.pop(0)()
            else:
                time.sleep(0.1)
        self.stop()
        raise _did_not_start(f"it did not answer within {limit:.0f} s", database)

    def _restart_on_another_port(self) -> None:
        self.port = _free_port()
        self.process = _uvicorn(self.port)
        point_prefect_at(self.api_url)
        if "prefect" in sys.modules:  # Prefect read the old address already
            from prefect.context import refresh_global_settings_context
            from prefect.settings import PREFECT_API_URL, temporary_settings

            refresh_global_settings_context()  # what other threads fall back to

            # entered for the rest of the process, exit handlers included; kept referenced, or
            # collecting it would close its generator and restore the old address
            moved = temporary_settings(updates={PREFECT_API_URL: self.api_url})
            moved.__enter__()
            _MOVED.append(moved)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _did_not_start(why: str, database: Path | None) -> PrefectServerError:
    return PrefectServerError(
        f"Prefect's temporary server did not start: {why}. Its files are in "
        f"{database.parent if database else 'PREFECT_HOME'}; set PREFECT_API_URL to a running "
        "server, or move a damaged prefect.db away"
    )


def _free_port() -> int:
    """A free port in the range Prefect's own temporary server uses (outside the range the
    kernel hands out to outgoing connections)."""
    for _ in range(50):
        port = random.randrange(8000, 9000)
        with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise PrefectServerError("no free port in 8000-8999 for Prefect's temporary server")


def _uvicorn(port: int) -> subprocess.Popen[bytes]:
    """The command Prefect runs for its temporary server (API only, no UI)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "uvicorn",
            "--app-dir",  # import Prefect from where it is installed, never from the cwd
            _site_of("prefect"),
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ],
        env=temporary_server_environment(),
        preexec_fn=_die_with_parent,
        # its own session: a Ctrl-C at the terminal goes to lowtide, which stops the run
        # cleanly, not to the server it still needs for that (measured: the server died first
        # and the run hung on its dead API)
        start_new_session=True,
    )


def _site_of(package: str) -> str:
    """The folder a package is installed in, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise PrefectServerError(f"{package} is not installed; run `make install`")
    return str(Path(next(iter(spec.submodule_search_locations))).parent)


def _spawn() -> _Server:
    port = _free_port()
    return _Server(_uvicorn(port), port)


def _start_through_prefect() -> None:
    """Prefect's own start-up of its temporary server, with the child tied to this process."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value() or _STARTED_THROUGH_PREFECT:
        return
    from prefect.server.api.server import SubprocessASGIServer  # 6 s of imports: only now

    class TiedServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            popen: Any = subprocess.Popen

            def tied(*args: Any, **kwargs: Any) -> Any:
                return popen(*args, preexec_fn=_die_with_parent, start_new_session=True, **kwargs)

            subprocess.Popen = tied  # type: ignore[misc, assignment]
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = popen  # type: ignore[misc]

    database = prefect_database_path()
    new = _prepare_database(database)
    try:
        TiedServer().start()
    except RuntimeError as e:  # Prefect's own: "Timed out while attempting to connect ..."
        raise _did_not_start(" ".join(str(e).split()).rstrip("."), database) from e
    _STARTED_THROUGH_PREFECT.append(True)
    if new and database is not None:
        keep_template(database)


def _prepare_database(database: Path | None) -> bool:
    """Check the SQLite file the server will use, or start a new one as a migrated copy
    (`prefect_template`); whether the server will create and migrate one from nothing."""
    if database is None:
        return False
    if database.exists():
        _check_database(database)
        return False
    return not seed_database(database)


def _check_database(path: Path) -> None:
    """A file that is not an SQLite database makes the server time out after minutes; say so
    at once instead."""
    if not path.is_file():
        return
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as con:
            con.execute("PRAGMA schema_version").fetchone()
    except sqlite3.DatabaseError as e:
        raise PrefectServerError(
            f"{path}: Prefect's database cannot be read ({e}); move it away (Prefect makes a new "
            "one, losing the run history it held) or set PREFECT_API_URL to a running server"
        ) from e
