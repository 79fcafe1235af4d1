"""The realtime path: plain synchronous calls for the few requests that must not wait.

Used for peak shaving (units that cannot sit in a 24 h batch window) and as the fallback for
requests that came back broken or never came back (repair, stragglers). It takes the same
stored OpenAI-format batch lines as the batch backends and returns the same RESULT_SCHEMA
rows, so join and parse/repair do not care which path answered.

Retries: tenacity is the only retry owner here. The client's own retries are switched off
(`max_retries=0`) for these calls, and transient errors (429, 408/409, 5xx, 529, timeouts,
dropped connections) are retried with exponential backoff and jitter, honouring the
provider's `retry-after-ms` / `retry-after` hint. A request that still fails becomes a
`provider_error` row with the reason; one request's failure never raises. A refused key
(401/403) is not a request's failure: it raises `CredentialsError`, for every request alike.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import anthropic
import openai
import orjson
import polars as pl
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential_jitter,
)

from lowtide.backends import anthropic_batch, openai_batch
from lowtide.backends.anthropic_params import to_anthropic_params
from lowtide.backends.base import (
    RESULT_SCHEMA,
    BackendError,
    RequestStatus,
    TerminalBackendError,
    TransientBackendError,
)
from lowtide.backends.wire import completion_row, retry_after_s
from lowtide.errors import CredentialsError

Provider = Literal["openai", "anthropic"]

# Backoff between attempts when the provider gives no hint, and the longest hint obeyed.
BACKOFF_INITIAL_S = 0.5
BACKOFF_MAX_S = 30.0
RETRY_AFTER_CAP_S = 60.0


def run_realtime(
    lines: list[str],
    *,
    provider: Provider,
    client: openai.OpenAI | anthropic.Anthropic,
    concurrency: int = 8,
    max_attempts: int = 4,
    structured_output: str = anthropic_batch.CAPABILITIES.structured_output,
) -> pl.DataFrame:
    """Send each stored batch line's body as one synchronous call; one row per line, in order.

    At most `concurrency` calls are in flight (waits between retries hold their slot, which
    paces a rate-limited provider). Each request is tried at most `max_attempts` times.
    `structured_output` is the Anthropic schema mode ("output_config" or "tool").
    Rows have status `answered` or `provider_error` (with the error text) — never raises for
    a single request; a line that is not valid JSON is a caller bug and does raise, and a key
    the provider refuses raises `CredentialsError`.
    """
    if concurrency < 1 or max_attempts < 1:
        raise ValueError("concurrency and max_attempts must be at least 1")
    if provider == "openai":
        call = _openai_caller(_no_sdk_retries(client))
    elif provider == "anthropic":
        call = _anthropic_caller(_no_sdk_retries(client), structured_output)
    else:
        raise TerminalBackendError(
            f"Unknown realtime provider {provider!r}; known: openai, anthropic",
            backend="realtime",
        )
    items = [orjson.loads(line) for line in lines]

    key = getattr(client, "api_key", None)  # only to scrub it from a refusal's message

    def one(item: dict[str, Any]) -> dict[str, Any]:
        return _with_retries(item["custom_id"], item["body"], call, provider, max_attempts, key)

    if not items:
        return pl.DataFrame(schema=RESULT_SCHEMA)
    with ThreadPoolExecutor(max_workers=min(concurrency, len(items))) as pool:
        rows = list(pool.map(one, items))
    return pl.DataFrame(rows, schema=RESULT_SCHEMA, orient="row")


Caller = Callable[[str | None, dict[str, Any]], dict[str, Any]]


def _no_sdk_retries(client: Any) -> Any:
    return client.with_options(max_retries=0)


def _split_kwargs(method: Callable[..., Any], body: dict[str, Any]) -> dict[str, Any]:
    """Body keys the SDK method names go as keyword arguments; the rest (e.g. vLLM or
    provider-specific extras) travel verbatim in `extra_body`, as in the batch line."""
    known = set(inspect.signature(method).parameters)
    kwargs = {k: v for k, v in body.items() if k in known and k != "stream"}
    extra = {k: v for k, v in body.items() if k not in known}
    if extra:
        kwargs["extra_body"] = extra
    return kwargs


def _openai_caller(client: openai.OpenAI) -> Caller:
    def call(custom_id: str | None, body: dict[str, Any]) -> dict[str, Any]:
        create = client.chat.completions.create
        completion = create(**_split_kwargs(create, body))
        return _completion_row(custom_id, completion)

    return call


def _anthropic_caller(client: anthropic.Anthropic, structured_output: str) -> Caller:
    def call(custom_id: str | None, body: dict[str, Any]) -> dict[str, Any]:
        params = to_anthropic_params(body, structured_output)
        create = client.messages.create
        message = create(**_split_kwargs(create, params))
        return anthropic_batch.message_row(custom_id, message, structured_output)

    return call


def _completion_row(custom_id: str | None, completion: Any) -> dict[str, Any]:
    # The SDK object as plain JSON, read by the rule the vLLM pool and batch files share.
    return dict(zip(RESULT_SCHEMA, completion_row(custom_id, completion.model_dump()), strict=True))


def _translate(provider: Provider, exc: BaseException, key: str | None = None) -> BackendError:
    if provider == "openai" and isinstance(exc, openai.OpenAIError):
        return openai_batch.translate(exc, "realtime", key=key)  # type: ignore[return-value]
    return anthropic_batch.translate(exc, "realtime", key=key)


def _retry_after(exc: BaseException) -> float | None:
    """The provider's retry hint in seconds (see `wire.retry_after_s`), if the error carries
    a response."""
    response = getattr(exc, "response", None)
    return retry_after_s(getattr(response, "headers", None))


def _with_retries(
    custom_id: str | None,
    body: dict[str, Any],
    call: Caller,
    provider: Provider,
    max_attempts: int,
    key: str | None = None,
) -> dict[str, Any]:
    backoff = wait_exponential_jitter(multiplier=BACKOFF_INITIAL_S, max=BACKOFF_MAX_S)

    def wait(state: RetryCallState) -> float:
        exc = state.outcome.exception() if state.outcome else None
        hint = _retry_after(exc) if exc is not None else None
        if hint is not None:
            return min(hint, RETRY_AFTER_CAP_S)
        return backoff(state)

    def transient(exc: BaseException) -> bool:
        return isinstance(_translate(provider, exc), TransientBackendError)

    retrying = Retrying(
        retry=retry_if_exception(transient),
        stop=stop_after_attempt(max_attempts),
        wait=wait,
        reraise=True,
    )
    try:
        return retrying(call, custom_id, body)
    except TerminalBackendError as e:  # the body cannot be expressed for this provider
        return _error_row(custom_id, f"invalid request: {e}")
    except (openai.OpenAIError, anthropic.AnthropicError) as e:
        refused = _translate(provider, e, key)
        if isinstance(refused, CredentialsError):  # the key, not this request
            raise refused from e
        attempts = retrying.statistics.get("attempt_number", 1)
        kind = "transient" if transient(e) else "terminal"
        return _error_row(custom_id, f"{describe(e)} ({kind}; {attempts} attempt(s))")


def describe(exc: BaseException) -> str:
    """A provider error in one line: "HTTP 429 rate_limit_error: <message>" for an HTTP
    error (either provider's envelope), else the exception's class and message."""
    status = getattr(exc, "status_code", None)
    body = getattr(exc, "body", None)
    if isinstance(status, int):
        err = body.get("error", body) if isinstance(body, dict) else None
        if isinstance(err, dict) and err.get("message"):
            kind = err.get("type") or err.get("code") or "error"
            return f"HTTP {status} {kind}: {err['message']}"
        return f"HTTP {status}: {exc}"
    return f"{type(exc).__name__}: {exc}"


def _error_row(custom_id: str | None, error: str) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(RESULT_SCHEMA)
    row["custom_id"] = custom_id
    row["status"] = RequestStatus.PROVIDER_ERROR.value
    row["error"] = error
    return row
