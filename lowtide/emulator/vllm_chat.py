"""vLLM's chat-completions wire format, shared by the emulated `vllm serve` (`vllm`) and the
emulated `vllm run-batch` (`run_batch`): validating a request as vLLM's OpenAI server does
(`parse_chat`), the `chat.completion` body it answers with, its error envelope (the integer
status as `code`), and the KV block hashes of a prompt that the engine's prefix cache keys on.
No routes and no engine here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import orjson
from fastapi.responses import Response

from lowtide.backends.wire import EMULATOR_FINGERPRINT
from lowtide.emulator import model as emulated_model
from lowtide.emulator.engine_capacity import EngineConfig, prefix_block_hashes
from lowtide.emulator.routes_common import json_response
from lowtide.tokens import encode


def error_response(status: int, message: str, kind: str, param: str | None = None) -> Response:
    """vLLM's error envelope: `kind` is its exception class name, `code` the HTTP status."""
    return json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status
    )


def chat_completion(
    served_model_name: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    prompt_tokens_details: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A `chat.completion` body shaped as vLLM's OpenAI server returns it (also used by the
    emulated run-batch)."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served_model_name,
        "choices": [
            {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning_content": None,
                },
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": EMULATOR_FINGERPRINT,  # vLLM sends null: this marks the emulator
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": prompt_tokens_details,
        },
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def engine_dead_response() -> Response:
    """The 500 vLLM answers once its engine core has died."""
    return error_response(
        500,
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "InternalServerError",
    )


def parse_chat(
    body: dict[str, Any], served: str | Sequence[str]
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, int | None] | Response:
    """Validate a chat request; return (messages, schema, max_tokens) or an error response.
    `served` is the served model name, or every name the server answers to (vLLM's
    `--served-model-name a b`): a request naming another model gets vLLM's 404."""
    names = (served,) if isinstance(served, str) else tuple(served)
    requested = body.get("model")
    if requested is not None and requested not in names:
        return error_response(
            404,
            f"The model `{requested}` does not exist. Valid aliases: {', '.join(names)}.",
            "NotFoundError",
            "model",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return error_response(
            400, "'messages' must be a non-empty list of messages", "BadRequestError"
        )
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        return error_response(
            400, "every message needs a string 'role'", "BadRequestError", "messages"
        )
    if body.get("stream"):
        return error_response(
            400,
            "stream=true is not supported by the lowtide vLLM emulator; send stream=false",
            "BadRequestError",
            "stream",
        )
    if body.get("n") not in (None, 1):
        return error_response(
            400, "n > 1 is not supported by the lowtide vLLM emulator", "BadRequestError", "n"
        )
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        return error_response(
            400, f"max_tokens must be at least 1, got {max_tokens!r}", "BadRequestError"
        )
    schema = _requested_schema(body)
    if isinstance(schema, Response):
        return schema
    return messages, schema, max_tokens


def _requested_schema(body: dict[str, Any]) -> dict[str, Any] | None | Response:
    """The JSON schema a request constrains its output to, if any. `guided_json` and the other
    `guided_*` fields are deliberately not read (vLLM >= 0.12 ignores them)."""
    fmt = body.get("response_format")
    if isinstance(fmt, dict):
        kind = fmt.get("type")
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                return error_response(
                    400,
                    "response_format json_schema needs json_schema.schema (an object)",
                    "BadRequestError",
                    "response_format",
                )
            return schema
        if kind == "json_object":
            return {"type": "object"}
    outputs = body.get("structured_outputs")
    if isinstance(outputs, dict):
        schema = outputs.get("json")
        if isinstance(schema, str):
            try:
                schema = orjson.loads(schema)
            except orjson.JSONDecodeError:
                return error_response(
                    400,
                    "structured_outputs.json is not valid JSON",
                    "BadRequestError",
                    "structured_outputs",
                )
        if isinstance(schema, dict):
            return schema
        if outputs.get("json_object"):
            return {"type": "object"}
    return None


@lru_cache(maxsize=4096)
def _message_ids(role: str, text: str) -> tuple[int, ...]:
    # A stand-in chat template; what matters is that equal prefixes give equal tokens.
    return tuple(encode(f"<|{role}|>\n{text}\n"))


def prompt_block_hashes(
    messages: Sequence[dict[str, Any]], prompt_tokens: int, config: EngineConfig
) -> tuple[int, ...]:
    """Prefix-cache block hashes of the first `prompt_tokens` tokens of `messages` rendered
    through a stand-in chat template: requests sharing a prefix share its leading hashes."""
    ids: list[int] = []
    for message in messages:
        ids.extend(
            _message_ids(message["role"], emulated_model.message_text(message.get("content")))
        )
        if len(ids) >= prompt_tokens:
            break
    return prefix_block_hashes(ids[:prompt_tokens], config.block_size)
