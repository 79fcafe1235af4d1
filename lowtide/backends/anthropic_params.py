"""An OpenAI chat-completions batch line as an Anthropic Messages request: the translation
`anthropic_batch` applies when a batch is created and `realtime` when a request is sent alone."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from lowtide.backends.base import TerminalBackendError

STRUCTURED_OUTPUT_MODES = ("output_config", "tool")

# Keys of a stored chat body that are known Anthropic Messages parameters under the same name
# and meaning; they pass through (typically from the job's `extra_body`). Everything else that
# is not translated below is OpenAI- or vLLM-only and is dropped: response_format (translated),
# n, logprobs, top_logprobs, seed, frequency_penalty, presence_penalty, logit_bias, user, store,
# stream, stream_options, parallel_tool_calls, reasoning_effort, ... An `output_config` (e.g.
# an effort setting) is kept and merged with the structured-output format.
PASSTHROUGH_PARAMS = frozenset(
    {"top_k", "top_p", "stop_sequences", "metadata", "thinking", "inference_geo"}
)


def to_anthropic_params(body: Mapping[str, Any], structured_output: str) -> dict[str, Any]:
    """One stored chat-completions body → the `params` of an Anthropic Messages request.

    - system messages become top-level text blocks;
    - user/assistant messages keep their order (few-shot examples, then the unit);
    - one `cache_control: ephemeral` breakpoint ends the prefix every request repeats: on the
      last block of the message before the last (the last few-shot turn), or on the last
      system block when there are no such turns, so only the unit's message is uncached;
    - `model`, `max_tokens` (or `max_completion_tokens`), `temperature`; `stop` → `stop_sequences`;
    - `response_format.json_schema.schema` → `output_config.format` (structured_output
      "output_config") or a strict forced tool named after the schema ("tool");
    - keys in PASSTHROUGH_PARAMS are kept; other keys are dropped.
    Raises TerminalBackendError for a body Anthropic cannot express.
    """
    if structured_output not in STRUCTURED_OUTPUT_MODES:
        raise TerminalBackendError(
            f"unknown structured_output {structured_output!r} for backend 'anthropic'; "
            f"known: {', '.join(STRUCTURED_OUTPUT_MODES)}",
            backend="anthropic",
        )
    system: list[dict[str, Any]] = []
    messages: list[dict[str, Any]] = []
    for i, msg in enumerate(body.get("messages") or []):
        role = msg.get("role")
        if role in ("system", "developer"):
            system.extend({"type": "text", "text": t} for t in _texts(msg.get("content"), i))
        elif role in ("user", "assistant"):
            messages.append({"role": role, "content": _content(msg.get("content"), i)})
        else:
            raise TerminalBackendError(
                f"messages[{i}]: role {role!r} has no Anthropic equivalent in lowtide "
                "(expected system, user or assistant)",
                backend="anthropic",
            )
    # One breakpoint, at the end of what every request of a job repeats: the system prompt and
    # the few-shot turns (all messages but the last, the request's own). A breakpoint on the
    # system block alone would leave the examples out of the cached prefix.
    marked = len(messages) > 1 and _mark_breakpoint(messages[-2])
    if not marked and system:
        system[-1]["cache_control"] = {"type": "ephemeral"}

    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is None:
        raise TerminalBackendError(
            "Anthropic needs max_tokens: set [model] max_tokens in the job file",
            backend="anthropic",
        )
    params: dict[str, Any] = {"model": body.get("model"), "max_tokens": max_tokens}
    if system:
        params["system"] = system
    params["messages"] = messages
    if body.get("temperature") is not None:
        params["temperature"] = body["temperature"]
    stop = body.get("stop")
    if stop:
        params["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
    params.update({k: v for k, v in body.items() if k in PASSTHROUGH_PARAMS})

    schema_name, schema = _json_schema(body.get("response_format"))
    output_config = dict(body.get("output_config") or {})
    if schema is not None and structured_output == "output_config":
        output_config["format"] = {"type": "json_schema", "schema": schema}
    elif schema is not None:
        params["tools"] = [{"name": schema_name, "input_schema": schema, "strict": True}]
        params["tool_choice"] = {"type": "tool", "name": schema_name}
    if output_config:
        params["output_config"] = output_config
    return params


def _mark_breakpoint(message: dict[str, Any]) -> bool:
    """Put `cache_control` on the last block of `message` (a string content becomes one text
    block); False when it has no text to mark (Anthropic cannot cache an empty block)."""
    content = message["content"]
    if isinstance(content, str):
        if not content:
            return False
        message["content"] = [
            {"type": "text", "text": content, "cache_control": {"type": "ephemeral"}}
        ]
        return True
    if not content or not content[-1]["text"]:
        return False
    content[-1]["cache_control"] = {"type": "ephemeral"}  # a block _content built for this request
    return True


def _json_schema(response_format: Any) -> tuple[str, dict[str, Any] | None]:
    if not isinstance(response_format, Mapping) or response_format.get("type") != "json_schema":
        return "output", None  # text / json_object / absent: no schema to enforce
    spec = response_format.get("json_schema") or {}
    return str(spec.get("name") or "output"), spec.get("schema")


def _texts(content: Any, index: int) -> list[str]:
    if isinstance(content, str):
        return [content]
    blocks = _content(content, index)
    return [blocks] if isinstance(blocks, str) else [block["text"] for block in blocks]


def _content(content: Any, index: int) -> str | list[dict[str, Any]]:
    """OpenAI message content (a string or text parts) → Anthropic content."""
    if isinstance(content, str):
        return content
    blocks: list[dict[str, Any]] = []
    for part in content or []:
        if not isinstance(part, Mapping) or part.get("type") != "text":
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise TerminalBackendError(
                f"messages[{index}]: content part {kind!r} is not supported for Anthropic "
                "(only text parts are)",
                backend="anthropic",
            )
        blocks.append({"type": "text", "text": part["text"]})
    return blocks


def batch_requests(lines: Iterable[str], structured_output: str) -> list[dict[str, Any]]:
    """Stored OpenAI batch lines → Anthropic batch requests (`custom_id` + `params`).

    Every line repeats the same system prompt, few-shot messages and schema; parsed naively,
    a 100,000-request shard would hold 100,000 copies of them. Parts equal to the previous
    line's are replaced by the previous line's objects, so the copies are shared.
    """
    out = []
    shared: dict[str, Any] = {}
    for line in lines:
        item = orjson.loads(line)
        body = item["body"]
        messages = body.get("messages") or []
        seen = shared.get("messages") or []
        body["messages"] = [
            seen[i] if i < len(seen) and seen[i] == m else m for i, m in enumerate(messages)
        ]
        for key in ("response_format", "output_config"):
            if key in body and shared.get(key) == body[key]:
                body[key] = shared[key]
        shared = body
        out.append(
            {
                "custom_id": item["custom_id"],
                "params": to_anthropic_params(body, structured_output),
            }
        )
    return out


# --------------------------------------------------------------------------- results
