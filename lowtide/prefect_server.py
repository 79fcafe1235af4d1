"""Prefect's temporary server, tied to the lowtide process that needs it.

Without PREFECT_API_URL, Prefect starts a temporary API server as a child process the first time
a flow runs, and stops it at exit. A SIGKILL skips that, and the server lived on (measured: an
orphaned uvicorn for more than 20 minutes). On Linux the child is started here instead, from the
main thread, with the kernel told to send it SIGTERM when its parent dies; Prefect's clients
then find it already running (Prefect keeps one temporary server per process).
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from lowtide.errors import PrefectServerError

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM it when the parent exits."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def start_tied_server() -> None:
    """Start Prefect's temporary server now, tied to this process (no-op with a configured
    server, or off Linux). Call from the main thread: the tie is to the thread that forks."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value() or not sys.platform.startswith("linux"):
        return

    class TiedServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            popen: Any = subprocess.Popen

            def tied(*args: Any, **kwargs: Any) -> Any:
                # its own session: a Ctrl-C at the terminal goes to lowtide, which stops the
                # run cleanly, not to the server it still needs for that (measured: the
                # server died first and the run hung on its dead API)
                return popen(*args, preexec_fn=_die_with_parent, start_new_session=True, **kwargs)

            subprocess.Popen = tied  # type: ignore[misc, assignment]
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = popen  # type: ignore[misc]

    database = _default_database()
    if database is not None:
        _check_database(database)
    try:
        TiedServer().start()
    except RuntimeError as e:  # Prefect's own: "Timed out while attempting to connect ..."
        raise PrefectServerError(
            f"Prefect's temporary server did not start: {' '.join(str(e).split())} Its files "
            f"are in {database.parent if database else 'PREFECT_HOME'}; set PREFECT_API_URL to "
            "a running server, or move a damaged prefect.db away"
        ) from e


def _default_database() -> Path | None:
    """The SQLite file Prefect's temporary server will use (None for another database)."""
    from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL

    url = str(PREFECT_API_DATABASE_CONNECTION_URL.value() or "")
    if not url.startswith("sqlite") or ":///" not in url:
        return None
    return Path(url.split(":///", 1)[1])


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
