"""OpenAI Batches routes: create, list, retrieve and cancel, as the official SDK sees them.

Create checks its own parameters at once and parses the input file the way the provider's
validator would, keeping any line errors for the moment validation "finishes" on the simulated
clock. What happens to a batch after that is `openai_batch_lifecycle`'s job; every route ticks
the state first, so what it returns is where the clock says the batch is.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from lowtide.emulator import limits
from lowtide.emulator.faults import ApiError
from lowtide.emulator.openai_batch_lifecycle import TERMINAL, BatchLine, OpenAIBatch, line_error
from lowtide.emulator.openai_files import parse_expires_after
from lowtide.emulator.routes_common import (
    emulator_state,
    json_response,
    openai_json_body,
    openai_page,
)

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
_MAX_REPORTED_LINE_ERRORS = 1000


@router.post("/batches")
async def create_batch(request: Request) -> Response:
    body = await openai_json_body(request)
    state = emulator_state(request)
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
        output_expires_s = parse_expires_after(
            output_expiry.get("anchor"), output_expiry.get("seconds"), "output_expires_after"
        )
    config = state.config
    with state.lock:
        now = state.tick()
        # After the parameter checks: a malformed create is a 400 and takes no slot.
        limits.check_batch_create_rate(state, now)
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
        )
        batch.times["created"] = now
        state.batches[batch.id] = batch
        return json_response(batch.to_json())


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
                line_error(
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
        return [], [line_error("empty_file", "The batch input file is empty.", None)], None
    if len(numbered) > max_lines:
        line_no = numbered[max_lines][0]
        return (
            [],
            [
                line_error(
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
                line_error("invalid_json_line", f"Line {line_no} is not valid JSON.", line_no)
            )
            continue
        if not isinstance(item, dict):
            errors.append(
                line_error("invalid_json_line", f"Line {line_no} is not a JSON object.", line_no)
            )
            continue
        missing = [k for k in ("custom_id", "method", "url", "body") if item.get(k) in (None, "")]
        if missing:
            errors.append(
                line_error(
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
                line_error(
                    "invalid_method",
                    f"Line {line_no}: method must be 'POST', got {item['method']!r}.",
                    line_no,
                    "method",
                )
            )
        elif item["url"] != endpoint:
            errors.append(
                line_error(
                    "invalid_url",
                    f"Line {line_no}: url {item['url']!r} does not match the batch endpoint {endpoint!r}.",
                    line_no,
                    "url",
                )
            )
        elif not isinstance(body, dict):
            errors.append(
                line_error(
                    "invalid_body", f"Line {line_no}: body must be an object.", line_no, "body"
                )
            )
        elif body.get("stream"):
            errors.append(
                line_error(
                    "invalid_value",
                    f"Line {line_no}: streaming is not supported in batches.",
                    line_no,
                    "body.stream",
                )
            )
        elif custom_id in seen:
            errors.append(
                line_error(
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
                    line_error(
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
    state = emulator_state(request)
    if not 1 <= limit <= 100:
        raise ApiError(400, "'limit' must be between 1 and 100.", param="limit")
    with state.lock:
        state.tick()
        batches = sorted(state.batches.values(), key=lambda b: b.seq, reverse=True)
        return json_response(openai_page([b.to_json() for b in batches], after, limit))


def _get_batch(state: EmulatorState, batch_id: str) -> OpenAIBatch:
    batch = state.batches.get(batch_id)
    if batch is None:
        raise ApiError(404, f"No batch found with id '{batch_id}'.", param="batch_id")
    return batch


@router.get("/batches/{batch_id}")
def retrieve_batch(request: Request, batch_id: str) -> Response:
    state = emulator_state(request)
    with state.lock:
        state.tick()
        return json_response(_get_batch(state, batch_id).to_json())


@router.post("/batches/{batch_id}/cancel")
def cancel_batch(request: Request, batch_id: str) -> Response:
    state = emulator_state(request)
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
        return json_response(batch.to_json())
