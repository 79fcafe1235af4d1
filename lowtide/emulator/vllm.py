"""One emulated `vllm serve`: vLLM's OpenAI-compatible routes in front of the simulated engine.

Routes (shapes follow vLLM 0.33, see shared/reference/provider-apis.md §3):

- `POST /v1/chat/completions`: the answer comes from `lowtide.emulator.model.answer` (schema-valid
  JSON for `response_format` json_schema / `structured_outputs.json`); the response is sent when
  the engine model has generated it, so how many requests a client keeps in flight decides the
  throughput it gets. `guided_*` fields are ignored, as in vLLM >= 0.12. `stream` and `n > 1` are
  refused with 400 (emulator limits).
- `GET /v1/models` (every served name), `GET /health` (200 empty, 503 while the engine is
  dead), `GET /metrics` (Prometheus text with vLLM's names and `model_name`/`engine` labels).

A server answers to every name it serves (vLLM's `--served-model-name a b`) and names the first
in responses and metrics; any other model is vLLM's 404. By default it serves
`DEFAULT_SERVED_MODEL_NAMES`: the emulator's own name and the sample job's vLLM model id, so the
sample job runs against it unchanged.
- Admin: `POST /_emulator/kill`, `POST /_emulator/revive`, `GET /_emulator/stats` (JSON).

Errors use vLLM's envelope `{"error": {"message", "type", "param", "code"}}` with the integer
status as `code`; with an API key set, `/v1…` paths without `Authorization: Bearer <key>` get
401 `{"error": "Unauthorized"}` while `/health` and `/metrics` stay open. A full queue
(`EngineConfig.max_num_queued_reqs`) answers 503. A dead engine answers 500, like vLLM's
EngineDeadError.

Executions go to the billing ledger (provider "vllm", kind "realtime"); a client may tag a
request with the `X-Lowtide-Custom-Id` header to have its custom_id recorded.

Run one from a shell: `python -m lowtide.emulator.vllm --port 8001 --max-num-seqs 64`.

The request checks, response bodies and error envelope are in `vllm_chat`; `/metrics` and
`/_emulator/stats` are rendered by `vllm_metrics`. This module wires them and the engine into
an app, and is the `python -m` entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import Response

from lowtide.emulator import model as emulated_model
from lowtide.emulator.engine import (
    Engine,
    EngineConfig,
    EngineDeadError,
    QueueFullError,
    RequestTooLongError,
)
from lowtide.emulator.ledger import BillingLedger
from lowtide.emulator.routes_common import json_response
from lowtide.emulator.vllm_chat import (
    chat_completion,
    engine_dead_response,
    error_response,
    parse_chat,
    prompt_block_hashes,
)
from lowtide.emulator.vllm_metrics import render_metrics, stats_dict

__all__ = [
    "CUSTOM_ID_HEADER",
    "DEFAULT_SERVED_MODEL_NAMES",
    "create_vllm_app",
    "main",
    "render_metrics",
    "served_model_names",
    "stats_dict",
]

CUSTOM_ID_HEADER = "x-lowtide-custom-id"
DEFAULT_SERVED_MODEL_NAMES = ("emulated-model", "qwen2.5-7b-instruct")
"""The names an emulated server answers to unless told otherwise: the emulator's own, first (it
names responses and metrics), and the sample job's `[model] names.vllm`
(data/jobs/support-intents.toml), so `lowtide run` of the sample job with `--backend vllm` works
against `lowtide emulator --engines N` as it is."""
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


def served_model_names(names: str | Iterable[str]) -> tuple[str, ...]:
    """Served model names from a name, a comma-separated list or several of either, in order,
    without repeats; ValueError when none is left."""
    given = [names] if isinstance(names, str) else list(names)
    out: list[str] = []
    for item in given:
        for name in item.split(","):
            if name.strip() and name.strip() not in out:
                out.append(name.strip())
    if not out:
        raise ValueError("served model names: give at least one name")
    return tuple(out)


def create_vllm_app(
    config: EngineConfig | None = None,
    *,
    served_model_name: str | Sequence[str] = DEFAULT_SERVED_MODEL_NAMES,
    ledger: BillingLedger | None = None,
    api_key: str | None = None,
    engine_label: str = "0",
    server_label: str | None = None,
    model_version: int = 1,
    malformed_rate: float = 0.0,
    seed: int = 0,
    enable_prompt_tokens_details: bool = False,
) -> FastAPI:
    """A FastAPI app that behaves like one `vllm serve` of `served_model_name`: one name, a
    comma-separated list or a sequence of them (the first names responses and metrics).

    The engine lives in `app.state.engine` and runs on the server's event loop (its scheduler
    starts with the first request). `malformed_rate`, `seed` and `model_version` go to the
    emulated model; `enable_prompt_tokens_details` adds `usage.prompt_tokens_details.
    cached_tokens` as vLLM's flag of that name does. `server_label` names this server in the
    ledger's entries (a pool's index), so a test can tell which server ran a request."""
    config = config or EngineConfig()
    engine = Engine(config)
    created = int(time.time())
    names = served_model_names(served_model_name)
    primary = names[0]
    labels = f'engine="{engine_label}",model_name="{primary}"'

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await engine.aclose()

    app = FastAPI(title="lowtide vLLM emulator", lifespan=lifespan, openapi_url=None)
    app.state.engine = engine
    app.state.config = config
    app.state.ledger = ledger
    app.state.served_model_name = primary
    app.state.served_model_names = names
    if api_key:
        app.add_middleware(_ApiKeyMiddleware, api_key=api_key)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        try:
            body = orjson.loads(await request.body())
        except orjson.JSONDecodeError as exc:
            return error_response(400, f"Request body is not valid JSON: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            return error_response(400, "Request body must be a JSON object", "BadRequestError")
        parsed = parse_chat(body, names)
        if isinstance(parsed, Response):
            return parsed
        messages, schema, max_tokens = parsed
        if not engine.alive:
            return engine_dead_response()
        answer = emulated_model.answer(
            messages,
            schema=schema,
            max_tokens=max_tokens,
            model=primary,
            model_version=model_version,
            malformed_rate=malformed_rate,
            seed=seed,
        )
        prompt_tokens = answer.prompt_tokens
        limit = config.max_model_len
        if prompt_tokens + (max_tokens or 1) > limit:
            return error_response(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + (max_tokens or 0)} tokens ({prompt_tokens} in the messages, "
                f"{max_tokens or 0} in the completion). Please reduce the length of the "
                "messages or completion.",
                "BadRequestError",
            )
        hashes = prompt_block_hashes(messages, prompt_tokens, config) if config.prefix_cache else ()
        try:
            result = await engine.generate(
                prompt_tokens=prompt_tokens,
                output_tokens=max(answer.completion_tokens, 1),
                block_hashes=hashes,
                finish_reason=answer.finish_reason,
            )
        except QueueFullError as exc:
            return error_response(503, str(exc), "ServiceUnavailableError")
        except RequestTooLongError as exc:
            return error_response(400, str(exc), "BadRequestError")
        except EngineDeadError:
            return engine_dead_response()
        completion_tokens = answer.completion_tokens
        if ledger is not None:
            ledger.record(
                provider="vllm",
                kind="realtime",
                model=primary,
                input_tokens=prompt_tokens,
                cached_input_tokens=result.cached_tokens,
                output_tokens=completion_tokens,
                custom_id=request.headers.get(CUSTOM_ID_HEADER),
                server=server_label,
            )
        details = {"cached_tokens": result.cached_tokens} if enable_prompt_tokens_details else None
        return json_response(
            chat_completion(
                primary,
                answer.text,
                answer.finish_reason,
                prompt_tokens,
                completion_tokens,
                details,
            )
        )

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": name,
                        "object": "model",
                        "created": created,
                        "owned_by": "vllm",
                        "root": primary,
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
                    for name in names
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
        return json_response({"alive": False})

    @app.post("/_emulator/revive")
    async def revive() -> Response:
        engine.revive()
        return json_response({"alive": True})

    @app.get("/_emulator/stats")
    async def stats() -> Response:
        return json_response(stats_dict(engine.stats(), config))

    return app


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = EngineConfig()
    p = argparse.ArgumentParser(description="Run one emulated vLLM server (no GPU).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=list(DEFAULT_SERVED_MODEL_NAMES),
        help="names the server answers to (space- or comma-separated); the first names responses",
    )
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
