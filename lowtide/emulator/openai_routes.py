"""OpenAI Files, Batches and Chat Completions, as the official SDK sees them.

A batch's life is computed from the simulated clock rather than driven by a worker: validation
ends `validating_s` after creation, request i finishes `(i + 1) * batch_seconds_per_request`
after `in_progress_at`, and each request is executed (answered, billed) exactly once, the first
time anyone looks after its finish time. Expiry, cancel and finalization follow from the same
timeline, so jumping the clock reproduces a 24 h batch in milliseconds.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.responses import Response

from lowtide.emulator import model as emodel
from lowtide.emulator.faults import ApiError

if TYPE_CHECKING:
    from lowtide.emulator.app import EmulatorState

router = APIRouter()

ALLOWED_ENDPOINTS = (
    "/v1/responses",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/completions",
    "/v1/moderations",
    "/v1/images/generations",
    "/v1/images/edits",
    "/v1/videos",
)
UPLOAD_PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals")
TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
_MAX_REPORTED_LINE_ERRORS = 1000
_EXPIRY_BOUNDS = (3600, 2_592_000)


# --------------------------------------------------------------------------- records


@dataclass
class StoredFile:
    id: str
    filename: str
    purpose: str
    content: bytes
    created_at: int
    expires_at: int | None
    seq: int
    deleted: bool = False

    def alive(self, now: float) -> bool:
        return not self.deleted and (self.expires_at is None or now < self.expires_at)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": len(self.content),
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "status_details": None,
        }


@dataclass
class BatchLine:
    line_no: int
    custom_id: str
    body: dict[str, Any]


@dataclass
class OpenAIBatch:
    id: str
    seq: int
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    output_expires_s: float | None
    created_at: float
    expires_at: float
    validating_s: float
    per_request_s: float
    finalizing_s: float
    cancel_drain_s: float
    lines: list[BatchLine]
    line_errors: list[dict[str, Any]]
    model: str | None
    enqueued_tokens: int = 0
    status: str = "validating"
    times: dict[str, float] = field(default_factory=dict)
    executed: int = 0
    output_lines: list[dict[str, Any]] = field(default_factory=list)
    error_lines: list[dict[str, Any]] = field(default_factory=list)
    output_file_id: str | None = None
    error_file_id: str | None = None
    usage: dict[str, int] = field(
        default_factory=lambda: {"input_tokens": 0, "cached_tokens": 0, "output_tokens": 0}
    )

    def finish_time(self, index: int) -> float:
        return self.times["in_progress"] + (index + 1) * self.per_request_s

    def to_json(self) -> dict[str, Any]:
        admitted = "in_progress" in self.times
        total = len(self.lines) if admitted else 0
        failed = len(self.error_lines) if admitted else 0
        usage = self.usage
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "model": self.model if admitted else None,
            "errors": (
                {"object": "list", "data": self.line_errors} if self.status == "failed" else None
            ),
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": int(self.created_at),
            "in_progress_at": _ts(self.times.get("in_progress")),
            "expires_at": int(self.expires_at),
            "finalizing_at": _ts(self.times.get("finalizing")),
            "completed_at": _ts(self.times.get("completed")),
            "failed_at": _ts(self.times.get("failed")),
            "expired_at": _ts(self.times.get("expired")),
            "cancelling_at": _ts(self.times.get("cancelling")),
            "cancelled_at": _ts(self.times.get("cancelled")),
            "request_counts": {
                "total": total,
                "completed": len(self.output_lines) if admitted else 0,
                "failed": failed,
            },
            "usage": {
                "input_tokens": usage["input_tokens"],
                "input_tokens_details": {"cached_tokens": usage["cached_tokens"]},
                "output_tokens": usage["output_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["input_tokens"] + usage["output_tokens"],
            },
            "metadata": self.metadata,
        }


def _ts(value: float | None) -> int | None:
    return None if value is None else int(value)


def _state(request: Request) -> EmulatorState:
    return request.app.state.emulator


def _json(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


async def _json_body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


# --------------------------------------------------------------------------- files


@router.post("/files")
async def create_file(request: Request) -> Response:
    state = _state(request)
    length = int(request.headers.get("content-length") or 0)
    if length > state.config.max_upload_bytes + 64 * 1024:
        raise _too_large(state.config.max_upload_bytes)
    form = await request.form()
    upload = form.get("file")
    if not isinstance(upload, UploadFile):
        raise ApiError(400, "Missing required parameter: 'file'.", param="file")
    content = await upload.read()
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    return await run_in_threadpool(
        _create_file, state, content, upload.filename or "upload.jsonl", fields
    )


def _too_large(limit: int) -> ApiError:
    return ApiError(
        400, f"File is too large. The maximum size is {limit} bytes.", code="file_too_large"
    )


def _create_file(
    state: EmulatorState, content: bytes, filename: str, fields: dict[str, str]
) -> Response:
    purpose = fields.get("purpose")
    if purpose is None:
        raise ApiError(400, "Missing required parameter: 'purpose'.", param="purpose")
    if purpose not in UPLOAD_PURPOSES:
        raise ApiError(
            400,
            f"Invalid value for 'purpose': {purpose!r}; expected one of {', '.join(UPLOAD_PURPOSES)}.",
            param="purpose",
            code="invalid_value",
        )
    if len(content) > state.config.max_upload_bytes:
        raise _too_large(state.config.max_upload_bytes)
    expires_s = _parse_expires_after(
        fields.get("expires_after[anchor]"), fields.get("expires_after[seconds]"), "expires_after"
    )
    with state.lock:
        now = state.tick()
        if expires_s is None and purpose == "batch":
            expires_s = state.config.file_retention_s
        stored = _store_file(state, content, filename, purpose, now, expires_s)
        return _json(stored.to_json())


def _parse_expires_after(anchor: Any, seconds: Any, param: str) -> float | None:
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise ApiError(
            400, f"Invalid '{param}.anchor': only 'created_at' is supported.", param=param
        )
    try:
        value = int(seconds)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"Invalid '{param}.seconds': {seconds!r}.", param=param) from exc
    low, high = _EXPIRY_BOUNDS
    if not low <= value <= high:
        raise ApiError(400, f"'{param}.seconds' must be between {low} and {high}.", param=param)
    return float(value)


def _store_file(
    state: EmulatorState,
    content: bytes,
    filename: str,
    purpose: str,
    created: float,
    expires_s: float | None,
) -> StoredFile:
    stored = StoredFile(
        id=state.new_id("file-"),
        filename=filename,
        purpose=purpose,
        content=content,
        created_at=int(created),
        expires_at=None if expires_s is None else int(created + expires_s),
        seq=state.next_seq(),
    )
    state.files[stored.id] = stored
    return stored


def _live_file(state: EmulatorState, file_id: str, now: float) -> StoredFile:
    stored = state.files.get(file_id)
    if stored is None or not stored.alive(now):
        raise ApiError(404, f"No such File object: {file_id}", param="id")
    return stored


@router.get("/files")
def list_files(
    request: Request,
    purpose: str | None = None,
    limit: int = 10_000,
    order: str = "desc",
    after: str | None = None,
) -> Response:
    state = _state(request)
    if not 1 <= limit <= 10_000:
        raise ApiError(400, "'limit' must be between 1 and 10000.", param="limit")
    if order not in ("asc", "desc"):
        raise ApiError(400, "'order' must be 'asc' or 'desc'.", param="order")
    with state.lock:
        now = state.tick()
        files = sorted(
            (f for f in state.files.values() if f.alive(now)),
            key=lambda f: f.seq,
            reverse=order == "desc",
        )
        if purpose is not None:
            files = [f for f in files if f.purpose == purpose]
        return _json(_page([f.to_json() for f in files], after, limit))


def _page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
    """OpenAI cursor page: items after the one whose id is `after`."""
    start = 0
    if after is not None:
        ids = [item["id"] for item in items]
        start = ids.index(after) + 1 if after in ids else len(items)
    data = items[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(items),
    }


@router.get("/files/{file_id}")
def retrieve_file(request: Request, file_id: str) -> Response:
    state = _state(request)
    with state.lock:
        now = state.tick()
        return _json(_live_file(state, file_id, now).to_json())


@router.delete("/files/{file_id}")
def delete_file(request: Request, file_id: str) -> Response:
    state = _state(request)
    with state.lock:
        now = state.tick()
        stored = _live_file(state, file_id, now)
        stored.deleted = True
        return _json({"id": stored.id, "object": "file", "deleted": True})


@router.get("/files/{file_id}/content")
def file_content(request: Request, file_id: str) -> Response:
    state = _state(request)
    with state.lock:
        now = state.tick()
        content = _live_file(state, file_id, now).content
    # Raw bytes whatever the Accept header says (the SDK asks for application/binary).
    return Response(content, media_type="application/octet-stream")


# --------------------------------------------------------------------------- batches


@router.post("/batches")
async def create_batch(request: Request) -> Response:
    body = await _json_body(request)
    state = _state(request)
    return await run_in_threadpool(_create_batch, state, body)


def _create_batch(state: EmulatorState, body: dict[str, Any]) -> Response:
    for name in ("input_file_id", "endpoint", "completion_window"):
        if not body.get(name):
            raise ApiError(400, f"Missing required parameter: '{name}'.", param=name)
    endpoint = body["endpoint"]
    if endpoint not in ALLOWED_ENDPOINTS:
        raise ApiError(
            400,
            f"Invalid value for 'endpoint': {endpoint!r}; supported: {', '.join(ALLOWED_ENDPOINTS)}.",
            param="endpoint",
            code="invalid_value",
        )
    if body["completion_window"] != "24h":
        raise ApiError(
            400,
            f"Invalid value for 'completion_window': {body['completion_window']!r}; only '24h' is supported.",
            param="completion_window",
            code="invalid_value",
        )
    metadata = _check_metadata(body.get("metadata"))
    output_expiry = body.get("output_expires_after")
    output_expires_s = None
    if output_expiry is not None:
        if not isinstance(output_expiry, dict):
            raise ApiError(
                400, "'output_expires_after' must be an object.", param="output_expires_after"
            )
        output_expires_s = _parse_expires_after(
            output_expiry.get("anchor"), output_expiry.get("seconds"), "output_expires_after"
        )
    config = state.config
    with state.lock:
        now = state.tick()
        input_file = state.files.get(body["input_file_id"])
        if input_file is None or not input_file.alive(now):
            raise ApiError(
                400, f"Input file {body['input_file_id']!r} does not exist.", param="input_file_id"
            )
        if input_file.purpose != "batch":
            raise ApiError(
                400,
                f"Input file {input_file.id!r} has purpose {input_file.purpose!r}; batches need purpose 'batch'.",
                param="input_file_id",
            )
        lines, line_errors, batch_model = _validate_input(
            input_file.content, endpoint, config.max_batch_lines, config.max_batch_file_bytes
        )
        enqueued = 0
        if config.enqueued_token_limit is not None and not line_errors:
            enqueued = sum(
                emodel.prompt_token_count(line.body.get("messages") or []) for line in lines
            )
        batch = OpenAIBatch(
            id=state.new_id("batch_"),
            seq=state.next_seq(),
            endpoint=endpoint,
            input_file_id=input_file.id,
            completion_window="24h",
            metadata=metadata,
            output_expires_s=output_expires_s,
            created_at=now,
            expires_at=now + config.completion_window_s,
            validating_s=config.validating_s,
            per_request_s=config.batch_seconds_per_request,
            finalizing_s=config.finalizing_s + state.faults.extra_finalizing_s(),
            cancel_drain_s=config.cancel_drain_s,
            lines=lines,
            line_errors=line_errors,
            model=batch_model,
            enqueued_tokens=enqueued,
        )
        batch.times["created"] = now
        state.batches[batch.id] = batch
        return _json(batch.to_json())


def _check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise ApiError(400, "'metadata' must be an object of strings.", param="metadata")
    if len(metadata) > 16:
        raise ApiError(400, "'metadata' can have at most 16 keys.", param="metadata")
    for key, value in metadata.items():
        if len(key) > 64:
            raise ApiError(
                400, f"Metadata key {key[:20]!r}… is longer than 64 characters.", param="metadata"
            )
        if not isinstance(value, str) or len(value) > 512:
            raise ApiError(
                400,
                f"Metadata value for {key!r} must be a string of at most 512 characters.",
                param="metadata",
            )
    return dict(metadata)


def _line_error(
    code: str, message: str, line: int | None, param: str | None = None
) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def _validate_input(
    content: bytes, endpoint: str, max_lines: int, max_bytes: int
) -> tuple[list[BatchLine], list[dict[str, Any]], str | None]:
    """Parse a batch input file the way the provider's validator would.

    Returns (requests, errors, model). Errors carry 1-based line numbers; any error fails the
    whole batch once validation "finishes".
    """
    if len(content) > max_bytes:
        return (
            [],
            [
                _line_error(
                    "file_too_large",
                    f"The batch input file is larger than the {max_bytes} maximum for batch input files.",
                    None,
                )
            ],
            None,
        )
    raw_lines = content.decode("utf-8", errors="replace").split("\n")
    numbered = [(i + 1, text) for i, text in enumerate(raw_lines) if text.strip()]
    if not numbered:
        return [], [_line_error("empty_file", "The batch input file is empty.", None)], None
    if len(numbered) > max_lines:
        line_no = numbered[max_lines][0]
        return (
            [],
            [
                _line_error(
                    "too_many_requests",
                    f"The batch input file has {len(numbered)} requests; the maximum is {max_lines}.",
                    line_no,
                )
            ],
            None,
        )

    lines: list[BatchLine] = []
    errors: list[dict[str, Any]] = []
    seen: set[str] = set()
    batch_model: str | None = None
    for line_no, text in numbered:
        try:
            item = orjson.loads(text)
        except orjson.JSONDecodeError:
            errors.append(
                _line_error("invalid_json_line", f"Line {line_no} is not valid JSON.", line_no)
            )
            continue
        if not isinstance(item, dict):
            errors.append(
                _line_error("invalid_json_line", f"Line {line_no} is not a JSON object.", line_no)
            )
            continue
        missing = [k for k in ("custom_id", "method", "url", "body") if item.get(k) in (None, "")]
        if missing:
            errors.append(
                _line_error(
                    "missing_required_parameter",
                    f"Line {line_no} is missing required field(s): {', '.join(missing)}.",
                    line_no,
                    missing[0],
                )
            )
            continue
        custom_id, body = str(item["custom_id"]), item["body"]
        if item["method"] != "POST":
            errors.append(
                _line_error(
                    "invalid_method",
                    f"Line {line_no}: method must be 'POST', got {item['method']!r}.",
                    line_no,
                    "method",
                )
            )
        elif item["url"] != endpoint:
            errors.append(
                _line_error(
                    "invalid_url",
                    f"Line {line_no}: url {item['url']!r} does not match the batch endpoint {endpoint!r}.",
                    line_no,
                    "url",
                )
            )
        elif not isinstance(body, dict):
            errors.append(
                _line_error(
                    "invalid_body", f"Line {line_no}: body must be an object.", line_no, "body"
                )
            )
        elif body.get("stream"):
            errors.append(
                _line_error(
                    "invalid_value",
                    f"Line {line_no}: streaming is not supported in batches.",
                    line_no,
                    "body.stream",
                )
            )
        elif custom_id in seen:
            errors.append(
                _line_error(
                    "duplicate_custom_id",
                    f"The custom_id for this request is a duplicate of another request ({custom_id!r}, line {line_no}).",
                    line_no,
                    "custom_id",
                )
            )
        else:
            line_model = body.get("model")
            if batch_model is None:
                batch_model = line_model
            if line_model != batch_model:
                errors.append(
                    _line_error(
                        "mismatched_model",
                        f"Line {line_no} uses model {line_model!r} but the batch uses {batch_model!r}; one model per batch.",
                        line_no,
                        "body.model",
                    )
                )
            else:
                lines.append(BatchLine(line_no, custom_id, body))
        seen.add(custom_id)
        if len(errors) >= _MAX_REPORTED_LINE_ERRORS:
            break
    return lines, errors, batch_model


@router.get("/batches")
def list_batches(request: Request, limit: int = 20, after: str | None = None) -> Response:
    state = _state(request)
    if not 1 <= limit <= 100:
        raise ApiError(400, "'limit' must be between 1 and 100.", param="limit")
    with state.lock:
        state.tick()
        batches = sorted(state.batches.values(), key=lambda b: b.seq, reverse=True)
        return _json(_page([b.to_json() for b in batches], after, limit))


def _get_batch(state: EmulatorState, batch_id: str) -> OpenAIBatch:
    batch = state.batches.get(batch_id)
    if batch is None:
        raise ApiError(404, f"No batch found with id '{batch_id}'.", param="batch_id")
    return batch


@router.get("/batches/{batch_id}")
def retrieve_batch(request: Request, batch_id: str) -> Response:
    state = _state(request)
    with state.lock:
        state.tick()
        return _json(_get_batch(state, batch_id).to_json())


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(request: Request, batch_id: str) -> Response:
    state = _state(request)
    with state.lock:
        now = state.tick()
        batch = _get_batch(state, batch_id)
        if batch.status in TERMINAL - {"cancelled"}:
            # Undocumented upstream; 400 rather than 409 because the SDKs retry 409.
            raise ApiError(
                400, f"Cannot cancel a batch with status '{batch.status}'.", code="invalid_state"
            )
        if batch.status not in ("cancelling", "cancelled"):
            batch.status = "cancelling"
            batch.times["cancelling"] = now
        return _json(batch.to_json())


# --------------------------------------------------------------------------- lifecycle


def advance_all(state: EmulatorState, now: float) -> None:
    """Move every unfinished OpenAI batch to where the clock says it is."""
    for batch in state.batches.values():
        if batch.status not in TERMINAL:
            _advance(state, batch, now)


def _advance(state: EmulatorState, batch: OpenAIBatch, now: float) -> None:
    while batch.status not in TERMINAL:
        status = batch.status
        if status == "validating":
            done = batch.created_at + batch.validating_s
            if now < done:
                return
            if not batch.line_errors:
                _check_enqueued_limit(state, batch)
            if batch.line_errors:
                batch.status, batch.times["failed"] = "failed", done
                return
            batch.status, batch.times["in_progress"] = "in_progress", done
        elif status == "in_progress":
            all_done = batch.times["in_progress"] + len(batch.lines) * batch.per_request_s
            if all_done > batch.expires_at:
                _run_until(state, batch, min(now, batch.expires_at))
                if now < batch.expires_at:
                    return
                _close(state, batch, "expired", batch.expires_at, "batch_expired")
                return
            _run_until(state, batch, min(now, all_done))
            if now < all_done:
                return
            batch.status, batch.times["finalizing"] = "finalizing", all_done
        elif status == "finalizing":
            done = batch.times["finalizing"] + batch.finalizing_s
            if now < done:
                return
            _close(state, batch, "completed", done, None)
        elif status == "cancelling":
            cancel_at = batch.times["cancelling"]
            if "in_progress" in batch.times:
                # The request already running when cancel arrived is allowed to finish.
                limit = min(cancel_at + batch.per_request_s, batch.expires_at)
                _run_until(state, batch, min(now, limit))
            done = cancel_at + batch.cancel_drain_s
            if now < done:
                return
            _close(state, batch, "cancelled", done, "batch_cancelled")
        else:
            return


def _check_enqueued_limit(state: EmulatorState, batch: OpenAIBatch) -> None:
    limit = state.config.enqueued_token_limit
    if limit is None:
        return
    queued = sum(
        other.enqueued_tokens
        for other in state.batches.values()
        if other is not batch
        and other.model == batch.model
        and other.status in ("in_progress", "finalizing", "cancelling")
    )
    if queued + batch.enqueued_tokens > limit:
        batch.line_errors = [
            _line_error(
                "token_limit_exceeded",
                f"Enqueued token limit reached for {batch.model} in organization emulator. "
                f"Limit: {limit} enqueued tokens. Please try again once some in_progress batches have been completed.",
                None,
            )
        ]


def _run_until(state: EmulatorState, batch: OpenAIBatch, until: float) -> None:
    while batch.executed < len(batch.lines) and batch.finish_time(batch.executed) <= until:
        _execute(state, batch, batch.executed)
        batch.executed += 1


def _execute(state: EmulatorState, batch: OpenAIBatch, index: int) -> None:
    line = batch.lines[index]
    at = batch.finish_time(index)
    request_id = state.new_id("req_")
    attempt = state.next_attempt("openai", line.custom_id)
    if batch.endpoint != "/v1/chat/completions":
        status, body = (
            400,
            _error_body(
                f"The lowtide emulator only executes /v1/chat/completions, not {batch.endpoint}.",
                "invalid_request_error",
                "unsupported_endpoint",
            ),
        )
        _record_error(state, batch, line, at)
    elif _draws_error(state, line.custom_id, attempt):
        status, body = (
            500,
            _error_body(
                "The server had an error while processing your request. Sorry about that!",
                "server_error",
                None,
            ),
        )
        _record_error(state, batch, line, at)
    else:
        try:
            body = chat_completion(
                state, line.body, at, kind="batch", batch_id=batch.id, custom_id=line.custom_id
            )
            status = 200
        except ApiError as err:
            status, body = (
                err.status,
                _error_body(err.message, "invalid_request_error", err.code, err.param),
            )
            _record_error(state, batch, line, at)
    out = {
        "id": state.new_id("batch_req_", 16),
        "custom_id": line.custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }
    if status == 200:
        usage = body["usage"]
        batch.usage["input_tokens"] += usage["prompt_tokens"]
        batch.usage["cached_tokens"] += usage["prompt_tokens_details"]["cached_tokens"]
        batch.usage["output_tokens"] += usage["completion_tokens"]
        batch.output_lines.append(out)
    else:
        batch.error_lines.append(out)


def _draws_error(state: EmulatorState, custom_id: str, attempt: int) -> bool:
    rate = state.config.error_rate
    if rate <= 0:
        return False
    digest = hashlib.sha256(f"error|{state.config.seed}|{custom_id}|{attempt}".encode()).hexdigest()
    return int(digest[:13], 16) / 16**13 < rate


def _record_error(state: EmulatorState, batch: OpenAIBatch, line: BatchLine, at: float) -> None:
    messages = line.body.get("messages") if isinstance(line.body.get("messages"), list) else []
    state.ledger.record(
        provider="openai",
        kind="batch",
        model=str(line.body.get("model")),
        input_tokens=emodel.prompt_token_count(messages),
        output_tokens=0,
        batch_id=batch.id,
        custom_id=line.custom_id,
        at=at,
        billed=False,
    )


def _error_body(
    message: str, type_: str, code: str | None, param: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_NOT_RUN_MESSAGES = {
    "batch_expired": "This request could not be executed before the completion window expired.",
    "batch_cancelled": "This request was not executed because the batch was cancelled.",
}


def _close(
    state: EmulatorState, batch: OpenAIBatch, status: str, at: float, not_run_code: str | None
) -> None:
    """Enter a terminal state: mark unrun requests, then write the output and error files."""
    admitted = "in_progress" in batch.times
    if not_run_code is not None and admitted:
        for line in batch.lines[batch.executed :]:
            batch.error_lines.append(
                {
                    "id": state.new_id("batch_req_", 16),
                    "custom_id": line.custom_id,
                    "response": None,
                    "error": {"code": not_run_code, "message": _NOT_RUN_MESSAGES[not_run_code]},
                }
            )
        batch.executed = len(batch.lines)
    batch.status, batch.times[status] = status, at
    if not admitted:
        return
    expires_s = batch.output_expires_s or state.config.file_retention_s
    # Seeded by the request ids, not the random batch id, so a rerun reproduces the order.
    ids_digest = hashlib.sha256("\n".join(ln.custom_id for ln in batch.lines).encode()).hexdigest()
    rng = random.Random(f"{state.config.seed}|{ids_digest}")
    for kind, lines in (("output", batch.output_lines), ("error", batch.error_lines)):
        if not lines and state.config.omit_empty_files:
            continue
        ordered = list(lines)
        if state.config.shuffle_results:
            rng.shuffle(ordered)
        content = b"".join(orjson.dumps(line) + b"\n" for line in ordered)
        stored = _store_file(
            state, content, f"batch_{batch.id}_{kind}.jsonl", "batch_output", at, expires_s
        )
        if kind == "output":
            batch.output_file_id = stored.id
        else:
            batch.error_file_id = stored.id


# --------------------------------------------------------------------------- chat completions


@router.post("/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    body = await _json_body(request)
    state = _state(request)

    def run() -> Response:
        with state.lock:
            now = state.tick()
            return _json(chat_completion(state, body, now, kind="realtime"))

    return await run_in_threadpool(run)


def chat_completion(
    state: EmulatorState,
    body: dict[str, Any],
    at: float,
    *,
    kind: str,
    batch_id: str | None = None,
    custom_id: str | None = None,
) -> dict[str, Any]:
    """Execute one chat completion body (records it in the ledger); raises ApiError(400)
    for a request the real endpoint would reject."""
    model_name = body.get("model")
    if not isinstance(model_name, str) or not model_name:
        raise ApiError(400, "you must provide a model parameter", param="model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array.", param="messages")
    if body.get("stream"):
        raise ApiError(
            400, "The lowtide emulator does not stream; set stream=false.", param="stream"
        )
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ApiError(
            400,
            f"Invalid 'max_tokens': integer below minimum value 1 ({max_tokens!r}).",
            param="max_tokens",
            code="integer_below_min_value",
        )
    schema = _response_schema(body.get("response_format"))
    config = state.config
    result = emodel.answer(
        messages,
        schema=schema,
        max_tokens=max_tokens,
        model=model_name,
        model_version=config.model_version,
        malformed_rate=config.malformed_rate,
        seed=config.seed,
    )
    cached = _cached_prefix_tokens(state, model_name, messages, at)
    state.ledger.record(
        provider="openai",
        kind=kind,
        model=model_name,
        input_tokens=result.prompt_tokens,
        cached_input_tokens=cached,
        output_tokens=result.completion_tokens,
        batch_id=batch_id,
        custom_id=custom_id,
        at=at,
    )
    return {
        "id": state.new_id("chatcmpl-", 14),
        "object": "chat.completion",
        "created": int(at),
        "model": model_name,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": result.text,
                    "refusal": None,
                    "annotations": [],
                },
                "logprobs": None,
                "finish_reason": result.finish_reason,
            }
        ],
        "usage": {
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": result.completion_tokens,
            "total_tokens": result.prompt_tokens + result.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        },
        "service_tier": "default",
        "system_fingerprint": "fp_lowtide_emulator",
    }


def _response_schema(response_format: Any) -> dict[str, Any] | None:
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ApiError(400, "'response_format' must be an object.", param="response_format")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ApiError(
                400,
                "Missing required parameter: 'response_format.json_schema.schema'.",
                param="response_format.json_schema",
            )
        return spec["schema"]
    raise ApiError(400, f"Invalid 'response_format.type': {kind!r}.", param="response_format.type")


def _cached_prefix_tokens(
    state: EmulatorState, model_name: str, messages: list[Any], at: float
) -> int:
    """OpenAI's automatic prompt cache: a repeated system prefix of >= 1024 tokens is served
    from cache in 128-token steps."""
    prefix_parts = []
    for message in messages:
        if not isinstance(message, dict) or message.get("role") not in ("system", "developer"):
            break
        prefix_parts.append(emodel.message_text(message.get("content")))
    if not prefix_parts:
        return 0
    prefix = "\n".join(prefix_parts)
    tokens = emodel.prompt_token_count([], prefix) - 3  # drop the reply primer
    if tokens < state.config.openai_cache_min_tokens:
        return 0
    key = "openai|" + model_name + "|" + hashlib.sha256(prefix.encode()).hexdigest()
    last = state.prompt_cache.get(key)
    state.prompt_cache[key] = at
    if last is None or at - last > state.config.cache_ttl_s:
        return 0
    return math.floor(tokens / 128) * 128
