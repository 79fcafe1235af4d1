"""Small helpers shared by the emulator's route modules, kept here so that no two of them carry
a copy: looking up the emulator's state from a request, writing a JSON response (the vLLM
modules use that one too), reading a request body the way each provider words its complaints,
OpenAI's cursor page, the seeded per-attempt draw that fails a batch request, and the seeded
order a finished batch's results are shuffled into."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import orjson
from fastapi import Request
from starlette.responses import Response

from lowtide.emulator.faults import ApiError

if TYPE_CHECKING:
    from lowtide.emulator.app import EmulatorState


def emulator_state(request: Request) -> EmulatorState:
    return request.app.state.emulator


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body), status_code=status, media_type="application/json", headers=headers
    )


async def openai_json_body(request: Request) -> dict[str, Any]:
    """The request's JSON object, or an ApiError(400) worded as OpenAI words it."""
    raw = await request.body()
    try:
        body = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"We could not parse the JSON body of your request: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.")
    return body


def anthropic_json_body(raw: bytes) -> dict[str, Any]:
    """`raw` parsed as a JSON object, or an ApiError(400) worded as Anthropic words it."""
    try:
        body = orjson.loads(raw or b"{}")
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"Request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "Request body must be a JSON object.")
    return body


def openai_page(items: list[dict[str, Any]], after: str | None, limit: int) -> dict[str, Any]:
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


def draws_error(state: EmulatorState, custom_id: str, attempt: int) -> bool:
    """Whether this attempt of a batch request fails with a server error (`error_rate`).

    Drawn from the seed, the custom_id and the attempt number, so a rerun fails the same
    requests and a retried request can succeed."""
    rate = state.config.error_rate
    if rate <= 0:
        return False
    digest = hashlib.sha256(f"error|{state.config.seed}|{custom_id}|{attempt}".encode()).hexdigest()
    return int(digest[:13], 16) / 16**13 < rate


def result_order_rng(seed: int, custom_ids: Iterable[str]) -> random.Random:
    """The generator that shuffles a finished batch's results. Seeded by the request ids, not
    the random batch id, so a rerun of the same requests reproduces the order."""
    digest = hashlib.sha256("\n".join(custom_ids).encode()).hexdigest()
    return random.Random(f"{seed}|{digest}")
