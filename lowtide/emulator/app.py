"""The emulator's FastAPI app: shared state, the provider edge (auth, faults, request ids,
error envelopes) and the admin routes tests use from another process."""

from __future__ import annotations

import logging
import secrets
import threading
from collections import Counter
from typing import Any

import anyio.to_thread
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from lowtide.emulator import (
    anthropic_batches,
    anthropic_messages,
    limits,
    openai_batch_lifecycle,
    openai_batches,
    openai_chat,
    openai_files,
)
from lowtide.emulator.clock import Clock
from lowtide.emulator.config import EmulatorConfig, FaultRule, apply_fault_spec
from lowtide.emulator.faults import (
    ApiError,
    DeliberateDrop,
    FaultInjector,
    anthropic_error_body,
    fault_error,
    hide_deliberate_drops,
    openai_error_body,
    provider_for_path,
)
from lowtide.emulator.ledger import BillingLedger
from lowtide.emulator.persist import Snapshot, StateDir, StateDirInUse, capture, ledger_entries
from lowtide.emulator.routes_common import json_response

log = logging.getLogger("lowtide.emulator")


class EmulatorState:
    """Everything one emulator instance knows. Guard mutations with `lock`.

    Batch progress is never pushed by a background thread: `tick()` derives it from the
    clock, and every provider call ticks first, so reads always see current state.

    With `config.state_dir`, the state is loaded from that folder at construction (the clock
    resumes at the snapshot's time) and `persist()` writes it back after each change a client
    caused; see `lowtide.emulator.persist`.
    """

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.clock = Clock(config.time_scale)
        self.ledger = BillingLedger()
        self.faults = FaultInjector(config.faults)
        self.lock = threading.RLock()
        self.files: dict[str, openai_files.StoredFile] = {}
        self.batches: dict[str, openai_batch_lifecycle.OpenAIBatch] = {}
        self.message_batches: dict[str, anthropic_batches.MessageBatch] = {}
        # Prompt-cache entries: key -> simulated time of last use.
        self.prompt_cache: dict[str, float] = {}
        self._attempts: Counter[tuple[str, str]] = Counter()
        self._next_seq = 0
        self.queue_marks = limits.QueueMarks(since=self.clock.now(), since_seq=0)
        self._state_dir: StateDir | None = None
        self._dirty = False
        if config.state_dir:
            self.open_state_dir(load=True)

    def new_id(self, prefix: str, nbytes: int = 12) -> str:
        return new_id(prefix, nbytes)

    def next_seq(self) -> int:
        with self.lock:
            seq = self._next_seq
            self._next_seq += 1
            return seq

    def next_attempt(self, provider: str, custom_id: str) -> int:
        """How many times this custom_id has run before here (0 the first time).

        Per-request errors are drawn per attempt, so a retried request can succeed.
        """
        key = (provider, custom_id)
        attempt = self._attempts[key]
        self._attempts[key] += 1
        return attempt

    def tick(self) -> float:
        """Bring every batch up to the clock's current time; returns that time."""
        with self.lock:
            now = self.clock.now()
            before = self._unfinished()
            openai_batch_lifecycle.advance_all(self, now)
            anthropic_batches.advance_all(self, now)
            if self._state_dir is not None and self._unfinished() != before:
                self._dirty = True
            return now

    def _unfinished(self) -> list[str]:
        """The status of every unfinished batch: it changes exactly when a batch moves on."""
        return [
            b.status
            for b in self.batches.values()
            if b.status not in openai_batch_lifecycle.TERMINAL
        ] + [b.status for b in self.message_batches.values() if b.status != "ended"]

    def reset_queue_meter(self) -> float:
        """Start a new queue measurement now (`GET /_emulator/queue`); returns its start."""
        with self.lock:
            now = self.tick()
            self.queue_marks = limits.QueueMarks(since=now, since_seq=self._next_seq)
            return now

    def patch_config(self, patch: dict[str, Any]) -> None:
        if "state_dir" in patch:
            raise ValueError("state_dir is fixed when the emulator starts")
        with self.lock:
            self.config.update(patch)
            if "time_scale" in patch:
                self.clock.set_time_scale(self.config.time_scale)

    # ------------------------------------------------------------------ persistence

    def open_state_dir(self, *, load: bool) -> None:
        """Lock `config.state_dir` and, with `load`, take over the snapshot in it. When another
        live emulator holds the folder, or it cannot be created, log a warning and keep this
        state in memory only (as without a folder)."""
        assert self.config.state_dir
        try:
            state_dir = StateDir(self.config.state_dir)
        except (StateDirInUse, OSError) as exc:
            log.warning("%s; this emulator keeps its state in memory only", exc)
            return
        with self.lock:
            self._state_dir = state_dir
            snap = state_dir.load() if load else None
            if snap is not None:
                self._restore(snap)
            else:
                self._dirty = True
                self.persist()

    @property
    def dirty(self) -> bool:
        """Whether the state changed since its last snapshot (never without a state folder)."""
        return self._dirty

    def mark_changed(self) -> None:
        """Something a client did changed the state: the next `persist()` writes it."""
        self._dirty = self._state_dir is not None

    def persist(self) -> None:
        """Write the snapshot if the state changed since the last one (no-op without a state
        folder). Holds the lock for the write, so the snapshot is one consistent moment."""
        with self.lock:
            if self._state_dir is None or not self._dirty:
                return
            snap, blobs = capture(
                now=self.clock.now(),
                next_seq=self._next_seq,
                files=self.files,
                batches=self.batches,
                message_batches=self.message_batches,
                attempts=self._attempts,
                ledger=self.ledger._snapshot(),
                prompt_cache=self.prompt_cache,
                queue_marks=self.queue_marks,
            )
            self._state_dir.save(snap, blobs)
            self._dirty = False

    def close(self) -> None:
        """Write the last snapshot and release the folder (the state stays usable in memory)."""
        with self.lock:
            self.persist()
            if self._state_dir is not None:
                self._state_dir.close()
                self._state_dir = None

    def _restore(self, snap: Snapshot) -> None:
        self.clock = Clock(self.config.time_scale, start=snap.now)
        self.files = snap.files
        self.batches = snap.batches
        self.message_batches = snap.message_batches
        self.prompt_cache = snap.prompt_cache
        self._attempts = Counter(snap.attempts)
        self._next_seq = snap.next_seq
        self.queue_marks = snap.queue_marks
        self.ledger.reset()
        for entry in ledger_entries(snap):
            self.ledger.record(**entry)


def new_id(prefix: str, nbytes: int = 12) -> str:
    return prefix + secrets.token_hex(nbytes)


def error_response(path: str, err: ApiError, request_id: str) -> Response:
    if provider_for_path(path) == "anthropic":
        body = anthropic_error_body(err, request_id)
    else:
        body = openai_error_body(err)
    return json_response(body, err.status, err.headers)


class ProviderEdge:
    """ASGI middleware for provider routes: request id header, auth check, injected faults.
    On every route (admin ones too) it persists the state before a response goes out, so a
    client never holds an id the emulator could forget.

    Pure ASGI (not BaseHTTPMiddleware) so that a `drop` fault can cut a response body halfway.
    """

    def __init__(self, app: ASGIApp, state: EmulatorState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _persisting(self.state, scope["method"], send)
        path: str = scope["path"]
        provider = provider_for_path(path)
        if provider is None:
            await self.app(scope, receive, send)
            return
        request_id = new_id("req_")
        scope.setdefault("state", {})["request_id"] = request_id
        header = b"x-request-id" if provider == "openai" else b"request-id"

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (header, request_id.encode())]
            await send(message)

        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        auth_error = _check_auth(provider, headers)
        if auth_error is not None:
            await error_response(path, auth_error, request_id)(scope, receive, send_with_id)
            return
        rule = self.state.faults.take(scope["method"], path)
        if rule is None:
            await self.app(scope, receive, send_with_id)
        elif rule.kind == "drop":
            await self.app(scope, receive, _dropping(send_with_id))
        else:
            err = fault_error(rule, self.state.config.retry_after_s)
            await error_response(path, err, request_id)(scope, receive, send_with_id)


def _persisting(state: EmulatorState, method: str, send: Send) -> Send:
    """A `send` that writes the state's snapshot (when it has a folder and something changed)
    before the response starts. A POST or DELETE answered below 400 changed it; any call may
    have ticked a batch into a new status."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            if method in ("POST", "DELETE") and message["status"] < 400:
                state.mark_changed()
            if state.dirty:
                await anyio.to_thread.run_sync(state.persist)
        await send(message)

    return wrapped


def _check_auth(provider: str, headers: dict[str, str]) -> ApiError | None:
    bearer = headers.get("authorization", "")
    has_bearer = bearer.lower().startswith("bearer ") and bearer[7:].strip() != ""
    if provider == "openai" and not has_bearer:
        return ApiError(
            401,
            "You didn't provide an API key. You need to provide your API key in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
        )
    if provider == "anthropic" and not (has_bearer or headers.get("x-api-key")):
        return ApiError(401, "x-api-key header is required (or Authorization: Bearer).")
    return None


def _dropping(send: Send) -> Send:
    """A `send` that forwards the first half of the body, then kills the connection."""

    async def wrapped(message: Message) -> None:
        if message["type"] != "http.response.body":
            await send(message)
            return
        body: bytes = message.get("body", b"")
        await send(
            {"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True}
        )
        raise DeliberateDrop("injected connection drop")

    return wrapped


def create_app(config: EmulatorConfig | None = None) -> FastAPI:
    """A fresh emulator app; its state is `app.state.emulator` (an `EmulatorState`)."""
    state = EmulatorState(config or EmulatorConfig())
    app = FastAPI(title="lowtide emulator", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.emulator = state
    hide_deliberate_drops()

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return error_response(request.url.path, exc, _request_id(request))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = "Not found" if exc.status_code == 404 else str(exc.detail)
        err = ApiError(exc.status_code, f"{message}: {request.method} {request.url.path}")
        return error_response(request.url.path, err, _request_id(request))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        err = ApiError(400, f"Invalid request: {exc.errors()}")
        return error_response(request.url.path, err, _request_id(request))

    for module in (
        openai_files,
        openai_batches,
        openai_chat,
        anthropic_batches,
        anthropic_messages,
    ):
        app.include_router(module.router, prefix="/v1")
    _add_admin_routes(app, state)
    app.add_middleware(ProviderEdge, state=state)
    return app


def _request_id(request: Request) -> str:
    return getattr(request.state, "request_id", None) or new_id("req_")


def _add_admin_routes(app: FastAPI, state: EmulatorState) -> None:
    @app.get("/_emulator/ledger")
    def ledger() -> Response:
        state.tick()
        return json_response(state.ledger.to_dict())

    @app.post("/_emulator/ledger/reset")
    def ledger_reset() -> Response:
        state.ledger.reset()
        return json_response({"reset": True})

    @app.get("/_emulator/queue")
    def queue() -> Response:
        with state.lock:
            return json_response(limits.queue_report(state, state.tick()))

    @app.post("/_emulator/queue/reset")
    def queue_reset() -> Response:
        return json_response({"since": state.reset_queue_meter()})

    @app.get("/_emulator/clock")
    def clock() -> Response:
        return json_response({"now": state.clock.now(), "time_scale": state.clock.time_scale})

    @app.post("/_emulator/clock/advance")
    def clock_advance(seconds: float) -> Response:
        if seconds < 0:
            raise StarletteHTTPException(400, "seconds must be >= 0")
        state.clock.advance(seconds)
        return json_response({"now": state.tick()})

    @app.get("/_emulator/faults")
    def faults() -> Response:
        return json_response({"rules": [r.to_dict() for r in state.faults.rules()]})

    @app.post("/_emulator/faults")
    async def set_faults(request: Request) -> Response:
        payload = orjson.loads(await request.body() or b"{}")
        try:
            if isinstance(payload, dict) and "spec" in payload:
                with state.lock:
                    rules = apply_fault_spec(state.config, str(payload["spec"]))
            else:
                items = payload.get("rules", []) if isinstance(payload, dict) else payload
                rules = [FaultRule(**item) for item in items]
        except (TypeError, ValueError) as exc:
            raise StarletteHTTPException(400, str(exc)) from exc
        state.faults.replace(rules)
        return json_response({"rules": [r.to_dict() for r in state.faults.rules()]})

    @app.get("/_emulator/config")
    def get_config() -> Response:
        return json_response(_config_dict(state.config))

    @app.post("/_emulator/config")
    async def patch_config(request: Request) -> Response:
        payload = orjson.loads(await request.body() or b"{}")
        if not isinstance(payload, dict):
            raise StarletteHTTPException(400, "Expected a JSON object of config fields")
        try:
            state.patch_config(payload)
        except ValueError as exc:
            raise StarletteHTTPException(400, str(exc)) from exc
        return json_response(_config_dict(state.config))


def _config_dict(config: EmulatorConfig) -> dict[str, Any]:
    out = {k: v for k, v in vars(config).items() if k != "faults"}
    out["faults"] = [r.to_dict() for r in config.faults]
    return out
