"""An OpenAI batch's record and its life on the simulated clock.

A batch is not driven by a worker: validation ends `validating_s` after creation, request i
finishes `(i + 1) * batch_seconds_per_request` after `in_progress_at`, and each request is
executed (answered, billed) exactly once, the first time anyone looks after its finish time.
Expiry, cancel and finalization follow from the same timeline, so jumping the clock reproduces
a 24 h batch in milliseconds. `advance_all` is what `EmulatorState.tick` calls; the routes that
create and read batches live in `openai_batches`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from lowtide.emulator import limits
from lowtide.emulator import model as emodel
from lowtide.emulator.faults import ApiError
from lowtide.emulator.openai_chat import chat_completion
from lowtide.emulator.openai_files import store_file
from lowtide.emulator.routes_common import draws_error, result_order_rng

if TYPE_CHECKING:
    from lowtide.emulator.app import EmulatorState

TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})


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
    # Prompt tokens the batch holds in its model's enqueued pool; None until first needed.
    enqueued_tokens: int | None = None
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

    @property
    def validation_end(self) -> float:
        return self.created_at + self.validating_s

    def ended_at(self) -> float | None:
        """When the batch reached its terminal status; None while it has not."""
        return next((self.times[s] for s in TERMINAL if s in self.times), None)

    def queue_tokens(self) -> int:
        """Prompt tokens the batch holds in the enqueued pool while admitted: the emulator's
        own count of each request's messages. Counted on first need, since tokenizing a big
        batch costs about what its create does."""
        if self.enqueued_tokens is None:
            self.enqueued_tokens = sum(
                emodel.prompt_token_count(messages)
                for line in self.lines
                if isinstance(messages := line.body.get("messages"), list)
            )
        return self.enqueued_tokens

    def refused_for_tokens(self) -> bool:
        return self.status == "failed" and any(
            e["code"] == "token_limit_exceeded" for e in self.line_errors
        )

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


def line_error(
    code: str, message: str, line: int | None, param: str | None = None
) -> dict[str, Any]:
    """One entry of a failed batch's `errors.data`; `line` is 1-based, or None for the file."""
    return {"code": code, "message": message, "param": param, "line": line}


# --------------------------------------------------------------------------- lifecycle


def advance_all(state: EmulatorState, now: float) -> None:
    """Move every unfinished OpenAI batch to where the clock says it is."""
    if state.config.enqueued_token_limit is not None:
        _admit_in_time_order(state, now)
    for batch in state.batches.values():
        if batch.status not in TERMINAL:
            _advance(state, batch, now)


def _admit_in_time_order(state: EmulatorState, now: float) -> None:
    """Decide every admission due by `now` at its own validation end, earliest first (ties by
    creation), with the same model's admitted batches brought to that moment first: whether a
    batch fits the enqueued-token pool then depends on the simulated timeline only, not on
    how far the clock jumped or the order batches sit in."""
    due = sorted(
        (b for b in state.batches.values() if b.status == "validating" and b.validation_end <= now),
        key=lambda b: (b.validation_end, b.seq),
    )
    for batch in due:
        at = batch.validation_end
        for other in state.batches.values():
            if (
                other.model == batch.model
                and other.ended_at() is None
                and "in_progress" in other.times
            ):
                _advance(state, other, at)
        _advance(state, batch, at)


def _advance(state: EmulatorState, batch: OpenAIBatch, now: float) -> None:
    while batch.status not in TERMINAL:
        status = batch.status
        if status == "validating":
            done = batch.validation_end
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
    """Refuse the batch if its tokens would overfill its model's pool now (its validation end;
    the pool is up to date there, see `_admit_in_time_order`)."""
    limit = state.config.enqueued_token_limit
    if limit is None:
        return
    if limits.enqueued_tokens(state, batch.model) + batch.queue_tokens() > limit:
        batch.line_errors = [
            line_error(
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
    elif draws_error(state, line.custom_id, attempt):
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


def _record_error(state: EmulatorState, batch: OpenAIBatch, line: BatchLine, at: float) -> None:
    sent = line.body.get("messages")
    messages: list[dict[Any, Any]] = sent if isinstance(sent, list) else []
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
    rng = result_order_rng(state.config.seed, (ln.custom_id for ln in batch.lines))
    for kind, lines in (("output", batch.output_lines), ("error", batch.error_lines)):
        if not lines and state.config.omit_empty_files:
            continue
        ordered = list(lines)
        if state.config.shuffle_results:
            rng.shuffle(ordered)
        content = b"".join(orjson.dumps(line) + b"\n" for line in ordered)
        stored = store_file(
            state, content, f"batch_{batch.id}_{kind}.jsonl", "batch_output", at, expires_s
        )
        if kind == "output":
            batch.output_file_id = stored.id
        else:
            batch.error_file_id = stored.id
