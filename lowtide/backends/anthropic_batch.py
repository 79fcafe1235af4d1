"""Anthropic Message Batches through the official SDK (also any server that speaks it).

lowtide stores every request as an OpenAI chat-completions batch line; this backend translates
each line into a Messages request (`to_anthropic_params`) when the batch is created, and maps
Anthropic's results back into lowtide's result rows. There is no upload step: requests travel
inline with the create call.

Two Anthropic facts shape the code:
- Batches carry no metadata, so a batch created just before a crash can only be found again by
  its size and creation time (`find`).
- The results download is a stream that the SDK never retries; a connection cut mid-way raises
  a transport error after part of the results were yielded. `results` re-requests the stream
  and keeps the first result seen for each custom_id.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, TypeVar

import anthropic
import httpx2
import orjson
import polars as pl
from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from lowtide.backends.anthropic_params import (
    STRUCTURED_OUTPUT_MODES,
    batch_requests,
)
from lowtide.backends.base import (
    RESULT_SCHEMA,
    BackendError,
    BatchRefs,
    BatchState,
    BatchStatus,
    Capabilities,
    ItemRole,
    ProviderItem,
    RequestStatus,
    TerminalBackendError,
    TransientBackendError,
)
from lowtide.backends.keys import refused_key, require_key
from lowtide.backends.wire import is_emulator_answer, is_transient_status, retry_after_s
from lowtide.errors import ProviderQueueFullError

T = TypeVar("T")

CAPABILITIES = Capabilities(
    name="anthropic",
    max_requests=100_000,
    max_bytes=256 * 1024 * 1024,
    structured_output="output_config",
    wire="openai_chat",
    price_provider="anthropic",
    queue="queued_requests",
)

# Anthropic's stop_reason → the OpenAI finish_reason vocabulary that parse/repair reads.
# A forced tool call ends with "tool_use": for lowtide that is the normal, complete answer.
_FINISH_REASON = {
    "end_turn": "stop",
    "stop_sequence": "stop",
    "tool_use": "stop",
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "refusal": "content_filter",
    "pause_turn": "pause_turn",
}

_STATUS = {
    "in_progress": BatchStatus.IN_PROGRESS,
    "canceling": BatchStatus.CANCELLING,
    "ended": BatchStatus.COMPLETED,  # refined from the request counts in map_status
}

# How far before `not_before` a batch may have been created and still count as "ours" in
# find(): covers clock skew between this machine and the provider.
FIND_SLACK_S = 5.0

RESULTS_ATTEMPTS = 4


# --------------------------------------------------------------------------- status


def map_status(processing_status: str, counts: Mapping[str, int] | None = None) -> BatchStatus:
    """Anthropic batch status (+ request counts) → lowtide's vocabulary.

    The only place that knows Anthropic's status strings. `ended` means every request reached
    a result; the counts say how: any `canceled` request → CANCELLED (a cancel was accepted),
    else any `expired` request with nothing processing → EXPIRED (the 24 h window closed,
    partial results kept), else COMPLETED (errored requests are per-request outcomes).
    """
    try:
        status = _STATUS[processing_status]
    except KeyError as e:
        raise TerminalBackendError(
            f"unknown Anthropic batch processing_status {processing_status!r}",
            backend="anthropic",
        ) from e
    if status is BatchStatus.COMPLETED and counts:
        if counts.get("canceled", 0) > 0:
            return BatchStatus.CANCELLED
        if counts.get("expired", 0) > 0 and counts.get("processing", 0) == 0:
            return BatchStatus.EXPIRED
    return status


def finish_reason(stop_reason: str | None) -> str | None:
    """Anthropic stop_reason → OpenAI-style finish_reason ("stop", "length", ...)."""
    if stop_reason is None:
        return None
    return _FINISH_REASON.get(stop_reason, stop_reason)


# --------------------------------------------------------------------------- errors


_QUEUE_LIMIT = re.compile(r"limit of ([\d,]+)", re.I)


def _stated_queue_limit(message: str) -> float | None:
    """The queue size a queue-full 429 states ("… over the limit of N …"), when it does."""
    found = _QUEUE_LIMIT.search(message)
    return float(found.group(1).replace(",", "")) if found else None


def translate(
    exc: BaseException, operation: str, base_url: object = None, key: str | None = None
) -> BackendError:
    """SDK (or transport) exception → transient or terminal, keeping the provider's message.

    Transient: rate limits, timeouts, dropped connections, 408/409/429, 5xx and 529 overloaded.
    A refused key (401/403) is a `CredentialsError`, its message scrubbed of `key`. Everything
    else (bad request, not found, a client-side AnthropicError) is terminal.
    """
    if isinstance(exc, anthropic.AuthenticationError | anthropic.PermissionDeniedError):
        return refused_key(
            "anthropic", "ANTHROPIC_API_KEY", operation, exc.status_code, str(exc), key
        )
    transient = isinstance(
        exc,
        anthropic.RateLimitError
        | anthropic.APIConnectionError  # includes APITimeoutError
        | anthropic.InternalServerError  # includes 503 and 529 OverloadedError
        | httpx2.TransportError,
    ) or (isinstance(exc, anthropic.APIStatusError) and is_transient_status(exc.status_code))
    if operation == "create" and isinstance(exc, anthropic.RateLimitError):
        # the processing queue (shared by all models) is full: nothing was created
        return ProviderQueueFullError(
            f"{operation}: {exc}",
            backend="anthropic",
            operation=operation,
            retry_after_s=retry_after_s(exc.response.headers),
            limit=_stated_queue_limit(str(exc)),
        )
    unreachable = isinstance(exc, anthropic.APIConnectionError | httpx2.TransportError)
    where = f" (cannot reach {base_url})" if unreachable and base_url else ""
    message = f"{operation}: {exc}{where}"
    if not transient:
        return TerminalBackendError(message, backend="anthropic", operation=operation)
    response = getattr(exc, "response", None)
    return TransientBackendError(
        message,
        backend="anthropic",
        operation=operation,
        retry_after_s=retry_after_s(response.headers) if response is not None else None,
    )


# A results stream broken while its body is read: anthropic before 2.17 lets the transport
# error through; 2.17 and later wrap it in APIConnectionError (an APIError).
STREAM_CUT_ERRORS = (httpx2.TransportError, anthropic.APIConnectionError)


class _StreamCut(Exception):
    """One results pass cut mid-body; `error` is what the SDK raised."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


# --------------------------------------------------------------------------- request lines


def message_row(custom_id: str | None, message: Any, structured_output: str) -> dict[str, Any]:
    """A Messages response (SDK `Message`) → one RESULT_SCHEMA row with status answered.

    raw_text is the text blocks joined, or the forced tool's input as JSON in "tool" mode.
    Token counts follow OpenAI's convention: input_tokens includes cache writes and reads,
    cached_tokens is the cache reads.
    """
    text: str | None = None
    if structured_output == "tool":
        tool = next((b for b in message.content if b.type == "tool_use"), None)
        if tool is not None:
            text = orjson.dumps(tool.input).decode()
    if text is None:
        parts = [b.text for b in message.content if b.type == "text"]
        text = "".join(parts) if parts else None
    usage = message.usage
    cache_write = usage.cache_creation_input_tokens or 0
    cache_read = usage.cache_read_input_tokens or 0
    return {
        "custom_id": custom_id,
        "status": RequestStatus.ANSWERED.value,
        "raw_text": text,
        "finish_reason": finish_reason(message.stop_reason),
        "error": f"refusal: {text or ''}" if message.stop_reason == "refusal" else None,
        "input_tokens": usage.input_tokens + cache_write + cache_read,
        "cached_tokens": cache_read,
        "output_tokens": usage.output_tokens,
        "emulated": is_emulator_answer(message),
    }


def result_row(item: Any, structured_output: str) -> dict[str, Any]:
    """One batch result (SDK `MessageBatchIndividualResponse`) → one RESULT_SCHEMA row."""
    result = item.result
    if result.type == "succeeded":
        return message_row(item.custom_id, result.message, structured_output)
    row: dict[str, Any] = dict.fromkeys(RESULT_SCHEMA)
    row["custom_id"] = item.custom_id
    if result.type == "errored":
        err = result.error.error
        row["status"] = RequestStatus.PROVIDER_ERROR.value
        row["error"] = f"{err.type}: {err.message}"
    elif result.type == "canceled":
        row["status"] = RequestStatus.CANCELLED.value
        row["error"] = "canceled: the batch was canceled before this request ran"
    elif result.type == "expired":
        row["status"] = RequestStatus.EXPIRED.value
        row["error"] = "expired: the batch's 24 h window closed before this request ran"
    else:
        row["status"] = RequestStatus.PROVIDER_ERROR.value
        row["error"] = f"unknown Anthropic result type {result.type!r}"
    return row


def rows_frame(rows: Iterable[dict[str, Any]]) -> pl.DataFrame:
    return pl.DataFrame(list(rows), schema=RESULT_SCHEMA, orient="row")


# --------------------------------------------------------------------------- backend


class AnthropicBatchBackend:
    """Message Batches through `client.messages.batches`; `client` decides where they go.

    `structured_output` picks how the output schema is enforced: "output_config" (JSON outputs,
    the default) or "tool" (a strict forced tool, for models without JSON outputs).
    """

    def __init__(
        self,
        client: anthropic.Anthropic,
        structured_output: str | None = None,
        capabilities: Capabilities = CAPABILITIES,
        results_attempts: int = RESULTS_ATTEMPTS,
    ):
        mode = structured_output or capabilities.structured_output
        if mode not in STRUCTURED_OUTPUT_MODES:
            raise TerminalBackendError(
                f"unknown structured_output {mode!r} for backend 'anthropic'; "
                f"known: {', '.join(STRUCTURED_OUTPUT_MODES)}",
                backend="anthropic",
            )
        self.client = client
        self.structured_output = mode
        self.capabilities = dataclasses.replace(capabilities, structured_output=mode)
        self.results_attempts = results_attempts

    def _call(self, operation: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except anthropic.AnthropicError as e:
            raise translate(e, operation, self.client.base_url, self.client.api_key) from e

    def upload(self, batch_id: str, lines: Sequence[str]) -> None:
        """No upload step: Anthropic takes the requests inline with create."""
        return None

    def create(self, batch_id: str, input_file_id: str | None, lines: Sequence[str]) -> str:
        requests = batch_requests(lines, self.structured_output)
        batch = self._call(
            "create",
            # no SDK retry: a timed-out create may have been accepted (see submit_batch/find)
            lambda: self.client.with_options(max_retries=0).messages.batches.create(
                requests=requests,  # type: ignore[arg-type]  # plain dicts of the Request shape
            ),
        )
        return batch.id

    def find(
        self,
        batch_id: str,
        n_requests: int,
        not_before: float,
        *,
        exclude: Collection[str] = (),
    ) -> str | None:
        """The newest batch of exactly `n_requests` requests created at or after
        `not_before - FIND_SLACK_S` (unix seconds), or None.

        Limitation: Anthropic batches carry no metadata, so lowtide's `batch_id` cannot be
        checked. Two batches of the same size created within that window are told apart only
        by `exclude` (provider ids already recorded for other lowtide batches); otherwise the
        newest wins, which is right when the crash came right after this batch's create call.
        """
        cutoff = not_before - FIND_SLACK_S

        def scan() -> str | None:
            for b in self.client.messages.batches.list(limit=100):  # newest first
                if b.created_at.timestamp() < cutoff:
                    return None
                if b.id not in exclude and sum(_counts(b).values()) == n_requests:
                    return b.id
            return None

        return self._call("find", scan)

    def poll(self, provider_batch_id: str) -> BatchState:
        """The batch's status and counts. Once it has ended, `result_ref` holds the batch id
        (Anthropic has no result files: results are streamed per batch), which is what
        `results` reads. Anthropic moves `processing` only, so `done` is the rest."""
        b = self._call("poll", lambda: self.client.messages.batches.retrieve(provider_batch_id))
        counts = _counts(b)
        total = sum(counts.values())
        return BatchState(
            status=map_status(b.processing_status, counts),
            provider_status=b.processing_status,
            counts={**counts, "total": total},
            result_ref=b.id if b.results_url else None,
            done=total - counts.get("processing", 0),
            total=total,
        )

    def results(self, state: BatchState) -> pl.DataFrame:
        """Every result of the ended batch named by `state.result_ref`, one row per custom_id.
        A stream cut mid-way is requested again (up to `results_attempts` times), keeping the
        first result seen for each custom_id; then TransientBackendError."""
        provider_batch_id = state.result_ref
        if not provider_batch_id:
            return pl.DataFrame(schema=RESULT_SCHEMA)
        rows: dict[str, dict[str, Any]] = {}

        def one_pass() -> None:
            # Opening the stream is the SDK's request (retried by the SDK itself); a failure
            # while reading the body is a cut, re-requested here.
            stream = self.client.messages.batches.results(provider_batch_id)
            try:
                for item in stream:
                    if item.custom_id not in rows:
                        rows[item.custom_id] = result_row(item, self.structured_output)
            except STREAM_CUT_ERRORS as e:
                raise _StreamCut(e) from e
            finally:
                stream.close()

        retrying = Retrying(
            retry=retry_if_exception_type(_StreamCut),
            stop=stop_after_attempt(self.results_attempts),
            wait=wait_exponential_jitter(multiplier=0.05, max=2.0),
            reraise=True,
        )
        try:
            retrying(one_pass)
        except _StreamCut as cut:
            raise TransientBackendError(
                f"download: the results stream of {provider_batch_id} was cut "
                f"{self.results_attempts} times ({len(rows)} results read so far): "
                f"{cut.error!r}",
                backend="anthropic",
                operation="download",
            ) from cut.error
        except anthropic.AnthropicError as e:
            raise translate(e, "download", key=self.client.api_key) from e
        return rows_frame(rows.values())

    def cancel(self, provider_batch_id: str) -> None:
        self._call("cancel", lambda: self.client.messages.batches.cancel(provider_batch_id))

    # Anthropic keeps no files: a batch holds its requests and results (29 days) until it is
    # deleted, which it allows once the batch has ended. Batches carry no tags, so they are
    # found by the provider ids the state file recorded.

    def kept_items(self, batch: BatchRefs) -> list[ProviderItem]:
        """The batch itself, while Anthropic keeps it (no size: Anthropic reports none)."""
        if not batch.provider_batch_id:
            return []
        found = self._call("release", lambda: self._retrieve(batch.provider_batch_id or ""))
        if found is None:
            return []
        busy = not map_status(found.processing_status).terminal
        return [ProviderItem(found.id, ItemRole.BATCH, batch.batch_id, None, busy=busy)]

    def delete_item(self, item: ProviderItem) -> None:
        """Delete the ended batch; one already gone counts as deleted."""

        def delete() -> None:
            try:
                self.client.messages.batches.delete(item.provider_id)
            except anthropic.NotFoundError:
                return

        self._call("delete", delete)

    def tagged_items(self, batches: Sequence[BatchRefs], since: float) -> list[ProviderItem]:
        """The recorded batches Anthropic still keeps (`since` is not needed: each is asked
        for by its id)."""
        return [item for b in batches for item in self.kept_items(b)]

    def _retrieve(self, provider_batch_id: str) -> Any:
        try:
            return self.client.messages.batches.retrieve(provider_batch_id)
        except anthropic.NotFoundError:
            return None


def _counts(batch: Any) -> dict[str, int]:
    c = batch.request_counts
    return {
        "processing": c.processing,
        "succeeded": c.succeeded,
        "errored": c.errored,
        "canceled": c.canceled,
        "expired": c.expired,
    }


def from_environment(
    structured_output: str | None = None, api_key_block: str | None = None
) -> AnthropicBatchBackend:
    """The real Anthropic backend; honours ANTHROPIC_API_KEY and ANTHROPIC_BASE_URL like the
    SDK does, the key coming from the Prefect Secret block `api_key_block` when unset."""
    key = require_key("anthropic", "ANTHROPIC_API_KEY", api_key_block)
    return AnthropicBatchBackend(anthropic.Anthropic(api_key=key), structured_output)


def realtime_client_from_environment(api_key_block: str | None = None) -> anthropic.Anthropic:
    """A messages client for the realtime path, with the SDK's own retries off: the realtime
    path retries with tenacity. The key as for `from_environment`."""
    key = require_key("anthropic", "ANTHROPIC_API_KEY", api_key_block)
    return anthropic.Anthropic(api_key=key, max_retries=0)


def realtime_client_for_base_url(base_url: str, api_key: str = "emulator") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key=api_key, max_retries=0)


def for_base_url(
    base_url: str, api_key: str = "emulator", structured_output: str | None = None
) -> AnthropicBatchBackend:
    return AnthropicBatchBackend(
        anthropic.Anthropic(base_url=base_url, api_key=api_key), structured_output
    )
