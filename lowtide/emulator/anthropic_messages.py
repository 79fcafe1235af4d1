"""Anthropic Messages: the realtime `POST /v1/messages` route and `create_message`, the one
executor both it and a message batch's requests go through.

A call is validated as the real API would (400 for a request it rejects), answered by the
deterministic model (a forced tool or `output_config.format` makes the answer follow a schema),
billed in the ledger, and priced with Anthropic's explicit prompt cache: the prompt prefix up to
and including the last block that carries `cache_control` (a system block or a message's
content block) is written by the first request and read by later ones within `cache_ttl_s` (an
hour when the breakpoint asks for `ttl: "1h"`); a prefix shorter than
`anthropic_cache_min_tokens` is never cached.
"""

from __future__ import annotations

import hashlib
import json
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from lowtide.backends.wire import EMULATOR_FINGERPRINT
from lowtide.emulator import model as emodel
from lowtide.emulator.faults import ApiError
from lowtide.emulator.routes_common import anthropic_json_body, emulator_state, json_response

if TYPE_CHECKING:
    from lowtide.emulator.app import EmulatorState

router = APIRouter()

_ONE_HOUR_TTL_S = 3600.0


@router.post("/messages")
async def messages(request: Request) -> Response:
    body = anthropic_json_body(await request.body())
    state = emulator_state(request)

    def run() -> Response:
        with state.lock:
            now = state.tick()
            return json_response(create_message(state, body, now, kind="realtime"))

    return await run_in_threadpool(run)


def create_message(
    state: EmulatorState,
    params: dict[str, Any],
    at: float,
    *,
    kind: str,
    batch_id: str | None = None,
    custom_id: str | None = None,
) -> dict[str, Any]:
    """Execute one Messages request (recording it in the ledger); raises ApiError(400) for a
    request the real API would reject."""
    model_name = params.get("model")
    if not isinstance(model_name, str) or not model_name:
        raise ApiError(400, "model: Field required")
    max_tokens = params.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool):
        raise ApiError(400, "max_tokens: Field required")
    if max_tokens < 1:
        raise ApiError(400, "max_tokens: must be at least 1")
    messages = params.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages: at least one message is required")
    if params.get("stream"):
        raise ApiError(400, "stream: the lowtide emulator does not stream; set stream=false")
    schema, tool_name = _structured_output(params)
    system_blocks = _system_blocks(params.get("system"))
    system_text = "".join(block.get("text", "") for block in system_blocks) or None
    config = state.config
    result = emodel.answer(
        messages,
        schema=schema,
        max_tokens=max_tokens,
        model=model_name,
        model_version=config.model_version,
        malformed_rate=config.malformed_rate,
        seed=config.seed,
        system=system_text,
    )
    creation, read, ttl_kind = _prompt_cache(state, params, system_blocks, at)
    input_tokens = max(0, result.prompt_tokens - creation - read)
    state.ledger.record(
        provider="anthropic",
        kind=kind,
        model=model_name,
        input_tokens=input_tokens + creation + read,
        cached_input_tokens=read,
        output_tokens=result.completion_tokens,
        batch_id=batch_id,
        custom_id=custom_id,
        at=at,
    )
    truncated = result.finish_reason == "length" or (tool_name is not None and result.broken)
    if tool_name is not None:
        tool_input = result.data if isinstance(result.data, dict) else {"value": result.data}
        if truncated:
            # A cut-off tool call arrives with only part of its input.
            keys = list(tool_input)
            tool_input = {k: tool_input[k] for k in keys[: len(keys) // 2]}
        content: list[dict[str, Any]] = [
            {
                "type": "tool_use",
                "id": state.new_id("toolu_01", 12),
                "name": tool_name,
                "input": tool_input,
            }
        ]
        stop_reason = "max_tokens" if truncated else "tool_use"
    else:
        content = [{"type": "text", "text": result.text}]
        stop_reason = "max_tokens" if truncated else "end_turn"
    return {
        "id": state.new_id("msg_01", 12),
        "type": "message",
        "role": "assistant",
        "model": model_name,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        # not an Anthropic field (the SDK keeps unknown ones): how lowtide tells its answers apart
        "system_fingerprint": EMULATOR_FINGERPRINT,
        "usage": {
            "input_tokens": input_tokens,
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": read,
            "cache_creation": {
                "ephemeral_5m_input_tokens": creation if ttl_kind == "5m" else 0,
                "ephemeral_1h_input_tokens": creation if ttl_kind == "1h" else 0,
            },
            "output_tokens": result.completion_tokens,
            "service_tier": "batch" if kind == "batch" else "standard",
        },
    }


def _structured_output(params: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """(schema, forced tool name) from `output_config.format` or a forced `tool_choice`."""
    tool_choice = params.get("tool_choice")
    tools = params.get("tools") or []
    if isinstance(tool_choice, dict) and tool_choice.get("type") in ("tool", "any"):
        thinking = params.get("thinking")
        if isinstance(thinking, dict) and thinking.get("type") == "enabled":
            raise ApiError(
                400, "tool_choice: forcing tool use is not compatible with extended thinking"
            )
        by_name = {t.get("name"): t for t in tools if isinstance(t, dict)}
        name = (
            tool_choice.get("name") if tool_choice["type"] == "tool" else next(iter(by_name), None)
        )
        tool = by_name.get(name)
        if tool is None:
            raise ApiError(400, f"tool_choice: tool {name!r} is not among the provided tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise ApiError(400, f"tools.{name}.input_schema: Field required")
        return schema, name
    output_config = params.get("output_config")
    if isinstance(output_config, dict) and isinstance(output_config.get("format"), dict):
        fmt = output_config["format"]
        if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise ApiError(
                400, "output_config.format: expected {type: 'json_schema', schema: {...}}"
            )
        return fmt["schema"], None
    return None, None


def _system_blocks(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"type": "text", "text": system}]
    if isinstance(system, list):
        return [b for b in system if isinstance(b, dict)]
    raise ApiError(400, "system: Input should be a string or a list of text blocks")


def _prompt_cache(
    state: EmulatorState,
    params: dict[str, Any],
    system_blocks: list[dict[str, Any]],
    at: float,
) -> tuple[int, int, str | None]:
    """(cache_creation, cache_read, ttl kind) for the prompt prefix that ends with the last
    block carrying `cache_control`: the first request writes it, a later one with the same
    prefix within the TTL reads it (and restarts the TTL). A prefix shorter than
    `anthropic_cache_min_tokens` is not cached: both counts are 0, and no error, as the real
    API does."""
    prefix = _cached_prefix(system_blocks, params["messages"])
    if prefix is None:
        return 0, 0, None
    system_texts, messages, control = prefix
    tokens = emodel.prefix_token_count(messages, "".join(system_texts) or None)
    if tokens < state.config.anthropic_cache_min_tokens:
        return 0, 0, None
    one_hour = isinstance(control, dict) and control.get("ttl") == "1h"
    ttl = _ONE_HOUR_TTL_S if one_hour else state.config.cache_ttl_s
    key = _cache_key(params, system_texts, messages)
    previous = state.prompt_cache.get(key)
    state.prompt_cache[key] = at
    if previous is not None and at - previous <= ttl:
        return 0, tokens, None
    return tokens, 0, "1h" if one_hour else "5m"


def _cached_prefix(
    system_blocks: list[dict[str, Any]], messages: list[Any]
) -> tuple[list[str], list[dict[str, Any]], Any] | None:
    """(system texts, messages, its `cache_control`) of the prefix up to and including the
    last block that carries `cache_control`, in Anthropic's order (system, then messages; a
    message is cut after that block); None when no block carries one."""
    for m in range(len(messages) - 1, -1, -1):
        message = messages[m]
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue  # a string content cannot carry a breakpoint
        for b in range(len(content) - 1, -1, -1):
            block = content[b]
            if isinstance(block, dict) and block.get("cache_control"):
                head = [*messages[:m], {**message, "content": content[: b + 1]}]
                return [x.get("text", "") for x in system_blocks], head, block["cache_control"]
    for s in range(len(system_blocks) - 1, -1, -1):
        if system_blocks[s].get("cache_control"):
            texts = [x.get("text", "") for x in system_blocks[: s + 1]]
            return texts, [], system_blocks[s]["cache_control"]
    return None


def _cache_key(
    params: dict[str, Any], system_texts: list[str], messages: list[dict[str, Any]]
) -> str:
    """What a cached prefix is tied to: the model, the tools and output format (which come
    before, or change, the system prompt), the prefix's texts, and the tool choice once the
    prefix reaches the messages (the real API's invalidation table)."""
    output_config = params.get("output_config")
    identity = [
        params.get("model"),
        params.get("tools"),
        output_config.get("format") if isinstance(output_config, dict) else None,
        system_texts,
        [[m.get("role"), emodel.message_text(m.get("content"))] for m in messages],
        params.get("tool_choice") if messages else None,
    ]
    canonical = json.dumps(identity, sort_keys=True, ensure_ascii=False, default=str)
    return "anthropic|" + hashlib.sha256(canonical.encode()).hexdigest()
