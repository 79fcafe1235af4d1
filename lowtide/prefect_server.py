"""Prefect's temporary server, tied to the lowtide process that needs it.

Without PREFECT_API_URL, Prefect starts a temporary API server as a child process the first time
a flow runs, and stops it at exit. A SIGKILL skips that, and the server lived on (measured: an
orphaned uvicorn for more than 20 minutes). On Linux the child is started here instead, from the
main thread, with the kernel told to send it SIGTERM when its parent dies; Prefect's clients
then find it already running (Prefect keeps one temporary server per process).
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from typing import Any

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
                return popen(*args, preexec_fn=_die_with_parent, **kwargs)

            subprocess.Popen = tied  # type: ignore[misc, assignment]
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = popen  # type: ignore[misc]

    TiedServer().start()
