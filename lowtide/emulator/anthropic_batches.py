"""Anthropic Message Batches, as the official SDK sees them: the create, list, retrieve,
cancel, delete and results routes, and a batch's life on the simulated clock.

A batch is not driven by a worker: request i finishes `(i + 1) * batch_seconds_per_request`
after creation and is executed exactly once (through `anthropic_messages.create_message`), the
first time anyone looks after that; `advance_all` is what `EmulatorState.tick` calls.
Create-time checks are synchronous (custom_id pattern, length, uniqueness, size limits); bad
`params` surface later as `errored` results. Request counts stay all-`processing` until the
batch ends, and results are served from an absolute URL on the emulator's own host, as the SDK
follows `results_url` verbatim.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from lowtide.emulator import limits
from lowtide.emulator import model as emodel
from lowtide.emulator.anthropic_messages import create_message
from lowtide.emulator.faults import ApiError, anthropic_error_type
from lowtide.emulator.routes_common import (
    anthropic_json_body,
    draws_error,
    emulator_state,
    json_response,
    result_order_rng,
)

if TYPE_CHECKING:
    from lowtide.emulator.app import EmulatorState

router = APIRouter()

CUSTOM_ID_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
RESULT_TYPES = ("succeeded", "errored", "canceled", "expired")


@dataclass
class BatchRequest:
    custom_id: str
    params: dict[str, Any]


@dataclass
class MessageBatch:
    id: str
    seq: int
    created_at: float
    expires_at: float
    per_request_s: float
    finalizing_s: float
    cancel_drain_s: float
    archive_after_s: float
    requests: list[BatchRequest]
    status: str = "in_progress"
    cancel_initiated_at: float | None = None
    ended_at: float | None = None
    executed: int = 0
    results: list[dict[str, Any]] = field(default_factory=list)
    results_jsonl: bytes = b""
    deleted: bool = False

    def finish_time(self, index: int) -> float:
        return self.created_at + (index + 1) * self.per_request_s

    def all_done_at(self) -> float:
        return self.created_at + len(self.requests) * self.per_request_s

    def natural_end(self) -> float:
        """When the batch ends unless cancelled: `finalizing_s` after its last request, or at
        expiry when that request would finish later."""
        done = self.all_done_at()
        return self.expires_at if done > self.expires_at else done + self.finalizing_s

    def queued_until(self) -> float | None:
        """When the batch stopped counting as queued (in_progress): its cancel or its end;
        None while it still counts."""
        return self.cancel_initiated_at if self.cancel_initiated_at is not None else self.ended_at

    def archived(self, now: float) -> bool:
        return now >= self.created_at + self.archive_after_s

    def to_json(self, base_url: str, now: float) -> dict[str, Any]:
        ended = self.status == "ended"
        counts = dict.fromkeys(("processing", *RESULT_TYPES), 0)
        if ended:
            counts.update(Counter(r["result"]["type"] for r in self.results))
        else:
            # Only `processing` moves before the end, however many requests already ran.
            counts["processing"] = len(self.requests)
        archived = self.archived(now)
        return {
            "id": self.id,
            "type": "message_batch",
            "processing_status": self.status,
            "request_counts": counts,
            "ended_at": _rfc3339(self.ended_at),
            "created_at": _rfc3339(self.created_at),
            "expires_at": _rfc3339(self.expires_at),
            "archived_at": _rfc3339(self.created_at + self.archive_after_s) if archived else None,
            "cancel_initiated_at": _rfc3339(self.cancel_initiated_at),
            "results_url": f"{base_url}/v1/messages/batches/{self.id}/results" if ended else None,
        }


def _rfc3339(value: float | None) -> str | None:
    if value is None:
        return None
    stamp = datetime.fromtimestamp(value, tz=UTC).isoformat(timespec="microseconds")
    return stamp.replace("+00:00", "Z")


def _base_url(request: Request) -> str:
    return str(request.base_url).rstrip("/")


# --------------------------------------------------------------------------- routes


@router.post("/messages/batches")
async def create_batch(request: Request) -> Response:
    state = emulator_state(request)
    limit = state.config.anthropic_max_body_bytes
    if int(request.headers.get("content-length") or 0) > limit:
        raise _too_large(limit)
    raw = await request.body()
    if len(raw) > limit:
        raise _too_large(limit)
    body = anthropic_json_body(raw)
    return await run_in_threadpool(_create_batch, state, body, _base_url(request))


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"Request exceeds the maximum allowed size of {limit} bytes.")


def _create_batch(state: EmulatorState, body: dict[str, Any], base_url: str) -> Response:
    requests = body.get("requests")
    if not isinstance(requests, list) or not requests:
        raise ApiError(400, "requests: Field required (a non-empty list of requests).")
    config = state.config
    if len(requests) > config.anthropic_max_requests:
        raise ApiError(
            400,
            f"requests: List should have at most {config.anthropic_max_requests} items "
            f"after validation, not {len(requests)}",
        )
    parsed: list[BatchRequest] = []
    seen: set[str] = set()
    for i, item in enumerate(requests):
        if not isinstance(item, dict):
            raise ApiError(400, f"requests.{i}: Input should be an object")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str):
            raise ApiError(400, f"requests.{i}.custom_id: Field required")
        if len(custom_id) > 64:
            raise ApiError(400, f"requests.{i}.custom_id: String should have at most 64 characters")
        if not CUSTOM_ID_RE.match(custom_id):
            raise ApiError(
                400,
                f"requests.{i}.custom_id: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$'",
            )
        if custom_id in seen:
            raise ApiError(
                400,
                f"requests.{i}.custom_id: Duplicate custom_id {custom_id!r}; "
                "custom_id must be unique within a batch.",
            )
        seen.add(custom_id)
        params = item.get("params")
        if not isinstance(params, dict):
            raise ApiError(400, f"requests.{i}.params: Field required")
        parsed.append(BatchRequest(custom_id, params))
    with state.lock:
        now = state.tick()
        limits.check_anthropic_queue(state, now, len(parsed))
        batch = MessageBatch(
            id=state.new_id("msgbatch_01", 12),
            seq=state.next_seq(),
            created_at=now,
            expires_at=now + config.completion_window_s,
            per_request_s=config.batch_seconds_per_request,
            finalizing_s=config.finalizing_s + state.faults.extra_finalizing_s(),
            cancel_drain_s=config.cancel_drain_s,
            archive_after_s=config.archive_after_s,
            requests=parsed,
        )
        state.message_batches[batch.id] = batch
        return json_response(batch.to_json(base_url, now))


def _get_batch(state: EmulatorState, batch_id: str) -> MessageBatch:
    batch = state.message_batches.get(batch_id)
    if batch is None or batch.deleted:
        raise ApiError(404, f"Message batch {batch_id!r} not found.")
    return batch


@router.get("/messages/batches")
def list_batches(
    request: Request, limit: int = 20, after_id: str | None = None, before_id: str | None = None
) -> Response:
    state = emulator_state(request)
    if not 1 <= limit <= 1000:
        raise ApiError(400, "limit: Input should be between 1 and 1000")
    with state.lock:
        now = state.tick()
        batches = sorted(
            (b for b in state.message_batches.values() if not b.deleted),
            key=lambda b: b.seq,
            reverse=True,  # newest first
        )
        ids = [b.id for b in batches]
        if before_id is not None:
            end = ids.index(before_id) if before_id in ids else 0
            start = max(0, end - limit)
            page, has_more = batches[start:end], start > 0
        else:
            start = (
                ids.index(after_id) + 1
                if after_id in ids
                else (0 if after_id is None else len(ids))
            )
            page, has_more = batches[start : start + limit], start + limit < len(batches)
        base = _base_url(request)
        return json_response(
            {
                "data": [b.to_json(base, now) for b in page],
                "has_more": has_more,
                "first_id": page[0].id if page else None,
                "last_id": page[-1].id if page else None,
            }
        )


@router.get("/messages/batches/{batch_id}")
def retrieve_batch(request: Request, batch_id: str) -> Response:
    state = emulator_state(request)
    with state.lock:
        now = state.tick()
        return json_response(_get_batch(state, batch_id).to_json(_base_url(request), now))


@router.post("/messages/batches/{batch_id}/cancel")
def cancel_batch(request: Request, batch_id: str) -> Response:
    state = emulator_state(request)
    with state.lock:
        now = state.tick()
        batch = _get_batch(state, batch_id)
        if batch.status == "ended":
            raise ApiError(
                400, f"Message batch {batch_id!r} has already ended and cannot be canceled."
            )
        if batch.status == "in_progress":
            batch.status = "canceling"
            batch.cancel_initiated_at = now
        return json_response(batch.to_json(_base_url(request), now))


@router.delete("/messages/batches/{batch_id}")
def delete_batch(request: Request, batch_id: str) -> Response:
    state = emulator_state(request)
    with state.lock:
        state.tick()
        batch = _get_batch(state, batch_id)
        if batch.status != "ended":
            raise ApiError(
                400,
                f"Message batch {batch_id!r} is still {batch.status}; "
                "cancel it and wait until it has ended before deleting it.",
            )
        batch.deleted = True
        return json_response({"id": batch.id, "type": "message_batch_deleted"})


@router.get("/messages/batches/{batch_id}/results")
def batch_results(request: Request, batch_id: str) -> Response:
    state = emulator_state(request)
    with state.lock:
        now = state.tick()
        batch = _get_batch(state, batch_id)
        if batch.status != "ended":
            raise ApiError(
                400, f"Message batch {batch_id!r} has not ended yet; results are not ready."
            )
        if batch.archived(now):
            raise ApiError(404, f"Results of message batch {batch_id!r} have been archived.")
        content = batch.results_jsonl
    return Response(content, media_type="application/x-jsonl")


# --------------------------------------------------------------------------- lifecycle


def advance_all(state: EmulatorState, now: float) -> None:
    """Move every unfinished message batch to where the clock says it is."""
    for batch in state.message_batches.values():
        if batch.status != "ended":
            _advance(state, batch, now)


def _advance(state: EmulatorState, batch: MessageBatch, now: float) -> None:
    if batch.status == "in_progress":
        expiring = batch.all_done_at() > batch.expires_at
        _run_until(state, batch, min(now, batch.expires_at if expiring else batch.all_done_at()))
        end = batch.natural_end()
        if now >= end:
            _end(state, batch, end, "expired" if expiring else None)
    elif batch.status == "canceling":
        assert batch.cancel_initiated_at is not None
        # Requests already running when the cancel came in may still finish.
        limit = min(batch.cancel_initiated_at + batch.per_request_s, batch.expires_at)
        _run_until(state, batch, min(now, limit))
        done = batch.cancel_initiated_at + batch.cancel_drain_s
        if now >= done:
            _end(state, batch, done, "canceled")


def _run_until(state: EmulatorState, batch: MessageBatch, until: float) -> None:
    while batch.executed < len(batch.requests) and batch.finish_time(batch.executed) <= until:
        _execute(state, batch, batch.executed)
        batch.executed += 1


def _execute(state: EmulatorState, batch: MessageBatch, index: int) -> None:
    item = batch.requests[index]
    at = batch.finish_time(index)
    attempt = state.next_attempt("anthropic", item.custom_id)
    try:
        if draws_error(state, item.custom_id, attempt):
            raise ApiError(500, "Internal server error", type="api_error")
        message = create_message(
            state, item.params, at, kind="batch", batch_id=batch.id, custom_id=item.custom_id
        )
    except ApiError as err:
        messages = item.params.get("messages")
        state.ledger.record(
            provider="anthropic",
            kind="batch",
            model=str(item.params.get("model")),
            input_tokens=emodel.prompt_token_count(messages if isinstance(messages, list) else []),
            output_tokens=0,
            batch_id=batch.id,
            custom_id=item.custom_id,
            at=at,
            billed=False,
        )
        result: dict[str, Any] = {
            "type": "errored",
            "error": {
                "type": "error",
                "error": {
                    "type": err.type or anthropic_error_type(err.status),
                    "message": err.message,
                },
                "request_id": state.new_id("req_011"),
            },
        }
    else:
        result = {"type": "succeeded", "message": message}
    batch.results.append({"custom_id": item.custom_id, "result": result})


def _end(state: EmulatorState, batch: MessageBatch, at: float, not_run: str | None) -> None:
    if not_run is not None:
        for item in batch.requests[batch.executed :]:
            batch.results.append({"custom_id": item.custom_id, "result": {"type": not_run}})
        batch.executed = len(batch.requests)
    batch.status, batch.ended_at = "ended", at
    ordered = list(batch.results)
    if state.config.shuffle_results:
        result_order_rng(state.config.seed, (r.custom_id for r in batch.requests)).shuffle(ordered)
    # One line per result and no blank lines: the SDK's JSONL decoder fails on an empty line.
    batch.results_jsonl = b"\n".join(orjson.dumps(r) for r in ordered) + b"\n"
