"""Run an emulator app over real HTTP on loopback, in a background thread."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from lowtide.emulator.config import EmulatorConfig

_START_TIMEOUT_S = 10.0


class NoDelayH11Protocol(H11Protocol):
    """h11 writes headers and body separately; without TCP_NODELAY, Nagle's algorithm meets the
    client's delayed ACK and every keep-alive response stalls ~40 ms."""

    def connection_made(self, transport: Any) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        super().connection_made(transport)


class RunningServer:
    """A uvicorn server serving `app` from a daemon thread; stop() (or leaving the `with`
    block) shuts it down."""

    def __init__(self, app: Any, host: str, sock: socket.socket) -> None:
        self.app = app
        self.host = host
        self.port: int = sock.getsockname()[1]
        self.base_url = f"http://{host}:{self.port}"
        self._sock = sock
        config = uvicorn.Config(
            app,
            http=NoDelayH11Protocol,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
            # Keep-alive long enough that SDK clients reuse connections between polls.
            timeout_keep_alive=30,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run,
            kwargs={"sockets": [sock]},
            name=f"emulator:{self.port}",
            daemon=True,
        )

    def start(self) -> RunningServer:
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"Emulator server on {self.base_url} exited during startup")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"Emulator server on {self.base_url} did not start in {_START_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.005)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def run_in_thread(app: Any, host: str = "127.0.0.1", port: int = 0) -> RunningServer:
    """Serve `app` on host:port (a free port when 0) and return once it accepts connections."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"Cannot bind the emulator to {host}:{port}: {exc}") from exc
    return RunningServer(app, host, sock).start()


class Emulator:
    """The OpenAI + Anthropic emulator on a free loopback port.

    Point the SDKs at `openai_base_url` / `anthropic_base_url` with any API key. `state` is the
    live `EmulatorState` (clock, ledger, faults, stores), shared with the server thread. With
    `config.state_dir` the state is loaded from that folder here and saved back as it changes;
    `stop()` writes the last snapshot and releases the folder for the next emulator.
    """

    def __init__(
        self, config: EmulatorConfig | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        from lowtide.emulator.app import create_app

        self.config = config or EmulatorConfig()
        self.app = create_app(self.config)
        self.state = self.app.state.emulator
        self.ledger = self.state.ledger
        self._host = host
        self._port = port
        self._server: RunningServer | None = None
        self._closed = False

    def start(self) -> Emulator:
        if self._server is None:
            if self._closed and self.config.state_dir:
                self.state.open_state_dir(load=False)  # started again after stop()
            self._closed = False
            self._server = run_in_thread(self.app, self._host, self._port)
        return self

    def stop(self) -> None:
        """Stop serving; with a state folder, write the last snapshot and release the folder."""
        if self._server is not None:
            self._server.stop()
            self._server = None
        if not self._closed:
            self.state.close()
            self._closed = True

    @property
    def base_url(self) -> str:
        if self._server is None:
            raise RuntimeError(
                "Emulator is not running; call start() or use it as a context manager"
            )
        return self._server.base_url

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    @property
    def openai_base_url(self) -> str:
        return self.base_url + "/v1"

    @property
    def anthropic_base_url(self) -> str:
        return self.base_url

    def __enter__(self) -> Emulator:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
