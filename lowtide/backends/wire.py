"""Rules shared by every backend that speaks HTTP to a model server.

Three decisions used to be made separately by the batch backends, the realtime path and the
vLLM pool, and had started to disagree: which HTTP status is worth sending again, how long a
server asks to be left alone, and how a chat completion becomes a result row. Each is made
here, once. Nothing here does I/O or imports an SDK.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from email.utils import parsedate_to_datetime
from typing import Any

from lowtide.backends.base import RequestStatus

EMULATOR_FINGERPRINT = "fp_lowtide_emulator"
"""How lowtide's emulator signs every answer it gives (`system_fingerprint` of a chat completion,
and the same extra field on an Anthropic message): an answer is recorded as the emulator's from
what actually answered, whichever backend's client asked (`results.engine`)."""

_TRANSIENT_4XX = frozenset({408, 409, 429})
_ANSWERED = RequestStatus.ANSWERED.value
_NOTHING: dict[str, Any] = {}


def is_transient_status(status_code: int) -> bool:
    """True when a request answered with `status_code` may succeed if sent again: 408 (the
    server timed the request out), 409 (a conflicting request was in progress), 429 (rate
    limited) and every 5xx, Anthropic's 529 "overloaded" included. Every other status is
    terminal: sending the same request again gets the same answer."""
    return status_code in _TRANSIENT_4XX or status_code >= 500


def retry_after_s(headers: Mapping[str, str] | None, now: float | None = None) -> float | None:
    """The server's own retry hint in seconds (never negative), or None when it gave none.

    `retry-after-ms` (milliseconds, OpenAI's and Anthropic's) is read first, then
    `retry-after` as seconds or as an HTTP date, counted from `now` (epoch seconds; the wall
    clock when omitted). A header that does not parse, or is not finite, counts as absent.
    Names are looked up in lower case: httpx's `Headers` match any case, a plain dict must
    use lower-case keys."""
    if not headers:
        return None
    ms = _finite(headers.get("retry-after-ms"))
    if ms is not None:
        return max(0.0, ms / 1000)
    value = headers.get("retry-after")
    if not value:
        return None
    seconds = _finite(value)
    if seconds is not None:
        return max(0.0, seconds)
    try:
        when = parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when - (time.time() if now is None else now))


def _finite(value: str | None) -> float | None:
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def completion_row(custom_id: str | None, completion: Mapping[str, Any]) -> tuple[Any, ...]:
    """One `chat.completion` (parsed JSON) → a RESULT_SCHEMA row, as a tuple in column order:
    (custom_id, status, raw_text, finish_reason, error, input_tokens, cached_tokens,
    output_tokens, emulated).

    The status is always `answered`; `raw_text` and `finish_reason` come from the first choice,
    and `error` is "refusal: <text>" when its message carries a refusal. Tokens come from
    `usage`: prompt, `prompt_tokens_details.cached_tokens`, completion. A part the server left
    out is None — cached tokens included when it does not report them (vLLM without
    `--enable-prompt-tokens-details`), exactly as `openai_batch.parse_result_lines` reads a
    batch output file. Never raises on a malformed completion: callers that must tell one
    apart check for a first choice themselves. `emulated` is whether the completion carries
    the emulator's `system_fingerprint`. Plain dict access only: the vLLM pool calls
    this once per answer, so nested parts are checked with `isinstance(…, dict)` (what JSON
    parsers and pydantic's `model_dump` produce), not against the slower Mapping ABC."""
    choices = completion.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict):
        choice = _NOTHING
    message = choice.get("message")
    if not isinstance(message, dict):
        message = _NOTHING
    usage = completion.get("usage")
    if not isinstance(usage, dict):
        usage = _NOTHING
    details = usage.get("prompt_tokens_details")
    refusal = message.get("refusal")
    return (
        custom_id,
        _ANSWERED,
        message.get("content"),
        choice.get("finish_reason"),
        f"refusal: {refusal}" if refusal else None,
        usage.get("prompt_tokens"),
        details.get("cached_tokens") if isinstance(details, dict) else None,
        usage.get("completion_tokens"),
        completion.get("system_fingerprint") == EMULATOR_FINGERPRINT,
    )


def is_emulator_answer(response: Any) -> bool:
    """True when an SDK response object (an OpenAI completion, an Anthropic message, whose
    models keep unknown fields) carries the emulator's fingerprint."""
    return getattr(response, "system_fingerprint", None) == EMULATOR_FINGERPRINT
