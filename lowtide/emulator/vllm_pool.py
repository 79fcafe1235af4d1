"""A pool of emulated vLLM servers on loopback, one uvicorn server per engine, each on its own
thread and event loop — what a lowtide vLLM backend sees when it is given several endpoints.

`EnginePool.stop(i)` takes one server down the way a crashed process would: the listening
socket closes (new connections are refused), open connections are reset, and in-flight requests
never get an answer, so clients see connection errors rather than HTTP statuses. That needs the
server's own event loop and connection set, which `lowtide.emulator.server.run_in_thread`
(a graceful stop only) does not expose, hence the small runner here; it shares that module's
TCP_NODELAY protocol and keep-alive setting.

`EnginePool.restart(i)` brings a stopped server back on the same port, as a restarted process
(or pod) would come back: a new engine with an empty queue and a cold prefix cache, serving the
same names with the same key and recording into the same ledger.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from types import TracebackType

import uvicorn
from fastapi import FastAPI

from lowtide.emulator.engine import Engine, EngineConfig
from lowtide.emulator.ledger import BillingLedger
from lowtide.emulator.server import NoDelayH11Protocol
from lowtide.emulator.vllm import DEFAULT_SERVED_MODEL_NAMES, create_vllm_app

_START_TIMEOUT_S = 10.0


class _ThreadedServer:
    """uvicorn serving `app` on its own thread and loop; stoppable gently or abruptly."""

    def __init__(self, app: FastAPI, host: str, port: int) -> None:
        self.app = app
        self.host = host
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            http=NoDelayH11Protocol,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=1,
            timeout_keep_alive=30,
        )
        self.server = uvicorn.Server(config)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"vllm-emulator-{port}", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self._error = exc

    async def _serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.server.serve()

    def start(self) -> int:
        self.thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                self.server.should_exit = True
                raise RuntimeError(
                    f"Emulated vLLM server on {self.host} did not start"
                    + (f": {self._error!r}" if self._error else " (port in use?)")
                ) from self._error
            time.sleep(0.005)
        return self.server.servers[0].sockets[0].getsockname()[1]

    def kill(self, engine: Engine) -> None:
        """Stop abruptly: refuse new connections, reset open ones, fail the engine."""
        if self.loop is None or not self.thread.is_alive():
            return

        async def crash() -> None:
            for listener in self.server.servers:
                listener.close()
            for connection in list(self.server.server_state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.abort()
            engine.kill()

        asyncio.run_coroutine_threadsafe(crash(), self.loop).result(timeout=5)
        self.server.force_exit = True
        self.server.should_exit = True
        self.thread.join(timeout=5)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=5)


class EnginePool:
    """Running emulated vLLM servers. `urls[i]` is server i's OpenAI base URL (ending in /v1);
    `apps[i].state.engine` is its engine. Use as a context manager or call `close()`."""

    def __init__(
        self,
        servers: list[_ThreadedServer],
        urls: list[str],
        make_app: Callable[[int], FastAPI] | None = None,
    ) -> None:
        self._servers = servers
        self.urls = urls
        self.apps = [s.app for s in servers]
        self._stopped = [False] * len(servers)
        self._make_app = make_app

    @property
    def engines(self) -> list[Engine]:
        return [app.state.engine for app in self.apps]

    def base_url(self, i: int) -> str:
        """Server i's root URL (for /health and /metrics)."""
        return self.urls[i].removesuffix("/v1")

    def is_stopped(self, i: int) -> bool:
        return self._stopped[i]

    def stop(self, i: int) -> None:
        """Take server i down as a crash would (idempotent); the others keep serving."""
        if self._stopped[i]:
            return
        self._stopped[i] = True
        self._servers[i].kill(self.apps[i].state.engine)

    def restart(self, i: int) -> None:
        """Start server i again after `stop(i)`, on the same port, as a restarted process: a
        new engine (`engines[i]` is then the new one; the old one's counters stay with it)."""
        if not self._stopped[i]:
            raise RuntimeError(f"engine {i} is running; stop({i}) it before restart({i})")
        if self._make_app is None:
            raise RuntimeError("this pool was not built by start_engines; it cannot restart")
        old = self._servers[i]
        port = int(self.urls[i].removesuffix("/v1").rsplit(":", 1)[1])
        server = _ThreadedServer(self._make_app(i), old.host, port)
        server.start()
        self._servers[i] = server
        self.apps[i] = server.app
        self._stopped[i] = False

    def close(self) -> None:
        """Shut every server down (gracefully for those still running)."""
        for i, server in enumerate(self._servers):
            if not self._stopped[i]:
                self._stopped[i] = True
                server.close()

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def start_engines(
    n: int,
    config: EngineConfig | None = None,
    ports: Sequence[int] | None = None,
    *,
    served_model_name: str | Sequence[str] = DEFAULT_SERVED_MODEL_NAMES,
    ledger: BillingLedger | None = None,
    api_key: str | None = None,
    host: str = "127.0.0.1",
) -> EnginePool:
    """Start `n` emulated vLLM servers with the same engine config on `host`.

    `ports` gives one port per server (default: free ports chosen by the OS). Every server
    answers to `served_model_name` (one name or several, the first naming responses; by default
    the emulator's own and the sample job's vLLM model id) and records into the same `ledger`
    when one is given. If one fails to start, those already
    started are shut down and the error is raised."""
    if n < 1:
        raise ValueError(f"start_engines needs n >= 1, got {n}")
    if ports is not None and len(ports) != n:
        raise ValueError(f"start_engines got {len(ports)} ports for {n} engines")
    servers: list[_ThreadedServer] = []
    urls: list[str] = []

    def make_app(index: int) -> FastAPI:
        return create_vllm_app(
            config or EngineConfig(),
            served_model_name=served_model_name,
            ledger=ledger,
            api_key=api_key,
            server_label=str(index),
        )

    try:
        for i in range(n):
            server = _ThreadedServer(make_app(i), host, ports[i] if ports else 0)
            servers.append(server)
            port = server.start()
            urls.append(f"http://{host}:{port}/v1")
    except BaseException:
        for server in servers:
            server.close()
        raise
    return EnginePool(servers, urls, make_app)
