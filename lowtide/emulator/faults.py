"""Things that go wrong on purpose: provider error envelopes and injected faults.

Each provider wraps errors in its own envelope, and clients branch on it, so one `ApiError`
is raised inside the emulator and rendered at the edge in the envelope of the provider whose
route was called.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
from dataclasses import replace
from typing import Any, Literal

from lowtide.emulator.config import FaultRule

Provider = Literal["openai", "anthropic"]

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "requests",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    529: "server_error",
}
_FAULT_MESSAGES = {
    429: "Rate limit reached for requests (injected by the lowtide emulator).",
    500: "The server had an error while processing your request (injected fault).",
    502: "Bad gateway (injected fault).",
    503: "The service is temporarily unavailable (injected fault).",
    529: "Overloaded (injected fault).",
}


class ApiError(Exception):
    """An HTTP error to send back in the calling provider's envelope.

    `type` overrides the provider's usual error type for `status`; `headers` are added to the
    response (e.g. retry-after).
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}


def provider_for_path(path: str) -> Provider | None:
    """Which provider a route belongs to; both live under /v1, told apart by /v1/messages."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path.startswith("/v1/"):
        return "openai"
    return None


def openai_error_body(err: ApiError) -> dict[str, Any]:
    return {
        "error": {
            "message": err.message,
            "type": err.type or _OPENAI_TYPES.get(err.status, "invalid_request_error"),
            "param": err.param,
            "code": err.code,
        }
    }


def anthropic_error_body(err: ApiError, request_id: str) -> dict[str, Any]:
    return {
        "type": "error",
        "error": {
            "type": err.type or _ANTHROPIC_TYPES.get(err.status, "api_error"),
            "message": err.message,
        },
        "request_id": request_id,
    }


def anthropic_error_type(status: int) -> str:
    return _ANTHROPIC_TYPES.get(status, "api_error")


def fault_error(rule: FaultRule, retry_after_s: float) -> ApiError:
    """The error an HTTP-status fault rule produces, with retry hints the SDKs honour."""
    status = int(rule.kind)
    headers = {
        "retry-after-ms": str(max(1, round(retry_after_s * 1000))),
        # Integer seconds for clients that ignore the millisecond header; at least 1.
        "retry-after": str(max(1, round(retry_after_s + 0.499))),
    }
    code = "rate_limit_exceeded" if status == 429 else None
    return ApiError(
        status, _FAULT_MESSAGES.get(status, "Injected fault."), code=code, headers=headers
    )


class DeliberateDrop(Exception):
    """Raised mid-response to make the server close the connection (a `drop` fault)."""


class _HideDeliberateDrops(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None:
            if isinstance(exc, DeliberateDrop):
                return False
            exc = exc.__cause__ or exc.__context__
        return True


def hide_deliberate_drops() -> None:
    """Keep uvicorn from logging a traceback for every injected connection drop."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _HideDeliberateDrops) for f in logger.filters):
        logger.addFilter(_HideDeliberateDrops())


class FaultInjector:
    """The active fault rules of one emulator instance, with their remaining counts."""

    def __init__(self, rules: list[FaultRule] | None = None) -> None:
        self._lock = threading.Lock()
        self._rules: list[FaultRule] = []
        self.replace(rules or [])

    def replace(self, rules: list[FaultRule]) -> None:
        with self._lock:
            self._rules = [replace(rule) for rule in rules]

    def rules(self) -> list[FaultRule]:
        with self._lock:
            return [replace(rule) for rule in self._rules]

    def take(self, method: str, path: str) -> FaultRule | None:
        """Consume one hit of the first rule matching this call, if any."""
        with self._lock:
            for rule in self._rules:
                if rule.method is None or rule.path is None:
                    continue
                if rule.count is not None and rule.count <= 0:
                    continue
                if rule.method not in (method.upper(), "*"):
                    continue
                if not fnmatch.fnmatchcase(path, rule.path):
                    continue
                if rule.count is not None:
                    rule.count -= 1
                return replace(rule)
        return None

    def extra_finalizing_s(self) -> float:
        with self._lock:
            return sum(r.seconds for r in self._rules if r.kind == "slow_finalizing")
