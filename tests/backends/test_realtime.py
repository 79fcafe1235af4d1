"""The realtime path, through both real SDKs over real HTTP to the emulator.

The emulator is served behind a small ASGI meter that counts the realtime calls that reach the
server and how many are in flight at once. It can hold calls at a gate until a given number
are in flight at once (so a cap is shown to be reached by what the server saw, not by timing)
and hold each for a moment after, so that a client over its cap would be caught.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import orjson
import pytest
import tenacity
from starlette.types import ASGIApp, Receive, Scope, Send

from lowtide.backends import anthropic_batch, openai_batch, realtime
from lowtide.backends.base import TerminalBackendError
from lowtide.emulator import Emulator, EmulatorConfig, run_in_thread
from lowtide.errors import CredentialsError
from lowtide.jobspec import JobSpec, load_job
from tests.backends.test_anthropic_batch import sample_lines
from tests.conftest import SAMPLE_JOB
from tests.emulator.conftest import TEST_CONFIG
from tests.key_guard import RequireKey

REALTIME_PATHS = ("/v1/chat/completions", "/v1/messages")


class Meter:
    """ASGI wrapper: counts calls per realtime path and the most in flight at once. With a
    `gate`, calls wait until that many are in flight at once (then the gate stays open)."""

    def __init__(self, app: ASGIApp, hold_s: float = 0.0, gate: int = 0) -> None:
        self.app = app
        self.hold_s = hold_s
        self.gate = gate
        self.opened = asyncio.Event()  # bound to the server's loop when first awaited
        self.calls: dict[str, int] = dict.fromkeys(REALTIME_PATHS, 0)
        self.in_flight = 0
        self.max_in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in REALTIME_PATHS:
            await self.app(scope, receive, send)
            return
        self.calls[scope["path"]] += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.gate:
                if self.in_flight >= self.gate:
                    self.opened.set()
                await self.opened.wait()
            if self.hold_s:
                await asyncio.sleep(self.hold_s)
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class Served:
    def __init__(self, emu: Emulator, meter: Meter, base_url: str) -> None:
        self.emu = emu
        self.meter = meter
        self.base_url = base_url

    def client(self, provider: str) -> Any:
        if provider == "openai":
            return openai_batch.realtime_client_for_base_url(self.base_url + "/v1")
        return anthropic_batch.realtime_client_for_base_url(self.base_url)

    def set_faults(self, spec: str) -> None:
        request = urllib.request.Request(
            self.base_url + "/_emulator/faults",
            data=orjson.dumps({"spec": spec}),
            method="POST",
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200

    def realtime_executions(self, provider: str) -> list[dict[str, Any]]:
        return [e for e in self.emu.ledger.executions(provider) if e["kind"] == "realtime"]


@pytest.fixture
def serve() -> Iterator[Any]:
    """Start an emulator behind a Meter; stopped after the test."""
    servers: list[Any] = []

    def start(hold_s: float = 0.0, gate: int = 0, **overrides: Any) -> Served:
        emu = Emulator(EmulatorConfig(**{**TEST_CONFIG, **overrides}))
        meter = Meter(emu.app, hold_s, gate)
        server = run_in_thread(meter)
        servers.append(server)
        return Served(emu, meter, server.base_url)

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def job() -> JobSpec:
    return load_job(SAMPLE_JOB, backend="anthropic")


@pytest.fixture(scope="module")
def lines(job: JobSpec) -> list[str]:
    return sample_lines(job, 12)


def ids_of(lines: list[str]) -> list[str]:
    return [orjson.loads(line)["custom_id"] for line in lines]


PROVIDERS = ["openai", "anthropic"]
PATH = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages"}


@pytest.mark.parametrize("provider", PROVIDERS)
def test_answers_are_valid_one_row_per_line_in_order(
    serve: Any, job: JobSpec, lines: list[str], provider: str
) -> None:
    served = serve()
    frame = realtime.run_realtime(lines, provider=provider, client=served.client(provider))
    assert frame["custom_id"].to_list() == ids_of(lines)
    assert set(frame["status"]) == {"answered"} and frame["error"].null_count() == len(lines)
    for raw in frame["raw_text"]:
        jsonschema.validate(orjson.loads(raw), job.output_schema)
    assert set(frame["finish_reason"]) == {"stop"}
    assert (frame["input_tokens"] > 0).all() and (frame["output_tokens"] > 0).all()
    assert len(served.realtime_executions(provider)) == len(lines)
    assert served.meter.calls[PATH[provider]] == len(lines)
    billed = served.emu.ledger.total_usage(provider)
    assert billed["input_tokens"] == frame["input_tokens"].sum()
    assert billed["cached_input_tokens"] == frame["cached_tokens"].sum()


def test_anthropic_forced_tool_mode(serve: Any, job: JobSpec, lines: list[str]) -> None:
    served = serve()
    frame = realtime.run_realtime(
        lines[:3],
        provider="anthropic",
        client=served.client("anthropic"),
        structured_output="tool",
    )
    assert set(frame["status"]) == {"answered"}
    for raw in frame["raw_text"]:
        jsonschema.validate(orjson.loads(raw), job.output_schema)


@pytest.mark.parametrize(
    "provider,kind",
    [("openai", "429"), ("openai", "500"), ("anthropic", "429"), ("anthropic", "529")],
)
def test_transient_faults_are_retried_by_tenacity(
    serve: Any, lines: list[str], provider: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = serve(retry_after_s=0.2)
    served.set_faults(f"{kind}:POST {PATH[provider]}:3")
    waits = _record_tenacity_sleeps(monkeypatch)
    frame = realtime.run_realtime(
        lines[:4], provider=provider, client=served.client(provider), concurrency=2
    )
    assert set(frame["status"]) == {"answered"}
    assert served.meter.calls[PATH[provider]] == 4 + 3  # each fault cost exactly one more call
    assert len(served.realtime_executions(provider)) == 4  # faults answer before the model runs
    # one wait per fault, of the hint (retry-after-ms: 200), not the 0.5 s+ backoff without it
    assert waits == [0.2, 0.2, 0.2]


def _record_tenacity_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The seconds tenacity's default sleep is asked to wait, in order; it still waits them."""
    waits: list[float] = []

    class _Time:
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        @staticmethod
        def sleep(seconds: float) -> None:
            waits.append(seconds)
            time.sleep(seconds)

    monkeypatch.setattr(tenacity.nap, "time", _Time())
    return waits


@pytest.mark.parametrize("provider", PROVIDERS)
def test_sdk_retries_are_off_so_attempts_are_exact(
    serve: Any, lines: list[str], provider: str
) -> None:
    served = serve()
    served.set_faults(f"500:POST {PATH[provider]}:*")
    # a client built with the SDK's default retries: run_realtime switches them off
    client: Any = (
        openai.OpenAI(base_url=served.base_url + "/v1", api_key="x")
        if provider == "openai"
        else anthropic.Anthropic(base_url=served.base_url, api_key="x")
    )
    frame = realtime.run_realtime(lines[:2], provider=provider, client=client, max_attempts=2)
    assert set(frame["status"]) == {"provider_error"}
    assert served.meter.calls[PATH[provider]] == 2 * 2
    assert frame["error"].str.starts_with("HTTP 500 ").all()
    assert frame["error"].str.ends_with("(transient; 2 attempt(s))").all()
    assert frame["raw_text"].null_count() == 2


@pytest.mark.parametrize("provider", PROVIDERS)
def test_terminal_400_is_a_provider_error_row_not_retried(
    serve: Any, lines: list[str], provider: str
) -> None:
    served = serve()
    bad = orjson.loads(lines[0])
    bad["body"]["max_tokens"] = 0
    mixed = [orjson.dumps(bad).decode(), *lines[1:4]]
    frame = realtime.run_realtime(mixed, provider=provider, client=served.client(provider))
    rows = frame.to_dicts()
    assert rows[0]["status"] == "provider_error"
    assert rows[0]["error"].startswith("HTTP 400 invalid_request_error: ")
    assert "max_tokens" in rows[0]["error"] and rows[0]["error"].endswith(
        "(terminal; 1 attempt(s))"
    )
    assert [r["status"] for r in rows[1:]] == ["answered"] * 3
    assert served.meter.calls[PATH[provider]] == 4  # the 400 was sent once


@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_refused_key_raises_instead_of_failing_each_row(lines: list[str], provider: str) -> None:
    """A 401 is about the key, not a request: no rows of provider errors (they would be failed
    rows of a finished run), one CredentialsError without the key (tasks/realtime.py puts the
    batch back to pending)."""
    emu = Emulator(EmulatorConfig(**TEST_CONFIG))
    guard = RequireKey(emu.app, "sk-the-right-one", echo=True)
    server = run_in_thread(guard)
    try:
        client: Any = (
            openai_batch.realtime_client_for_base_url(server.base_url + "/v1", "sk-wrong")
            if provider == "openai"
            else anthropic_batch.realtime_client_for_base_url(server.base_url, "sk-wrong")
        )
        with pytest.raises(CredentialsError, match="refused the API key") as info:
            realtime.run_realtime(lines[:3], provider=provider, client=client, concurrency=1)
    finally:
        server.stop()
    assert "sk-wrong" not in str(info.value)
    assert guard.refused >= 1 and guard.accepted == 0 and emu.ledger.executions() == []


def test_untranslatable_line_is_a_row_not_an_exception(serve: Any, lines: list[str]) -> None:
    served = serve()
    odd = orjson.loads(lines[0])
    odd["body"]["messages"].append({"role": "tool", "content": "x"})
    frame = realtime.run_realtime(
        [orjson.dumps(odd).decode()], provider="anthropic", client=served.client("anthropic")
    )
    assert frame["status"].to_list() == ["provider_error"]
    assert frame["error"][0].startswith("invalid request: ")
    assert served.meter.calls["/v1/messages"] == 0


@pytest.mark.parametrize("provider,cap", [("openai", 3), ("anthropic", 5)])
def test_concurrency_is_bounded(serve: Any, job: JobSpec, provider: str, cap: int) -> None:
    # The first calls wait at the server until `cap` are in flight at once: a client that
    # sends fewer at a time never gets past the gate (the suite's timeout fails it), and one
    # that sends more shows it in the count while the released calls are held for a moment.
    served = serve(hold_s=0.05, gate=cap)
    many = sample_lines(job, 4 * cap)
    frame = realtime.run_realtime(
        many, provider=provider, client=served.client(provider), concurrency=cap
    )
    assert set(frame["status"]) == {"answered"}
    assert served.meter.calls[PATH[provider]] == 4 * cap
    assert served.meter.max_in_flight == cap  # reached, never exceeded


def test_empty_input_and_bad_arguments(serve: Any) -> None:
    served = serve()
    client = served.client("openai")
    assert realtime.run_realtime([], provider="openai", client=client).height == 0
    with pytest.raises(ValueError, match="at least 1"):
        realtime.run_realtime([], provider="openai", client=client, concurrency=0)
    with pytest.raises(TerminalBackendError, match="known: openai, anthropic"):
        realtime.run_realtime([], provider="vllm", client=client)  # type: ignore[arg-type]


def test_client_factories_need_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        TerminalBackendError, match=r"set OPENAI_API_KEY \(looked in: environment\)"
    ):
        openai_batch.realtime_client_from_environment()
    with pytest.raises(
        TerminalBackendError, match=r"set ANTHROPIC_API_KEY \(looked in: environment\)"
    ):
        anthropic_batch.realtime_client_from_environment()
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    monkeypatch.setenv("ANTHROPIC_API_KEY", "k")
    assert openai_batch.realtime_client_from_environment().max_retries == 0
    assert anthropic_batch.realtime_client_from_environment().max_retries == 0
