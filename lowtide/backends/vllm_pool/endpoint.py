"""One server of the pool as the runner sees it: its HTTP clients, queue, cap and health."""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from typing import Any

import httpx2
import orjson

from lowtide.backends.vllm_pool.config import PoolConfig
from lowtide.backends.vllm_pool.control import CapControl
from lowtide.backends.vllm_pool.stats import EndpointStats, InflightMeter
from lowtide.backends.wire import completion_row

# Chat requests are spread over several small connection pools of this size: the HTTP client's
# pool does work per pooled connection on every request, which a few hundred connections in one
# pool turn into most of the client's CPU.
CONNECTIONS_PER_POOL = 32


class Endpoint:
    """Mutable per-server state, owned by one `_PoolRun` on one event loop."""

    def __init__(self, url: str, index: int, config: PoolConfig, started: float):
        self.url = url
        self.index = index
        self.root = url.removesuffix("/v1")
        self.up = False
        self.draining = False  # its address left `[pool] discover`: finish, send nothing new
        self.control = CapControl(float(config.start_cap))
        self.meter = InflightMeter(started)
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.queue: deque[int] = deque()
        self.wake = asyncio.Event()
        self.probing = False
        self.recovering = False
        self.down_reason = ""
        self.stats = EndpointStats(url=url)
        self.stats.cap_history.append((0.0, self.cap_int))
        self.clients: list[httpx2.AsyncClient] = []
        self.active: list[int] = []
        self.http: httpx2.AsyncClient | None = None  # /health and /metrics, apart from chat

    @property
    def cap(self) -> float:
        return self.control.cap

    @property
    def cap_int(self) -> int:
        return self.control.cap_int

    @property
    def serving(self) -> bool:
        """Up and not draining: the feeder may send it new requests."""
        return self.up and not self.draining

    @property
    def inflight(self) -> int:
        return self.meter.count

    def open(self, config: PoolConfig, headers: dict[str, str], tls: ssl.SSLContext) -> None:
        """Build the chat clients (enough pools for `max_inflight`) and the control client."""
        timeout = httpx2.Timeout(
            config.request_timeout_s, connect=config.connect_timeout_s, pool=None
        )
        per_pool = CONNECTIONS_PER_POOL
        limits = httpx2.Limits(max_connections=per_pool, max_keepalive_connections=per_pool)
        self.clients = [
            httpx2.AsyncClient(
                base_url=self.url, headers=headers, timeout=timeout, limits=limits, verify=tls
            )
            for _ in range(-(-config.max_inflight // per_pool))
        ]
        self.active = [0] * len(self.clients)
        self.http = httpx2.AsyncClient(
            timeout=httpx2.Timeout(config.connect_timeout_s), headers=headers, verify=tls
        )

    async def aclose(self) -> None:
        for client in [*self.clients, self.http]:
            if client is not None:
                await client.aclose()

    async def post(self, body: dict[str, Any], headers: dict[str, str]) -> httpx2.Response:
        """POST one chat body on the least busy of the chat clients."""
        k = min(range(len(self.clients)), key=self.active.__getitem__)
        self.active[k] += 1
        try:
            return await self.clients[k].post(
                "/chat/completions", content=orjson.dumps(body), headers=headers
            )
        finally:
            self.active[k] -= 1

    async def healthy(self) -> bool:
        """/health answered 200."""
        assert self.http is not None
        try:
            response = await self.http.get(self.root + "/health")
        except httpx2.TransportError:
            return False
        return response.status_code == 200


def answered_row(custom_id: str, content: bytes) -> tuple[Any, ...] | None:
    """A RESULT_SCHEMA row for a 200 chat completion body, or None when the body is not JSON
    or has no first choice (the caller records that as an unreadable answer)."""
    try:
        data = orjson.loads(content)
    except orjson.JSONDecodeError:
        return None
    choices = data.get("choices") if isinstance(data, dict) else None
    if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
        return None
    return completion_row(custom_id, data)


def error_text(response: httpx2.Response) -> str:
    """`<type or code>: <message>` from vLLM's / OpenAI's error envelope, else the raw body."""
    try:
        data = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text[:300]
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        kind = error.get("type") or error.get("code") or "error"
        return f"{kind}: {error.get('message', '')}"
    if isinstance(error, str):
        return error
    return response.text[:300]
