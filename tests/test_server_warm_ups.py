"""While Prefect's temporary server boots, the CLI imports what the run needs later (its
backend's SDK, the tokenizer, the charts) instead of waiting idle; once the server answers, the
rest is left for when the run needs it, and a warm-up that fails is left to fail there."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest

from lowtide import prefect_server
from lowtide.prefect_server import _free_port, _Server


class _Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - the handler's name is fixed by http.server
        self.send_response(200 if self.path == "/api/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def booting() -> Iterator[tuple[_Server, list[http.server.HTTPServer]]]:
    """A server process that never answers by itself, and where its API is started."""
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    started: list[http.server.HTTPServer] = []
    try:
        yield _Server(stand_in, _free_port()), started
    finally:
        stand_in.kill()
        stand_in.wait()
        for api in started:
            api.shutdown()
            api.server_close()


def test_warm_ups_run_while_the_server_boots_and_stop_once_it_answers(
    booting: tuple[_Server, list[http.server.HTTPServer]],
) -> None:
    server, started = booting
    calls: list[str] = []

    def answer_from_now_on() -> None:
        api = http.server.HTTPServer(("127.0.0.1", server.port), _Healthy)
        threading.Thread(target=api.serve_forever, daemon=True).start()
        started.append(api)

    def first() -> None:
        calls.append("first")

    def second_fails_and_the_server_answers() -> None:
        calls.append("second")
        answer_from_now_on()
        raise ImportError("no such SDK")  # the run's own import says so later, in context

    def third() -> None:
        calls.append("third")

    server.wait_until_healthy(None, [first, second_fails_and_the_server_answers, third])
    assert calls == ["first", "second"]


def test_a_warm_up_that_outlasts_the_start_up_limit_does_not_fail_a_server_that_answers(
    booting: tuple[_Server, list[http.server.HTTPServer]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow warm-up (matplotlib building its font cache) may end past the limit: the server is
    asked once more before it is given up on. The clock here is the test's own."""
    server, started = booting
    now = [0.0]
    monkeypatch.setattr(prefect_server, "time", SimpleNamespace(monotonic=lambda: now[0]))
    monkeypatch.setattr(prefect_server, "prefect_startup_timeout_s", lambda: 60.0)

    def slow_warm_up() -> None:
        api = http.server.HTTPServer(("127.0.0.1", server.port), _Healthy)
        threading.Thread(target=api.serve_forever, daemon=True).start()
        started.append(api)
        now[0] += 61.0  # it ends after the limit

    server.wait_until_healthy(None, [slow_warm_up])
