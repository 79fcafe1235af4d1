"""OpenAI Files + Batch API through the official SDK (also any server that speaks it)."""

from __future__ import annotations

import mmap
import re
import tempfile
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any, TypeVar

import httpx2
import openai
import orjson
import polars as pl

from lowtide.backends import openai_storage
from lowtide.backends.base import (
    RESULT_SCHEMA,
    BatchRefs,
    BatchState,
    BatchStatus,
    Capabilities,
    ProviderItem,
    QuotaRefusal,
    RequestStatus,
    TerminalBackendError,
    TransientBackendError,
)
from lowtide.backends.keys import refused_key, require_key
from lowtide.backends.wire import EMULATOR_FINGERPRINT, is_transient_status, retry_after_s
from lowtide.errors import InputFileGoneError, ProviderQueueFullError
from lowtide.json_lines import json_lines
from lowtide.request_lines import JsonlFile, jsonl_payload

T = TypeVar("T")

_DOWNLOAD_ATTEMPTS = 3
"""Reads of one results file whose body was cut mid-way, before the join is left to retry."""

CAPABILITIES = Capabilities(
    name="openai",
    max_requests=50_000,
    max_bytes=200 * 1024 * 1024,
    structured_output="json_schema",
    wire="openai_chat",
    price_provider="openai",
    queue="enqueued_tokens",
)

_STATUS = {
    "validating": BatchStatus.VALIDATING,
    "in_progress": BatchStatus.IN_PROGRESS,
    "finalizing": BatchStatus.FINALIZING,
    "completed": BatchStatus.COMPLETED,
    "failed": BatchStatus.FAILED,
    "expired": BatchStatus.EXPIRED,
    "cancelling": BatchStatus.CANCELLING,
    "cancelled": BatchStatus.CANCELLED,
}

METADATA_KEY = "lowtide_batch_id"

# One result line, as both the output and the error file write it. Giving the schema up front
# matters: inferred from early `"error": null` lines the column would be typed null.
_LINE_SCHEMA: dict[str, Any] = {
    "custom_id": pl.String,
    "response": pl.Struct(
        {
            "status_code": pl.Int64,
            "body": pl.Struct(
                {
                    "choices": pl.List(
                        pl.Struct(
                            {
                                "message": pl.Struct({"content": pl.String, "refusal": pl.String}),
                                "finish_reason": pl.String,
                            }
                        )
                    ),
                    "usage": pl.Struct(
                        {
                            "prompt_tokens": pl.Int64,
                            "completion_tokens": pl.Int64,
                            "prompt_tokens_details": pl.Struct({"cached_tokens": pl.Int64}),
                        }
                    ),
                    "error": pl.Struct(
                        {"message": pl.String, "type": pl.String, "code": pl.String}
                    ),
                    "system_fingerprint": pl.String,
                }
            ),
        }
    ),
    "error": pl.Struct({"code": pl.String, "message": pl.String}),
}


def map_status(provider_status: str) -> BatchStatus:
    """OpenAI batch status → lowtide's vocabulary (the only place that knows OpenAI's strings)."""
    try:
        return _STATUS[provider_status]
    except KeyError as e:
        raise TerminalBackendError(
            f"unknown OpenAI batch status {provider_status!r}", backend="openai"
        ) from e


def translate(
    exc: openai.OpenAIError, operation: str, base_url: object = None, key: str | None = None
) -> Exception:
    """SDK exception → transient or terminal, keeping the provider's message (and, when the
    server could not be reached at all, its address). A refused key (401/403) is a
    `CredentialsError`, its message scrubbed of `key`: nothing was answered, nothing fails."""
    if isinstance(exc, openai.AuthenticationError | openai.PermissionDeniedError):
        return refused_key("openai", "OPENAI_API_KEY", operation, exc.status_code, str(exc), key)
    transient = (
        openai.RateLimitError,
        openai.APIConnectionError,
        openai.APITimeoutError,
        openai.InternalServerError,
    )
    if operation == "create" and isinstance(exc, openai.RateLimitError):
        # a create refused for the batch-create rate (or a queue) made nothing: wait and send it
        return ProviderQueueFullError(
            f"{operation}: {exc}",
            backend="openai",
            operation=operation,
            retry_after_s=retry_after_s(exc.response.headers),
        )
    if isinstance(exc, transient) or (
        isinstance(exc, openai.APIStatusError) and is_transient_status(exc.status_code)
    ):
        where = (
            f" (cannot reach {base_url})"
            if isinstance(exc, openai.APIConnectionError) and base_url
            else ""
        )
        response = getattr(exc, "response", None)
        return TransientBackendError(
            f"{operation}: {exc}{where}",
            backend="openai",
            operation=operation,
            retry_after_s=retry_after_s(response.headers) if response is not None else None,
        )
    if (
        operation == "create"
        and isinstance(exc, openai.BadRequestError | openai.NotFoundError)
        and "input_file_id" in (getattr(exc, "param", None) or str(exc))
    ):
        return InputFileGoneError(f"{operation}: {exc}", backend="openai", operation=operation)
    return TerminalBackendError(f"{operation}: {exc}", backend="openai", operation=operation)


_ENQUEUED_LIMIT = re.compile(r"Limit:\s*([\d,]+)\s*enqueued tokens", re.I)


def quota_refusal(status: str, errors: list[dict[str, Any]]) -> QuotaRefusal | None:
    """A batch that failed validation because the model's enqueued-token limit was reached (not
    a 429: the create succeeded), with the limit when the message states it."""
    if status != "failed":
        return None
    for error in errors:
        if error.get("code") == "token_limit_exceeded":
            message = str(error.get("message") or "")
            found = _ENQUEUED_LIMIT.search(message)
            limit = float(found.group(1).replace(",", "")) if found else None
            return QuotaRefusal(f"token_limit_exceeded: {message}", "enqueued_tokens", limit)
    return None


# A top-level-looking `"error"` whose value is a string or another `{"error": ...}` object: the
# two shapes `vllm run-batch` writes (provider-apis.md §3.2). Only a pre-filter: a hit is
# confirmed by parsing the line, so a false hit costs time, never correctness.
_RUN_BATCH_ERROR_RE = re.compile(rb'"error"\s*:\s*(?:"|\{\s*"error"\s*:)')


def _openai_error(error: Any) -> dict[str, str] | None:
    """A run-batch `error` in OpenAI's `{code, message}` shape; None when it already is one."""
    if isinstance(error, str):
        return {"code": "run_batch_error", "message": error}
    if isinstance(error, dict) and isinstance(error.get("error"), dict):
        inner = error["error"]
        return {
            "code": str(inner.get("type") or inner.get("code") or "run_batch_error"),
            "message": str(inner.get("message") or ""),
        }
    return None


def _normalise_run_batch_errors(content: bytes) -> bytes:
    """Rewrite the lines whose `error` is a string or vLLM's envelope to OpenAI's shape; every
    other line (and an ordinary OpenAI file as a whole) is passed through untouched."""
    if _RUN_BATCH_ERROR_RE.search(content) is None:
        return content
    lines = content.splitlines()
    for i, raw in enumerate(lines):
        if _RUN_BATCH_ERROR_RE.search(raw) is None:
            continue
        line = orjson.loads(raw)
        if not isinstance(line, dict):
            continue
        error = _openai_error(line.get("error"))
        if error is not None:
            line["error"] = error
            lines[i] = orjson.dumps(line)
    return b"\n".join(lines) + b"\n"


def _read_in_place(path: Path) -> bytes | Path:
    """A downloaded results file as DuckDB should read it: the file itself, or its bytes when
    some line needs rewriting first (`vllm run-batch`'s errors). Searched where it lies in
    the page cache (mapped, not read into fresh memory)."""
    size = path.stat().st_size
    if size == 0:
        return b""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        # (a file that starts blank goes the bytes' way, which tells an empty one)
        if _RUN_BATCH_ERROR_RE.search(mapped) is None and mapped[:1].strip():
            return path
    return path.read_bytes()


NO_RESPONSE = "no_response: the result line holds neither a response nor an error"
"""A failed request's reason when its result line says nothing about it."""


def parse_result_lines(content: bytes | Path) -> pl.DataFrame:
    """Output/error file JSONL (its bytes, or the file) → RESULT_SCHEMA frame, columnar (no
    per-line Python).

    Also reads `vllm run-batch` output: lines whose `error` is a string (code
    `run_batch_error`) or vLLM's `{"error": {message, type, ...}}` envelope (code = its type)
    are first rewritten to OpenAI's `{code, message}`; files without such lines skip that."""
    if isinstance(content, Path):
        content = _read_in_place(content)
    if isinstance(content, bytes):
        if not content.strip():
            return pl.DataFrame(schema=RESULT_SCHEMA)
        content = _normalise_run_batch_errors(content)
    raw = json_lines(content, _LINE_SCHEMA)
    resp = pl.col("response")
    body = resp.struct.field("body")
    choice = body.struct.field("choices").list.first()
    usage = body.struct.field("usage")
    top_error = pl.col("error")
    ok = resp.struct.field("status_code").is_between(200, 299)
    status = (
        pl.when(ok)
        .then(pl.lit(RequestStatus.ANSWERED.value))
        .when(top_error.struct.field("code") == "batch_expired")
        .then(pl.lit(RequestStatus.EXPIRED.value))
        .when(top_error.struct.field("code") == "batch_cancelled")
        .then(pl.lit(RequestStatus.CANCELLED.value))
        .otherwise(pl.lit(RequestStatus.PROVIDER_ERROR.value))
    )
    body_error = body.struct.field("error")
    error_text = (
        pl.when(ok)
        .then(
            pl.when(choice.struct.field("message").struct.field("refusal").is_not_null()).then(
                pl.lit("refusal: ") + choice.struct.field("message").struct.field("refusal")
            )
        )
        .when(top_error.is_not_null())
        .then(
            top_error.struct.field("code").fill_null("error")
            + pl.lit(": ")
            + top_error.struct.field("message").fill_null("")
        )
        .when(resp.is_null())
        .then(pl.lit(NO_RESPONSE))
        .otherwise(
            pl.lit("HTTP ")
            + resp.struct.field("status_code").cast(pl.String).fill_null("?")
            + pl.lit(" ")
            + body_error.struct.field("code")
            .fill_null(body_error.struct.field("type"))
            .fill_null("")
            + pl.lit(": ")
            + body_error.struct.field("message").fill_null("")
        )
    )
    return raw.select(
        pl.col("custom_id"),
        status.alias("status"),
        pl.when(ok).then(choice.struct.field("message").struct.field("content")).alias("raw_text"),
        pl.when(ok).then(choice.struct.field("finish_reason")).alias("finish_reason"),
        error_text.alias("error"),
        usage.struct.field("prompt_tokens").alias("input_tokens"),
        usage.struct.field("prompt_tokens_details")
        .struct.field("cached_tokens")
        .alias("cached_tokens"),
        usage.struct.field("completion_tokens").alias("output_tokens"),
        (body.struct.field("system_fingerprint") == EMULATOR_FINGERPRINT)
        .fill_null(False)
        .alias("emulated"),
    ).cast(RESULT_SCHEMA)


class OpenAIBatchBackend:
    """Batches through `client.files` and `client.batches`; `client` decides where they go.

    Every upload, and every batch's output and error files, expire after
    `openai_storage.EXPIRES_AFTER_S`, a backstop for lowtide's own deletes; with `keep_files`
    (the job keeps them) they are left to OpenAI's default retention instead."""

    def __init__(
        self,
        client: openai.OpenAI,
        capabilities: Capabilities = CAPABILITIES,
        keep_files: bool = False,
    ):
        self.client = client
        self.capabilities = capabilities
        self._expiry: Any = openai.omit if keep_files else openai_storage.expiry()

    def _call(self, operation: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except openai.OpenAIError as e:
            raise translate(e, operation, self.client.base_url, self.client.api_key) from e

    def upload(self, batch_id: str, lines: Sequence[str]) -> str:
        with ExitStack() as stack:
            # a prepared file is streamed (the SDK's retries send it again from its start)
            payload = (
                stack.enter_context(lines.open())
                if isinstance(lines, JsonlFile)
                else jsonl_payload(lines)
            )
            f = self._call(
                "upload",
                lambda: self.client.files.create(
                    file=(f"{batch_id}.jsonl", payload),  # the name finds it again (leftovers)
                    purpose="batch",
                    expires_after=self._expiry,
                ),
            )
        return f.id

    def create(self, batch_id: str, input_file_id: str | None, lines: Sequence[str]) -> str:
        if input_file_id is None:
            raise TerminalBackendError(
                "OpenAI batches need an uploaded input file", backend="openai"
            )
        batch = self._call(
            "create",
            # no SDK retry here: a create that timed out may have been accepted, and a blind
            # re-POST would start (and bill) a second batch; Prefect's task retry goes through
            # find() first
            lambda: self.client.with_options(max_retries=0).batches.create(
                input_file_id=input_file_id,
                endpoint="/v1/chat/completions",
                completion_window="24h",
                metadata={METADATA_KEY: batch_id},
                output_expires_after=self._expiry,
            ),
        )
        return batch.id

    def find(
        self,
        batch_id: str,
        n_requests: int = 0,
        not_before: float = 0.0,
        *,
        exclude: tuple[str, ...] = (),
    ) -> str | None:
        def scan() -> str | None:
            for b in self.client.batches.list(limit=100):
                if (b.metadata or {}).get(METADATA_KEY) == batch_id and b.id not in exclude:
                    return b.id
            return None

        return self._call("find", scan)

    def poll(self, provider_batch_id: str) -> BatchState:
        b = self._call("poll", lambda: self.client.batches.retrieve(provider_batch_id))
        counts = b.request_counts.model_dump() if b.request_counts else {}
        errors = [e.model_dump() for e in (b.errors.data or [])] if b.errors else []
        usage: dict[str, Any] | None = None
        u = getattr(b, "usage", None)
        if u is not None:
            usage = {
                "input_tokens": u.input_tokens,
                "cached_tokens": u.input_tokens_details.cached_tokens
                if u.input_tokens_details
                else 0,
                "output_tokens": u.output_tokens,
            }
        return BatchState(
            status=map_status(b.status),
            provider_status=b.status,
            refused=quota_refusal(b.status, errors),
            counts=counts,
            output_file_id=b.output_file_id,
            error_file_id=b.error_file_id,
            errors=errors,
            usage=usage,
            done=int(counts.get("completed", 0)) + int(counts.get("failed", 0)),
            total=int(counts.get("total", 0)),
        )

    def _download(self, file_id: str, path: Path) -> None:
        """The file's content streamed to `path`: never held whole in memory, and read from
        there by DuckDB (held, a 1M-row night's results were copied four times over into fresh
        memory: ~1.1 million page faults, a quarter of join's CPU). A body cut mid-way is asked
        for again, `_DOWNLOAD_ATTEMPTS` times in all, then reported as transient."""
        for attempt in range(1, _DOWNLOAD_ATTEMPTS + 1):
            try:
                with self.client.files.with_streaming_response.content(file_id) as response:
                    response.stream_to_file(path)
                return
            except openai.OpenAIError as e:
                raise translate(e, "download", self.client.base_url, self.client.api_key) from e
            except httpx2.TransportError as e:  # the SDK retries the request, not its body
                if attempt == _DOWNLOAD_ATTEMPTS:
                    raise TransientBackendError(
                        f"download: the connection dropped while reading file {file_id} "
                        f"({_DOWNLOAD_ATTEMPTS} tries): {e}",
                        backend="openai",
                        operation="download",
                    ) from e

    def _file_results(self, file_id: str) -> pl.DataFrame:
        """One results file, parsed from a temporary copy on disk; read into memory instead
        when the temporary folder cannot hold it (full, missing, read-only)."""
        try:
            with tempfile.TemporaryDirectory(prefix="lowtide-results-") as folder:
                path = Path(folder) / "results.jsonl"
                self._download(file_id, path)
                return parse_result_lines(path)
        except OSError:
            content = self._call("download", lambda: self.client.files.content(file_id).content)
            return parse_result_lines(content)

    def results(self, state: BatchState) -> pl.DataFrame:
        frames = [
            self._file_results(fid) for fid in (state.output_file_id, state.error_file_id) if fid
        ]
        if not frames:
            return pl.DataFrame(schema=RESULT_SCHEMA)
        return pl.concat(frames)

    def cancel(self, provider_batch_id: str) -> None:
        self._call("cancel", lambda: self.client.batches.cancel(provider_batch_id))

    def kept_items(self, batch: BatchRefs) -> list[ProviderItem]:
        return self._call("release", lambda: openai_storage.kept_files(self.client, batch))

    def delete_item(self, item: ProviderItem) -> None:
        self._call("delete", lambda: openai_storage.delete_file(self.client, item.provider_id))

    def tagged_items(self, batches: Sequence[BatchRefs], since: float) -> list[ProviderItem]:
        return self._call(
            "leftovers",
            lambda: openai_storage.tagged_files(
                self.client, batches, since, METADATA_KEY, lambda s: map_status(s).terminal
            ),
        )


def from_environment(
    api_key_block: str | None = None, keep_files: bool = False
) -> OpenAIBatchBackend:
    """The real OpenAI backend; honours OPENAI_API_KEY and OPENAI_BASE_URL like the SDK does,
    the key coming from the Prefect Secret block `api_key_block` when OPENAI_API_KEY is unset."""
    key = require_key("openai", "OPENAI_API_KEY", api_key_block)
    return OpenAIBatchBackend(openai.OpenAI(api_key=key), keep_files=keep_files)


def realtime_client_from_environment(api_key_block: str | None = None) -> openai.OpenAI:
    """A chat-completions client for the realtime path, with the SDK's own retries off: the
    realtime path retries with tenacity. The key as for `from_environment`."""
    key = require_key("openai", "OPENAI_API_KEY", api_key_block)
    return openai.OpenAI(api_key=key, max_retries=0)


def realtime_client_for_base_url(base_url: str, api_key: str = "emulator") -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)


def for_base_url(
    base_url: str, api_key: str = "emulator", keep_files: bool = False
) -> OpenAIBatchBackend:
    return OpenAIBatchBackend(
        openai.OpenAI(base_url=base_url, api_key=api_key), keep_files=keep_files
    )
