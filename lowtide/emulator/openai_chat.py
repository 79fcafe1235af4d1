"""OpenAI Chat Completions: the realtime `POST /v1/chat/completions` route and
`chat_completion`, the one executor both it and a batch's requests go through.

A call is validated as the real endpoint would (400 for a request it rejects), answered by the
deterministic model, billed in the ledger with its provider, kind and ids, and priced with
OpenAI's automatic prompt cache: a repeated prefix (every message before the last) of at least
`openai_cache_min_tokens` tokens, seen within `cache_ttl_s`, is served from cache.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from lowtide.backends.wire import EMULATOR_FINGERPRINT
from lowtide.emulator import model as emodel
from lowtide.emulator.faults import ApiError
from lowtide.emulator.routes_common import emulator_state, json_response, openai_json_body

if TYPE_CHECKING:
    from lowtide.emulator.app import EmulatorState

router = APIRouter()


@router.post("/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    body = await openai_json_body(request)
    state = emulator_state(request)

    def run() -> Response:
        with state.lock:
            now = state.tick()
            return json_response(chat_completion(state, body, now, kind="realtime"))

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
    cached = _cached_prefix_tokens(state, model_name, body, at)
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
        "system_fingerprint": EMULATOR_FINGERPRINT,  # how lowtide tells its answers apart
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
    state: EmulatorState, model_name: str, body: dict[str, Any], at: float
) -> int:
    """OpenAI's automatic prompt cache: a repeated prefix of >= `openai_cache_min_tokens`
    tokens is served from cache in 128-token steps. The prefix is every message before the
    last (the system prompt and few-shot turns every request of a job repeats; the last
    message is the request's own), tied to the response format, which OpenAI puts before it."""
    messages = body["messages"]
    prefix = [m for m in messages[:-1] if isinstance(m, dict)]
    if not prefix:
        return 0
    tokens = emodel.prefix_token_count(prefix)
    if tokens < state.config.openai_cache_min_tokens:
        return 0
    identity = [
        body.get("response_format"),
        [[m.get("role"), emodel.message_text(m.get("content"))] for m in prefix],
    ]
    canonical = json.dumps(identity, sort_keys=True, ensure_ascii=False, default=str)
    key = "openai|" + model_name + "|" + hashlib.sha256(canonical.encode()).hexdigest()
    last = state.prompt_cache.get(key)
    state.prompt_cache[key] = at
    if last is None or at - last > state.config.cache_ttl_s:
        return 0
    return math.floor(tokens / 128) * 128
