"""One emulated `vllm serve`: vLLM's OpenAI-compatible routes in front of the simulated engine.

Routes (shapes follow vLLM 0.33, see shared/reference/provider-apis.md §3):

- `POST /v1/chat/completions`: the answer comes from `lowtide.emulator.model.answer` (schema-valid
  JSON for `response_format` json_schema / `structured_outputs.json`); the response is sent when
  the engine model has generated it, so how many requests a client keeps in flight decides the
  throughput it gets. `guided_*` fields are ignored, as in vLLM >= 0.12. `stream` and `n > 1` are
  refused with 400 (emulator limits).
- `GET /v1/models`, `GET /health` (200 empty, 503 while the engine is dead), `GET /metrics`
  (Prometheus text with vLLM's names and `model_name`/`engine` labels).
- Admin: `POST /_emulator/kill`, `POST /_emulator/revive`, `GET /_emulator/stats` (JSON).

Errors use vLLM's envelope `{"error": {"message", "type", "param", "code"}}` with the integer
status as `code`; with an API key set, `/v1…` paths without `Authorization: Bearer <key>` get
401 `{"error": "Unauthorized"}` while `/health` and `/metrics` stay open. A full queue
(`EngineConfig.max_num_queued_reqs`) answers 503. A dead engine answers 500, like vLLM's
EngineDeadError.

Executions go to the billing ledger (provider "vllm", kind "realtime"); a client may tag a
request with the `X-Lowtide-Custom-Id` header to have its custom_id recorded.

Run one from a shell: `python -m lowtide.emulator.vllm --port 8001 --max-num-seqs 64`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from functools import lru_cache
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from lowtide.emulator import model as emulated_model
from lowtide.emulator.engine import (
    FINISH_REASONS,
    Engine,
    EngineConfig,
    EngineDeadError,
    EngineStats,
    Histogram,
    QueueFullError,
    RequestTooLongError,
    prefix_block_hashes,
)
from lowtide.emulator.ledger import BillingLedger
from lowtide.tokens import encode

CUSTOM_ID_HEADER = "x-lowtide-custom-id"
_AUTH_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
_JSON = "application/json"


class _ApiKeyMiddleware:
    """vLLM's auth: paths under /v1 (and a few others) need the bearer key; others are open."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_AUTH_PREFIXES):
            headers = dict(scope["headers"])
            if headers.get(b"authorization") != self.expected:
                await Response(b'{"error":"Unauthorized"}', 401, media_type=_JSON)(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)


def _json(data: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(data), status, media_type=_JSON)


def _error(status: int, message: str, kind: str, param: str | None = None) -> Response:
    return _json(
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
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": prompt_tokens_details,
        },
        "prompt_logprobs": None,
        "kv_transfer_params": None,
    }


def create_vllm_app(
    config: EngineConfig | None = None,
    *,
    served_model_name: str = "emulated-model",
    ledger: BillingLedger | None = None,
    api_key: str | None = None,
    engine_label: str = "0",
    model_version: int = 1,
    malformed_rate: float = 0.0,
    seed: int = 0,
    enable_prompt_tokens_details: bool = False,
) -> FastAPI:
    """A FastAPI app that behaves like one `vllm serve` of `served_model_name`.

    The engine lives in `app.state.engine` and runs on the server's event loop (its scheduler
    starts with the first request). `malformed_rate`, `seed` and `model_version` go to the
    emulated model; `enable_prompt_tokens_details` adds `usage.prompt_tokens_details.
    cached_tokens` as vLLM's flag of that name does."""
    config = config or EngineConfig()
    engine = Engine(config)
    created = int(time.time())
    labels = f'engine="{engine_label}",model_name="{served_model_name}"'

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.aclose()

    app = FastAPI(title="lowtide vLLM emulator", lifespan=lifespan, openapi_url=None)
    app.state.engine = engine
    app.state.config = config
    app.state.ledger = ledger
    app.state.served_model_name = served_model_name
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return _error(400, f"Request body is not valid JSON: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            return _error(400, "Request body must be a JSON object", "BadRequestError")
        parsed = _parse_chat(body, served_model_name)
        if isinstance(parsed, Response):
            return parsed
        messages, schema, max_tokens = parsed
        if not engine.alive:
            return _engine_dead()
        answer = emulated_model.answer(
            messages,
            schema=schema,
            max_tokens=max_tokens,
            model=served_model_name,
            model_version=model_version,
            malformed_rate=malformed_rate,
            seed=seed,
        )
        prompt_tokens = answer.prompt_tokens
        limit = config.max_model_len
        if prompt_tokens + (max_tokens or 1) > limit:
            return _error(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + (max_tokens or 0)} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens or 0} in the completion). Please reduce the length of the "
                "messages or completion.",
                "BadRequestError",
            )
        hashes = _block_hashes(messages, prompt_tokens, config) if config.prefix_cache else ()
        try:
            result = await engine.generate(
                prompt_tokens=prompt_tokens,
                output_tokens=max(answer.completion_tokens, 1),
                block_hashes=hashes,
                finish_reason=answer.finish_reason,
            )
        except QueueFullError as exc:
            return _error(503, str(exc), "ServiceUnavailableError")
        except RequestTooLongError as exc:
            return _error(400, str(exc), "BadRequestError")
        except EngineDeadError:
            return _engine_dead()
        completion_tokens = answer.completion_tokens
        if ledger is not None:
            ledger.record(
                provider="vllm",
                kind="realtime",
                model=served_model_name,
                input_tokens=prompt_tokens,
                cached_input_tokens=result.cached_tokens,
                output_tokens=completion_tokens,
                custom_id=request.headers.get(CUSTOM_ID_HEADER),
            )
        details = {"cached_tokens": result.cached_tokens} if enable_prompt_tokens_details else None
        return _json(
            chat_completion(
                served_model_name,
                answer.text,
                answer.finish_reason,
                prompt_tokens,
                completion_tokens,
                details,
            )
        )

    @app.get("/v1/models")
    async def list_models() -> Response:
        return _json(
            {
                "object": "list",
                "data": [
                    {
                        "id": served_model_name,
                        "object": "model",
                        "created": created,
                        "owned_by": "vllm",
                        "root": served_model_name,
                        "parent": None,
                        "max_model_len": config.max_model_len,
                        "permission": [
                            {
                                "id": f"modelperm-{uuid.uuid4().hex}",
                                "object": "model_permission",
                                "created": created,
                                "allow_create_engine": False,
                                "allow_sampling": True,
                                "allow_logprobs": True,
                                "allow_search_indices": False,
                                "allow_view": True,
                                "allow_fine_tuning": False,
                                "organization": "*",
                                "group": None,
                                "is_blocking": False,
                            }
                        ],
                    }
                ],
            }
        )

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            render_metrics(engine.stats(), labels),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )

    @app.post("/_emulator/kill")
    async def kill() -> Response:
        engine.kill()
        return _json({"alive": False})

    @app.post("/_emulator/revive")
    async def revive() -> Response:
        engine.revive()
        return _json({"alive": True})

    @app.get("/_emulator/stats")
    async def stats() -> Response:
        return _json(stats_dict(engine.stats(), config))

    return app


def _engine_dead() -> Response:
    return _error(
        500,
        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
        "InternalServerError",
    )


def _parse_chat(
    body: dict[str, Any], served: str
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, int | None] | Response:
    """Validate a chat request; return (messages, schema, max_tokens) or an error response."""
    requested = body.get("model")
    if requested is not None and requested != served:
        return _error(
            404,
            f"The model `{requested}` does not exist. Valid aliases: {served}.",
            "NotFoundError",
            "model",
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return _error(400, "'messages' must be a non-empty list of messages", "BadRequestError")
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        return _error(400, "every message needs a string 'role'", "BadRequestError", "messages")
    if body.get("stream"):
        return _error(
            400,
            "stream=true is not supported by the lowtide vLLM emulator; send stream=false",
            "BadRequestError",
            "stream",
        )
    if body.get("n") not in (None, 1):
        return _error(
            400, "n > 1 is not supported by the lowtide vLLM emulator", "BadRequestError", "n"
        )
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        return _error(400, f"max_tokens must be at least 1, got {max_tokens!r}", "BadRequestError")
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
                return _error(
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
                return _error(
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


def _block_hashes(
    messages: Sequence[dict[str, Any]], prompt_tokens: int, config: EngineConfig
) -> tuple[int, ...]:
    ids: list[int] = []
    for message in messages:
        ids.extend(
            _message_ids(message["role"], emulated_model.message_text(message.get("content")))
        )
        if len(ids) >= prompt_tokens:
            break
    return prefix_block_hashes(ids[:prompt_tokens], config.block_size)


def _histogram_lines(name: str, hist: Histogram, labels: str) -> list[str]:
    lines = [
        f"# HELP {name} Histogram of {name[5:]} (simulated seconds).",
        f"# TYPE {name} histogram",
    ]
    for le, count in hist.cumulative():
        lines.append(f'{name}_bucket{{{labels},le="{le}"}} {count}')
    lines.append(f"{name}_sum{{{labels}}} {hist.sum!r}")
    lines.append(f"{name}_count{{{labels}}} {hist.count}")
    return lines


def render_metrics(stats: EngineStats, labels: str) -> str:
    """Prometheus text exposition of `stats` under vLLM's metric names."""
    lines: list[str] = []

    def gauge(name: str, help_text: str, value: float) -> None:
        lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} gauge"))
        lines.append(f"{name}{{{labels}}} {float(value)!r}")

    def counter(name: str, help_text: str, value: float) -> None:
        lines.extend((f"# HELP {name} {help_text}", f"# TYPE {name} counter"))
        lines.append(f"{name}_total{{{labels}}} {float(value)!r}")

    gauge(
        "vllm:num_requests_running", "Number of requests in model execution batches.", stats.running
    )
    gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.waiting)
    gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_usage)
    counter("vllm:num_preemptions", "Cumulative number of preemptions.", stats.preemptions)
    counter("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.prompt_tokens_total)
    counter(
        "vllm:generation_tokens",
        "Number of generation tokens processed.",
        stats.generation_tokens_total,
    )
    counter(
        "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens.",
        stats.prefix_cache_queries,
    )
    counter(
        "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens.",
        stats.prefix_cache_hits,
    )
    name = "vllm:request_success"
    lines.extend(
        (f"# HELP {name} Count of successfully processed requests.", f"# TYPE {name} counter")
    )
    reasons = list(FINISH_REASONS) + [r for r in stats.request_success if r not in FINISH_REASONS]
    for reason in reasons:
        value = float(stats.request_success.get(reason, 0))
        lines.append(f'{name}_total{{{labels},finished_reason="{reason}"}} {value!r}')
    lines.extend(_histogram_lines("vllm:time_to_first_token_seconds", stats.ttft, labels))
    lines.extend(_histogram_lines("vllm:e2e_request_latency_seconds", stats.e2e_latency, labels))
    lines.extend(_histogram_lines("vllm:request_queue_time_seconds", stats.queue_time, labels))
    return "\n".join(lines) + "\n"


def stats_dict(stats: EngineStats, config: EngineConfig) -> dict[str, Any]:
    """JSON-ready engine snapshot plus its config (for benches and tests)."""
    data = {
        f.name: getattr(stats, f.name)
        for f in dataclasses.fields(stats)
        if not isinstance(getattr(stats, f.name), Histogram)
    }
    cfg = dataclasses.asdict(config)
    if math.isinf(cfg["time_scale"]):
        cfg["time_scale"] = "inf"
    data["config"] = cfg
    return data


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = EngineConfig()
    p = argparse.ArgumentParser(description="Run one emulated vLLM server (no GPU).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default="emulated-model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=defaults.max_num_batched_tokens)
    p.add_argument("--kv-cache-tokens", type=int, default=defaults.kv_cache_tokens)
    p.add_argument("--max-model-len", type=int, default=defaults.max_model_len)
    p.add_argument("--max-num-queued-reqs", type=int, default=None)
    p.add_argument("--prefill-tokens-per-s", type=float, default=defaults.prefill_tokens_per_s)
    p.add_argument("--decode-step-s-base", type=float, default=defaults.decode_step_s_base)
    p.add_argument("--decode-step-s-per-seq", type=float, default=defaults.decode_step_s_per_seq)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--time-scale", type=float, default=defaults.time_scale)
    p.add_argument("--malformed-rate", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enable-prompt-tokens-details", action="store_true")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    import uvicorn

    from lowtide.emulator.server import NoDelayH11Protocol

    args = _parse_args(argv)
    config = EngineConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_tokens=args.kv_cache_tokens,
        max_model_len=args.max_model_len,
        max_num_queued_reqs=args.max_num_queued_reqs,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        decode_step_s_base=args.decode_step_s_base,
        decode_step_s_per_seq=args.decode_step_s_per_seq,
        prefix_cache=args.enable_prefix_caching,
        time_scale=args.time_scale,
    )
    app = create_vllm_app(
        config,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        malformed_rate=args.malformed_rate,
        seed=args.seed,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
    )
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        http=NoDelayH11Protocol,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=30,
    )


if __name__ == "__main__":
    main()
